"""Every caller of `memfit.step.tracked_steps` records the same step: the trainer's loop, the planner's
trace (fake tensors) and the measurements the estimates are checked against (memory/measure.py).

The same configuration, full-length unpadded batches (texts far longer than seq_len), one micro-batch per
step: if one caller tagged, held or stepped differently, its peak, its split by category or its phase
peaks would differ.
"""

from __future__ import annotations

import json
import random

import pytest

from memfit.config import load_config
from memfit.memory.measure import measure_peak, tracked_step_peaks
from memfit.memory.trace import trace_estimate
from memfit.train.loop import train
from memfit.train.resolve import resolve_run


@pytest.fixture(scope="module")
def long_texts(tmp_path_factory):
    rng = random.Random(0)
    path = tmp_path_factory.mktemp("data") / "long.jsonl"
    path.write_text("".join(json.dumps({"text": " ".join(rng.choice(["alpha", "beta", "memory", "peak"])
                                                          for _ in range(300))}) + "\n" for _ in range(16)))
    return str(path)


@pytest.mark.parametrize("extra", [[], ["precision=bf16-mixed", "memory.checkpointing=full"]],
                         ids=["fp32", "bf16-mixed-checkpointed"])
def test_every_caller_records_the_same_peak(tmp_path, long_texts, extra):
    cfg = load_config(None, [f"data.path={long_texts}", "data.format=text", "max_steps=2", "device=cpu",
                             "warmup_steps=0", f"output_dir={tmp_path / 'run'}", "batch.micro_batch=2",
                             "data.seq_len=64", "optim.max_grad_norm=1.0", *extra])
    trainer = train(resolve_run(cfg), progress=False).report
    measured, by_category = measure_peak(cfg)
    traced = trace_estimate(cfg, device="cpu", padded=False)
    assert measured == trainer.measured_peak_bytes
    assert by_category == trainer.measured_by_category
    # the second step's own peak (after a short first step) is the steady state the others peak in
    assert tracked_step_peaks(cfg, [cfg.data.seq_len]) == [measured]
    assert traced.peak_allocated_bytes == measured
    assert traced.by_category == by_category
    assert traced.step_phase_peaks == trainer.measured_phase_peaks
