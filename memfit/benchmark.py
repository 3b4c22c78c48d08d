"""`memfit bench MODEL`: what each memory strategy saves and costs, measured on this machine.

Every variant is an ordinary `memfit train` run (the real code path) of a few steps on the same
data with the same seed: the baseline, each strategy alone, and the roadmap combinations.
Peak memory is the tracker's (tensor storage bytes; on CUDA also max_memory_allocated), the
step time is the median over the steps after the first (which pays one-off costs: lazy
optimizer-state allocation, torchao's compile). Results: a table, a JSON file and a PNG chart.
"""

from __future__ import annotations

import json
import logging
import statistics
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

from memfit.config import RunConfig, load_config
from memfit.errors import MemfitError, require
from memfit.train.loop import train
from memfit.train.resolve import resolve_run
from memfit.units import format_bytes

log = logging.getLogger(__name__)

# name -> overrides on top of the baseline (fp32, AdamW, full fine-tune, no checkpointing).
VARIANTS: dict[str, dict] = {
    "baseline": {},
    "bf16-mixed": {"precision": "bf16-mixed"},
    "checkpointing": {"memory.checkpointing": "full"},
    "adamw-8bit": {"optim.name": "adamw-8bit"},
    "chunked-loss": {"memory.chunked_loss": True},
    "optimizer-in-backward": {"memory.optimizer_in_backward": True, "optim.max_grad_norm": None},
    "activation-offload": {"memory.activation_offload": True},
    "lora": {"method": "lora"},
    "qlora": {"method": "qlora", "quant.scheme": "nf4-dq"},
    # The roadmap: mixed precision + checkpointing + 8-bit optimizer, then adapters on top.
    "roadmap: bf16+ckpt+8bit": {"precision": "bf16-mixed", "memory.checkpointing": "full", "optim.name": "adamw-8bit"},
    "roadmap: + chunked loss": {"precision": "bf16-mixed", "memory.checkpointing": "full", "optim.name": "adamw-8bit",
                                "memory.chunked_loss": True},
    "roadmap: lora+bf16+ckpt": {"method": "lora", "precision": "bf16-mixed", "memory.checkpointing": "full"},
    "roadmap: qlora+bf16+ckpt": {"method": "qlora", "quant.scheme": "nf4-dq", "precision": "bf16-mixed",
                                 "memory.checkpointing": "full", "memory.chunked_loss": True},
}


@dataclass
class BenchRow:
    name: str
    overrides: dict
    peak_bytes: int | None = None           # tracker: tensor storage bytes at the run's peak
    cuda_max_allocated_bytes: int | None = None
    step_time_s: float | None = None        # median over steps 2..N
    tokens_per_s: float | None = None       # median over steps 2..N
    final_loss: float | None = None
    error: str | None = None                # why this variant could not run here


def _median_after_first(values: list[float]) -> float | None:
    values = values[1:] or values
    return statistics.median(values) if values else None


def run_variant(name: str, changes: dict, base: RunConfig, workdir: Path) -> BenchRow:
    """`changes`: {config path: value} on top of `base`."""
    row = BenchRow(name, changes)
    out = workdir / name.replace(" ", "_").replace(":", "").replace("+", "-")
    try:
        cfg = base.updated({**changes, "output_dir": str(out), "overwrite": True, "logging.every": 1,
                            "checkpoints.every": 0, "logging.track_memory": True}, f"bench variant '{name}'")
        result = train(resolve_run(cfg), progress=False)
    except (MemfitError, ImportError, NotImplementedError, RuntimeError) as exc:
        row.error = str(exc).splitlines()[0][:200]
        log.warning("bench: %s could not run: %s", name, row.error)
        return row
    lines = [json.loads(line) for line in (result.output_dir / "metrics.jsonl").read_text().splitlines()]
    row.peak_bytes = result.report.measured_peak_bytes
    row.cuda_max_allocated_bytes = result.report.cuda_max_allocated_bytes
    row.step_time_s = _median_after_first([line["step_time_s"] for line in lines])
    row.tokens_per_s = _median_after_first([line["tokens_per_s"] for line in lines])
    row.final_loss = result.losses[-1]
    return row


def run_bench(model: str, steps: int = 4, seq_len: int = 256, micro_batch: int = 4, variants: list[str] | None = None,
              overrides: list[str] = (), workdir: str | Path | None = None) -> list[BenchRow]:
    """Run the chosen variants (default: all) and return one row each, baseline first."""
    names = variants or list(VARIANTS)
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        raise MemfitError(f"bench: unknown variant(s) {', '.join(unknown)}; known: {', '.join(VARIANTS)}")
    if "baseline" not in names:
        names = ["baseline", *names]  # every ratio needs it
    # Memory and speed do not depend on the weights' values: random init unless the overrides ask for the
    # pretrained weights, so shapes without weights (memfit's presets, config-only folders) bench too.
    base = load_config(None, [f"model={model}", "model.init=random", f"max_steps={steps}", f"data.seq_len={seq_len}",
                              f"batch.micro_batch={micro_batch}", "optim.warmup_steps=0", *overrides])
    with tempfile.TemporaryDirectory(prefix="memfit-bench-") as tmp:
        root = Path(workdir) if workdir else Path(tmp)
        rows = []
        for name in names:
            log.info("bench: %s", name)
            rows.append(run_variant(name, VARIANTS[name], base, root))
            if rows[0].error:
                raise MemfitError(f"bench: the baseline could not run ({rows[0].error}); every ratio needs it")
    return rows


def to_table(rows: list[BenchRow]) -> str:
    """Peak memory and step time, each with its ratio to the baseline (units in the header)."""
    base = rows[0]
    header = f"{'variant':<28}{'peak memory':>14}{'vs base':>9}{'step time':>12}{'vs base':>9}{'tokens/s':>11}"
    lines = [header, "-" * len(header)]
    for row in rows:
        if row.error:
            lines.append(f"{row.name:<28}  not run: {row.error}")
            continue
        mem_ratio = f"{row.peak_bytes / base.peak_bytes:.2f}x" if base.peak_bytes else "-"
        time_ratio = f"{row.step_time_s / base.step_time_s:.2f}x" if base.step_time_s else "-"
        lines.append(f"{row.name:<28}{format_bytes(row.peak_bytes):>14}{mem_ratio:>9}"
                     f"{row.step_time_s * 1000:>9,.0f} ms{time_ratio:>9}{row.tokens_per_s:>11,.0f}")
    lines.append("peak memory: memfit tracker, tensor storage bytes at the peak (GiB/MiB = 2^30/2^20 bytes); "
                 "step time: median of steps 2..N")
    return "\n".join(lines)


def write_chart(rows: list[BenchRow], path: str | Path, title: str) -> Path:
    """Two horizontal bar charts side by side: peak memory (MiB) and step time (ms)."""
    require("matplotlib", "memfit bench's chart")
    import matplotlib

    matplotlib.use("Agg")  # files only, no display needed
    import matplotlib.pyplot as plt

    ok = [r for r in rows if not r.error]
    names = [r.name for r in ok][::-1]
    fig, (left, right) = plt.subplots(1, 2, figsize=(12, 0.45 * len(ok) + 1.5), sharey=True)
    left.barh(names, [r.peak_bytes / 2**20 for r in ok][::-1], color="#4477aa")
    left.set_xlabel("peak memory (MiB, tracker)")
    right.barh(names, [r.step_time_s * 1000 for r in ok][::-1], color="#ee6677")
    right.set_xlabel("step time (ms, median)")
    for axis, base in ((left, ok[0].peak_bytes / 2**20), (right, ok[0].step_time_s * 1000)):
        axis.axvline(base, color="grey", linestyle="--", linewidth=1)  # the baseline
    fig.suptitle(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def save_results(rows: list[BenchRow], out_dir: str | Path, title: str) -> tuple[Path, Path, Path]:
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.txt").write_text(title + "\n" + to_table(rows) + "\n")
    (out / "bench.json").write_text(json.dumps([asdict(r) for r in rows], indent=2) + "\n")
    return out / "bench.txt", out / "bench.json", write_chart(rows, out / "bench.png", title)
