"""The planner's traced estimate (fake tensors) of LoRA / QLoRA / int8 runs equals the tracker's
measurement of the same step on real tensors, within 2%."""

from __future__ import annotations

import pytest
import torch

from memfit.memory.tracker import MemoryTracker
from memfit.models.loading import build_model
from memfit.strategies.adapters import apply_method
from memfit.strategies.checkpointing import apply_checkpointing
from memfit.strategies.optimizers import build_optimizer
from memfit.strategies.precision import make_precision
from memfit.train.step import training_step

trace = pytest.importorskip("memfit.memory.trace", reason="memfit/memory/trace.py (the traced engine) is not there")

CONFIGS = [
    {"method": "lora"},
    {"method": "lora", "lora.targets": "all-linear", "lora.use_rslora": "true"},
    {"method": "qlora"},                                   # bitsandbytes nf4-dq
    {"method": "qlora", "quant": "fp4", "checkpointing": "full"},
    {"method": "qlora", "quant_backend": "torchao"},
    {"method": "lora", "quant": "int8"},
    pytest.param({"method": "lora", "quant": "int8", "precision": "bf16-mixed"}, marks=pytest.mark.xfail(
        strict=True, reason="known gap: int8 + bf16 autocast on CPU, the real run holds ~5% more temporaries "
                            "at the peak than the trace (tiny model; cause not yet found, see docs/lora.md)")),
]


def measure_real(cfg, padded: bool) -> tuple[int, dict[str, int]]:
    """What memfit.train.loop.train measures, for full-length batches shaped like the trace's."""
    torch.manual_seed(cfg.seed)
    precision = make_precision(cfg.precision, torch.device("cpu"))
    model = build_model(cfg.model, cfg.attention, dtype=precision.weight_dtype)
    model = apply_method(apply_checkpointing(model, cfg.checkpoint_every), cfg, "cpu")
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg.optimizer, params, cfg.lr, cfg.weight_decay, cfg.optimizer_backend)
    tracker = MemoryTracker()
    with tracker:
        tracker.tag_module(model)
        for _ in range(trace.TRACED_STEPS):
            batches = [trace.fake_batch(cfg, padded) for _ in range(cfg.grad_accum)]  # real tensors out here
            for batch in batches:
                batch["input_ids"].random_(0, 256)
                batch["labels"].copy_(batch["input_ids"])
                tracker.tag(batch.values(), "activations")
            training_step(model, optimizer, batches, precision, tracker, params, cfg.max_grad_norm)
    return tracker.peak_bytes, tracker.peak_by_category()


@pytest.mark.slow  # 20-170 s each on 2 busy cores
@pytest.mark.parametrize("extra", CONFIGS, ids=lambda e: "-".join(f"{v}" for v in e.values()))
def test_traced_estimate_matches_real_run(tiny_config, extra):
    cfg = tiny_config(seq_len=48, micro_batch=4, **extra)
    estimate = trace.trace_estimate(cfg, device="cpu")
    peak, by_category = measure_real(cfg, padded=cfg.micro_batch > 1)
    assert estimate.peak_allocated_bytes == pytest.approx(peak, rel=0.02)
    # Quantized weights (codes + block scales + tables) and adapter states: the same bytes.
    assert estimate.by_category["weights"] == pytest.approx(by_category["weights"], rel=0.02)
    assert estimate.by_category["optimizer_states"] == pytest.approx(by_category["optimizer_states"], rel=0.02)
