"""Evaluation during training: held-out records leave the training stream, eval lines and
TensorBoard scalars at the asked steps, the best weights kept, every bad setting named."""

from __future__ import annotations

import json

import pytest
import torch
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from transformers import AutoModelForCausalLM

from memfit.config import ConfigError
from memfit.data.batching import is_held_out
from memfit.data.loader import build_batch_stream, eval_batches
from memfit.models.loading import load_tokenizer
from memfit.train.loop import train
from memfit.train.resolve import resolve_run


def test_held_out_examples_never_reach_the_training_stream(tiny_config):
    cfg = tiny_config(**{"eval.fraction": 0.2})
    tokenizer = load_tokenizer(cfg.model)
    held = {tuple(ids) for batch in eval_batches(cfg, tokenizer)
            for ids, mask in zip(batch["input_ids"].tolist(), batch["attention_mask"].tolist())
            for ids in [[t for t, m in zip(ids, mask) if m]]}
    stream = build_batch_stream(cfg, tokenizer, torch.device("cpu"))
    trained = {tuple(e["input_ids"]) for e in stream.examples}
    assert held and trained and not held & trained
    assert 0.1 < len(held) / (len(held) + len(trained)) < 0.3
    assert all(is_held_out({"input_ids": list(ids)}, 0.2) for ids in held)


def test_eval_lines_scalars_and_best_weights(tiny_config):
    cfg = tiny_config(**{"eval.fraction": 0.2, "eval.every": 10, "eval.save_best": "true",
                         "report_to": "[tensorboard]", "max_steps": 20})
    result = train(resolve_run(cfg), progress=False)
    out, phases = result.output_dir, result.report.measured_phase_peaks
    assert {"forward", "backward", "optimizer", "eval"} <= set(phases)
    assert max(phases.values()) == result.report.measured_peak_bytes  # the step's peak falls inside a phase
    assert 0 < phases["eval"] < phases["backward"]  # no_grad: nothing kept for a backward
    assert "eval" in (out / "memory_report.txt").read_text()
    lines = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    evals = [line for line in lines if "eval_loss" in line]
    assert [line["step"] for line in evals] == [10, 20]
    assert evals[-1]["eval_loss"] < evals[0]["eval_loss"]  # it learns
    assert evals[0]["eval_perplexity"] == pytest.approx(2.718281828 ** evals[0]["eval_loss"], rel=1e-6)
    events = EventAccumulator(str(out / "tensorboard"))
    events.Reload()
    assert [e.step for e in events.Scalars("eval/loss")] == [10, 20]
    assert [e.step for e in events.Scalars("train/loss")][:2] == [1, 2]
    assert AutoModelForCausalLM.from_pretrained(out / "best") is not None


def test_bad_eval_settings_are_listed_at_load(tiny_config):
    with pytest.raises(ConfigError) as caught:
        tiny_config(**{"eval.fraction": 0.1, "eval.data": "x.jsonl"})
    assert "eval.data or eval.fraction, not both" in str(caught.value)
    with pytest.raises(ConfigError, match="need held-out data"):
        tiny_config(**{"eval.save_best": "true"})
    with pytest.raises(ConfigError) as caught:
        tiny_config(**{"eval.fraction": 0.1, "data.streaming": "true", "pipeline_parallel": 2,
                       "max_grad_norm": "null"})
    assert "set eval.data to a held-out file" in str(caught.value) and "pipeline_parallel > 1" in str(caught.value)
