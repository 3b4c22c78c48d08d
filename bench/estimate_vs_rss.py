"""The traced estimate against an independent measure: the process's RSS growth while training.

A 12-layer Llama-style model of ~134M parameters (built from a config, random init) trains for
two steps on CPU with `memfit.train.loop.train`. Printed side by side:
  * the traced estimate (fake tensors, computed first, in this process, before the baseline),
  * the tracker's measurement of the run (real tensors),
  * RSS growth: peak RSS during training minus RSS just before `train` (before the model exists).
The peak RSS is read when training ends, just before the run saves its checkpoint and weights
(serialising them would add its own copy, which is not training memory).

Each measurement runs in a fresh child process, twice: with glibc malloc's defaults, and with
MALLOC_MMAP_THRESHOLD_=131072, which fixes the threshold above which malloc maps memory directly
(and unmaps it on free). By default glibc raises that threshold up to 32 MiB after the first
large frees, so later tensors of 128 KiB-32 MiB come from the heap, whose freed pages mostly stay
resident: RSS then counts memory the program has freed.

    .venv/bin/python bench/estimate_vs_rss.py [--layers 12] [--hidden 768] [--seq-len 256] [--micro-batch 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from memfit.units import format_bytes
import memfit.train.loop as loop
from memfit.config import load_config
from memfit.distributed.engine import Engine
from memfit.models.loading import build_model
from memfit.memory.trace import trace_estimate
from memfit.train.resolve import resolve_run


def current_rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def write_model_and_data(folder: Path, layers: int, hidden: int) -> tuple[Path, Path]:
    model_dir = folder / "model"
    model_dir.mkdir()
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 32000,
              "hidden_size": hidden, "intermediate_size": hidden * 8 // 3 // 64 * 64,
              "num_hidden_layers": layers, "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64,
              "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "tie_word_embeddings": False,
              "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258}
    (model_dir / "config.json").write_text(json.dumps(config))
    rng = random.Random(0)
    data = folder / "long.jsonl"
    with data.open("w") as f:  # every example longer than seq_len: full-length rows, no padding
        for _ in range(16):
            f.write(json.dumps({"text": " ".join(rng.choice(["alpha", "beta", "gamma", "delta"])
                                                 for _ in range(2000))}) + "\n")
    return model_dir, data


def measure(args) -> dict:
    """In this (child) process: the estimate, the tracker's measurement and the RSS growth."""
    logging.basicConfig(level=logging.ERROR)
    torch.set_num_threads(2)
    folder = Path(tempfile.mkdtemp(prefix="memfit-rss-"))
    model_dir, data = write_model_and_data(folder, args.layers, args.hidden)
    cfg = load_config(None, [f"model={model_dir}", "model.init=random", f"data.path={data}", "data.format=text",
                             "max_steps=2",
                             "device=cpu", f"batch.micro_batch={args.micro_batch}", f"data.seq_len={args.seq_len}",
                             f"precision={args.precision}", f"optim.name={args.optimizer}", "optim.warmup_steps=0",
                             f"output_dir={folder / 'run'}"])
    estimate = trace_estimate(cfg, device="cpu", padded=False)

    # Read the peak when training is over, before the run serialises checkpoint and weights.
    at_end: dict[str, int] = {}
    for name in ("save", "save_final"):
        def reading_first(*a, _original=getattr(Engine, name), **k):
            at_end.setdefault("peak_rss", peak_rss_bytes())
            return _original(*a, **k)
        setattr(Engine, name, reading_first)
    baseline = current_rss_bytes()
    report = loop.train(resolve_run(cfg), progress=False).report
    growth = at_end.get("peak_rss", peak_rss_bytes()) - baseline
    params = sum(p.numel() for p in build_model(cfg.model, on_meta=True).parameters())
    return {"params": params, "estimate": estimate.peak_allocated_bytes, "tracker": report.measured_peak_bytes,
            "rss_growth": growth, "baseline": baseline, "by_category": estimate.by_category}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--seq-len", type=int, default=256)
    parser.add_argument("--micro-batch", type=int, default=2)
    parser.add_argument("--precision", default="fp32")
    parser.add_argument("--optimizer", default="adamw")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print("RESULT " + json.dumps(measure(args)))
        return
    runs = {}
    for name, env in (("glibc defaults", {}), ("MALLOC_MMAP_THRESHOLD_=131072", {"MALLOC_MMAP_THRESHOLD_": "131072"})):
        done = subprocess.run([sys.executable, __file__, "--child", *sys.argv[1:]], env={**os.environ, **env},
                              capture_output=True, text=True)
        if done.returncode:
            sys.exit(f"the {name} child failed:\n{done.stderr[-3000:]}")
        runs[name] = json.loads(next(line for line in done.stdout.splitlines() if line.startswith("RESULT "))[7:])
    first = next(iter(runs.values()))
    print(f"model: {args.layers} layers, hidden {args.hidden}, {first['params'] / 1e6:.1f}M parameters; "
          f"{args.precision}, "
          f"{args.optimizer}, micro_batch {args.micro_batch}, seq_len {args.seq_len}, 2 steps on CPU")
    print("estimate by category: " + ", ".join(f"{k} {format_bytes(v)}" for k, v in first["by_category"].items()))
    print(f"{'malloc':<32}{'traced estimate':>17}{'tracker (real)':>17}{'RSS growth':>14}{'estimate/RSS':>14}"
          f"{'RSS before model':>18}")
    for name, r in runs.items():
        print(f"{name:<32}{format_bytes(r['estimate']):>17}{format_bytes(r['tracker']):>17}"
              f"{format_bytes(r['rss_growth']):>14}{r['estimate'] / r['rss_growth']:>14.3f}{format_bytes(r['baseline']):>18}")


if __name__ == "__main__":
    main()
