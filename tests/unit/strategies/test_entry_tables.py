"""Every table's names are the config's choices and `memfit plan`'s flag; and for the quantized-base, method,
data-parallel engine, CPU offload and model-parallel tables, every consumer reads each entry's own numbers
(the estimate, the speed model, the per-rank states, the rules, the search)."""

from __future__ import annotations

import contextlib
import math
from typing import get_args

import pytest

from memfit.cli import PLAN_OPTIONS
from memfit.config import ConfigError, Method, Offload, Optimizer, Precision, Quant, Sharding, load_config
from memfit.memory.candidates import gives_up
from memfit.memory.costs import MEMORY_EFFICIENCY, step_time
from memfit.memory.distributed_estimate import rank_model_states
from memfit.memory.gpus import find_gpu
from memfit.memory.model_shape import lora_params, model_shape
from memfit.memory.model_states import weights_bytes
from memfit.memory.search_space import families
from memfit.memory.single_device import StrategyTerms
from memfit.models.presets import load_preset_config
from memfit.strategies.engines import (MODEL_PARALLEL_ENTRIES, OFFLOAD_ENTRIES, OFFLOADS, SHARDED_FROM_STAGE,
                                      SHARDING_ENTRIES, SHARDINGS)
from memfit.strategies.methods import METHOD_ENTRIES, METHODS
from memfit.strategies.optimizers import OPTIMIZER_ENTRIES, OPTIMIZERS
from memfit.strategies.precision import PRECISION_ENTRIES, PRECISIONS
from memfit.strategies.quantization import BNB_BLOCK, QUANT_ENTRIES, QUANT_SCHEMES

SHAPE = model_shape(load_preset_config("meta-llama/Llama-3.2-1B"))


@pytest.mark.parametrize("kind, entries, names, flag, path", [
    (Optimizer, OPTIMIZER_ENTRIES, OPTIMIZERS, "optimizer", "optim.name"),
    (Precision, PRECISION_ENTRIES, PRECISIONS, "precision", "precision"),
    (Quant, QUANT_ENTRIES, QUANT_SCHEMES, "quant", "quant.scheme"),
    (Method, METHOD_ENTRIES, METHODS, "method", "method"),
    (Sharding, SHARDING_ENTRIES, SHARDINGS, "sharding", "distributed.sharding"),
    (Offload, OFFLOAD_ENTRIES, OFFLOADS, "offload", "distributed.offload")],
    ids=["optimizer", "precision", "quant", "method", "sharding", "offload"])
def test_config_choices_and_plan_flags_are_the_table(kind, entries, names, flag, path):
    assert get_args(kind) == names == tuple(entry.name for entry in entries)
    assert PLAN_OPTIONS[flag][0] == path and PLAN_OPTIONS[flag][1]["choices"] == list(names)


@pytest.mark.parametrize("entry", [e for e in QUANT_ENTRIES if e.bits], ids=lambda e: e.name)
def test_every_quantized_base_reaches_the_estimate_and_the_step_time(entry):
    cfg = load_config(None, ["method=lora", f"quant.scheme={entry.name}", "precision=bf16-pure"])
    rest = SHAPE.total_params - SHAPE.block_linear_params
    assert weights_bytes(SHAPE, cfg) == (math.ceil(SHAPE.block_linear_params * entry.bytes_per_param) + rest * 2
                                         + lora_params(SHAPE, cfg) * 4)
    gpu = find_gpu("h100")
    seconds = step_time(StrategyTerms(SHAPE, cfg, "cuda"), gpu)["dequantize"]
    assert seconds == pytest.approx(SHAPE.block_linear_params * entry.dequant_bytes * 2
                                    / (gpu.memory_gbps * 1e9 * MEMORY_EFFICIENCY))
    assert entry.gives_up in gives_up(cfg)
    # 4 bits + its share of the block scales, from bitsandbytes' layout constants
    assert entry.bytes_per_param >= entry.bits / 8 and (entry.bits != 4 or entry.bytes_per_param <= 0.5 + 4 / BNB_BLOCK)


@pytest.mark.parametrize("entry", METHOD_ENTRIES, ids=lambda e: e.name)
def test_every_method_gives_its_default_base_and_what_it_gives_up(entry):
    cfg = load_config(None, [f"method={entry.name}"])
    assert cfg.quant.scheme == entry.default_quant
    if entry.gives_up:
        assert entry.gives_up in gives_up(cfg)
    assert (lora_params(SHAPE, cfg) > 0) == entry.adapters


@pytest.mark.parametrize("entry", SHARDING_ENTRIES, ids=lambda e: e.name)
def test_every_engine_splits_model_states_by_its_stage(entry):
    split = entry.split(1000, 1000, 1000, 4)
    for value, category in zip(split, ("weights", "gradients", "optimizer_states")):
        assert value == (250 if entry.zero_stage >= SHARDED_FROM_STAGE[category] else 1000)
    if entry.fsdp2:  # FSDP2 holds every state sharded between uses
        assert entry.split(1000, 1000, 1000, 4, at_rest=True) == (250, 250, 250)


@pytest.mark.parametrize("entry", [e for e in SHARDING_ENTRIES if e.ranks], ids=lambda e: e.name)
def test_every_engine_reaches_the_per_rank_states_and_the_search(entry):
    cfg = load_config(None, ["precision=bf16-mixed", f"distributed.sharding={entry.name}"])
    one = rank_model_states(SHAPE, load_config(None, ["precision=bf16-mixed"]), 1)
    rank = rank_model_states(SHAPE, cfg, 4)
    expected = entry.split(one.weights, one.gradients, one.optimizer_states, 4, at_rest=True)
    assert (rank.weights, rank.gradients, rank.optimizer_states) == expected
    assert rank.persistent_gradients == (one.gradients if entry.gradient_buckets else 0)
    gathered = rank.beside.get("backward_start", {}).get("activations", 0)  # FSDP2's weights gathered in the forward
    assert (gathered > 0) == entry.fsdp2
    labels = [name for name, _ in families(cfg, gpus=4, device="cuda")]
    assert f"full, {entry.label}" in labels
    assert (f"LoRA, {entry.label}" in labels) != entry.full_only


@pytest.mark.parametrize("entry", OFFLOAD_ENTRIES, ids=lambda e: e.name)
def test_every_offload_entry_reaches_the_rules_the_states_and_the_step_time(entry):
    cfg = load_config(None, ["precision=bf16-mixed", "distributed.sharding=zero3", f"distributed.offload={entry.name}"])
    rank = rank_model_states(SHAPE, cfg, 4)
    assert (rank.host_bytes > 0) == entry.host_states and (rank.weights == 0) == entry.host_states
    assert ("host_link" in step_time(StrategyTerms(SHAPE, cfg, "cuda"), find_gpu("h100"), 4)) == entry.host_states
    if entry.host_states:  # FSDP2's CPUOffloadPolicy: refused without FSDP2
        with pytest.raises(ConfigError, match="distributed.offload"):
            load_config(None, ["distributed.sharding=ddp", f"distributed.offload={entry.name}"])


@pytest.mark.parametrize("entry", MODEL_PARALLEL_ENTRIES, ids=lambda e: e.name)
def test_every_model_parallel_entry_reaches_the_rules_the_step_time_and_the_search(entry):
    clip = ["optim.max_grad_norm=null"] if entry.clipping_problem else []
    cfg = load_config(None, ["precision=bf16-mixed", f"distributed.{entry.name}=2", *clip])
    seconds = step_time(StrategyTerms(SHAPE, cfg, "cuda"), find_gpu("h100"), 2)
    assert ("collectives" in seconds) == (entry.all_reduces_per_layer > 0)
    assert ("pipeline_bubble" in seconds) == entry.bubble
    if entry.clipping_problem:
        with pytest.raises(ConfigError, match=entry.clipping_problem):
            load_config(None, [f"distributed.{entry.name}=2"])
    with pytest.raises(ConfigError, match="DTensor") if entry.dtensor else contextlib.nullcontext():
        load_config(None, [f"distributed.{entry.name}=2", "optim.name=adamw-8bit", *clip])
    found = dict(families(cfg, gpus=2, device="cuda"))
    assert found[f"full, {entry.label} 2"][f"distributed.{entry.name}"] == 2
