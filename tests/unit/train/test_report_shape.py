"""The run's memory report compares the measured peak with the estimate for the batch it ran on.

Real batches are padded to their longest example, so they are shorter than seq_len; an estimate at
seq_len would mix that shape difference into the estimator's error. The full-length plan stays in
the report as the worst case.
"""

from __future__ import annotations

import pytest

from memfit.memory.trace import trace_estimate
from memfit.memory.tracker import CATEGORIES
from memfit.train.loop import train
from memfit.train.resolve import resolve_run


def test_demo_report_estimates_the_measured_batch_shape(tiny_config):
    # The demo's settings, a few steps; its examples are at most 98 tokens, seq_len is 128.
    cfg = tiny_config(precision="bf16-mixed", checkpointing="full", optimizer="adamw-8bit", max_steps=3,
                      **{"data.limit": 48})
    report = train(resolve_run(cfg), progress=False).report

    shape = report.estimated_shape
    assert shape["micro_batch"] == cfg.batch.micro_batch and shape["grad_accum"] == cfg.batch.grad_accum
    assert shape["seq_len"] < cfg.data.seq_len  # padded to the longest example, not to seq_len
    at_shape = trace_estimate(cfg.updated({"data.seq_len": shape["seq_len"]}), "cpu")
    assert report.estimated_peak_bytes == at_shape.peak_allocated_bytes
    assert report.estimated_peak_bytes == pytest.approx(report.measured_peak_bytes, rel=0.05)
    for category in CATEGORIES:
        measured = report.measured_by_category[category]
        assert report.estimated_by_category[category] == pytest.approx(measured, rel=0.10), category

    assert report.worst_case_seq_len == cfg.data.seq_len
    assert report.worst_case_peak_bytes == trace_estimate(cfg, "cpu").peak_allocated_bytes
    assert report.worst_case_peak_bytes > report.estimated_peak_bytes
    text = report.to_text()
    assert f"micro_batch {cfg.batch.micro_batch} x {shape['seq_len']} tokens" in text
    assert f"worst case at seq_len {cfg.data.seq_len}: " in text


def test_a_run_without_tracking_says_so_instead_of_a_table_of_zeros(tiny_config):
    cfg = tiny_config(max_steps=1, **{"logging.track_memory": "false", "data.limit": 16})
    result = train(resolve_run(cfg), progress=False)
    text = (result.output_dir / "memory_report.txt").read_text()
    assert "Memory tracking was off (logging.track_memory: false)" in text
    assert "Peak memory by category" not in text and "0 B" not in text
    assert "process peak RSS" in text  # what is still measured is still shown
