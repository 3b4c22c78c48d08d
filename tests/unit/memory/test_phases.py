"""Phases outside the step: loading (quantize-on-load), checkpoint save, merge; the run's peak is their max."""

from __future__ import annotations

from memfit.config import load_config
from memfit.memory.analytic import analytic_estimate, device_total_bytes
from memfit.memory.model_shape import model_shape
from memfit.memory.single_device import weights_bytes
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
