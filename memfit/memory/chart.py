"""Stacked bars of the fastest plans' predicted memory against the budget line (matplotlib, imported lazily)."""

from __future__ import annotations

from memfit.errors import require
from memfit.memory.tracker import CATEGORIES

COLORS = {"weights": "#4c72b0", "gradients": "#dd8452", "optimizer_states": "#55a868",
          "activations": "#c44e52", "temporaries": "#8172b3", "runtime overhead": "#937860"}


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
    fig.savefig(path, dpi=110)
    plt.close(fig)
