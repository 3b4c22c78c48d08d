"""What the planner's search varies, and how: the method x engine families, the values each inner
dimension takes, every member of a family and its leanest settings, each checked by the trainer's own
config rules before it is scored (memory/search.py).

Every value comes from the tables beside the torch code (optimizers, precisions, step strategies), so a
new entry is searched without a change here.
"""

from __future__ import annotations

import itertools

from memfit.config import ConfigError, RunConfig
from memfit.config.distributed import launch_problems
from memfit.memory.model_shape import ModelShape, adapted_linears, linear_leaf_names, model_shape
from memfit.strategies.engines import MODEL_PARALLEL_ENTRIES, SHARDING_ENTRIES, sharding_entry
from memfit.strategies.methods import method_entry
from memfit.strategies.optimizers import OPTIMIZER_ENTRIES
from memfit.strategies.precision import PRECISION_ENTRIES
from memfit.strategies.quantization import quantized_base_shape_problem, sharded_quantization_problems
from memfit.strategies.table import STEP_STRATEGIES

CHECKPOINTING = ("none", "every-4", "every-2", "full")
MESH_2D_DEGREES = (2, 4, 8)  # tensor parallel inside a node of up to 8 GPUs, FSDP2 across the rest
OPTIMIZERS_SEARCHED = tuple(entry.name for entry in OPTIMIZER_ENTRIES if entry.searched)
# the leanest pre-check tries these: no one optimizer keeps the fewest bytes for every model
OPTIMIZERS_LEAN = tuple(entry.name for entry in OPTIMIZER_ENTRIES if entry.lean)
PRECISIONS_SEARCHED = tuple(entry.name for entry in PRECISION_ENTRIES if entry.searched)
# the leanest pre-check tries the searched precision that keeps the fewest bytes per weight and per activation
PRECISION_LEAN = min((entry for entry in PRECISION_ENTRIES if entry.searched),
                     key=lambda entry: (entry.weight_bytes, entry.compute_bytes)).name
# config paths the search may choose; a value the user set is held fixed (micro_batch x grad_accum is
# always re-split, holding the sequences per optimizer step the user asked for)
SEARCHED = ("method", "quant.scheme", "precision", "optim.name", "memory.checkpointing",
            *(strategy.path for strategy in STEP_STRATEGIES),
            *(f"memory.{option}" for strategy in STEP_STRATEGIES for option in strategy.searched_options),
            "distributed.sharding", "distributed.offload",
            "distributed.tensor_parallel", "distributed.pipeline_parallel", "optim.max_grad_norm")


def families(cfg: RunConfig, gpus: int, device: str) -> list[tuple[str, dict]]:
    """(name, {config path: value}) of every method x engine family this run may use."""
    methods = [("full", {"method": "full", "quant.scheme": "none"}),
               ("LoRA", {"method": "lora", "quant.scheme": "none"}),
               ("LoRA, 8-bit base", {"method": "lora", "quant.scheme": "int8"}),
               ("QLoRA", {"method": "qlora", "quant.scheme": method_entry("qlora").default_quant})]
    sharding, offload = "distributed.sharding", "distributed.offload"
    one_rank_each = {f"distributed.{entry.name}": 1 for entry in MODEL_PARALLEL_ENTRIES}  # unless a family splits
    out = []
    for name, fields in methods:
        if gpus == 1:
            out.append((name, {**fields, sharding: "none", offload: "none"}))
            if fields["method"] == "full" and device == "cuda":
                out.append((name + " + CPU offload (FSDP2, one process)",
                            {**fields, sharding: "zero3", offload: "all"}))
            continue
        # FSDP2 shards a quantized base only as torchao's NF4 (the config's rule); ZeRO-1 saves adapters
        # nothing worth its step
        shardable = not sharded_quantization_problems(fields["quant.scheme"], cfg.quant.backend, "zero3") \
            if fields["quant.scheme"] != "none" else True
        engines = [(engine.label, {sharding: engine.name}) for engine in SHARDING_ENTRIES
                   if engine.ranks and not (engine.fsdp2 and not shardable)
                   and not (engine.full_only and fields["method"] != "full")]
        if shardable:
            engines.append(("ZeRO-3 + CPU offload", {sharding: "zero3", offload: "all"}))
        if fields["method"] == "full":
            engines += [(f"{entry.label} {gpus}", {sharding: "none", f"distributed.{entry.name}": gpus,
                                                   **({"optim.max_grad_norm": None} if entry.clipping_problem else {})})
                        for entry in MODEL_PARALLEL_ENTRIES]
            engines += [(f"{engine.label} x {entry.label} {k}", {sharding: engine.name, f"distributed.{entry.name}": k})
                        for entry in MODEL_PARALLEL_ENTRIES if entry.with_fsdp2
                        for k in MESH_2D_DEGREES if k < gpus and gpus % k == 0
                        for engine in SHARDING_ENTRIES if engine.fsdp2]
        for engine, extra in engines:
            out.append((f"{name}, {engine}", {**fields, offload: "none", **one_rank_each, **extra}))
    return out


def fixed_values(cfg: RunConfig, fixed: set[str]) -> dict:
    return {path: cfg.get(path) for path in fixed}


def inner_choices(cfg: RunConfig, device: str, shape: ModelShape | None = None) -> dict[str, tuple]:
    """The values each inner dimension takes."""
    choices = {"precision": PRECISIONS_SEARCHED, "optim.name": OPTIMIZERS_SEARCHED,
               "memory.checkpointing": CHECKPOINTING}
    for strategy in STEP_STRATEGIES:
        choices[strategy.path] = tried_values(strategy, strategy.searched, device, shape)
    return choices


def tried_values(strategy, values: tuple, device: str, shape: ModelShape | None = None) -> tuple:
    """The values of a step strategy the search tries on `device` for a model of `shape` (off only where
    it is a no-op or cannot run on this model)."""
    runs = (device == "cuda" or not strategy.cuda_only) and not (
        shape is not None and strategy.model_problem and strategy.model_problem(shape))
    return values if runs else (False,)


def _batch_shapes(sequences: int) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) pairs holding the user's sequences per optimizer step."""
    shapes = [(m, sequences // m) for m in (1 << k for k in range(sequences.bit_length())) if sequences % m == 0]
    return shapes if (sequences, 1) in shapes else shapes + [(sequences, 1)]


def sequences_per_step(cfg: RunConfig) -> int:
    return (cfg.batch.micro_batch if isinstance(cfg.batch.micro_batch, int) else 1) * cfg.batch.grad_accum


def _no_adapters(cfg: RunConfig, shape: ModelShape) -> str | None:
    """Why an adapter plan would train nothing: its lora.targets name none of the model's block linears
    (the default q_proj, v_proj on GPT-2, Phi or Falcon); the trainer refuses such a run."""
    if cfg.method == "full" or adapted_linears(shape, cfg):
        return None
    return (f"lora.targets {cfg.lora.targets} name none of this model's block linears "
            f"({', '.join(sorted(linear_leaf_names(shape)))}); set --lora-targets")


def _strategy_problem(cfg: RunConfig, shape: ModelShape) -> str | None:
    """Why a step strategy `cfg` switches on cannot run on a model of `shape` (the user fixed it on)."""
    for strategy in STEP_STRATEGIES:
        if strategy.model_problem and getattr(cfg.memory, strategy.name):
            if problem := strategy.model_problem(shape):
                return problem
    return None


def member_config(base: RunConfig, update: dict, model_config, gpus: int) -> RunConfig | list[str]:
    """The candidate, or why the trainer would refuse it: its config rules (checked on every
    construction), layer shapes its quantization backend cannot take and, on several GPUs, the
    launch rules."""
    try:
        cfg = base.updated(update, "planned config")
    except ConfigError as exc:
        return exc.problems
    shape = model_shape(model_config)
    shards = gpus // cfg.distributed.tensor_parallel if sharding_entry(cfg.distributed.sharding).fsdp2 else 1
    problem = (quantized_base_shape_problem(method=cfg.method, scheme=cfg.quant.scheme, backend=cfg.quant_backend,
                                            linears=shape.linear, shards=shards)
               or _no_adapters(cfg, shape) or _strategy_problem(cfg, shape))
    if problem:
        return [problem]
    if gpus > 1 or cfg.distributed.tensor_parallel > 1 or cfg.distributed.pipeline_parallel > 1:
        return launch_problems(cfg, gpus, model_config) or cfg
    return cfg


def lean_member(base: RunConfig, update: dict, model_config, gpus: int, fixed: dict) -> RunConfig | list[str]:
    """A leanest update as member_config checks it; where the engine refuses step strategies it switches on
    (their problems name them), the same update with those off, unless the user fixed them."""
    built = member_config(base, update, model_config, gpus)
    if isinstance(built, RunConfig):
        return built
    refused = {strategy.path: False for strategy in STEP_STRATEGIES
               if update.get(strategy.path) and strategy.path not in fixed
               and any(strategy.path in problem for problem in built)}
    return member_config(base, {**update, **refused}, model_config, gpus) if refused else built


def family_members(base: RunConfig, family: dict, fixed: dict, sequences: int, device: str, shape: ModelShape):
    """The updates of every member of one family (the trainer's rules are checked by member_config)."""
    dims = {k: v for k, v in inner_choices(base, device, shape).items() if k not in fixed and k not in family}
    shapes = _batch_shapes(sequences)
    keys = list(dims)
    for values in itertools.product(*(dims[k] for k in keys)):
        for chosen in _with_options(dict(zip(keys, values)), base, fixed):
            for mb, ga in shapes:
                update = {**family, **chosen, "batch.micro_batch": mb, "batch.grad_accum": ga, "budget": None}
                yield with_forced(update, base, fixed)


def _with_options(chosen: dict, base: RunConfig, fixed: dict):
    """`chosen` once for each combination of the searched options of the strategies it switches on."""
    options = {f"memory.{name}": values for strategy in STEP_STRATEGIES
               if chosen.get(strategy.path, getattr(base.memory, strategy.name))
               for name, values in strategy.searched_options.items() if f"memory.{name}" not in fixed}
    for values in itertools.product(*options.values()):
        yield {**chosen, **dict(zip(options, values))}


def leanest_updates(base: RunConfig, family: dict, fixed: dict, device: str,
             shape: ModelShape | None = None) -> list[RunConfig]:
    """The family's most memory-saving settings at micro_batch 1 (a few, as no one optimizer is smallest
    for every model): the pre-check that rejects a whole family with one or two estimates."""
    out = []
    lean = [[(strategy.path, value) for value in tried_values(strategy, strategy.lean, device, shape)]
            for strategy in STEP_STRATEGIES]
    for optimizer, *switches in itertools.product(OPTIMIZERS_LEAN, *lean):
        update = {"precision": PRECISION_LEAN, "memory.checkpointing": "full", "optim.name": optimizer,
                  **dict(switches), "batch.micro_batch": 1, "batch.grad_accum": 1, "budget": None, **family}
        out.append(with_forced(update, base, fixed))
    return out


def with_forced(update: dict, base: RunConfig, fixed: dict) -> dict:
    """The update with the settings its step strategies force (unless the user fixed them), then
    the user's fixed values on top."""
    given = {**update, **fixed}
    for strategy in STEP_STRATEGIES:
        if given.get(strategy.path, getattr(base.memory, strategy.name)):
            update.update({path: value for path, value in strategy.forces.items() if path not in fixed})
    update.update(fixed)
    return update
