"""The planner: estimate a run; with a budget, search every strategy mix for the fastest that fits.

`plan` estimates the run as described and, given a budget, hands the search (memory/search.py) the
model, the budget, the margin and the GPU the times are predicted for (memory/gpus.py). Options the
user gave are held fixed; everything else is free. The traced engine, when asked for, confirms the
chosen plan on the trainer's own step. `resolve_budget` is the same search before `memfit train`.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from memfit.config import RunConfig
from memfit.errors import MemfitError
from memfit.memory.analytic import analytic_estimate, device_total_bytes
from memfit.memory.estimate import Estimate
from memfit.memory.gpus import DEFAULT_GPU, GPU, GPUS, find_gpu
from memfit.memory.model_shape import model_shape, trainable_params
from memfit.memory.search import SEARCHED, Candidate, SearchResult, config_summary, search
from memfit.memory.single_device import _trainable_size, strategy_host_bytes
from memfit.memory.trace import trace_estimate
from memfit.models.loading import load_model_config, missing_weights
from memfit.models.validate import POSITIONS, check_model, model_where
from memfit.strategies.adapters import check_lora_targets_on_meta
from memfit.strategies.table import STEP_STRATEGIES
from memfit.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)


@dataclass
class Plan:
    model: str
    cfg: RunConfig
    estimate: Estimate
    device_bytes: int
    budget_bytes: int | None
    gpus: int
    search: SearchResult | None = None
    seconds: float = 0.0  # wall time of the search

    @property
    def recommendation(self) -> Candidate | None:
        return self.search.chosen if self.search else None

    def to_dict(self) -> dict:
        out = {"model": self.model, "gpus": self.gpus, "budget_bytes": self.budget_bytes,
               "estimate": self.estimate.to_dict(), "device_bytes": self.device_bytes}
        if self.search is not None:
            found = self.search
            out.update(margin_bytes=found.margin_bytes, host_ram_bytes=found.host_ram, gpu=found.gpu.name, evaluated=found.evaluated,
                       families=[f.to_dict() for f in found.families], pareto=[c.to_dict() for c in found.pareto],
                       chosen=found.chosen.to_dict() if found.chosen else None,
                       recommendation=found.chosen.cfg.model_dump(mode="json") if found.chosen else None,
                       max_micro_batch=found.max_micro_batch, max_seq_len=found.max_seq_len,
                       seq_len_ladder=[r.to_dict() for r in found.seq_len_ladder])
        return out


def user_fixed_fields(cfg: RunConfig) -> set[str]:
    """The searched config paths this config sets explicitly (from YAML or the command line)."""
    return cfg.explicit_paths() & set(SEARCHED)


def reference_gpu(name: str | None, budget: int | None) -> GPU:
    """--gpu NAME, else the listed card whose memory is closest to the budget (times only)."""
    if name:
        return find_gpu(name)
    if budget is None:
        return GPUS[DEFAULT_GPU]
    return min(GPUS.values(), key=lambda g: abs(g.memory_bytes - budget))


def plan(model_name: str, cfg: RunConfig, budget_bytes: int | None = None, gpus: int = 1,
         engine: str = "analytic", device: str = "cuda", gpu: str | None = None, margin: int | None = None,
         fixed: set[str] | None = None, max_micro_batch: bool = False, max_seq_len: bool = False,
         host_ram: int | None = None) -> Plan:
    """Estimate `cfg` for `model_name`; with a budget, search for the fastest plan that fits."""
    if gpus < 1:
        raise MemfitError(f"--gpus: must be 1 or more (got {gpus})")
    if budget_bytes is not None and budget_bytes <= 0:
        raise MemfitError(f"--budget: must be a positive size such as 24GiB (got {budget_bytes} bytes)")
    if margin is not None and budget_bytes is not None and not 0 <= margin < budget_bytes:
        raise MemfitError(f"--margin: must be at least 0 and less than the budget ({format_bytes(budget_bytes)}); "
                          f"got {format_bytes(margin)}")
    reference = reference_gpu(gpu, budget_bytes)
    fixed = user_fixed_fields(cfg) if fixed is None else fixed
    if cfg.model.name != model_name:
        # Another model: its weights are the default again, whatever init the configured model had.
        cfg = cfg.updated({"model.name": model_name, "model.init": "pretrained"})
    model_config, _ = load_model_config(cfg.model)
    check_model(cfg, model_config, model_where(cfg.model), gpus)
    check_lora_targets_on_meta(model_config, cfg)  # a name the analytic count would drop silently
    described = cfg
    if not isinstance(cfg.batch.micro_batch, int):
        described = cfg.updated({"batch.micro_batch": 1})
    estimate = _engine_estimate(described, model_config, device, engine, gpus)
    result = Plan(model_name, described, estimate, device_total_bytes(estimate), budget_bytes, gpus)
    if budget_bytes is None:
        return result
    started = time.perf_counter()
    result.search = search(described, model_config, budget_bytes, reference, gpus, device,
                           fixed, margin, max_micro_batch, max_seq_len,
                           host_ram)
    result.seconds = time.perf_counter() - started
    chosen = result.recommendation
    if chosen is not None:
        if engine == "traced":  # confirm the choice on the trainer's own step
            chosen.estimate = _engine_estimate(chosen.cfg, model_config, device, "traced", gpus)
            chosen.device_bytes = device_total_bytes(chosen.estimate)
    return result


def _engine_estimate(cfg: RunConfig, model_config, device: str, engine: str, gpus: int = 1) -> Estimate:
    if engine == "analytic":
        return analytic_estimate(cfg, model_config, device=device, gpus=gpus)
    if engine != "traced":
        raise MemfitError(f"--engine: unknown '{engine}'; allowed: analytic, traced")
    traced = trace_estimate(cfg, device=device)
    analytic = analytic_estimate(cfg, model_config, device=device, gpus=gpus)
    # host RAM beyond the training tensors (runtime, loading path, data) comes from the analytic terms
    on_host = traced.peak_allocated_bytes if device == "cpu" else 0
    analytic_on_host = analytic.peak_allocated_bytes if device == "cpu" else 0
    traced.cpu_ram_bytes = analytic.cpu_ram_bytes - analytic_on_host + on_host
    if device == "cuda" and not traced.overheads:
        # the tracker sees tensors only: add the same named runtime terms the analytic engine uses
        traced.overheads = dict(analytic.overheads)
        traced.peak_reserved_bytes = (traced.peak_allocated_bytes + analytic.overheads["cublas_workspace"]
                                      + analytic.overheads["allocator_reserve"])
    return traced


# --- budget: auto / size, before training ----------------------------------------------------------------
def available_bytes(device: str) -> int:
    """What a run on `device` may fill before the margin: the GPU's free memory, or half the available
    RAM on the CPU (the other half is for the dataset, the Python runtime and the page cache the data
    loader relies on, none of which a tensor estimate counts). budget: auto and micro_batch: auto both
    use this one rule."""
    if device == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available) // 2
    except ImportError:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 2


def machine_ram_bytes() -> int:
    """Total RAM of this machine (the host RAM limit `memfit plan` assumes by default)."""
    try:
        import psutil

        return int(psutil.virtual_memory().total)
    except ImportError:
        import os

        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_host_ram(cfg: RunConfig, device: str, host_ram: int | None = None) -> None:
    """Stop a CUDA run whose step strategies park more in host RAM (activation_offload's pinned saved
    tensors) than the machine has, before any model or data is loaded; a no-op when none is on."""
    if device != "cuda" or not any(s.host_bytes and getattr(cfg.memory, s.name) for s in STEP_STRATEGIES):
        return
    model_config = _model_config(cfg)
    parked = strategy_host_bytes(model_shape(model_config), cfg, device)
    needed = analytic_estimate(cfg, model_config, device=device).cpu_ram_bytes
    host_ram = machine_ram_bytes() if host_ram is None else host_ram
    if needed > host_ram:
        what = ", ".join(f"memory.{name} {format_bytes(value)}" for name, value in parked.items())
        raise MemfitError(
            f"host RAM: this run needs {format_bytes(needed)} of host RAM ({what} of it pinned, at data.seq_len "
            f"{cfg.data.seq_len} x batch.micro_batch {cfg.batch.micro_batch}); this machine has "
            f"{format_bytes(host_ram)}. Use a shorter data.seq_len, memory.checkpointing=full (only each "
            "layer's input is kept), or `memfit plan ... --host-ram SIZE` for a plan that fits")


def resolve_budget(cfg: RunConfig) -> RunConfig:
    """`budget: auto | <size>`: let the planner choose the setup before training; no-op when unset.

    The run as configured is kept when it fits with the margin; otherwise the search's choice (method,
    quantization and distribution stay as configured when set). The returned config has budget
    cleared, so it is not planned again. Raises MemfitError, with each family's reason, when nothing fits."""
    budget = cfg.budget
    if budget is None:
        return cfg
    import torch

    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    budget_bytes = available_bytes(device) if budget == "auto" else parse_bytes(budget)
    fixed = user_fixed_fields(cfg) & {"method", "quant.scheme", "distributed.sharding", "distributed.offload",
                                            "distributed.tensor_parallel", "distributed.pipeline_parallel"}
    result = plan(cfg.model.name, cfg, budget_bytes, gpus=1, device=device, fixed=fixed, host_ram=machine_ram_bytes())
    current = cfg.updated({"budget": None})
    if isinstance(cfg.batch.micro_batch, int) and result.device_bytes + result.search.margin_bytes <= budget_bytes:
        log.info("budget %s: the configured run fits (%s predicted); training it as configured",
                 format_bytes(budget_bytes), format_bytes(result.device_bytes))
        return current
    if result.recommendation is None:
        reasons = "; ".join(f"{f.name}: {f.reason}" for f in result.search.families)
        raise MemfitError(f"budget {format_bytes(budget_bytes)}: no configuration of {cfg.model.name} fits ({reasons})")
    chosen = result.recommendation.cfg
    log.info("budget %s: planner chose %s (predicted %s)", format_bytes(budget_bytes),
             config_summary(chosen), format_bytes(result.recommendation.device_bytes))
    return chosen


def _model_config(cfg: RunConfig):
    return load_model_config(cfg.model)[0]


def parse_budget(text: str | None, option: str = "--budget", allow_zero: bool = False) -> int | None:
    if text is None:
        return None
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise MemfitError(f"{option}: {exc}") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise MemfitError(f"{option}: must be a positive size such as 24GiB (got {text!r})")
    return value


# --- output ---------------------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / 2**30:8.2f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def plan_text(result: Plan) -> str:
    """The plan as a table; every number in GiB (2^30 bytes), said in the header."""
    est, cfg = result.estimate, result.cfg
    shape = model_shape(_model_config(cfg))
    trainable = trainable_params(shape, cfg)
    master = min(trainable * _trainable_size(cfg), est.by_category["weights"])
    lines = [f"memfit plan: {result.model} ({_count(shape.total_params)} parameters, "
             f"{_count(trainable)} trainable), engine {est.engine}, per GPU",
             f"run as described: {config_summary(cfg)}",
             "", "Predicted peak GPU memory (GiB = 2^30 bytes)"]
    rows = [("weights (frozen / base)", est.by_category["weights"] - master),
            ("trainable master weights", master),
            ("gradients", est.by_category["gradients"]),
            ("optimizer states", est.by_category["optimizer_states"]),
            ("activations (at the peak)", est.by_category["activations"]),
            ("temporaries", est.by_category["temporaries"])]
    lines += [f"  {name:<34}{_gib(value)} GiB" for name, value in rows]
    lines.append(f"  {'= allocator peak (max_memory_allocated)':<34}{_gib(est.peak_allocated_bytes)} GiB")
    for name, value in est.overheads.items():
        lines.append(f"  {'+ ' + name.replace('_', ' '):<34}{_gib(value)} GiB")
    if est.overheads:
        lines.append(f"  {'= reserved peak (max_memory_reserved)':<34}{_gib(est.peak_reserved_bytes)} GiB")
        lines.append(f"  {'= whole GPU (nvidia-smi)':<34}{_gib(result.device_bytes)} GiB")
    lines.append(f"Predicted CPU RAM (loading path, data, offload): {_gib(est.cpu_ram_bytes).strip()} GiB")
    if est.phases:
        top = max(est.phases, key=lambda name: est.phases[name]["gpu"])
        lines.append("Phases, GPU tensors / host RAM (GiB): " + ", ".join(
            f"{name.replace('_', ' ')} {p['gpu'] / 2**30:.2f} / {p['cpu_ram'] / 2**30:.2f}"
            for name, p in est.phases.items()) + f"; the GPU peak is set by: {top.replace('_', ' ')}")
    lines += [f"note: {n}" for n in est.notes]
    if result.search is None:
        return "\n".join(lines)
    return "\n".join(lines + [""] + search_lines(result))


def _settings(cfg: RunConfig) -> str:
    """The plan's choices in the words of RunConfig keys, defaults left out."""
    parts = [f"{cfg.precision}", cfg.optim.name, f"checkpointing {cfg.memory.checkpointing}"]
    for strategy in STEP_STRATEGIES:
        if getattr(cfg.memory, strategy.name):
            parts.append(strategy.name.replace("_", " "))
            parts += [option.replace("_", " ") + ("" if value is True else f" {value}") for option in strategy.options
                      if (value := getattr(cfg.memory, option)) not in (None, False)]
    parts.append(f"micro_batch {cfg.batch.micro_batch} x grad_accum {cfg.batch.grad_accum}")
    return ", ".join(parts)


def search_lines(result: Plan) -> list[str]:
    """The decision: the chosen plan, the Pareto table, one line per family."""
    found = result.search
    budget, margin = found.budget_bytes, found.margin_bytes
    lines = [f"Budget {budget / 2**30:.2f} GiB per GPU x {result.gpus} GPU(s), margin {margin / 2**30:.2f} GiB "
             f"(plan + margin <= budget); host RAM "
             f"{'unlimited' if found.host_ram is None else format(found.host_ram / 2**30, '.1f') + ' GiB'} "
             "(--host-ram); "
             f"step times predicted for {found.gpu.name} (--gpu); {found.evaluated} plans estimated in "
             f"{result.seconds:.2f} s"]
    chosen = found.chosen
    if chosen is None:
        lines.append("Recommendation: nothing fits this budget; each family's closest plan and its miss are below "
                     "(more GPUs with --gpus, a shorter --seq-len, or a larger budget)")
    else:
        lines += [f"Recommendation: {chosen.family}: {_settings(chosen.cfg)}",
                  f"  GPU {chosen.device_bytes / 2**30:.2f} GiB (reserved peak "
                  f"{chosen.estimate.peak_reserved_bytes / 2**30:.2f}"
                  f" + CUDA context), CPU RAM {chosen.estimate.cpu_ram_bytes / 2**30:.2f} GiB, "
                  f"~{chosen.step_seconds:.2f} s per step ({chosen.tokens_per_second:,.0f} tokens/s predicted), "
                  f"gives up: {'; '.join(chosen.gives_up) or 'nothing'}"]
        if found.max_seq_len is not None:
            lines.append(f"  longest seq_len that fits this plan at micro_batch 1: {_count(found.max_seq_len)}"
                         + _position_cap(result.cfg, found.max_seq_len))
            lines += _ladder_lines(found.seq_len_ladder)
        if found.max_micro_batch is not None:
            lines.append(f"  largest micro_batch that fits this plan at seq_len {chosen.cfg.data.seq_len}: "
                         f"{found.max_micro_batch or 'none'}")
        fastest = found.pareto[0].step_seconds
        lines += ["", "Fastest plans that fit (each needs less memory than every faster one; time relative to the "
                      "fastest)",
                  f"  {'GPU GiB':>8} {'CPU GiB':>8} {'time':>6}  family: settings  [gives up]"]
        for c in found.pareto:
            mark = "*" if c is chosen else " "
            lines.append(f"{mark} {c.device_bytes / 2**30:8.2f} {c.estimate.cpu_ram_bytes / 2**30:8.2f} "
                         f"{c.step_seconds / fastest:5.2f}x  {c.family}: {_settings(c.cfg)}"
                         f"  [{'; '.join(c.gives_up) or 'nothing'}]")
    lines += ["", "Families"]
    for family in found.families:
        mark = "FITS" if family.fits else "no  "
        lines.append(f"  [{mark}] {family.name}: {family.reason}")
        limits = []
        if family.max_seq_len is not None:
            limits.append(f"longest seq_len at micro_batch 1: {_count(family.max_seq_len)}" + (
                f" (GPU {family.longest.device_bytes / 2**30:.2f} GiB, host RAM "
                f"{family.longest.estimate.cpu_ram_bytes / 2**30:.1f} GiB) with {_settings(family.longest.cfg)}"
                if family.longest else ""))
        if family.max_micro_batch is not None:
            limits.append(f"largest micro_batch at seq_len {result.cfg.data.seq_len}: "
                          f"{family.max_micro_batch or 'none'}")
        if limits:
            lines.append("         " + "; ".join(limits) + " (the family's leanest settings)")
    return lines


def _count(value: int) -> str:
    return f"{value:,}" if value else "none"


def _position_cap(cfg: RunConfig, longest: int) -> str:
    """Says so when the longest seq_len is the model's position table, not the memory, talking."""
    config = _model_config(cfg)
    name, limit = next(((n, getattr(config, n)) for n in POSITIONS if getattr(config, n, None)), (None, None))
    return f" (the model's {name}: memory would allow more)" if limit == longest else ""


def _ladder_lines(ladder) -> list[str]:
    """What each memory saver buys: the longest seq_len as they are switched on one after another."""
    if not ladder:
        return []
    lines = ["  what each memory saver buys (this plan at micro_batch 1, savers added one after another):",
             f"    {'memory savers':<26} {'longest seq_len':>15} {'GPU there':>10} {'host RAM there':>15} "
             f"{'step there':>11}"]
    for rung in ladder:
        best = rung.best
        length = _count(rung.max_seq_len)
        gpu = f"{best.device_bytes / 2**30:.2f} GiB" if best else "-"
        host = f"{best.estimate.cpu_ram_bytes / 2**30:.1f} GiB" if best else "-"
        step = f"{best.step_seconds:.1f} s" if best else "-"
        lines.append(f"    {rung.added:<26} {length:>15} {gpu:>10} {host:>15} {step:>11}")
    return lines


def check_config_path(path: str) -> Path:
    """The --write-config file, refused before any planning when it cannot be written there."""
    target = Path(path)
    if target.is_dir():
        raise MemfitError(f"--write-config {path}: is a folder; give a file name such as {target / 'plan.yaml'}")
    if not target.parent.is_dir():
        raise MemfitError(f"--write-config {path}: folder {target.parent} does not exist; create it or give a path "
                          "in an existing folder")
    return target


def write_config(result: Plan, path: str) -> RunConfig:
    """Write the recommendation (or the described run) as a RunConfig YAML `memfit train` accepts."""
    cfg = result.recommendation.cfg if result.recommendation else result.cfg
    if missing_weights(cfg.model):
        # A shape without weights anywhere: the written run says outright that it starts from random ones.
        cfg = cfg.updated({"model.init": "random"})
    target = check_config_path(path)
    try:
        target.write_text(cfg.to_yaml())
    except OSError as exc:
        raise MemfitError(f"--write-config {path}: cannot write ({exc.strerror})") from None
    return cfg
