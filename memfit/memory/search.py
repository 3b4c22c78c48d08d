"""The planner's search: every strategy mix the trainer can run, the fastest that fits the budget.

A family is a method (full, LoRA, LoRA on an 8-bit base, QLoRA) with its engine (one process, FSDP2
CPU offload, or with several GPUs DDP / ZeRO / tensor / pipeline parallel). Inside a family the search
varies precision, optimizer, checkpointing, chunked loss, activation offload, optimizer-in-backward
and the micro_batch x grad_accum split of the user's sequences per step. Options the user gave stay
fixed. Every candidate is checked by the trainer's own config rules, scored by the analytic
estimate (fractions of a millisecond) and, if it fits with the margin, by the step-time model of
memory/costs.py.

Pruning: a family's leanest member (every memory saver on, micro_batch 1) is estimated first; if
even that misses the budget the family is rejected with the amount it misses, without enumerating it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field

from memfit.config import ConfigError, RunConfig
from memfit.config.distributed import launch_problems
from memfit.memory.analytic import analytic_estimate, device_total_bytes
from memfit.memory.single_device import StrategyTerms
from memfit.memory.costs import METHOD_GIVES_UP, QUANTS, step_time
from memfit.memory.estimate import Estimate
from memfit.memory.fits import FitRule, default_margin, largest_that_fits
from memfit.memory.gpus import GPU
from memfit.memory.model_shape import ModelShape, adapted_linears, linear_leaf_names, model_shape
from memfit.strategies.optimizers import OPTIMIZER_ENTRIES, optimizer_entry
from memfit.strategies.precision import PRECISION_ENTRIES, precision_entry
from memfit.strategies.quantization import quant_shape_problem
from memfit.strategies.table import STEP_STRATEGIES
from memfit.units import format_bytes

CHECKPOINTING = ("none", "every-4", "every-2", "full")
OPTIMIZERS_SEARCHED = tuple(entry.name for entry in OPTIMIZER_ENTRIES if entry.searched)
# the leanest pre-check tries these: no one optimizer keeps the fewest bytes for every model
OPTIMIZERS_LEAN = tuple(entry.name for entry in OPTIMIZER_ENTRIES if entry.lean)
PRECISIONS_SEARCHED = tuple(entry.name for entry in PRECISION_ENTRIES if entry.searched)
# the leanest pre-check tries the searched precision that keeps the fewest bytes per weight and per activation
PRECISION_LEAN = min((entry for entry in PRECISION_ENTRIES if entry.searched),
                     key=lambda entry: (entry.weight_bytes, entry.compute_bytes)).name
TIE = 0.05  # plans within 5% of the fastest step time count as equally fast: fidelity decides
# config paths the search may choose; a value the user set is held fixed
SEARCHED = ("method", "quant.scheme", "precision", "optim.name", "memory.checkpointing",
            *(strategy.path for strategy in STEP_STRATEGIES),
            *(f"memory.{option}" for strategy in STEP_STRATEGIES for option in strategy.searched_options),
            "distributed.sharding", "distributed.offload",
            "distributed.tensor_parallel", "distributed.pipeline_parallel", "optim.max_grad_norm")
# the per-rank estimate (memory/distributed_estimate.py) does not model these yet: off in sharded families
UNMODELLED_SHARDED = {strategy.path: False for strategy in STEP_STRATEGIES if not strategy.sharded_estimate}
# what a plan's summary shows: short name -> config path
SUMMARY = {"method": "method", "quant": "quant.scheme", "precision": "precision", "optimizer": "optim.name",
           "checkpointing": "memory.checkpointing", **{strategy.name: strategy.path for strategy in STEP_STRATEGIES},
           "attention": "memory.attention", "micro_batch": "batch.micro_batch", "grad_accum": "batch.grad_accum",
           "seq_len": "data.seq_len"}
SUMMARY_IF_SET = {"sharding": "distributed.sharding", "offload": "distributed.offload",
                  "tensor_parallel": "distributed.tensor_parallel", "pipeline_parallel": "distributed.pipeline_parallel"}
# micro_batch x grad_accum is always re-split, holding the sequences per optimizer step the user asked for


@dataclass
class Candidate:
    cfg: RunConfig
    family: str
    estimate: Estimate
    device_bytes: int          # what the GPU must hold (nvidia-smi): reserved + CUDA context
    step_seconds: float = 0.0
    tokens_per_second: float = 0.0
    time_terms: dict = field(default_factory=dict)

    @property
    def gives_up(self) -> list[str]:
        return gives_up(self.cfg)

    def to_dict(self) -> dict:
        return {"family": self.family, "config": config_summary(self.cfg), "device_bytes": self.device_bytes,
                "peak_reserved_bytes": self.estimate.peak_reserved_bytes, "cpu_ram_bytes": self.estimate.cpu_ram_bytes,
                "step_seconds": round(self.step_seconds, 4), "tokens_per_second": round(self.tokens_per_second, 1),
                "gives_up": self.gives_up}


@dataclass
class FamilyResult:
    name: str
    fits: bool
    reason: str
    best: Candidate | None = None      # the fastest fit, else the leanest member (how close it came)
    max_micro_batch: int | None = None  # at the requested seq_len (with --max-micro-batch)
    max_seq_len: int | None = None      # at micro_batch 1 (with --max-seq-len)
    longest: Candidate | None = None    # the leanest settings at max_seq_len

    def to_dict(self) -> dict:
        out = {"family": self.name, "fits": self.fits, "reason": self.reason,
               "max_micro_batch": self.max_micro_batch, "max_seq_len": self.max_seq_len}
        if self.best is not None:
            out["best"] = self.best.to_dict()
        if self.longest is not None:
            out["longest"] = self.longest.to_dict()
        return out


@dataclass
class SearchResult:
    budget_bytes: int
    margin_bytes: int
    gpu: GPU
    families: list[FamilyResult]
    pareto: list[Candidate]            # fastest first; each smaller than every faster one
    chosen: Candidate | None
    evaluated: int                     # candidates estimated
    host_ram: int | None = None        # the host RAM limit plans were held to
    max_micro_batch: int | None = None  # of the chosen plan
    max_seq_len: int | None = None
    seq_len_ladder: list["Rung"] = field(default_factory=list)  # with --max-seq-len: what each saver buys


@dataclass
class Rung:
    """The chosen plan at micro_batch 1 with the memory savers up to `added` on: its longest seq_len,
    and the GPU and host memory and the step time it needs there."""
    added: str
    max_seq_len: int
    best: Candidate | None = None      # at max_seq_len (None when nothing fits)

    def to_dict(self) -> dict:
        out = {"added": self.added, "max_seq_len": self.max_seq_len}
        if self.best is not None:
            out.update(device_bytes=self.best.device_bytes, cpu_ram_bytes=self.best.estimate.cpu_ram_bytes,
                       step_seconds=round(self.best.step_seconds, 3))
        return out


def config_summary(cfg: RunConfig) -> dict:
    out = {name: cfg.get(path) for name, path in SUMMARY.items()}
    out.update({name: cfg.get(path) for name, path in SUMMARY_IF_SET.items() if cfg.get(path) not in ("none", 1)})
    return out


def gives_up(cfg: RunConfig) -> list[str]:
    """What a plan trades against full fine-tuning in bf16-mixed with AdamW and clipping."""
    out = [METHOD_GIVES_UP[cfg.method], QUANTS[cfg.quant.scheme].gives_up, precision_entry(cfg.precision).gives_up,
           optimizer_entry(cfg.optim.name).gives_up]
    if cfg.optim.max_grad_norm is None:
        out.append("no gradient clipping")
    return [item for item in out if item]


def fidelity_rank(cfg: RunConfig) -> tuple:
    """Lower is closer to full fine-tuning: method first (full > LoRA > 8-bit base > 4-bit base)."""
    method = {"full": 0, "lora": 1, "qlora": 3}[cfg.method] + (1 if cfg.quant.scheme == "int8" else 0)
    return method, len(gives_up(cfg))


# --- the space ------------------------------------------------------------------------------------------
def families(cfg: RunConfig, gpus: int, device: str) -> list[tuple[str, dict]]:
    """(name, {config path: value}) of every method x engine family this run may use."""
    methods = [("full", {"method": "full", "quant.scheme": "none"}),
               ("LoRA", {"method": "lora", "quant.scheme": "none"}),
               ("LoRA, 8-bit base", {"method": "lora", "quant.scheme": "int8"}),
               ("QLoRA", {"method": "qlora", "quant.scheme": "nf4-dq"})]
    sharding, offload = "distributed.sharding", "distributed.offload"
    tp, pp = "distributed.tensor_parallel", "distributed.pipeline_parallel"
    out = []
    for name, fields in methods:
        if gpus == 1:
            out.append((name, {**fields, sharding: "none", offload: "none"}))
            if fields["method"] == "full" and device == "cuda":
                out.append((name + " + CPU offload (FSDP2, one process)",
                            {**fields, sharding: "zero3", offload: "all", **UNMODELLED_SHARDED}))
            continue
        engines = [("DDP", {sharding: "ddp"})]
        if fields["quant.scheme"] == "none":
            engines += [("ZeRO-2", {sharding: "zero2"}), ("ZeRO-3", {sharding: "zero3"})]
        if fields["method"] == "full":
            engines += [("ZeRO-1", {sharding: "zero1"}),
                        ("ZeRO-3 + CPU offload", {sharding: "zero3", offload: "all"}),
                        (f"tensor parallel {gpus}", {sharding: "none", tp: gpus}),
                        (f"pipeline parallel {gpus}", {sharding: "none", pp: gpus, "optim.max_grad_norm": None})]
        for engine, extra in engines:
            out.append((f"{name}, {engine}", {**fields, offload: "none", tp: 1, pp: 1, **extra, **UNMODELLED_SHARDED}))
    return out


def _fixed(cfg: RunConfig, fixed: set[str]) -> dict:
    return {path: cfg.get(path) for path in fixed}


def _choices(cfg: RunConfig, device: str, shape: ModelShape | None = None) -> dict[str, tuple]:
    """The values each inner dimension takes."""
    choices = {"precision": PRECISIONS_SEARCHED, "optim.name": OPTIMIZERS_SEARCHED,
               "memory.checkpointing": CHECKPOINTING}
    for strategy in STEP_STRATEGIES:
        choices[strategy.path] = _tried(strategy, strategy.searched, device, shape)
    return choices


def _tried(strategy, values: tuple, device: str, shape: ModelShape | None = None) -> tuple:
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


def _build(base: RunConfig, update: dict, model_config, gpus: int) -> RunConfig | list[str]:
    """The candidate, or why the trainer would refuse it: its config rules (checked on every
    construction), layer shapes its quantization backend cannot take and, on several GPUs, the
    launch rules."""
    try:
        cfg = base.updated(update, "planned config")
    except ConfigError as exc:
        return exc.problems
    shape = model_shape(model_config)
    problem = quant_shape_problem(cfg, shape.linear) or _no_adapters(cfg, shape) or _strategy_problem(cfg, shape)
    if problem:
        return [problem]
    if gpus > 1 or cfg.distributed.tensor_parallel > 1 or cfg.distributed.pipeline_parallel > 1:
        return launch_problems(cfg, gpus, model_config) or cfg
    return cfg


def _members(base: RunConfig, family: dict, fixed: dict, sequences: int, device: str, shape: ModelShape):
    """The updates of every member of one family (the trainer's rules are checked by _build)."""
    dims = {k: v for k, v in _choices(base, device, shape).items() if k not in fixed and k not in family}
    shapes = _batch_shapes(sequences)
    keys = list(dims)
    for values in itertools.product(*(dims[k] for k in keys)):
        for chosen in _with_options(dict(zip(keys, values)), base, fixed):
            for mb, ga in shapes:
                update = {**family, **chosen, "batch.micro_batch": mb, "batch.grad_accum": ga, "budget": None}
                yield _with_forced(update, base, fixed)


def _with_options(chosen: dict, base: RunConfig, fixed: dict):
    """`chosen` once for each combination of the searched options of the strategies it switches on."""
    options = {f"memory.{name}": values for strategy in STEP_STRATEGIES
               if chosen.get(strategy.path, getattr(base.memory, strategy.name))
               for name, values in strategy.searched_options.items() if f"memory.{name}" not in fixed}
    for values in itertools.product(*options.values()):
        yield {**chosen, **dict(zip(options, values))}


# --- scoring ----------------------------------------------------------------------------------------------
class _Scorer:
    def __init__(self, model_config, shape: ModelShape, gpu: GPU, gpus: int, device: str, limit: int,
                 host_ram: int | None):
        self.model_config, self.shape, self.gpu, self.gpus, self.device = model_config, shape, gpu, gpus, device
        self.limit = limit  # budget - margin
        self.host_ram = host_ram
        self.count = 0

    def memory(self, cfg: RunConfig, family: str) -> Candidate:
        self.count += 1
        est = analytic_estimate(cfg, self.model_config, device=self.device, gpus=self.gpus)
        return Candidate(cfg, family, est, device_total_bytes(est))

    def fits(self, c: Candidate) -> bool:
        return FitRule(self.limit, self.host_ram).fits(c.estimate)

    def timed(self, c: Candidate) -> Candidate:
        cfg = c.cfg
        c.time_terms = step_time(StrategyTerms(self.shape, cfg, self.device), self.gpu, self.gpus)
        c.step_seconds = sum(c.time_terms.values())
        data_parallel = max(self.gpus // (cfg.distributed.tensor_parallel * cfg.distributed.pipeline_parallel), 1)
        c.tokens_per_second = cfg.batch.micro_batch * cfg.data.seq_len * cfg.batch.grad_accum * data_parallel / c.step_seconds
        return c


def _leanest(base: RunConfig, family: dict, fixed: dict, device: str,
             shape: ModelShape | None = None) -> list[RunConfig]:
    """The family's most memory-saving settings at micro_batch 1 (a few, as no one optimizer is smallest
    for every model): the pre-check that rejects a whole family with one or two estimates."""
    out = []
    lean = [[(strategy.path, value) for value in _tried(strategy, strategy.lean, device, shape)]
            for strategy in STEP_STRATEGIES]
    for optimizer, *switches in itertools.product(OPTIMIZERS_LEAN, *lean):
        update = {"precision": PRECISION_LEAN, "memory.checkpointing": "full", "optim.name": optimizer,
                  **dict(switches), "batch.micro_batch": 1, "batch.grad_accum": 1, "budget": None, **family}
        out.append(_with_forced(update, base, fixed))
    return out


def _with_forced(update: dict, base: RunConfig, fixed: dict) -> dict:
    """The update with the settings its step strategies force (unless the user fixed them), then
    the user's fixed values on top."""
    given = {**update, **fixed}
    for strategy in STEP_STRATEGIES:
        if given.get(strategy.path, getattr(base.memory, strategy.name)):
            update.update({path: value for path, value in strategy.forces.items() if path not in fixed})
    update.update(fixed)
    return update


def _limit_of(cfg: RunConfig, scorer: _Scorer, family: str, path: str, high: int) -> int:
    """The largest batch.micro_batch (at grad_accum 1) or data.seq_len of `cfg` that fits."""
    def fits(value: int) -> bool:
        update = {path: value}
        if path == "batch.micro_batch":
            update["batch.grad_accum"] = 1
        return scorer.fits(scorer.memory(cfg.updated(update), family))
    return largest_that_fits(fits, 1 if path == "batch.micro_batch" else 8, high)


def search(base: RunConfig, model_config, budget: int, gpu: GPU, gpus: int = 1, device: str = "cuda",
           fixed_fields: set[str] = frozenset(), margin: int | None = None, max_micro_batch: bool = False,
           max_seq_len: bool = False, host_ram: int | None = None) -> SearchResult:
    """Search every family for the fastest plan whose whole-GPU memory + margin fits the budget
    (and whose host RAM fits `host_ram`, when given)."""
    shape = model_shape(model_config)
    margin = default_margin(budget) if margin is None else margin
    scorer = _Scorer(model_config, shape, gpu, gpus, device, budget - margin, host_ram)
    fixed = _fixed(base, set(fixed_fields) & set(SEARCHED))
    sequences = sequences_per_step(base)
    seq_limit = int(getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", 4096))
    results, fitting = [], []
    for name, family in families(base, gpus, device):
        if any(k in family and family[k] != v for k, v in fixed.items()):
            given = ", ".join(f"{k}={v}" for k, v in fixed.items() if k in family and family[k] != v)
            results.append(FamilyResult(name, False, f"excluded by your option(s) {given}"))
            continue
        built = [_build(base, update, model_config, gpus) for update in _leanest(base, family, fixed, device, shape)]
        lean = [scorer.memory(cfg, name) for cfg in built if isinstance(cfg, RunConfig)]
        if not lean:
            results.append(FamilyResult(name, False, f"not runnable: {built[0][0]}"))
            continue
        leanest = min(lean, key=lambda c: (not scorer.fits(c), c.device_bytes))
        if max_seq_len:  # also for a family that misses at the requested length: how long it can go
            # the longest of the lean variants: with little host RAM, offloading may shorten it
            longest = max((_longest(c.cfg, scorer, name, seq_limit) for c in lean), key=lambda found: found[0])
        if leanest.device_bytes <= scorer.limit and not scorer.fits(leanest):
            results.append(FamilyResult(name, False, "its leanest plan needs "
                                                     f"{format_bytes(leanest.estimate.cpu_ram_bytes)}"
                                                     f" of host RAM; --host-ram is {format_bytes(host_ram)}", leanest))
            results[-1].max_seq_len, results[-1].longest = longest if max_seq_len else (None, None)
            continue
        if not scorer.fits(leanest):
            top = max(leanest.estimate.by_category.items(), key=lambda kv: kv[1])
            results.append(FamilyResult(
                name, False, f"needs at least {format_bytes(leanest.device_bytes)} (largest: "
                f"{top[0].replace('_', ' ')} {format_bytes(top[1])}) + margin {format_bytes(margin)}: misses the "
                f"budget by {format_bytes(leanest.device_bytes + margin - budget)}", leanest))
            results[-1].max_seq_len, results[-1].longest = longest if max_seq_len else (None, None)
            continue
        members = [scorer.timed(c) for update in _members(base, family, fixed, sequences, device, shape)
                   if isinstance(cfg := _build(base, update, model_config, gpus), RunConfig)
                   and scorer.fits(c := scorer.memory(cfg, name))]
        if not members:  # the lean pre-check fits, but not at the user's sequences per step
            results.append(FamilyResult(name, False, f"fits only with other batch settings; leanest "
                                                     f"{format_bytes(leanest.device_bytes)}", leanest))
            continue
        best = _prefer_fidelity(members)
        fitting += members
        results.append(FamilyResult(name, True, f"fits: {format_bytes(best.device_bytes)} + margin "
                                                f"{format_bytes(margin)} of {format_bytes(budget)}", best))
        if max_micro_batch:
            results[-1].max_micro_batch = _limit_of(_lean_like(best.cfg, leanest.cfg), scorer, name, "batch.micro_batch",
                                                    4096)
        if max_seq_len:
            results[-1].max_seq_len, results[-1].longest = longest
    chosen = _prefer_fidelity(fitting) if fitting else None
    result = SearchResult(budget, margin, gpu, results, pareto(fitting, chosen), chosen, scorer.count, host_ram)
    if chosen is not None:
        if max_micro_batch:
            result.max_micro_batch = _limit_of(chosen.cfg, scorer, chosen.family, "batch.micro_batch", 4096)
        if max_seq_len:
            one = chosen.cfg.updated({"batch.micro_batch": 1, "batch.grad_accum": 1})
            result.max_seq_len = _limit_of(one, scorer, chosen.family, "data.seq_len", seq_limit)
            result.seq_len_ladder = seq_len_ladder(one, scorer, chosen.family, seq_limit, fixed, model_config, gpus,
                                                   device)
        result.evaluated = scorer.count
    return result


def _longest(cfg: RunConfig, scorer: _Scorer, family: str, high: int) -> tuple[int, Candidate | None]:
    """The longest data.seq_len of `cfg` that fits, and the plan there (None when no length fits)."""
    longest = _limit_of(cfg, scorer, family, "data.seq_len", high)
    return longest, scorer.memory(cfg.updated({"data.seq_len": longest}), family) if longest else None


def seq_len_ladder(start: RunConfig, scorer: _Scorer, family: str, high: int, fixed: dict, model_config, gpus: int,
                   device: str) -> list[Rung]:
    """What each memory saver buys in context length: `start` (micro_batch 1) with checkpointing and
    every step strategy off, then the savers switched on one after another: checkpointing, then the
    step strategies in the strategy table's order. Savers the user fixed stay as given."""
    savers = {} if "memory.checkpointing" in fixed else {"checkpointing full": {"memory.checkpointing": "full"}}
    shape = model_shape(model_config)
    savers |= {strategy.name.replace("_", " "): {strategy.path: True} for strategy in STEP_STRATEGIES
               if strategy.path not in fixed and True in _tried(strategy, strategy.lean, device, shape)}
    off = {"memory.checkpointing": "none"} | {strategy.path: False for strategy in STEP_STRATEGIES}
    off |= {f"memory.{name}": values[0] for strategy in STEP_STRATEGIES for name, values in strategy.searched_options.items()}
    current = {path: value for path, value in off.items() if path not in fixed}

    def rung(added: str, update: dict) -> Rung | None:
        cfg = _build(start, _with_forced(dict(update), start, fixed), model_config, gpus)
        if not isinstance(cfg, RunConfig):
            return None
        longest, best = _longest(cfg, scorer, family, high)
        return Rung(added, longest, scorer.timed(best) if best else None)

    ladder = [rung("none of them", current)]
    for name, update in savers.items():
        current |= update
        ladder.append(rung(f"+ {name}", current))
    return [r for r in ladder if r is not None]


def _lean_like(best: RunConfig, lean: RunConfig) -> RunConfig:
    """The leanest settings, for the largest micro-batch a family can take at the requested seq_len."""
    return lean.updated({"data.seq_len": best.data.seq_len})


def _prefer_fidelity(candidates: list[Candidate]) -> Candidate:
    """The fastest; among plans within TIE of it, the one that gives up least."""
    fastest = min(c.step_seconds for c in candidates)
    close = [c for c in candidates if c.step_seconds <= fastest * (1 + TIE)]
    return min(close, key=lambda c: (fidelity_rank(c.cfg), c.step_seconds))


def pareto(candidates: list[Candidate], chosen: Candidate | None = None, keep: int = 8) -> list[Candidate]:
    """Fastest first; a plan stays only if it needs less memory than every faster one. The chosen
    plan is always listed (it may be a slightly slower plan that gives up less)."""
    front, smallest = [], None
    for c in sorted(candidates, key=lambda c: (c.step_seconds, c.device_bytes)):
        if c is chosen or smallest is None or c.device_bytes < smallest:
            front.append(c)
            smallest = c.device_bytes if smallest is None else min(smallest, c.device_bytes)
    shown = front[:keep]
    if chosen is not None and chosen not in shown:
        shown = sorted(shown[:keep - 1] + [chosen], key=lambda c: c.step_seconds)
    return shown
