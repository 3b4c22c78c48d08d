"""The user's DeepSpeed JSON: read it, check it against the RunConfig, fill the "auto" values.

Values memfit owns (the loop, the data and the schedule depend on them) come from the RunConfig
when the JSON writes them as "auto" or leaves them out, as in Hugging Face's integration:

  train_micro_batch_size_per_gpu   micro_batch
  gradient_accumulation_steps      grad_accum
  train_batch_size                 micro_batch x grad_accum x ranks
  gradient_clipping                max_grad_norm (null -> 0, DeepSpeed's "off")
  bf16.enabled / fp16.enabled      precision (bf16-mixed / fp16-mixed; fp32: both off)
  optimizer.params.lr, .weight_decay   lr, weight_decay (when the JSON has an optimizer block)

A number there that contradicts the RunConfig is an error naming both. "auto" is also filled,
from the model's hidden size as Hugging Face does, for zero_optimization.reduce_bucket_size,
stage3_prefetch_bucket_size and stage3_param_persistence_threshold; anywhere else it is refused.
Without an "optimizer" block memfit's own optimizer (`optimizer:`) is handed to DeepSpeed.
The learning rate follows memfit's lr_schedule, so a "scheduler" block is refused. LoRA runs on
ZeRO 0-2 (ZeRO-3 would partition the frozen base that rank 0 writes beside the adapter).
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from memfit.errors import MemfitError
from memfit.strategies.optimizers import OPTIMIZER_ENTRIES
from memfit.strategies.table import STEP_STRATEGIES

AUTO = "auto"
# "auto" values Hugging Face fills from the model's hidden size h (transformers.integrations.deepspeed).
_HIDDEN_SIZE_AUTO = {("zero_optimization", "reduce_bucket_size"): lambda h: h * h,
                     ("zero_optimization", "stage3_prefetch_bucket_size"): lambda h: int(0.9 * h * h),
                     ("zero_optimization", "stage3_param_persistence_threshold"): lambda h: 10 * h}
# Client optimizers DeepSpeed's ZeRO can flatten and partition (plain torch.optim states).
CLIENT_OPTIMIZERS = tuple(entry.name for entry in OPTIMIZER_ENTRIES if entry.deepspeed_client)


def read_json(path: str) -> tuple[dict | None, list[str]]:
    """(the JSON object, problems); problems say which file and where."""
    file = Path(path)
    if not file.is_file():
        return None, [f"distributed.deepspeed: file not found: {path} (relative paths are from the current directory)"]
    try:
        value = json.loads(file.read_text())
    except json.JSONDecodeError as exc:
        return None, [f"distributed.deepspeed: {path} is not valid JSON: {exc.msg} at line {exc.lineno}, column "
                      f"{exc.colno}"]
    except (OSError, UnicodeDecodeError) as exc:
        return None, [f"distributed.deepspeed: cannot read {path}: {exc}"]
    if not isinstance(value, dict):
        return None, [f"distributed.deepspeed: {path} must hold a JSON object ({{...}}), not {type(value).__name__}"]
    return value, []


def _owned(cfg, ds: dict) -> dict[tuple[str, ...], tuple[object, str]]:
    """JSON path -> (the value the RunConfig gives it, which RunConfig setting that is)."""
    def setting(path: str, value) -> tuple[object, str]:
        return value, f"{path}: {value}"

    owned = {("train_micro_batch_size_per_gpu",): setting("batch.micro_batch", cfg.batch.micro_batch),
             ("gradient_accumulation_steps",): setting("batch.grad_accum", cfg.batch.grad_accum),
             ("gradient_clipping",): (cfg.optim.max_grad_norm or 0.0, f"optim.max_grad_norm: {cfg.optim.max_grad_norm}"),
             ("bf16", "enabled"): (cfg.precision == "bf16-mixed", f"precision: {cfg.precision}"),
             ("fp16", "enabled"): (cfg.precision == "fp16-mixed", f"precision: {cfg.precision}")}
    if isinstance(ds.get("optimizer"), dict):
        owned[("optimizer", "params", "lr")] = setting("optim.lr", cfg.optim.lr)
        owned[("optimizer", "params", "weight_decay")] = setting("optim.weight_decay", cfg.optim.weight_decay)
    return owned


def json_path(tree: dict, path: tuple[str, ...]):
    for key in path:
        if not isinstance(tree, dict) or key not in tree:
            return None
        tree = tree[key]
    return tree


def _set(tree: dict, path: tuple[str, ...], value) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def _same(json_value, memfit_value) -> bool:
    if isinstance(memfit_value, bool) or isinstance(json_value, bool):
        return json_value is memfit_value
    if isinstance(json_value, (int, float)) and isinstance(memfit_value, (int, float)):
        return math.isclose(json_value, memfit_value, rel_tol=1e-9, abs_tol=0.0)
    return False


def _auto_paths(tree, prefix: tuple[str, ...] = ()) -> list[tuple[str, ...]]:
    if isinstance(tree, dict):
        return [p for key, value in tree.items() for p in _auto_paths(value, (*prefix, str(key)))]
    return [prefix] if tree == AUTO else []


def _conflicting_fields(cfg) -> list[str]:
    """RunConfig settings DeepSpeed takes over or cannot run with: field, why, what to do."""
    problems = []
    if cfg.distributed.sharding != "none":
        problems.append(f"distributed.sharding: {cfg.distributed.sharding} with deepspeed: DeepSpeed shards by its own "
                        "zero_optimization.stage; set distributed.sharding: none")
    if cfg.distributed.offload != "none":
        problems.append(f"distributed.offload: {cfg.distributed.offload} with deepspeed: use "
                        "zero_optimization.offload_optimizer / "
                        "offload_param in the DeepSpeed JSON; set distributed.offload: none")
    for name in ("tensor_parallel", "pipeline_parallel"):
        if getattr(cfg.distributed, name) > 1:
            problems.append(f"distributed.{name}: {getattr(cfg.distributed, name)} with deepspeed is not supported: "
                            f"set distributed.{name}: 1")
    for strategy in STEP_STRATEGIES:
        if getattr(cfg.memory, strategy.name) and strategy.without_deepspeed:
            problems.append(f"{strategy.path}: true with deepspeed: {strategy.without_deepspeed}; "
                            f"set {strategy.path}: false")
    if cfg.batch.micro_batch == "auto" or cfg.budget is not None or cfg.memory.limit is not None:
        which = ("batch.micro_batch: auto" if cfg.batch.micro_batch == "auto" else
                 f"budget: {cfg.budget}" if cfg.budget is not None else f"memory.limit: {cfg.memory.limit}")
        problems.append(f"{which} with deepspeed: the planner and out-of-memory recovery do not model the DeepSpeed "
                        "engine; give micro_batch as a number and leave budget / memory_budget null")
    if cfg.method == "qlora" or cfg.quant.scheme != "none":
        problems.append(f"method: {cfg.method} with quant: {cfg.quant.scheme} and deepspeed is not supported: "
                        "DeepSpeed flattens the weights into ZeRO partitions, which a 4/8-bit base (bitsandbytes' "
                        "or torchao's) cannot be; for QLoRA across GPUs drop distributed.deepspeed and use "
                        "distributed.sharding: zero3 (FSDP2 shards torchao's NF4 base), or method: lora / full "
                        "with DeepSpeed")
    if cfg.precision == "bf16-pure":
        problems.append("precision: bf16-pure with deepspeed: DeepSpeed's bf16 mode keeps fp32 master weights; "
                        "use precision: bf16-mixed (bf16 weights, fp32 optimizer copy)")
    return problems


def deepspeed_problems(cfg) -> list[str]:
    """Everything wrong with `deepspeed:` and its JSON for this RunConfig, all at once (load time)."""
    if not cfg.distributed.deepspeed:
        return []
    problems = _conflicting_fields(cfg)
    ds, unreadable = read_json(cfg.distributed.deepspeed)
    if ds is None:
        return problems + unreadable
    where = f"distributed.deepspeed: {cfg.distributed.deepspeed}:"
    owned = _owned(cfg, ds)
    for path, (value, setting) in owned.items():
        found = json_path(ds, path)
        if found is not None and found != AUTO and not _same(found, value):
            problems.append(f"{where} {'.'.join(path)} is {json.dumps(found)} but the run config has {setting}; "
                            f'make them agree or write "auto" in the JSON')
    allowed_auto = set(owned) | set(_HIDDEN_SIZE_AUTO) | {("train_batch_size",)}
    for path in _auto_paths(ds):
        if path not in allowed_auto:
            problems.append(f'{where} {".".join(path)} is "auto", which memfit cannot fill; write a value '
                            "(memfit fills: " + ", ".join(".".join(p) for p in sorted(allowed_auto)) + ")")
    if "scheduler" in ds:
        problems.append(f"{where} has a scheduler block, but memfit's lr_schedule / warmup_steps drive the learning "
                        "rate; remove the scheduler block")
    if json_path(ds, ("checkpoint", "load_universal")):
        problems.append(f"{where} checkpoint.load_universal is true: DeepSpeed reads universal checkpoints with "
                        "torch.load(weights_only=False), which runs any code pickled into them, and memfit resumes "
                        "only from its own checkpoints; remove checkpoint.load_universal")
    if cfg.method == "lora" and json_path(ds, ("zero_optimization", "stage")) == 3:
        problems.append(f"{where} zero_optimization.stage 3 with method: lora is not supported: rank 0 writes the "
                        "frozen base next to the adapter, which ZeRO-3 has partitioned; use stage 1 or 2 for LoRA")
    has_optimizer = isinstance(ds.get("optimizer"), dict)
    if has_optimizer and cfg.optim.name != "adamw":
        problems.append(f"{where} has an optimizer block and optim.name: {cfg.optim.name} is set too; remove one "
                        "(the JSON's optimizer is used when present)")
    if not has_optimizer and cfg.optim.name not in CLIENT_OPTIMIZERS:
        problems.append(f"optim.name: {cfg.optim.name} with deepspeed: ZeRO partitions plain torch optimizers only "
                        f"({', '.join(CLIENT_OPTIMIZERS)}); choose one, or put an optimizer block in "
                        f"{cfg.distributed.deepspeed}")
    return problems


def resolved_config(cfg, world_size: int, hidden_size: int | None = None) -> dict:
    """The user's JSON with every value memfit owns filled in (launch time: ranks and model known)."""
    ds, problems = read_json(cfg.distributed.deepspeed)
    if ds is None:
        raise MemfitError(problems[0])
    for path, (value, _) in _owned(cfg, ds).items():
        if json_path(ds, path) in (None, AUTO) and not (path[-1] == "enabled" and value is False and path[0] not in ds):
            _set(ds, path, value)
    train_batch = cfg.batch.micro_batch * cfg.batch.grad_accum * world_size
    given = ds.get("train_batch_size")
    if given not in (None, AUTO) and given != train_batch:
        raise MemfitError(f"distributed.deepspeed: {cfg.distributed.deepspeed}: train_batch_size is {given} but "
                          f"micro_batch {cfg.batch.micro_batch} "
                          f"x grad_accum {cfg.batch.grad_accum} x {world_size} ranks = {train_batch}; "
                          'make them agree or write "auto"')
    ds["train_batch_size"] = train_batch
    for path, rule in _HIDDEN_SIZE_AUTO.items():
        if json_path(ds, path) == AUTO:
            if hidden_size is None:
                raise MemfitError(f'distributed.deepspeed: {cfg.distributed.deepspeed}: {".".join(path)} is "auto" but '
                                  'the model has no '
                                  "hidden_size to fill it from; write a number")
            _set(ds, path, rule(hidden_size))
    return ds
