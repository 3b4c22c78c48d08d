"""Resolve once: the loaded RunConfig becomes the run that trains, before any model or data is loaded.

Each decision is made here, once, in this order:

  device             `device: auto` is CUDA when torch sees a GPU (the engine's own rule); this rank's GPU
                     under torchrun
  budget:            `auto` (the device's free memory) or a size: the configured run when it fits, else
                     the planner's search's fastest plan that fits (memory/planner.py)
  micro_batch: auto  the largest micro-batch whose traced estimate (the trainer's own step on fake
                     tensors) fits memory.limit, or the device's free memory less the planner's margin
  host RAM           a run that needs more host RAM than the machine has (the planner's host-RAM estimate
                     for this node's processes) stops here, with the numbers

Every "does it fit" is memory/fits.py's `FitRule`, the rule the planner's search applies. The caller
passes the `ResolvedRun` to the loop (memfit/train/loop.py: train), which builds its engine from its
cfg and device and never plans.
"""

from __future__ import annotations

import logging
import os

import torch

from memfit.config import RunConfig
from memfit.distributed.engine import resolve_device
from memfit.distributed.launch import world_size_from_env
from memfit.errors import MemfitError
from memfit.memory.analytic import analytic_estimate
from memfit.memory.candidates import config_summary
from memfit.memory.fits import FitRule, available_bytes, default_margin, largest_that_fits, machine_ram_bytes
from memfit.memory.model_shape import model_shape
from memfit.memory.planner import plan, user_fixed_fields
from memfit.memory.single_device import strategy_host_bytes
from memfit.memory.trace import trace_estimate
from memfit.models.loading import load_model_config
from memfit.train.resolved_run import ResolvedRun
from memfit.units import format_bytes, parse_bytes

log = logging.getLogger(__name__)

AUTO_MAX_MICRO_BATCH = 1024  # search ceiling for micro_batch: auto
# what `budget:` keeps as the user set it; the search chooses the rest
KEPT_UNDER_BUDGET = frozenset({"method", "quant.scheme", "distributed.sharding", "distributed.offload",
                               "distributed.tensor_parallel", "distributed.pipeline_parallel"})


def resolve_run(cfg: RunConfig) -> ResolvedRun:
    """Device, host RAM, `budget:` and `micro_batch: auto` of `cfg`, each decided once (module docstring)."""
    device = training_device(cfg)
    host_ram = machine_ram_bytes()
    notes: list[str] = []
    budget_bytes = None
    if cfg.budget is not None:
        budget_bytes = available_bytes(device) if cfg.budget == "auto" else parse_bytes(cfg.budget)
        cfg = fit_budget(cfg, budget_bytes, device.type, host_ram, notes)
    if cfg.batch.micro_batch == "auto":
        cfg = fit_micro_batch(cfg, device, notes=notes)
    check_host_ram(cfg, device.type, host_ram, ranks=int(os.environ.get("LOCAL_WORLD_SIZE", world_size_from_env())))
    return ResolvedRun(cfg, device, host_ram, budget_bytes, tuple(notes))


def training_device(cfg: RunConfig) -> torch.device:
    """cfg.device as the engine resolves it; under torchrun on GPUs, this rank's GPU (LOCAL_RANK), whose
    free memory is what this rank may fill."""
    device = resolve_device(cfg.device)
    if device.type == "cuda" and world_size_from_env() > 1:
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return device


def check_host_ram(cfg: RunConfig, device: str, host_ram: int, ranks: int = 1) -> None:
    """Stop, before any model or data is loaded, a run whose host RAM (the planner's: the runtimes and data of
    this node's `ranks` processes, the load, offloaded states, parked activations, a CPU run's training state)
    is more than this machine has, with the numbers."""
    model_config = load_model_config(cfg.model)[0]
    try:
        needed = analytic_estimate(cfg, model_config, device=device, gpus=ranks).cpu_ram_bytes
    except MemfitError:
        raise
    except Exception as exc:  # noqa: BLE001 - a model the estimate cannot read: the build names what is wrong
        log.warning("host RAM not checked: the estimate could not read %s (%s)", cfg.model.name, exc)
        return
    if needed <= host_ram:
        return
    parked = strategy_host_bytes(model_shape(model_config), cfg, device)
    what = (f" ({', '.join(f'memory.{name} {format_bytes(value)}' for name, value in parked.items())} of it "
            f"pinned, at data.seq_len {cfg.data.seq_len} x batch.micro_batch {cfg.batch.micro_batch})" if parked else "")
    where = f" on the {device.upper()}" if device == "cpu" else ""
    raise MemfitError(
        f"host RAM: this run{where} needs {format_bytes(needed)} of host RAM for {ranks} process(es){what}; this "
        f"machine has {format_bytes(host_ram)}. `memfit plan {cfg.model.name} --host-ram "
        f"{format_bytes(host_ram).replace(' ', '')}` finds plans that fit it (a shorter data.seq_len, "
        "memory.checkpointing=full, a quantized base...)")


def fit_budget(cfg: RunConfig, budget_bytes: int, device: str, host_ram: int | None,
               notes: list[str] | None = None) -> RunConfig:
    """`budget:` of `budget_bytes` on `device`: the run as configured when it fits with the margin,
    otherwise the search's choice (method, quantization and distribution stay as configured when set).
    The returned config has budget cleared, so it is not planned again. Raises MemfitError, with each
    family's reason, when nothing fits."""
    fixed = user_fixed_fields(cfg) & KEPT_UNDER_BUDGET
    result = plan(cfg.model.name, cfg, budget_bytes, gpus=1, device=device, fixed=fixed, host_ram=host_ram)
    rule = FitRule(budget_bytes - result.search.margin_bytes, host_ram)
    if isinstance(cfg.batch.micro_batch, int) and rule.fits(result.estimate):
        _note(notes, "budget %s: the configured run fits (%s predicted); training it as configured",
              format_bytes(budget_bytes), format_bytes(result.device_bytes))
        return cfg.updated({"budget": None})
    if result.recommendation is None:
        reasons = "; ".join(f"{f.name}: {f.reason}" for f in result.search.families)
        raise MemfitError(f"budget {format_bytes(budget_bytes)}: no configuration of {cfg.model.name} fits ({reasons})")
    chosen = result.recommendation.cfg
    _note(notes, "budget %s: planner chose %s (predicted %s)", format_bytes(budget_bytes),
          config_summary(chosen), format_bytes(result.recommendation.device_bytes))
    return chosen


def micro_batch_room(cfg: RunConfig, device: torch.device) -> tuple[FitRule, str]:
    """What micro_batch: auto must fit under, and where that number comes from. memory.limit is the
    tracker's own ceiling, which the traced estimate predicts exactly; the device's memory keeps the
    planner's margin free (fragmentation, a second process)."""
    if cfg.memory.limit is not None:
        return FitRule(cfg.memory.limit_bytes), f"memory.limit {cfg.memory.limit}"
    total = available_bytes(device)
    source = "the GPU's free memory" if device.type == "cuda" else "half of the available RAM"
    margin = default_margin(total)
    return FitRule(total - margin), f"{source} less the margin of {format_bytes(margin)}"


def fit_micro_batch(cfg: RunConfig, device: torch.device, estimate=None, limit: int = AUTO_MAX_MICRO_BATCH,
                    notes: list[str] | None = None) -> RunConfig:
    """cfg with micro_batch 'auto' replaced by the largest micro-batch whose estimate (by default the traced
    one: the planner's own fake run of this step) fits, found as the planner finds its largest micro-batch."""
    estimate = estimate or trace_estimate
    rule, source = micro_batch_room(cfg, device)

    def fits(micro_batch: int) -> bool:
        return rule.fits(estimate(cfg.updated({"batch.micro_batch": micro_batch}), device.type))

    best = largest_that_fits(fits, 1, limit)
    room = format_bytes(rule.device_limit_bytes)
    if not best:
        raise MemfitError(f"batch.micro_batch: auto: even one sequence of seq_len {cfg.data.seq_len} does not fit in "
                          f"{room} ({source}); see `memfit plan` for strategies that fit")
    _note(notes, "batch.micro_batch: auto -> %d (largest that fits %s, %s)", best, room, source)
    return cfg.updated({"batch.micro_batch": best})


def _note(notes: list[str] | None, message: str, *args) -> None:
    log.info(message, *args)
    if notes is not None:
        notes.append(message % args)
