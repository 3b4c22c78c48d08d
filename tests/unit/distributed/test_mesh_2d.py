"""2-D meshes (tensor_parallel K with zero2/zero3) without torchrun: which combinations the config and
the launch accept, which data slice each rank trains on, and the loss reduction over the slices."""

from __future__ import annotations

import pytest
import torch

from memfit.config import ConfigError, load_config
from memfit.config.distributed import DistributedSetupError, check_launch
from memfit.distributed import launch
from memfit.distributed.launch import DistContext, data_parallel_position
from memfit.models.loading import load_model_config

TINY = load_model_config(load_config(None, []).model)[0]  # tiny-llama: 4 heads, intermediate 352


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_tensor_parallel_with_fsdp2_is_a_2d_mesh(sharding):
    cfg = load_config(None, [f"distributed.sharding={sharding}", "distributed.tensor_parallel=2"])
    for world in (2, 4, 8):  # dp = 1, 2, 4 groups of 2
        check_launch(cfg, world_size=world, model_config=TINY)
    check_launch(load_config(None, [f"distributed.sharding={sharding}", "distributed.tensor_parallel=2",
                                    "distributed.offload=all"]), 4, TINY)


@pytest.mark.parametrize("sharding", ["ddp", "zero1"])
def test_tensor_parallel_with_replica_engines_is_refused_with_what_works(sharding):
    with pytest.raises(ConfigError) as error:
        load_config(None, [f"distributed.sharding={sharding}", "distributed.tensor_parallel=2"])
    text = str(error.value)
    assert f"distributed.tensor_parallel > 1 with distributed.sharding: {sharding} is not supported" in text
    assert "use distributed.sharding: zero2 or zero3 for a 2-D mesh" in text


@pytest.mark.parametrize("sharding", ["ddp", "zero1", "zero2", "zero3"])
def test_pipeline_with_any_sharding_is_refused(sharding):
    with pytest.raises(ConfigError, match=f"pipeline_parallel > 1 with distributed.sharding: {sharding} is not "
                                          "supported: every rank is one pipeline stage"):
        load_config(None, [f"distributed.sharding={sharding}", "distributed.pipeline_parallel=2",
                           "optim.max_grad_norm=null"])


def test_tensor_parallel_stays_full_fine_tuning_on_a_2d_mesh():
    with pytest.raises(ConfigError, match="method: lora with tensor/pipeline parallel is not supported"):
        load_config(None, ["distributed.sharding=zero3", "distributed.tensor_parallel=2", "method=lora"])


def test_a_world_size_the_degree_does_not_divide_is_a_launch_problem():
    cfg = load_config(None, ["distributed.sharding=zero3", "distributed.tensor_parallel=4"])
    with pytest.raises(DistributedSetupError, match="distributed.tensor_parallel: 4 with distributed.sharding: zero3 "
                                                    "needs a world size that 4 divides .* got 6"):
        check_launch(cfg, world_size=6, model_config=TINY)
    with pytest.raises(DistributedSetupError, match="got 1"):  # dp >= 1: fewer ranks than K is no mesh
        check_launch(cfg, world_size=1, model_config=TINY)
    # heads / MLP width that K does not divide stay a launch problem on a 2-D mesh too
    odd = load_config(None, ["distributed.sharding=zero2", "distributed.tensor_parallel=3"])
    with pytest.raises(DistributedSetupError, match=r"must divide the model's num_attention_heads \(4\)"):
        check_launch(odd, world_size=6, model_config=TINY)


def test_tensor_parallel_alone_still_needs_exactly_k_processes():
    cfg = load_config(None, ["distributed.tensor_parallel=2"])
    with pytest.raises(DistributedSetupError, match="needs exactly 2 processes .* or distributed.sharding: zero2/zero3"):
        check_launch(cfg, world_size=4, model_config=TINY)


def test_each_tensor_parallel_group_shares_one_data_slice():
    """Rank r of init_device_mesh((dp, K), ("dp", "tp")) sits at row r // K: its row is its data slice."""
    mesh = load_config(None, ["distributed.sharding=zero3", "distributed.tensor_parallel=2"])
    assert [data_parallel_position(mesh, r, 4) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    alone = load_config(None, ["distributed.tensor_parallel=2"])
    assert [data_parallel_position(alone, r, 2) for r in range(2)] == [(0, 1), (0, 1)]
    ranks = load_config(None, ["distributed.sharding=zero3"])
    assert [data_parallel_position(ranks, r, 4) for r in range(4)] == [(r, 4) for r in range(4)]


def _batch(targets: int) -> list[dict]:
    labels = torch.full((1, targets + 1), 7)  # the first label is shifted away inside the model
    return [{"input_ids": labels, "labels": labels}]


def test_loss_reduction_counts_each_data_slice_once(monkeypatch):
    """On a 2x2 mesh every rank's value reaches the default group's all-reduce, each slice's twice:
    the count each rank divides by and the reported loss must still be those of one process."""
    targets = {0: 30, 1: 30, 2: 10, 3: 10}  # ranks 0, 1: slice 0; ranks 2, 3: slice 1
    summed_over_world = {}

    def all_reduce(tensor, *args, **kwargs):  # the default group: every rank's value, summed
        tensor.fill_(summed_over_world["value"])

    monkeypatch.setattr(launch.dist, "all_reduce", all_reduce)
    for rank in range(4):
        ctx = DistContext(rank=rank, world_size=4, dp_rank=rank // 2, dp_size=2, enabled=True, backend="gloo")
        summed_over_world["value"] = float(sum(targets.values()))
        count = launch.target_count(ctx)(_batch(targets[rank]))
        # FSDP2 averages gradients over the 2 slices: (S0 / count + S1 / count) / 2 = (S0 + S1) / 40
        assert count == (30 + 10) / 2
        summed_over_world["value"] = 2 * 5.0 + 2 * 3.0  # slice losses 5 and 3, each on its 2 tp ranks
        assert launch.mean_over_ranks(5.0 if rank < 2 else 3.0, ctx) == 4.0
