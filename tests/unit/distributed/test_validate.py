"""Impossible distributed combinations are refused before any process does work, all at once."""

from __future__ import annotations

import pytest

from memfit.config import ConfigError, load_config
from memfit.config.distributed import DistributedSetupError, check_launch
from memfit.models.loading import load_model_config


def test_single_process_default_is_untouched():
    cfg = load_config(None, [])
    assert (cfg.distributed.sharding, cfg.distributed.offload, cfg.distributed.tensor_parallel, cfg.distributed.pipeline_parallel) == ("none", "none", 1, 1)
    check_launch(cfg, world_size=1, model_config=load_model_config(cfg.model)[0])  # no error


def test_config_combinations_are_all_listed():
    with pytest.raises(ConfigError) as error:
        load_config(None, ["distributed.sharding=ddp", "distributed.offload=all", "distributed.tensor_parallel=2", "distributed.pipeline_parallel=2"])
    text = str(error.value)
    assert "5 problem(s)" in text  # offload without FSDP2, tp with pp, tp with ddp, pp with ddp, pipeline clipping
    assert "distributed.offload: all needs distributed.sharding: zero2 or zero3" in text
    assert "tensor_parallel and pipeline_parallel together" in text
    assert "distributed.tensor_parallel > 1 with distributed.sharding: ddp is not supported" in text
    assert "distributed.pipeline_parallel > 1 with distributed.sharding: ddp is not supported" in text


def test_optimizer_only_offload_is_not_a_choice():
    """FSDP2's CPUOffloadPolicy moves parameters, gradients and the optimizer step together."""
    with pytest.raises(ConfigError, match="distributed.offload: got 'optimizer'; allowed: 'none', 'params' or 'all'"):
        load_config(None, ["distributed.sharding=zero3", "distributed.offload=optimizer"])


@pytest.mark.parametrize("overrides, expected", [
    (["distributed.sharding=zero3", "precision=fp16-mixed"], "fp16-mixed"),
    (["distributed.sharding=zero2", "optim.name=adamw-8bit"], "adamw-8bit"),
    (["distributed.tensor_parallel=2", "method=lora"], "method: lora"),
    (["distributed.pipeline_parallel=2"], "optim.max_grad_norm: null"),
    (["distributed.offload=all"], "needs distributed.sharding: zero2 or zero3"),
    (["distributed.sharding=zero2", "method=lora", "quant=int8"],
     r"quant: int8 with distributed.sharding: zero2 \(FSDP2\) is not supported: FSDP2 shards torchao's NF4 base only"),
    (["distributed.sharding=zero3", "method=qlora", "quant.backend=bitsandbytes"],
     r"quant.backend: bitsandbytes with distributed.sharding: zero3 \(FSDP2\) is not supported.*quant.backend: torchao"),
])
def test_each_refused_combination_names_its_fields(overrides, expected):
    with pytest.raises(ConfigError, match=expected):
        load_config(None, overrides)


def test_qlora_under_fsdp2_takes_torchao_nf4():
    """`auto` picks the one backend FSDP2 can shard; without FSDP2 it keeps its usual first choice."""
    assert load_config(None, ["distributed.sharding=zero3", "method=qlora"]).quant_backend == "torchao"
    assert load_config(None, ["distributed.sharding=ddp", "method=qlora"]).quant_backend == "auto"
    assert load_config(None, ["distributed.sharding=zero3"]).quant_backend == "auto"  # nothing quantized


def test_launch_checks_world_size_and_model_shape():
    cfg = load_config(None, ["distributed.tensor_parallel=3", "optim.max_grad_norm=null"])
    model_config = load_model_config(cfg.model)[0]  # tiny-llama: 4 heads, intermediate 352, 4 layers
    with pytest.raises(DistributedSetupError) as error:
        check_launch(cfg, world_size=2, model_config=model_config)
    text = str(error.value)
    assert "needs exactly 3 processes" in text
    assert "must divide the model's num_attention_heads (4)" in text
    with pytest.raises(DistributedSetupError, match="needs at least 8 layers"):
        check_launch(load_config(None, ["distributed.pipeline_parallel=8", "optim.max_grad_norm=null"]), 8, model_config)
    with pytest.raises(DistributedSetupError, match="sharding is none"):
        check_launch(load_config(None, []), 2, model_config)
