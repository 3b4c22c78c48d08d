"""Long context: what each memory saver buys Llama-3.1-8B QLoRA on 24 GiB (the planner), what each
costs in step time (the planner's cost model), and on CPU the tracker's measured peak beside the
planner's at 1k-8k tokens for each strategy mix.

    .venv/bin/python bench/long_context.py [--lengths 1024,2048,4096,8192] [--out docs/long_context_results.md]
    .venv/bin/python bench/long_context.py --lengths 64,128 --mixes plain     # smallest run

Part 1 plans (analytic engine, no GPU) `memfit plan meta-llama/Llama-3.1-8B --budget 24GiB --method qlora
--seq-len 98304 --micro-batch 1 --host-ram 128GiB --max-seq-len` and prints its ladder: the chosen plan
at micro_batch 1 with the savers switched on one after another, the longest seq_len each reaches.
Part 2: the predicted step time of that plan at COST_SEQ_LEN tokens on an RTX 4090, by term, and with
each saver switched off in turn (what the saver costs).
Part 3 measures on this machine's CPU: a tiny Llama-shaped model (intermediate/hidden = 3.5 as in
Llama-3.1-8B) trains one real step per length through memfit's build and step, under the tracker;
the analytic estimate for the same config stands beside it, with the slope of both. Activation
offload is a no-op on a CPU run, so its mixes run the CUDA path with the CPU as the device
(memfit/memory/measure.py), beside the estimate for device="cuda".
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

from memfit.config import load_config
from memfit.memory.analytic import analytic_estimate
from memfit.memory.costs import step_time
from memfit.memory.gpus import find_gpu
from memfit.memory.model_shape import model_shape
from memfit.memory.planner import plan
from memfit.memory.single_device import StrategyTerms
from memfit.memory.measure import tracked_step_peaks
from memfit.models.loading import load_model_config
from memfit.models.presets import load_preset_config
from memfit.units import parse_bytes

GiB = 2**30
MODEL = "meta-llama/Llama-3.1-8B"
PLANNED = ["method=qlora", "lora.rank=32", "batch.micro_batch=1", "data.seq_len=98304"]
COST_SEQ_LEN = 32768
SAVERS = {"checkpointing": {"memory.checkpointing": "none"}, "chunked loss": {"memory.chunked_loss": False},
          "tiled MLP": {"memory.tiled_mlp": False}, "activation offload": {"memory.activation_offload": False}}
CPU_MIXES = {
    "plain": [],
    "checkpointing": ["memory.checkpointing=full"],
    "checkpointing + offload": ["memory.checkpointing=full", "memory.activation_offload=true"],
    "checkpointing + offload + prefetch": ["memory.checkpointing=full", "memory.activation_offload=true",
                   "memory.activation_offload_prefetch=true"],
    "checkpointing + offload + tiled MLP": ["memory.checkpointing=full", "memory.activation_offload=true", "memory.tiled_mlp=true"],
    "checkpointing + offload + tiled MLP + chunked loss": ["memory.checkpointing=full", "memory.activation_offload=true", "memory.tiled_mlp=true",
                       "memory.chunked_loss=true"],
    "tiled MLP alone": ["memory.tiled_mlp=true"],
    "checkpointing + tiled MLP + chunked loss": ["memory.checkpointing=full", "memory.tiled_mlp=true",
                                                 "memory.chunked_loss=true"],
}
TINY_LLAMA_SHAPE = dict(model_type="llama", vocab_size=512, hidden_size=64, intermediate_size=224, num_hidden_layers=4,
                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=8192, rms_norm_eps=1e-5)


def ladder_rows(budget: str, host_ram: str):
    found = plan(MODEL, load_config(None, PLANNED), parse_bytes(budget), host_ram=parse_bytes(host_ram),
                 max_seq_len=True)
    rows = ["| memory savers (QLoRA nf4-dq, rank 32, micro_batch 1) | longest seq_len | GPU there (reserved + "
            "context) | host RAM there | predicted step there (RTX 4090) |", "|---|---:|---:|---:|---:|"]
    for rung in found.search.seq_len_ladder:
        best = rung.best
        rows.append(f"| {rung.added} | {rung.max_seq_len:,} | {best.device_bytes / GiB:.2f} GiB | "
                    f"{best.estimate.cpu_ram_bytes / GiB:.1f} GiB | {best.step_seconds:.1f} s |" if best else
                    f"| {rung.added} | none | - | - | - |")
        print(rows[-1], flush=True)
    return found.recommendation, rows


def cost_rows(chosen) -> list[str]:
    """The chosen plan's step time at COST_SEQ_LEN by term, and with each saver off (memory aside)."""
    shape, gpu = model_shape(load_preset_config(MODEL)), find_gpu("RTX 4090")
    at = chosen.cfg.updated({"data.seq_len": COST_SEQ_LEN})

    def terms(cfg):
        return step_time(StrategyTerms(shape, cfg, "cuda"), gpu, 1)

    every = terms(at)
    names = sorted(every)
    rows = [f"| at {COST_SEQ_LEN:,} tokens | " + " | ".join(names) + " | step | the saver costs |",
            "|---|" + "---:|" * (len(names) + 2)]

    def row(label: str, found: dict, cost: str) -> str:
        return (f"| {label} | " + " | ".join(f"{found.get(n, 0.0):.2f} s" for n in names) +
                f" | {sum(found.values()):.2f} s | {cost} |")

    rows.append(row("every saver on (the planned run)", every, "-"))
    for saver, off in SAVERS.items():
        without = terms(at.updated(off))
        rows.append(row(f"without {saver}", without,
                        f"{sum(every.values()) / sum(without.values()) - 1:+.1%}"))
    for line in rows:
        print(line, flush=True)
    return rows


def cpu_rows(lengths: list[int], mixes: list[str]) -> list[str]:
    folder = Path(tempfile.mkdtemp(prefix="memfit-long-"))
    (folder / "config.json").write_text(json.dumps(TINY_LLAMA_SHAPE))
    head = " | ".join(f"{n:,}: measured / planned" for n in lengths)
    rows = [f"| mix | {head} | slope measured / planned (B per token) |",
            "|---|" + "---:|" * (len(lengths) + 1)]
    for name in mixes:
        words = CPU_MIXES[name]

        def config(n: int):
            return load_config(None, [f"model={folder}", "model.init=random", "device=cpu", "batch.micro_batch=1",
                                      f"data.seq_len={n}", *words])
        model_config = load_model_config(config(lengths[0]).model)[0]
        measured = [tracked_step_peaks(config(n), [n])[0] for n in lengths]
        device = "cuda" if "memory.activation_offload=true" in words else "cpu"
        planned = [analytic_estimate(config(n), model_config, device=device).peak_allocated_bytes for n in lengths]
        span = lengths[-1] - lengths[0]
        slopes = (measured[-1] - measured[0]) / span, (planned[-1] - planned[0]) / span
        cells = " | ".join(f"{m / 2**20:.1f} / {p / 2**20:.1f} MiB" for m, p in zip(measured, planned))
        rows.append(f"| {name} | {cells} | {slopes[0]:,.0f} / {slopes[1]:,.0f} ({slopes[1] / slopes[0] - 1:+.1%}) |")
        print(rows[-1], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--lengths", default="1024,2048,4096,8192")
    parser.add_argument("--budget", default="24GiB")
    parser.add_argument("--host-ram", default="128GiB")
    parser.add_argument("--mixes", nargs="+", default=list(CPU_MIXES), choices=list(CPU_MIXES), metavar="MIX",
                        help="part 3's strategy mixes (default all; quote names with spaces)")
    parser.add_argument("--out", default=None, help="also write the three tables to this file")
    args = parser.parse_args()
    torch.set_num_threads(2)
    started = time.perf_counter()
    chosen, ladder = ladder_rows(args.budget, args.host_ram)
    costs = cost_rows(chosen)
    measured = cpu_rows([int(n) for n in args.lengths.split(",")], args.mixes)
    text = "\n\n".join("\n".join(rows) for rows in (ladder, costs, measured))
    text += f"\n\n({time.perf_counter() - started:.0f} s)\n"
    if args.out:
        Path(args.out).write_text(text)
    print(text)


if __name__ == "__main__":
    main()
