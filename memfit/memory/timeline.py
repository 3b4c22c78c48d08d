"""The memory timeline of a run: live tracked bytes by category across the step with the highest
peak (forward, backward, optimizer, and evaluation when it ran in that step), measured, with the
traced estimate's per-phase peaks as dashed lines.

`memfit train` writes RUN_DIR/memory_timeline.json (the tracker's samples, memory/tracker.py:
MemoryTracker.timeline) and, when matplotlib is installed, RUN_DIR/memory_timeline.png;
`memfit report RUN_DIR --chart FILE.png` draws it again from the run folder. A gradient is counted
as a temporary while the backward makes it and as a gradient from the step's tag onwards, as in the
memory report's categories.
"""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from memfit.errors import MemfitError, require
from memfit.memory.chart import COLORS, save_figure
from memfit.memory.tracker import CATEGORIES

TIMELINE_FILE = "memory_timeline.json"
TIMELINE_CHART = "memory_timeline.png"
PHASE_SHADES = {"forward": "#f2f2f2", "backward": "#e0e0e0", "optimizer": "#cccccc", "eval": "#fff2cc"}


def write_timeline(out: Path, samples: list[dict], report) -> None:
    """The samples and the phase peaks (measured and estimated) as JSON; the picture if matplotlib is there."""
    if not samples:
        return
    record = {"samples": samples, "measured_phase_peaks": report.measured_phase_peaks,
              "estimated_phase_peaks": report.estimated_phase_peaks}
    (Path(out) / TIMELINE_FILE).write_text(json.dumps(record) + "\n")
    if importlib.util.find_spec("matplotlib") is not None:
        timeline_chart(record, Path(out) / TIMELINE_CHART)


def read_timeline(run_dir: Path) -> dict:
    path = Path(run_dir) / TIMELINE_FILE
    if not path.is_file():
        raise MemfitError(f"{path} not found: is {run_dir} the output_dir of a finished memfit train run with "
                          "logging.track_memory: true?")
    try:
        record = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise MemfitError(f"{path}: cannot be read as a memory timeline ({exc}); run the training again to "
                          "write it") from None
    if not isinstance(record, dict) or not isinstance(record.get("samples"), list) or not all(
            isinstance(s, dict) and {"phase", "by_category"} <= s.keys() for s in record["samples"]):
        raise MemfitError(f"{path}: not a memory timeline memfit wrote (no samples with phase and by_category); "
                          "run the training again to write it")
    return record


def timeline_chart(record: dict, path: Path, title: str = "memory timeline of the step with the highest peak",
                   option: str = "memory timeline chart") -> None:
    """Stacked areas of live bytes by category, sample by sample; the phases shaded behind them;
    each phase's estimated peak as a dashed line across that phase."""
    matplotlib = require("matplotlib", option)
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    samples = record["samples"]
    mib = 2**20
    x = range(len(samples))
    fig, ax = plt.subplots(figsize=(10, 5))
    spans = _phase_spans([s["phase"] for s in samples])
    for phase, start, end in spans:
        ax.axvspan(start - 0.5, end + 0.5, color=PHASE_SHADES.get(phase, "white"), zorder=0)
        ax.text((start + end) / 2, 0, phase or "", ha="center", va="bottom", fontsize=8, color="#555555")
    stacks = [[s["by_category"][c] / mib for s in samples] for c in CATEGORIES]
    ax.stackplot(x, *stacks, labels=[c.replace("_", " ") for c in CATEGORIES], colors=[COLORS[c] for c in CATEGORIES],
                 zorder=1, alpha=0.9)
    for phase, peak in record.get("estimated_phase_peaks", {}).items():
        for name, start, end in spans:
            if name == phase:
                ax.hlines(peak / mib, start - 0.5, end + 0.5, colors="black", linestyles="dashed", zorder=2)
    if record.get("estimated_phase_peaks"):
        ax.plot([], [], color="black", linestyle="dashed", label="estimated phase peak")
    ax.set_xlabel("allocation and free events in the step (downsampled; the peak is kept)")
    ax.set_ylabel("tracked memory (MiB = 2^20 bytes)")
    ax.set_title(title)
    ax.legend(fontsize=8, loc="upper left")
    fig.tight_layout()
    save_figure(fig, path, dpi=120, option=option)


def _phase_spans(phases: list[str | None]) -> list[tuple[str | None, int, int]]:
    """(phase, first index, last index) of each run of equal phases."""
    spans = []
    for i, phase in enumerate(phases):
        if spans and spans[-1][0] == phase:
            spans[-1] = (phase, spans[-1][1], i)
        else:
            spans.append((phase, i, i))
    return spans
