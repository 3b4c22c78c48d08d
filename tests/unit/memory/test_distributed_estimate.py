"""Per-rank model-state terms: ZeRO stages divide what they should; DeepSpeed's formulas agree."""

from __future__ import annotations

import pytest

from memfit.config import load_config
from memfit.memory.analytic import analytic_estimate
from memfit.memory.distributed_estimate import (rank_model_states, rank_shape, stage_states,
                                               zero_model_states_like_deepspeed)
from memfit.memory.model_shape import model_shape
from memfit.memory.model_states import CPU_OPTIMIZER_SCRATCH_TENSORS, largest_param_bytes
from memfit.memory.single_device import cpu_ram_bytes, load_bytes
from memfit.models.loading import load_model_config


@pytest.fixture(scope="module")
def shape():
    return model_shape(load_model_config(load_config(None, []).model)[0])


def _states(shape, *overrides, gpus=4, device="cuda"):
    cfg = load_config(None, list(overrides))
    return rank_model_states(rank_shape(shape, cfg), cfg, gpus, device)


def test_zero_stages_shard_what_they_name(shape):
    full = _states(shape, "distributed.sharding=ddp")
    zero1, zero2, zero3 = (_states(shape, f"distributed.sharding=zero{i}") for i in (1, 2, 3))
    assert full.persistent_gradients == full.gradients  # DDP buckets live between steps
    assert zero1.optimizer_states == -(-full.optimizer_states // 4) and zero1.weights == full.weights
    gathered2, gathered3 = (s.beside["backward_start"]["activations"] for s in (zero2, zero3))  # in the forward
    assert zero2.gradients == -(-full.gradients // 4) and gathered2 == full.weights
    assert zero3.weights == -(-full.weights // 4) and gathered3 < full.weights


def test_offload_moves_shards_to_host_only_on_cuda(shape):
    on_gpu = _states(shape, "distributed.sharding=zero3", "distributed.offload=all")
    assert on_gpu.weights == on_gpu.gradients == on_gpu.optimizer_states == 0 and on_gpu.host_bytes > 0
    on_cpu = _states(shape, "distributed.sharding=zero3", "distributed.offload=all", device="cpu")
    assert on_cpu.host_bytes == 0 and on_cpu.weights > 0


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_offloaded_host_ram_is_each_ranks_shard_of_every_state(shape, sharding):
    """FSDP2 holds weights, gradients and states sharded at rest (zero2 too): each rank offloads 1/N of them,
    and its optimizer steps them on the host (per-tensor scratch of its largest shard)."""
    one = _states(shape, gpus=1)
    cfg = load_config(None, [f"distributed.sharding={sharding}", "distributed.offload=params"])
    scratch = CPU_OPTIMIZER_SCRATCH_TENSORS * -(-largest_param_bytes(shape, cfg) // 4)
    shard = sum(-(-state // 4) for state in (one.weights, one.gradients, one.optimizer_states)) + scratch
    rank = _states(shape, f"distributed.sharding={sharding}", "distributed.offload=params")
    assert rank.host_bytes == shard and rank.optimizer_scratch == 0  # nothing of the step on the GPU
    estimate = analytic_estimate(cfg, load_model_config(cfg.model)[0], device="cuda", gpus=4)
    base = cpu_ram_bytes(shape, cfg, "cuda")  # one process: runtime, data
    # per node: every rank's runtime, data and offloaded shard, and each rank's tensor in flight while it reads
    # its part into those host shards (load_plan.load_beside_host_states)
    in_flight = 4 * shape.largest_tensor_params * 4  # random init: each rank makes one whole fp32 tensor at a time
    assert load_bytes(shape, cfg, "cuda", ranks=4) == in_flight
    assert estimate.cpu_ram_bytes == 4 * (base["runtime"] + base["data"]) + in_flight + 4 * shard


@pytest.mark.parametrize("gpus", [2, 4])
def test_the_cpu_optimizer_scratch_of_fsdp2_is_a_shard_of_the_largest_tensor(shape, gpus):
    cfg = load_config(None, ["distributed.sharding=zero3"])
    states = rank_model_states(shape, cfg, gpus, "cpu")
    largest = -(-shape.largest_tensor_params * 4 // gpus)
    assert states.optimizer_scratch == CPU_OPTIMIZER_SCRATCH_TENSORS * largest


def test_tensor_and_pipeline_parallel_split_the_weights(shape):
    one = _states(shape, gpus=1)
    tp = _states(shape, "distributed.tensor_parallel=2", "optim.max_grad_norm=null", gpus=2)
    assert one.weights / 2 < tp.weights < one.weights  # block linears halve, embeddings replicate
    pp = load_config(None, ["distributed.pipeline_parallel=2", "optim.max_grad_norm=null"])
    first, last = (stage_states(shape, pp, stage, "cuda") for stage in (0, 1))
    tied_copy = shape.embedding_params * 4
    assert first.weights + last.weights == pytest.approx(one.weights + tied_copy + 0, abs=8)


def test_per_rank_peak_falls_with_the_stage():
    peaks = [analytic_estimate(load_config(None, [f"distributed.sharding={s}"]), gpus=4, device="cuda").peak_allocated_bytes
             for s in ("ddp", "zero1", "zero2", "zero3")]
    assert peaks == sorted(peaks, reverse=True) and len(set(peaks)) == 4


@pytest.mark.parametrize("gpus", [2, 8, 64])
def test_zero_formulas_against_deepspeeds_estimators(gpus):
    """memfit's ZeRO rule on DeepSpeed's byte layout (fp16 weights, fp32 master, Adam): ZeRO-2 is
    identical; ZeRO-3 differs by exactly 2 bytes/param/GPU (docs/distributed.md explains why)."""
    stage_1_and_2 = pytest.importorskip("deepspeed.runtime.zero.stage_1_and_2")
    stage3 = pytest.importorskip("deepspeed.runtime.zero.stage3")
    total, largest = 8_030_261_248, 525_336_576  # Llama-3-8B: parameters, largest layer (embeddings)
    _, gpu2 = stage_1_and_2.estimate_zero2_model_states_mem_needs(total, gpus, 1, cpu_offload=False)
    _, gpu3, _ = stage3.estimate_zero3_model_states_mem_needs(total, largest, gpus, 1, cpu_offload=False)
    assert zero_model_states_like_deepspeed(total, largest, gpus, stage=2) == gpu2
    ours3 = zero_model_states_like_deepspeed(total, largest, gpus, stage=3)
    assert ours3 - gpu3 == pytest.approx(2 * total / gpus, abs=8)


def test_plan_cli_reports_the_per_rank_estimate(capsys):
    """`memfit plan --gpus N --sharding/--tp/--pp`: the same JSON fields, per-rank figures."""
    import json

    from memfit.cli import main

    for flags, overrides in ((["--sharding", "zero3"], ["distributed.sharding=zero3"]),
                             (["--tp", "2", "--set", "optim.max_grad_norm=null"], ["distributed.tensor_parallel=2", "optim.max_grad_norm=null"]),
                             (["--pp", "2", "--set", "optim.max_grad_norm=null"], ["distributed.pipeline_parallel=2", "optim.max_grad_norm=null"])):
        assert main(["plan", "memfit/tiny-llama", "--gpus", "2", *flags, "--json"]) == 0
        out = capsys.readouterr().out
        plan = json.loads(out[out.index("{"):])
        expected = analytic_estimate(load_config(None, overrides), gpus=2, device="cuda")
        assert plan["estimate"]["peak_allocated_bytes"] == expected.peak_allocated_bytes, flags


def test_the_chunked_loss_lowers_a_zero3_plan_by_at_least_the_logits_it_never_makes():
    """`memfit plan Qwen/Qwen2.5-7B --method full --precision bf16-mixed --checkpointing full --seq-len 512
    --micro-batch 32 --gpus 4 --sharding zero3 [--chunked-loss]`: the per-rank estimate reads the strategy."""
    from memfit.models.loading import load_preset_config

    overrides = ["model=Qwen/Qwen2.5-7B", "method=full", "precision=bf16-mixed", "memory.checkpointing=full",
                 "data.seq_len=512", "batch.micro_batch=32", "distributed.sharding=zero3"]
    config = load_preset_config("Qwen/Qwen2.5-7B")
    plain, chunked = (analytic_estimate(load_config(None, [*overrides, f"memory.chunked_loss={on}"]), config, gpus=4)
                      for on in ("false", "true"))
    fp32_logits = 512 * 32 * config.vocab_size * 4
    assert plain.peak_allocated_bytes - chunked.peak_allocated_bytes >= fp32_logits


def test_a_pipeline_stage_holds_the_factored_states_of_its_own_blocks_only():
    """A stage's shape keeps only its blocks' linears: Adafactor's factored states per stage add up to the whole
    model's (a stage once carried every block's linears and went negative on the rest)."""
    cfg = load_config(None, ["model=meta-llama/Llama-3.1-70B", "distributed.pipeline_parallel=8",
                             "optim.max_grad_norm=null", "optim.name=adafactor"])
    shape = model_shape(load_model_config(cfg.model)[0])
    stages = [stage_states(shape, cfg, stage, "cuda").optimizer_states for stage in range(8)]
    one = load_config(None, ["model=meta-llama/Llama-3.1-70B", "optim.name=adafactor"])
    whole = rank_model_states(shape, one, 1).optimizer_states
    assert all(states > 0 for states in stages)
    # the norms, embeddings and lm_head are unfactored in both: the stages' states add up to the whole's
    assert sum(stages) == pytest.approx(whole, rel=1e-3)
