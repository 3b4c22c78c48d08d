"""How long a traced plan takes: a 70B preset (bf16-mixed, full checkpointing, micro_batch 1,
seq 2048) traced on fake tensors, for the CUDA and the CPU target.

Prints wall time and this process's CPU time for each, side by side, and the process's peak RSS
(a 70B trace must allocate next to nothing). On a shared machine wall time includes waiting
for a core; CPU time is the work itself.

    .venv/bin/python bench/plan_speed.py [--model meta-llama/Llama-2-70b-hf] [--seq-len 2048]
    .venv/bin/python bench/plan_speed.py --model memfit/tiny-llama --seq-len 64     # smallest run
"""

from __future__ import annotations

import argparse
import logging
import resource
import time

import torch

from memfit.config import load_config
from memfit.memory.trace import trace_estimate
from memfit.units import format_bytes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="meta-llama/Llama-2-70b-hf")
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--devices", default="cuda,cpu", help="targets to trace, comma-separated")
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(2)
    cfg = load_config(None, [f"model={args.model}", "precision=bf16-mixed", "memory.checkpointing=full",
                             "batch.micro_batch=1", f"data.seq_len={args.seq_len}"])
    trace_estimate(load_config(None, ["data.seq_len=8", "batch.micro_batch=1"]), device="cpu")  # imports, first-call setup
    print(f"traced plan of {args.model}: bf16-mixed, checkpointing full, micro_batch 1, seq_len {args.seq_len}")
    print(f"{'target':<8}{'wall s':>9}{'cpu s':>9}{'peak allocated':>18}  by category at the peak")
    for device in args.devices.split(","):
        wall, cpu = time.perf_counter(), time.process_time()
        estimate = trace_estimate(cfg, device=device)
        wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
        parts = ", ".join(f"{k} {format_bytes(v)}" for k, v in estimate.by_category.items() if v)
        print(f"{device:<8}{wall:>9.1f}{cpu:>9.1f}{format_bytes(estimate.peak_allocated_bytes):>18}  {parts}")
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print(f"process peak RSS: {format_bytes(rss)} (the estimates above are fake: nothing was allocated)")


if __name__ == "__main__":
    main()
