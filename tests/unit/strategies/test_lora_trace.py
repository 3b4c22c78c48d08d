"""The planner's traced estimate (fake tensors) of LoRA / QLoRA / int8 runs equals the tracker's
measurement of the same step on real tensors, within 2%."""

from __future__ import annotations

import pytest
import torch

from memfit.build import build_run
from memfit.memory.tracker import MemoryTracker
from memfit.step import training_step

trace = pytest.importorskip("memfit.memory.trace", reason="memfit/memory/trace.py (the traced engine) is not there")

CONFIGS = [
    {"method": "lora"},
    {"method": "lora", "lora.targets": "all-linear", "lora.use_rslora": "true"},
    {"method": "qlora"},                                   # bitsandbytes nf4-dq
    {"method": "qlora", "quant": "fp4", "checkpointing": "full"},
    {"method": "qlora", "quant_backend": "torchao"},
    {"method": "lora", "quant": "int8"},
    {"method": "lora", "quant": "int8", "precision": "bf16-mixed"},
]


def measure_real(cfg, padded: bool) -> tuple[int, dict[str, int]]:
    """What memfit.train.loop.train measures, for full-length batches shaped like the trace's."""
    torch.manual_seed(cfg.seed)
    run = build_run(cfg, torch.device("cpu"), place_on="cpu")
    model, optimizer, precision, params = run.model, run.optimizer, run.precision, run.params
    tracker = MemoryTracker()
    with tracker:
        tracker.tag_module(model)
        for _ in range(trace.TRACED_STEPS):
            batches = [trace.fake_batch(cfg, padded) for _ in range(cfg.batch.grad_accum)]  # real tensors out here
            for batch in batches:
                batch["input_ids"].random_(0, 256)
                batch["labels"].copy_(batch["input_ids"])
                tracker.tag(batch.values(), "activations")
            training_step(model, optimizer, batches, precision, tracker, params, cfg.optim.max_grad_norm)
    return tracker.peak_bytes, tracker.peak_by_category()


@pytest.mark.slow  # 20-170 s each on 2 busy cores
@pytest.mark.parametrize("extra", CONFIGS, ids=lambda e: "-".join(f"{v}" for v in e.values()))
def test_traced_estimate_matches_real_run(tiny_config, extra):
    cfg = tiny_config(seq_len=48, micro_batch=4, **extra)
    estimate = trace.trace_estimate(cfg, device="cpu")
    peak, by_category = measure_real(cfg, padded=cfg.batch.micro_batch > 1)
    assert estimate.peak_allocated_bytes == pytest.approx(peak, rel=0.02)
    # Quantized weights (codes + block scales + tables) and adapter states: the same bytes.
    assert estimate.by_category["weights"] == pytest.approx(by_category["weights"], rel=0.02)
    assert estimate.by_category["optimizer_states"] == pytest.approx(by_category["optimizer_states"], rel=0.02)
