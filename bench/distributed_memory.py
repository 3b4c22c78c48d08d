"""Per-rank memory of every distributed engine, measured next to the planner's estimate.

    .venv/bin/python bench/distributed_memory.py
    .venv/bin/python bench/distributed_memory.py --engines ddp      # smallest run: one engine

Same set-up as tests/integration/test_distributed.py: tiny Llama, fixed-length text (64 tokens
per sequence), 3 steps, 2 gloo ranks on the CPU; data-parallel engines take micro_batch 1 per
rank (global 2), tensor/pipeline parallel micro_batch 2, the single-process reference 2.
Prints, per engine, each rank's tracker peak, the planner's per-rank estimate
(memfit.memory.analytic.analytic_estimate, as `memfit plan --gpus N` runs it) and the largest loss difference from the
single-process run.
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
ENGINES = {
    "ddp": ["distributed.sharding=ddp", "batch.micro_batch=1"], "zero1": ["distributed.sharding=zero1", "batch.micro_batch=1"],
    "zero2": ["distributed.sharding=zero2", "batch.micro_batch=1"], "zero3": ["distributed.sharding=zero3", "batch.micro_batch=1"],
    "zero3+offload": ["distributed.sharding=zero3", "distributed.offload=all", "batch.micro_batch=1"],
    "tp 2": ["distributed.tensor_parallel=2"], "pp 2": ["distributed.pipeline_parallel=2", "optim.max_grad_norm=null"],
}
WORKER = '''
import os, sys, torch.distributed as dist
from memfit.config import load_config
from memfit.train.loop import train
from memfit.train.resolve import resolve_run
dist.init_process_group("gloo")
config, out = sys.argv[1], sys.argv[2]
for line in open(os.path.join(out, "engines.txt")):
    name, *overrides = line.split()
    train(resolve_run(load_config(config, [f"output_dir={os.path.join(out, name)}", *overrides])), progress=False)
dist.barrier(); dist.destroy_process_group(); os._exit(0)
'''


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES), metavar="ENGINE",
                        help=f"engines to run (default all: {', '.join(ENGINES)})")
    args = parser.parse_args()
    engines = {name: ENGINES[name] for name in args.engines}
    from memfit.config import load_config
    from memfit.memory.analytic import analytic_estimate
    from memfit.train.loop import train
    from memfit.train.resolve import resolve_run

    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp)
        rng = random.Random(0)
        words = ["alpha", "beta", "gamma", "delta", "memory", "shard", "rank", "stage"]
        with open(root / "data.jsonl", "w") as f:
            for _ in range(48):
                f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(80))}) + "\n")
        config = root / "run.yaml"
        config.write_text("max_steps: 3\ndevice: cpu\noverwrite: true\nbatch:\n  micro_batch: 2\n"
                          "logging:\n  every: 1\ncheckpoints:\n  every: 0\n"
                          "optim:\n  lr: 0.001\n  warmup_steps: 0\n  schedule: constant\n  max_grad_norm: 100.0\n"
                          f"data:\n  path: {root / 'data.jsonl'}\n  format: text\n  seq_len: 64\n")
        names = {name: name.replace(" ", "").replace("+", "_") for name in engines}
        (root / "engines.txt").write_text("".join(f"{names[n]} {' '.join(o)}\n" for n, o in engines.items()))
        (root / "worker.py").write_text(WORKER)
        single = train(resolve_run(load_config(config, [f"output_dir={root / 'single'}"])), progress=False)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
        result = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                                 "--master-port", str(port), str(root / "worker.py"), str(config), str(root)],
                                cwd=ROOT, env=dict(env, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
                                timeout=1200)
        if result.returncode:
            sys.exit(result.stderr[-3000:])
        estimate = analytic_estimate(load_config(config, ["output_dir=x"]), device="cpu").peak_allocated_bytes
        measured = single.report.measured_peak_bytes
        print("| run | measured peak per rank (MiB) | estimate per rank (MiB) | estimate / measured | max loss "
              "difference |")
        print("|---|---|---|---|---|")
        print(f"| single process | {measured / mib:.2f} | {estimate / mib:.2f} | {estimate / measured:.3f} | - |")
        for name, overrides in engines.items():
            out = root / names[name]
            ranks = json.loads((out / "distributed_memory.json").read_text())["ranks"]
            peaks = [r["measured_peak_bytes"] for r in ranks]
            est = analytic_estimate(load_config(config, ["output_dir=x", *overrides]), device="cpu", gpus=2).peak_allocated_bytes
            losses = [json.loads(line)["loss"] for line in (out / "metrics.jsonl").read_text().splitlines()]
            diff = max(abs(a / b - 1) for a, b in zip(losses, single.losses))
            print(f"| {name} | {' / '.join(f'{p / mib:.2f}' for p in peaks)} | {est / mib:.2f} | "
                  f"{est / max(peaks):.3f} | {diff:.1e} (relative) |")
        print(f"single-process losses: {', '.join(f'{x:.6f}' for x in single.losses)}")


if __name__ == "__main__":
    main()
