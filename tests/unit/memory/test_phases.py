"""Phases outside the step: loading (quantize-on-load), evaluation, checkpoint save, merge; the run's peak is
their max."""

from __future__ import annotations

import json

import pytest

from memfit.config import load_config
from memfit.memory.analytic import analytic_estimate, device_total_bytes
from memfit.memory.model_shape import model_shape
from memfit.memory.model_states import weights_bytes
from memfit.memory.single_device import eval_bytes
from memfit.memory.trace import trace_estimate
from memfit.models.loading import load_model_config
from memfit.models.presets import load_preset_config

LLAMA8 = "meta-llama/Llama-3.1-8B"


def _estimate(*overrides, device="cuda"):
    cfg = load_config(None, [f"model={LLAMA8}", "precision=bf16-mixed", "data.seq_len=512", "batch.micro_batch=1", *overrides])
    return cfg, analytic_estimate(cfg, load_preset_config(LLAMA8), device=device)


def test_quantize_on_load_holds_one_16_bit_layer_beside_the_4_bit_model():
    cfg, est = _estimate("method=qlora")
    shape = model_shape(load_preset_config(LLAMA8))
    largest = max(i * o for _, i, o in shape.linear)
    assert est.phases["load"]["gpu"] == weights_bytes(shape, cfg) + largest * 6  # bf16 source + fp32 statistics
    assert set(est.phases) == {"load", "step", "checkpoint_save"}
    assert est.phases["step"]["gpu"] == est.peak_reserved_bytes


def test_checkpoint_save_copies_trainable_weights_and_adam_states_to_host_ram():
    _, full = _estimate("method=full", "optim.name=adamw")
    params = model_shape(load_preset_config(LLAMA8)).total_params
    assert full.phases["checkpoint_save"]["cpu_ram"] >= params * (4 + 8)  # fp32 master + two fp32 moments


def test_merge_phase_only_when_merging_and_no_phases_on_cpu():
    _, merging = _estimate("method=lora", "lora.merge=true")
    assert merging.phases["merge"]["gpu"] == 0 and merging.phases["merge"]["cpu_ram"] > 16e9
    _, on_cpu = _estimate(device="cpu")
    assert on_cpu.phases == {}


def test_whole_gpu_figure_is_the_largest_phase():
    _, est = _estimate("method=qlora")
    context = est.overheads["cuda_context"]
    assert device_total_bytes(est) == max(p["gpu"] for p in est.phases.values()) + context


def test_eval_phase_only_when_the_run_evaluates_and_a_large_eval_batch_sets_the_peak():
    _, plain = _estimate("method=lora")
    assert "eval" not in plain.phases
    _, evaluating = _estimate("method=lora", "eval.fraction=0.01")
    assert evaluating.phases["eval"]["gpu"] < evaluating.phases["step"]["gpu"]  # same micro-batch, nothing saved
    _, wide = _estimate("method=lora", "eval.fraction=0.01", "eval.micro_batch=32")  # 32 x 512 tokens of logits
    assert max(wide.phases, key=lambda name: wide.phases[name]["gpu"]) == "eval"
    assert any("eval phase" in note for note in wide.notes)
    assert device_total_bytes(wide) == wide.phases["eval"]["gpu"] + wide.overheads["cuda_context"]
    _, chunked = _estimate("method=lora", "eval.fraction=0.01", "eval.micro_batch=32", "memory.chunked_loss=true")
    states = wide.phases["checkpoint_save"]["gpu"]  # weights + optimizer states
    assert chunked.phases["eval"]["gpu"] - states < (wide.phases["eval"]["gpu"] - states) / 4


@pytest.fixture(scope="module")
def wide_vocab_model(tmp_path_factory):
    """A tiny Llama whose logits (vocab 4000) or MLP (intermediate 2048) dominate the eval working set."""
    folders = {}
    for name, change in {"vocab": {"vocab_size": 4000}, "mlp": {"vocab_size": 300, "intermediate_size": 2048}}.items():
        raw = json.loads(load_preset_config("memfit/tiny-llama").to_json_string())
        raw.update(change)
        folders[name] = tmp_path_factory.mktemp(name)
        (folders[name] / "config.json").write_text(json.dumps(raw))
    return folders


@pytest.mark.parametrize("model,overrides", [
    ("vocab", ""), ("vocab", "precision=bf16-mixed method=lora"), ("vocab", "memory.chunked_loss=true"),
    ("vocab", "precision=bf16-pure eval.micro_batch=8"), ("mlp", "memory.attention=eager"), ("mlp", "method=lora"),
])
def test_analytic_eval_phase_within_5_percent_of_the_traced_evaluation(model, overrides, wide_vocab_model):
    cfg = load_config(None, [f"model={wide_vocab_model[model]}", "batch.micro_batch=4", "data.seq_len=128",
                             "eval.fraction=0.1", *overrides.split()])
    traced = trace_estimate(cfg, device="cpu").step_phase_peaks["eval"]
    analytic = eval_bytes(model_shape(load_model_config(cfg.model)[0]), cfg)
    assert abs(analytic - traced) / traced < 0.05, f"{model} {overrides}: analytic {analytic} vs traced {traced}"
