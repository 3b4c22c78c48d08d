"""Rank by rank: every rank's tracked peak beside the per-rank estimate `memfit plan --gpus N` computes.

    .venv/bin/python bench/rank_matrix.py                                   # tiny Llama, every mix
    .venv/bin/python bench/rank_matrix.py --mixes ddp-full zero3-lora-tiled # some mixes
    .venv/bin/python bench/rank_matrix.py --model bench/models/llama-125m --seq-len 64 --steps 2 --out table.md

Each mix is a sharding x method x precision x step strategy x micro-batch combination, trained for a few steps
on gloo ranks on the CPU (2, or 4 for a 2-D mesh) through memfit's own trainer; each rank's peak and its
breakdown by category at that peak come from memfit's tracker (distributed_memory.json). The estimate is
memfit.memory.analytic.analytic_estimate(cfg, device="cpu", gpus=ranks), the path `memfit plan` takes (a
pipeline rank's is its own stage's; the plan's is the fullest stage's).
Activation offload is a no-op on the CPU, in the trainer and in the estimate alike: its mix checks only that
it runs. The runs write no checkpoint (the step is what is estimated; DCP's staging copies of a checkpoint
are host RAM on a GPU but device memory on the CPU). Writes a markdown table (--out) and the rows as JSON (--json); tests/integration/test_rank_matrix.py
runs it and holds every rank within 5%.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MiB = 2**20
CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "temporaries")

DP = {s: [f"distributed.sharding={s}"] for s in ("ddp", "zero1", "zero2", "zero3")}
MIXES = {  # name -> overrides (micro_batch is per data-parallel rank)
    "ddp-full": [*DP["ddp"], "batch.micro_batch=1"],
    "ddp-lora-bf16-chunked": [*DP["ddp"], "method=lora", "precision=bf16-mixed", "memory.chunked_loss=true",
                              "batch.micro_batch=4"],
    "zero1-full-bf16-tiled": [*DP["zero1"], "precision=bf16-mixed", "memory.tiled_mlp=true", "batch.micro_batch=4"],
    "zero1-full-ckpt-chunked": [*DP["zero1"], "memory.checkpointing=full", "memory.chunked_loss=true",
                                "batch.micro_batch=8"],
    "zero2-full": [*DP["zero2"], "batch.micro_batch=1"],
    "zero2-full-bf16-ckpt-chunked": [*DP["zero2"], "precision=bf16-mixed", "memory.checkpointing=full",
                                     "memory.chunked_loss=true", "batch.micro_batch=4"],
    "zero2-lora-tiled-accum": [*DP["zero2"], "method=lora", "memory.tiled_mlp=true", "batch.micro_batch=4",
                               "batch.grad_accum=2"],
    "zero3-full": [*DP["zero3"], "batch.micro_batch=1"],
    "zero3-full-bf16pure-ckpt-chunked": [*DP["zero3"], "precision=bf16-pure", "memory.checkpointing=full",
                                         "memory.chunked_loss=true", "batch.micro_batch=16"],
    "zero3-lora-bf16-ckpt-tiled": [*DP["zero3"], "method=lora", "precision=bf16-mixed", "memory.checkpointing=full",
                                   "memory.tiled_mlp=true", "batch.micro_batch=8"],
    "zero3-lora-offload-activations": [*DP["zero3"], "method=lora", "memory.activation_offload=true",
                                       "batch.micro_batch=4"],
    "zero3-offload-full-chunked": [*DP["zero3"], "distributed.offload=all", "memory.chunked_loss=true",
                                   "batch.micro_batch=2"],
    "zero2-offload-lora": [*DP["zero2"], "distributed.offload=all", "method=lora", "batch.micro_batch=4"],
    "zero3-qlora-bf16-ckpt": [*DP["zero3"], "method=qlora", "precision=bf16-mixed", "memory.checkpointing=full",
                              "batch.micro_batch=2"],
    "zero2-qlora-offload": [*DP["zero2"], "method=qlora", "distributed.offload=all", "batch.micro_batch=2"],
    "tp2-full-chunked": ["distributed.tensor_parallel=2", "memory.chunked_loss=true", "batch.micro_batch=2"],
    "tp2-full-bf16-tiled": ["distributed.tensor_parallel=2", "precision=bf16-mixed", "memory.tiled_mlp=true",
                            "batch.micro_batch=8"],
    "tp2-full-bf16-ckpt": ["distributed.tensor_parallel=2", "precision=bf16-mixed", "memory.checkpointing=full",
                           "batch.micro_batch=16"],
    "tp2-full-in-backward": ["distributed.tensor_parallel=2", "memory.optimizer_in_backward=true",
                             "optim.max_grad_norm=null", "batch.micro_batch=4"],
    "pp2-full": ["distributed.pipeline_parallel=2", "optim.max_grad_norm=null", "batch.micro_batch=4"],
    "pp2-full-bf16-ckpt-tiled-offload": ["distributed.pipeline_parallel=2", "optim.max_grad_norm=null",
                                         "precision=bf16-mixed", "memory.checkpointing=full", "memory.tiled_mlp=true",
                                         "memory.tiled_mlp_slices=4", "memory.activation_offload=true",
                                         "batch.micro_batch=8"],
}
MESH_MIXES = {  # 4 ranks: FSDP2 over 2 data-parallel ranks x tensor parallel 2
    "zero3xtp2-full-chunked": [*DP["zero3"], "distributed.tensor_parallel=2", "memory.chunked_loss=true",
                               "batch.micro_batch=2"],
    "zero2xtp2-full-bf16-ckpt": [*DP["zero2"], "distributed.tensor_parallel=2", "precision=bf16-mixed",
                                 "memory.checkpointing=full", "batch.micro_batch=4"],
}

WORKER = '''
import os, sys, torch.distributed as dist
import memfit.distributed.engine as engine
from memfit.config import load_config
from memfit.train.loop import train
from memfit.train.resolve import resolve_run
# The final checkpoint is left out: the estimate is of the training step, and on a CPU device the tracker
# would also count DCP's staging copies of everything a rank writes (on a GPU they are host RAM).
engine.TorchDistributed.save = lambda self, out, *rest: out
dist.init_process_group("gloo")  # one group for every mix; train() leaves a group it did not create
config, out, mixes = sys.argv[1], sys.argv[2], sys.argv[3]
for line in open(mixes):
    name, *overrides = line.split()
    train(resolve_run(load_config(config, [f"output_dir={os.path.join(out, name)}", *overrides])), progress=False)
dist.barrier(); dist.destroy_process_group(); os._exit(0)
'''


def write_inputs(root: Path, model: str | None, seq_len: int, steps: int) -> Path:
    """Fixed-length text (every example longer than seq_len: no padding) and the shared run config."""
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "memory", "shard", "rank", "stage"]
    with open(root / "data.jsonl", "w") as f:
        for _ in range(256):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(seq_len + 16))}) + "\n")
    config = root / "run.yaml"
    config.write_text((f"model:\n  name: {model}\n  init: random\n" if model else "")
                      + f"max_steps: {steps}\ndevice: cpu\noverwrite: true\n"
                      "logging:\n  every: 1\ncheckpoints:\n  every: 0\n"
                      "optim:\n  lr: 0.001\n  warmup_steps: 0\n  schedule: constant\n  max_grad_norm: 100.0\n"
                      f"data:\n  path: {root / 'data.jsonl'}\n  format: text\n  seq_len: {seq_len}\n")
    (root / "worker.py").write_text(WORKER)
    return config


def torchrun(root: Path, config: Path, mixes: dict[str, list[str]], ranks: int, timeout: int) -> None:
    listing = root / f"mixes-{ranks}.txt"
    listing.write_text("".join(f"{name} {' '.join(overrides)}\n" for name, overrides in mixes.items()))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_PORT")}
    done = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
                           "--master-addr", "127.0.0.1", "--master-port", str(port),
                           str(root / "worker.py"), str(config), str(root), str(listing)],
                          cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1",
                                             TRANSFORMERS_VERBOSITY="error"),
                          capture_output=True, text=True, timeout=timeout)
    if done.returncode:
        sys.exit(f"torchrun ({ranks} ranks) exited {done.returncode}:\n{done.stderr[-6000:]}")


def rows(root: Path, config: Path, mixes: dict[str, list[str]], ranks: int) -> list[dict]:
    """Per mix and rank: the tracker's peak and categories beside the estimate's."""
    from memfit.config import load_config
    from memfit.memory.analytic import analytic_estimate

    out = []
    for name, overrides in mixes.items():
        cfg = load_config(config, ["output_dir=x", *overrides])
        measured = json.loads((root / name / "distributed_memory.json").read_text())["ranks"]
        for rank in measured:
            # a pipeline rank against its own stage's estimate (the plan's is the fullest stage's)
            stage = rank["rank"] if cfg.distributed.pipeline_parallel > 1 else None
            estimate = analytic_estimate(cfg, device="cpu", gpus=ranks, stage=stage)
            out.append({"mix": name, "overrides": overrides, "rank": rank["rank"],
                        "measured_peak_bytes": rank["measured_peak_bytes"],
                        "measured_by_category_bytes": rank["measured_by_category_bytes"],
                        "estimate_peak_bytes": estimate.peak_allocated_bytes,
                        "estimate_by_category_bytes": estimate.by_category,
                        "error": estimate.peak_allocated_bytes / rank["measured_peak_bytes"] - 1})
    return out


def table(found: list[dict]) -> str:
    """Markdown: per mix and rank, peak and every category, measured / estimated (MiB)."""
    head = "| mix | rank | peak (MiB) | error | " + " | ".join(c.replace("_", " ") for c in CATEGORIES) + " |"
    lines = [head, "|" + "---|" * (4 + len(CATEGORIES))]
    for row in found:
        cells = [f"{row['measured_by_category_bytes'].get(c, 0) / MiB:.2f} / {row['estimate_by_category_bytes'][c] / MiB:.2f}"
                 for c in CATEGORIES]
        lines.append(f"| {row['mix']} | {row['rank']} | {row['measured_peak_bytes'] / MiB:.2f} / "
                     f"{row['estimate_peak_bytes'] / MiB:.2f} | {row['error']:+.1%} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> None:
    every = {**MIXES, **MESH_MIXES}
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mixes", nargs="+", default=list(every), choices=list(every), metavar="MIX",
                        help=f"mixes to run (default all: {', '.join(every)})")
    parser.add_argument("--model", help="a local model folder or preset, trained from random weights (default: "
                                        "memfit's tiny Llama)")
    parser.add_argument("--seq-len", type=int, default=64, help="tokens per sequence (default 64)")
    parser.add_argument("--steps", type=int, default=3, help="optimizer steps per mix (default 3)")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--json", type=Path, help="write the rows here")
    parser.add_argument("--timeout", type=int, default=3600, help="seconds each torchrun may take")
    args = parser.parse_args()
    found = []
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        config = write_inputs(root, args.model, args.seq_len, args.steps)
        for ranks, group in ((2, MIXES), (4, MESH_MIXES)):
            chosen = {name: group[name] for name in args.mixes if name in group}
            if chosen:
                torchrun(root, config, chosen, ranks, args.timeout)
                found += rows(root, config, chosen, ranks)
    text = table(found)
    print(text)
    worst = max(found, key=lambda row: abs(row["error"]))
    print(f"\nlargest error: {worst['error']:+.1%} ({worst['mix']}, rank {worst['rank']}); "
          f"estimate / measured, each cell measured / estimated MiB")
    if args.out:
        args.out.write_text(text + "\n")
    if args.json:
        args.json.write_text(json.dumps(found, indent=1) + "\n")


if __name__ == "__main__":
    main()
