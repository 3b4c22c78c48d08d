"""The closed-form estimate of a training run: instant answers, fast enough to search hundreds of
candidate configurations.

The traced engine (memory/trace.py) runs the real step on fake tensors; this engine reproduces the
same numbers from formulas: memory/model_states.py and memory/activations.py count each category,
memory/single_device.py the moments where a step on one device can peak, memory/distributed_estimate.py
what sharding, tensor and pipeline parallel change per rank, and memory/phases.py the peaks outside the
step (loading, checkpoint save, merge); `analytic_estimate` takes the largest moment. Every term is
documented in docs/planner.md.
"""

from __future__ import annotations

from memfit.config import RunConfig
from memfit.errors import MemfitError
from memfit.memory.activations import loss_buffer_bytes
from memfit.memory.distributed_estimate import (distributed, fullest_stage, node_cpu_ram, rank_model_states,
                                               rank_shape)
from memfit.memory.estimate import Estimate
from memfit.memory.model_shape import ModelShape, model_shape
from memfit.memory.model_states import ModelStates, model_states, optimizer_state_bytes, weights_bytes
from memfit.memory.phases import phase_peaks
from memfit.memory.single_device import (ALLOCATOR_SEGMENT_BYTES, beyond_basics_terms, cpu_ram_bytes, eval_bytes,
                                         host_peak_bytes, peak_candidates, runtime_overheads, strategy_host_bytes,
                                         with_engine_holdings)
from memfit.memory.tracker import CATEGORIES
from memfit.models.load_plan import load_beside_host_states
from memfit.models.loading import load_model_config
from memfit.strategies.optimizers import optimizer_entry


def analytic_estimate(cfg: RunConfig, model_config=None, device: str = "cuda", gpus: int = 1,
                      stage: int | None = None) -> Estimate:
    """Closed-form estimate of one run's peak memory per device (see docs/planner.md). Under pipeline
    parallel, of the stage that needs the most, or of `stage`."""
    if model_config is None:
        model_config, _ = load_model_config(cfg.model)
    if not isinstance(cfg.batch.micro_batch, int):
        raise MemfitError("micro_batch: auto is resolved by the planner; the analytic estimate needs a number")
    if cfg.device != device:  # terms that differ by device (the dropout mask) read cfg.device
        cfg = cfg.model_copy(update={"device": device})
    shape = model_shape(model_config)
    candidates, states = step_moments(shape, cfg, device, gpus, stage)
    where, by_category = max(candidates.items(), key=lambda kv: sum(kv[1].values()))
    by_category = {c: int(by_category.get(c, 0)) for c in CATEGORIES}
    paged = 0
    if device == "cuda" and optimizer_entry(cfg.optim.name).paged:
        # bitsandbytes keeps paged states in CUDA unified memory, outside torch's allocator statistics
        paged, by_category["optimizer_states"] = by_category["optimizer_states"], 0
    allocated = sum(by_category.values())
    # allocator reserve: the loss buffers (the largest blocks of the step, cached after the backward's
    # start and rarely reusable for other shapes) + one partly used 2 MiB segment per layer
    transient = loss_buffer_bytes(shape, cfg) + ALLOCATOR_SEGMENT_BYTES * shape.layers
    overheads = runtime_overheads(cfg, device, transient)
    if paged:
        overheads["paged_optimizer_states"] = paged
    reserved = allocated + overheads.get("cublas_workspace", 0) + overheads.get("allocator_reserve", 0)
    ram = cpu_ram_bytes(shape, cfg, device)
    if states.host_bytes:  # what offload took off the GPU lives in host RAM
        ram["offloaded"] = states.host_bytes
    # e.g. activation_offload: the saved tensors, pinned
    ram.update(strategy_host_bytes(rank_shape(shape, cfg), cfg, device))
    if device == "cpu":
        ram["training_state"] = allocated
    ram = node_cpu_ram(ram, shape, cfg, gpus, device)  # per node: every rank's runtime, data, offload
    notes = [f"peak at {where.replace('_', ' ')}"]
    phases = {}
    if device == "cuda":
        notes.append("nvidia-smi would show peak_reserved_bytes + cuda_context")
        if gpus == 1 and cfg.distributed.sharding == "none":
            phases = _phases(shape, cfg, reserved, by_category, ram)
            top = max(phases, key=lambda name: phases[name]["gpu"])
            if top != "step":
                notes.append(f"the run's GPU peak is the {top.replace('_', ' ')} phase, not the step")
    host = host_peak_bytes(ram, load_beside_host_states(cfg, device))
    return Estimate(peak_allocated_bytes=allocated, peak_reserved_bytes=reserved, by_category=by_category,
                    overheads=overheads, cpu_ram_bytes=host, engine="analytic", notes=notes, phases=phases)


def step_moments(shape: ModelShape, cfg: RunConfig, device: str, gpus: int,
                 stage: int | None = None) -> tuple[dict, ModelStates]:
    """The moments where one step can peak on one device or rank, with every step strategy's terms applied
    (each entry's `peak`, computed on the part of the model the rank runs), and that rank's model states
    (under pipeline parallel: of the fullest stage, or of `stage`)."""
    if cfg.distributed.pipeline_parallel > 1:
        return fullest_stage(shape, cfg, device, stage)
    part = rank_shape(shape, cfg)
    states = rank_model_states(part, cfg, gpus, device) if distributed(cfg) else model_states(shape, cfg, device)
    moments = beyond_basics_terms(peak_candidates(part, cfg, states), part, cfg, device)
    return with_engine_holdings(moments, states), states


def _phases(shape: ModelShape, cfg: RunConfig, reserved: int, by_category: dict, ram: dict) -> dict:
    """Load, step, eval, checkpoint save (and merge) peaks of a single-GPU run (memory/phases.py)."""
    base = ram["runtime"] + ram.get("data", 0)
    step_ram = sum(v for k, v in ram.items() if k != "model_load")
    return phase_peaks(shape, cfg, reserved, step_ram, weights_bytes(shape, cfg), optimizer_state_bytes(shape, cfg),
                       ram.get("model_load", 0), base, eval_bytes(shape, cfg) if cfg.eval.enabled else None)


def device_total_bytes(estimate: Estimate) -> int:
    """What the whole GPU must hold (nvidia-smi) at the run's peak: the step's reserve and paged
    optimizer states (unified memory, resident on the GPU while the step runs), or a larger phase
    (loading, checkpoint save), plus the CUDA context."""
    step = estimate.peak_reserved_bytes + estimate.overheads.get("paged_optimizer_states", 0)
    other = max((p["gpu"] for name, p in estimate.phases.items() if name != "step"), default=0)
    return max(step, other) + estimate.overheads.get("cuda_context", 0)
