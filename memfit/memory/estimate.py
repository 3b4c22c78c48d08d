"""The planner's answer for one configuration, shared by the traced and analytic engines."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

from memfit.memory.tracker import CATEGORIES


@dataclass
class Estimate:
    """Predicted peak memory of one training run, per device (per rank when sharded).

    peak_allocated_bytes   what torch.cuda.max_memory_allocated would report (tensor storages,
                           rounded as the caching allocator rounds them on CUDA)
    peak_reserved_bytes    what max_memory_reserved / nvidia-smi would show: allocated plus the
                           allocator's reserve, plus the named runtime overheads
    by_category            bytes per category at the peak (keys: memory.tracker.CATEGORIES)
    overheads              named terms the tracker cannot see (e.g. "cuda_context"), bytes
    cpu_ram_bytes          host RAM: loading path, data side, anything offloaded
    engine                 "traced" or "analytic"
    phases                 per phase (load, step, eval, checkpoint_save, merge): {"gpu": bytes, "cpu_ram": bytes}
                           on a single CUDA device (memory/phases.py); empty otherwise
    step_phase_peaks       traced only: the highest tracked bytes inside forward, backward, optimizer
                           and (when the run evaluates) eval
    """

    peak_allocated_bytes: int
    peak_reserved_bytes: int
    by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    overheads: dict[str, int] = field(default_factory=dict)
    cpu_ram_bytes: int = 0
    engine: str = "analytic"
    notes: list[str] = field(default_factory=list)
    phases: dict[str, dict[str, int]] = field(default_factory=dict)
    step_phase_peaks: dict[str, int] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)
