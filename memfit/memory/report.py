"""Memory reports: bytes by category, estimated beside measured, as text and JSON.

Bytes internally; printed in binary units with the unit named (GiB = 2^30 bytes).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field

from memfit.memory.tracker import CATEGORIES
from memfit.units import format_bytes

@dataclass
class MemoryReport:
    """Peak memory of a run. `measured_*` come from the tracker (and CUDA on GPU), `estimated_*`
    from the planner when one was made: for `estimated_shape` (the batch the measured peak ran on,
    so both sides see the same tensors), with the full-length plan as `worst_case_*`."""

    tracked: bool = True  # False: logging.track_memory was off, so no category was measured
    measured_peak_bytes: int = 0
    measured_by_category: dict[str, int] = field(default_factory=lambda: dict.fromkeys(CATEGORIES, 0))
    measured_phase_peaks: dict[str, int] = field(default_factory=dict)  # forward, backward, optimizer, eval
    estimated_peak_bytes: int | None = None
    estimated_by_category: dict[str, int] | None = None
    estimated_phase_peaks: dict[str, int] = field(default_factory=dict)  # the traced step's, same shape
    cuda_max_allocated_bytes: int | None = None
    cuda_max_reserved_bytes: int | None = None
    process_peak_rss_bytes: int | None = None
    estimated_shape: dict[str, int] | None = None  # micro_batch, seq_len (tokens as padded), grad_accum
    worst_case_seq_len: int | None = None
    worst_case_peak_bytes: int | None = None
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> str:
        return json.dumps(asdict(self), indent=2)

    def to_text(self) -> str:
        lines = self._category_lines() if self.tracked else [
            "Memory tracking was off (logging.track_memory: false): no per-category measurement. "
            "Turn it on to see where the memory goes, or run `memfit plan` for the estimate."]
        if self.measured_phase_peaks:
            lines.append("measured peak by phase (all tracked bytes live at the time): " + ", ".join(
                f"{name} {format_bytes(n)}" for name, n in self.measured_phase_peaks.items()))
        if self.estimated_phase_peaks:
            lines.append("estimated peak by phase: " + ", ".join(
                f"{name} {format_bytes(n)}" for name, n in self.estimated_phase_peaks.items()))
        if self.cuda_max_allocated_bytes is not None:
            lines.append(f"torch.cuda.max_memory_allocated: {format_bytes(self.cuda_max_allocated_bytes)}")
            lines.append(f"torch.cuda.max_memory_reserved:  {format_bytes(self.cuda_max_reserved_bytes)}")
        if self.process_peak_rss_bytes is not None:
            lines.append(f"process peak RSS (whole process, incl. Python and libraries): "
                         f"{format_bytes(self.process_peak_rss_bytes)}")
        lines.extend(self.notes)
        return "\n".join(lines)

    def _category_lines(self) -> list[str]:
        with_estimate = self.estimated_by_category is not None
        header = f"{'category':<18}{'measured':>14}" + (f"{'estimated':>14}{'error':>9}" if with_estimate else "")
        lines = ["Peak memory by category (tensor storage bytes at the step's peak)", header, "-" * len(header)]
        rows = [(c, self.measured_by_category.get(c, 0), (self.estimated_by_category or {}).get(c)) for c in CATEGORIES]
        rows.append(("total (peak)", self.measured_peak_bytes, self.estimated_peak_bytes))
        for name, measured, estimated in rows:
            line = f"{name:<18}{format_bytes(measured):>14}"
            if with_estimate:
                error = f"{(estimated - measured) / measured:+.1%}" if measured and estimated is not None else "-"
                line += f"{format_bytes(estimated):>14}{error:>9}"
            lines.append(line)
        return lines + self._estimate_lines()

    def _estimate_lines(self) -> list[str]:
        shape = self.estimated_shape
        if self.worst_case_peak_bytes is None:
            return []
        worst = f"worst case at seq_len {self.worst_case_seq_len}: {format_bytes(self.worst_case_peak_bytes)}"
        if shape is None:  # no step measured: the estimate column is the worst case itself
            return [f"estimated: the {worst} (every sequence full length)"]
        accum = f", grad_accum {shape['grad_accum']}" if shape["grad_accum"] != 1 else ""
        return [f"estimated for the batch at the measured peak: micro_batch {shape['micro_batch']} x "
                f"{shape['seq_len']} tokens per sequence (padded to the batch's longest){accum}",
                f"{worst} (the plan's step with every sequence full length)"]
