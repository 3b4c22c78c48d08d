"""Analytic sweep: time 500 configurations of the closed-form engine (target: under 2 s).

    .venv/bin/python bench/plan_sweep.py [--count 500]
    .venv/bin/python bench/plan_sweep.py --count 5     # smallest run

Presets x precisions x optimizers x checkpointing x methods x micro-batches x sequence lengths,
estimated one by one (the model shapes are read once per model, as the planner does).
"""

from __future__ import annotations

import argparse
import itertools
import time

from memfit.config import RunConfig
from memfit.memory.analytic import analytic_estimate
from memfit.memory.model_shape import model_shape
from memfit.models.presets import load_preset_config

MODELS = ("meta-llama/Llama-3.2-1B", "meta-llama/Llama-2-7b-hf", "Qwen/Qwen2.5-7B", "mistralai/Mistral-7B-v0.1",
          "meta-llama/Llama-3.1-70B")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--count", type=int, default=500)
    args = parser.parse_args()
    configs = {name: load_preset_config(name) for name in MODELS}
    started = time.perf_counter()
    for config in configs.values():
        model_shape(config)  # one meta build per model (cached)
    shapes_s = time.perf_counter() - started
    grid = itertools.product(MODELS, ("bf16-mixed", "bf16-pure", "fp32"), ("adamw", "adamw-8bit"),
                             ("none", "full", "every-2"), ("full", "lora", "qlora"), (1, 2, 4, 8), (512, 2048))
    cases = [RunConfig(model={"name": m}, precision=p, optim={"name": o}, memory={"checkpointing": c}, method=me,
                       batch={"micro_batch": b}, data={"seq_len": s})
             for m, p, o, c, me, b, s in itertools.islice(grid, args.count)]
    started = time.perf_counter()
    peaks = [analytic_estimate(cfg, configs[cfg.model.name]).peak_allocated_bytes for cfg in cases]
    sweep_s = time.perf_counter() - started
    print(f"{len(cases)} analytic estimates in {sweep_s:.3f} s ({sweep_s / len(cases) * 1e3:.2f} ms each); "
          f"shape reading once per model: {shapes_s:.2f} s for {len(MODELS)} models; "
          f"largest peak {max(peaks) / 2**30:.1f} GiB (GiB = 2^30 bytes)")


if __name__ == "__main__":
    main()
