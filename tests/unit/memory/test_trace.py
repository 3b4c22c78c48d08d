"""The traced estimate (fake tensors) equals the trainer's own measurement of the same run.

Each configuration is run twice: `trace_estimate` (meta model, FakeTensorMode, two traced steps)
and the real `memfit.train.loop.train` for two steps on CPU, whose MemoryTracker measures real
tensors. Data: long texts, so every row of every batch is truncated to seq_len (no padding),
and the trace is told so (`padded=False`); one test covers padded batches.
"""

from __future__ import annotations

import json
import random

import pytest

from memfit.config import load_config
from memfit.memory.analytic import analytic_estimate
from memfit.memory.trace import CUDA_BLOCK_BYTES, cuda_block_bytes, trace_estimate
from memfit.memory.tracker import CATEGORIES
from memfit.models.loading import load_model_config
from memfit.train.loop import train
from memfit.train.resolve import resolve_run

# precision, optimizer, checkpointing, micro_batch, seq_len (+ extra overrides): 22 configurations.
MATRIX = [
    ("fp32", "adamw", "none", 1, 64, {}),
    ("fp32", "adamw", "full", 2, 64, {}),
    ("bf16-mixed", "adamw", "none", 4, 64, {}),
    ("bf16-mixed", "adamw-8bit", "full", 2, 128, {}),
    ("fp16-mixed", "adamw", "none", 2, 64, {}),
    ("fp16-mixed", "sgd", "every-2", 1, 128, {}),
    ("bf16-pure", "adamw", "none", 2, 64, {}),
    ("bf16-pure", "lion", "full", 4, 32, {}),
    ("fp32", "lion-8bit", "every-2", 2, 64, {}),
    ("fp32", "adafactor", "none", 4, 32, {}),
    ("bf16-mixed", "adafactor", "full", 1, 128, {}),
    ("fp32", "sgd", "none", 4, 128, {}),
    ("fp32", "paged-adamw-8bit", "none", 2, 64, {}),
    ("bf16-mixed", "lion", "none", 2, 64, {"attention": "eager"}),
    ("fp32", "adamw", "full", 2, 64, {"attention": "eager"}),
    ("fp32", "adamw", "none", 2, 32, {"grad_accum": 2}),
    ("fp32", "adamw", "none", 2, 64, {"method": "lora"}),
    ("bf16-mixed", "adamw", "full", 4, 64, {"method": "lora"}),
    ("bf16-pure", "adamw-8bit", "none", 2, 64, {"method": "lora", "lora.targets": "all-linear"}),
    ("fp16-mixed", "adamw-8bit", "every-2", 4, 32, {}),
    ("bf16-mixed", "sgd", "none", 1, 64, {"attention": "eager"}),
    ("fp32", "lion", "none", 1, 32, {"grad_accum": 2}),
]


def _write_texts(path, lengths_in_words: list[int]) -> str:
    rng = random.Random(0)
    words = ["alpha", "beta", "gamma", "delta", "memory", "tensor", "peak"]
    with open(path, "w") as f:
        for n in lengths_in_words:
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(n))}) + "\n")
    return str(path)


@pytest.fixture(scope="module")
def long_texts(tmp_path_factory):
    """Every example is far longer than any seq_len used here (byte-level tokens)."""
    return _write_texts(tmp_path_factory.mktemp("data") / "long.jsonl", [300] * 32)


def _config(tmp_path, data_path, **overrides):
    base = {"data.path": data_path, "data.format": "text", "max_steps": 2, "device": "cpu", "lr": 1e-3,
            "warmup_steps": 0, "output_dir": str(tmp_path / "run"), "log_every": 1}
    base.update(overrides)
    return load_config(None, [f"{k}={v}" for k, v in base.items()])


def _assert_matches(estimate, report):
    measured = report.measured_peak_bytes
    assert estimate.peak_allocated_bytes == pytest.approx(measured, rel=0.02)
    for category in CATEGORIES:  # within 2%, or within 0.5% of the peak for small categories
        assert abs(estimate.by_category[category] - report.measured_by_category[category]) <= max(
            0.02 * report.measured_by_category[category], 0.005 * measured), category


@pytest.mark.parametrize("precision, optimizer, checkpointing, micro_batch, seq_len, extra", MATRIX,
                         ids=lambda v: str(v) if not isinstance(v, dict) else "-".join(map(str, v.values())))
def test_traced_estimate_equals_trainer_measurement(tmp_path, long_texts, precision, optimizer, checkpointing,
                                                     micro_batch, seq_len, extra):
    cfg = _config(tmp_path, long_texts, precision=precision, optimizer=optimizer, checkpointing=checkpointing,
                  micro_batch=micro_batch, seq_len=seq_len, **extra)
    estimate = trace_estimate(cfg, device="cpu", padded=False)
    report = train(resolve_run(cfg), progress=False).report
    assert estimate.engine == "traced"
    assert estimate.peak_reserved_bytes == estimate.peak_allocated_bytes  # CPU: no allocator reserve
    assert estimate.overheads == {}
    _assert_matches(estimate, report)


def test_padded_batches_build_the_attention_mask(tmp_path):
    """Rows padded to the longest: transformers builds a [batch, 1, seq, seq] mask per layer; the
    trace's padded batch (default for micro_batch > 1) does the same. The data holds exactly one
    micro-batch (3 long examples, 1 short), so every step's batch is padded and full length."""
    data = _write_texts(tmp_path / "mixed.jsonl", [300, 300, 5, 300])
    cfg = _config(tmp_path, data, precision="bf16-mixed", micro_batch=4, seq_len=64, **{"data.limit": 4})
    padded = trace_estimate(cfg, device="cpu")
    unpadded = trace_estimate(cfg, device="cpu", padded=False)
    report = train(resolve_run(cfg), progress=False).report
    _assert_matches(padded, report)
    # The trainer puts the same traced estimate (padded by default here) beside its measurement.
    assert report.estimated_peak_bytes == padded.peak_allocated_bytes
    assert report.estimated_by_category == padded.by_category
    # The mask (bf16: 2 bytes per [seq x seq] entry per row), saved by every layer, is what differs.
    assert padded.by_category["activations"] > unpadded.by_category["activations"]


def test_activation_bytes_fall_with_checkpointing(tmp_path, long_texts):
    def run(checkpointing):
        cfg = _config(tmp_path / checkpointing, long_texts, checkpointing=checkpointing, micro_batch=4, seq_len=128)
        return trace_estimate(cfg, device="cpu", padded=False), train(resolve_run(cfg), progress=False).report

    (none_est, none_real), (full_est, full_real) = run("none"), run("full")
    assert full_real.measured_by_category["activations"] < 0.5 * none_real.measured_by_category["activations"]
    assert full_est.by_category["activations"] < 0.5 * none_est.by_category["activations"]
    assert full_est.peak_allocated_bytes < none_est.peak_allocated_bytes


def test_cuda_estimate_rounds_blocks_and_uses_foreach_optimizer(tmp_path, long_texts):
    """device=cuda: every storage rounded up to 512 B, and torch's AdamW takes its multi-tensor
    (foreach) path as on CUDA, whose intermediates cover all parameters at once."""
    assert [cuda_block_bytes(n) for n in (0, 1, 512, 513, 4096)] == [0, 512, 512, 1024, 4096]
    cfg = _config(tmp_path, long_texts, optimizer="adamw", micro_batch=1, seq_len=32)
    cpu, cuda = trace_estimate(cfg, device="cpu", padded=False), trace_estimate(cfg, device="cuda", padded=False)
    assert cuda.peak_allocated_bytes % CUDA_BLOCK_BYTES == 0
    assert cuda.by_category["weights"] >= cpu.by_category["weights"]
    weight_bytes = cpu.by_category["weights"]
    # foreach AdamW: at its peak, temporaries for all parameters at once (CPU loop: one at a time).
    assert cuda.by_category["temporaries"] >= 0.9 * weight_bytes > cpu.by_category["temporaries"]


def test_cuda_trace_keeps_the_fused_dropout_mask():
    """LoRA dropout's mask: 1 B per element as CUDA's fused kernel keeps it, 4 B (the fp32 adapter
    input's dtype) on CPU; the traced difference a dropout makes equals the analytic one on each device."""
    base = ["model=memfit/tiny-llama", "model.init=random", "method=lora", "precision=bf16-pure",
            "batch.micro_batch=4", "data.seq_len=256"]
    shape = load_model_config(load_config(None, base).model)[0]
    added = {}
    for device in ("cpu", "cuda"):
        traced, planned = [], []
        for p in (0.0, 0.1):
            cfg = load_config(None, base + [f"lora.dropout={p}"])
            traced.append(trace_estimate(cfg, device=device).by_category["activations"])
            planned.append(analytic_estimate(cfg, shape, device=device).by_category["activations"])
        added[device] = traced[1] - traced[0]
        assert added[device] == planned[1] - planned[0] > 0
    assert added["cpu"] == 4 * added["cuda"]


@pytest.mark.slow
def test_70b_traces_without_allocating(tmp_path):
    """A 70B plan runs on fake tensors: ~1 TiB of states estimated, nothing allocated."""
    import resource

    cfg = load_config(None, ["model=meta-llama/Llama-2-70b-hf", "precision=bf16-mixed", "memory.checkpointing=full",
                             "batch.micro_batch=1", "data.seq_len=256", "device=cuda"])
    estimate = trace_estimate(cfg)
    params = 68_976_648_192
    assert estimate.by_category["weights"] == pytest.approx(4 * params, rel=0.01)
    assert estimate.by_category["optimizer_states"] == pytest.approx(8 * params, rel=0.01)
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 < 16 * 2**30
