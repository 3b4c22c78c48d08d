"""Each precision's table entry reaches every place that needs it (the config's choices and `memfit plan
--precision`: test_entry_tables.py): the trainer's precision plan and model, the analytic memory terms,
the speed model, the checkpoint phase and the search."""

import re

import pytest
import torch

from memfit.build import build_run
from memfit.config import load_config
from memfit.errors import MemfitError
from memfit.memory.candidates import gives_up
from memfit.memory.costs import MEMORY_EFFICIENCY, step_time
from memfit.memory.gpus import find_gpu
from memfit.memory.model_shape import model_shape, trainable_params
from memfit.memory.phases import checkpoint_phase
from memfit.memory.search_space import PRECISIONS_SEARCHED, inner_choices, leanest_updates
from memfit.memory.model_states import gradient_bytes, trained_params, weights_bytes
from memfit.memory.single_device import StrategyTerms
from memfit.models.presets import load_preset_config
from memfit.strategies.optimizers import optimizer_entry
from memfit.strategies.precision import FP32, PRECISION_ENTRIES, PRECISIONS, make_precision

LLAMA8 = "meta-llama/Llama-3.1-8B"
CPU = torch.device("cpu")
ENTRIES = pytest.mark.parametrize("entry", PRECISION_ENTRIES, ids=lambda e: e.name)


def _cfg(entry, *overrides):
    return load_config(None, [f"model={LLAMA8}", f"precision={entry.name}", "data.seq_len=512",
                              "batch.micro_batch=1", *overrides])


def test_an_unknown_precision_names_the_choices():
    with pytest.raises(MemfitError, match=re.escape("allowed: " + ", ".join(PRECISIONS))):
        make_precision("fp8-pure", CPU)


@ENTRIES
def test_the_trainer_builds_and_computes_in_its_dtypes(entry, tiny_config):
    plan = make_precision(entry.name, CPU)
    assert (plan.weight_dtype, plan.autocast_dtype, plan.scaler is not None) == (
        entry.weight_dtype, entry.autocast_dtype, entry.scaler)
    shape = model_shape(load_preset_config("memfit/tiny-llama"))
    for method in ("lora", "full"):
        cfg = tiny_config(precision=entry.name, method=method)
        run = build_run(cfg, CPU)
        # the analytic engine's weight and gradient bytes are the built parameters' own sizes
        assert weights_bytes(shape, cfg) == sum(p.numel() * p.element_size() for p in run.model.parameters())
        assert gradient_bytes(shape, cfg) == sum(p.numel() * p.element_size() for p in run.params)
    assert {p.dtype for p in run.params} == {entry.master_dtype}  # full fine-tuning trains the weights
    outputs = []
    linear = next(m for m in run.model.modules() if isinstance(m, torch.nn.Linear))
    linear.register_forward_hook(lambda module, args, out: outputs.append(out.dtype))
    with run.precision.autocast():
        run.model(input_ids=torch.tensor([[1, 2, 3, 4]]))
    assert outputs == [entry.compute_dtype]


@ENTRIES
def test_the_analytic_terms_read_its_bytes(entry):
    shape = model_shape(load_preset_config(LLAMA8))
    cfg = _cfg(entry, "method=full")
    assert weights_bytes(shape, cfg) == shape.total_params * entry.weight_bytes
    assert gradient_bytes(shape, cfg) == trainable_params(shape, cfg) * entry.master_bytes
    assert trained_params(shape, cfg).bytes_per_value == entry.master_bytes
    terms = StrategyTerms(shape, cfg, "cuda")
    assert terms.hidden_bytes == terms.tokens * shape.hidden * entry.weight_bytes
    assert terms.attention_buffer_bytes == terms.tokens * entry.compute_bytes * (2 * shape.q_dim + 2 * shape.kv_dim)
    host_copy = checkpoint_phase(shape, cfg, 0, 0, 0)["cpu_ram"]
    assert host_copy == trainable_params(shape, cfg) * entry.master_bytes
    # LoRA adapters stay fp32 whatever the precision (peft upcasts them)
    assert trained_params(shape, _cfg(entry, "method=lora")).bytes_per_value == 4


@ENTRIES
def test_the_speed_model_reads_its_compute_and_master_dtypes(entry):
    shape, gpu = model_shape(load_preset_config(LLAMA8)), find_gpu("RTX 4090")
    cfg = _cfg(entry, "method=full", "optim.name=adamw")
    seconds = step_time(StrategyTerms(shape, cfg, "cuda"), gpu)
    per_value = 3 * entry.master_bytes + 2 * optimizer_entry("adamw").state_bytes_per_value(entry.master_bytes)
    assert seconds["optimizer"] == pytest.approx(
        shape.total_params * per_value / (gpu.memory_gbps * 1e9 * MEMORY_EFFICIENCY))
    fp32 = step_time(StrategyTerms(shape, _cfg(FP32, "method=full", "optim.name=adamw"), "cuda"), gpu)
    # fp32 matmuls run at the TF32 rate, 16-bit ones at the bf16/fp16 tensor-core rate
    rate = gpu.tf32_tflops if entry.compute_dtype == torch.float32 else gpu.bf16_tflops
    assert fp32["compute"] / seconds["compute"] == pytest.approx(rate / gpu.tf32_tflops)


@ENTRIES
def test_the_search_tries_it_when_searched_and_names_what_it_gives_up(entry):
    base = load_config(None, [f"model={LLAMA8}"])
    for device in ("cuda", "cpu"):
        assert (entry.name in inner_choices(base, device)["precision"]) == entry.searched
    cfg = _cfg(entry, "method=full", "optim.name=adamw", "optim.max_grad_norm=1.0")
    assert gives_up(cfg) == ([entry.gives_up] if entry.gives_up else [])


def test_the_leanest_pre_check_takes_the_searched_precision_with_the_fewest_bytes():
    searched = [entry for entry in PRECISION_ENTRIES if entry.searched]
    assert PRECISIONS_SEARCHED == tuple(entry.name for entry in searched)
    leanest = min(searched, key=lambda entry: (entry.weight_bytes, entry.compute_bytes))
    base = load_config(None, [f"model={LLAMA8}"])
    assert {update["precision"] for update in leanest_updates(base, {"method": "full"}, {}, "cuda")} == {leanest.name}
