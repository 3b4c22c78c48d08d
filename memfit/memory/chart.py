"""Stacked bars of the fastest plans' predicted memory against the budget line (matplotlib, imported lazily)."""

from __future__ import annotations

import os
from pathlib import Path

from memfit.errors import MemfitError, require
from memfit.memory.tracker import CATEGORIES

COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer_states": "#55a868",
          "activations": "#c44e52", "temporaries": "#8172b3", "runtime overhead": "#937860"}


def chart_formats(option: str = "--chart") -> list[str]:
    """The file suffixes matplotlib writes here, without pgf (LaTeX code that needs a TeX installation)."""
    require("matplotlib", option)
    from matplotlib.backend_bases import FigureCanvasBase

    return sorted(set(FigureCanvasBase.get_supported_filetypes()) - {"pgf"})


def check_chart_path(path: str | Path, option: str = "--chart") -> Path:
    """Refuse, before any work is done, a chart path matplotlib could not write: a folder, a missing or
    read-only parent folder, or a suffix that is no image format (matplotlib would write `plan` as
    `plan.png`, and fail on `plan.txt` only after the work)."""
    given, path = str(path), Path(path)  # messages show the path as the user wrote it
    if path.is_dir():
        raise MemfitError(f"{option} {given}: is a folder; give a file name such as {path / 'chart.png'}")
    formats = chart_formats(option)
    suffix = path.suffix.lower().lstrip(".")
    if suffix not in formats:
        what = f"'.{suffix}' is not an image format matplotlib writes" if suffix else "has no image suffix"
        raise MemfitError(f"{option} {given}: {what}; end the name with one of: .{', .'.join(formats)} (e.g. "
                          f"{path.with_suffix('.png').name})")
    folder = path.parent
    if not folder.is_dir():
        raise MemfitError(f"{option} {given}: folder {folder} does not exist; create it or give a path in an "
                          "existing folder")
    if not os.access(folder, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
        raise MemfitError(f"{option} {given}: cannot write there (permission denied); give a path you can write")
    return path


def save_figure(fig, path: str | Path, dpi: int, option: str = "--chart") -> None:
    """fig.savefig and close it; a failure to write (disk full, permissions) said in one line naming the file."""
    import matplotlib.pyplot as plt

    try:
        fig.savefig(path, dpi=dpi)
    except OSError as exc:
        raise MemfitError(f"{option} {path}: cannot write it ({exc.strerror or exc})") from None
    finally:
        plt.close(fig)


def plan_chart(result, path: str) -> None:
    """One bar for the run as described and one per plan of the Pareto table (or, when nothing fits,
    per family's closest plan)."""
    matplotlib = require("matplotlib", "--chart")
    matplotlib.use("Agg")  # files only, no display
    import matplotlib.pyplot as plt

    bars = [("as described", result.estimate, result.device_bytes)]
    found = result.search
    if found is not None:
        shown = found.pareto or [f.best for f in found.families if f.best is not None]
        for i, plan in enumerate(shown, 1):
            bars.append((f"{i}: {plan.family}" + ("" if found.pareto else " (no fit)"), plan.estimate, plan.device_bytes))
    fig, ax = plt.subplots(figsize=(1.8 * len(bars) + 3, 5))
    gib = 2**30
    for x, (label, est, total) in enumerate(bars):
        bottom = 0.0
        parts = [(c, est.by_category.get(c, 0)) for c in CATEGORIES]
        parts.append(("runtime overhead", max(total - est.peak_allocated_bytes, 0)))
        for name, value in parts:
            ax.bar(x, value / gib, bottom=bottom, color=COLORS[name], label=name.replace("_", " ") if x == 0 else None)
            bottom += value / gib
        ax.text(x, bottom, f"{total / gib:.1f}", ha="center", va="bottom", fontsize=9)
    if result.budget_bytes is not None:
        ax.axhline(result.budget_bytes / gib, color="black", linestyle="--", label="budget")
    ax.set_xticks(range(len(bars)), [b[0] for b in bars], rotation=20, ha="right", fontsize=8)
    ax.set_ylabel("predicted GPU memory per device (GiB = 2^30 bytes)")
    ax.set_title(f"memfit plan: {result.model}")
    ax.legend(fontsize=8, loc="upper right")
    fig.tight_layout()
    save_figure(fig, path, dpi=110)
