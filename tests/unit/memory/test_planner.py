"""The planner: the search against a budget, its limits and options, the cost model."""

from __future__ import annotations

import pytest

from memfit.config import load_config
from memfit.errors import MemfitError
from memfit.memory.analytic import analytic_estimate, device_total_bytes
from memfit.memory.model_shape import model_shape
from memfit.memory.model_states import optimizer_state_bytes
from memfit.memory.single_device import StrategyTerms
from memfit.memory.costs import step_time
from memfit.memory.gpus import find_gpu
from memfit.memory.planner import plan
from memfit.memory.candidates import TIE, fidelity_rank
from memfit.models.presets import load_preset_config
from memfit.strategies.optimizers import OPTIMIZER_ENTRIES

GiB = 2**30
LLAMA7 = "meta-llama/Llama-2-7b-hf"
LLAMA8 = "meta-llama/Llama-3.1-8B"


def test_without_budget_only_the_described_run_is_estimated():
    result = plan(LLAMA7, load_config(None, ["precision=bf16-mixed"]))
    assert result.search is None and result.recommendation is None
    assert result.estimate.peak_allocated_bytes > 16 * 6.7e9  # 16 B per parameter of model states alone
    assert "families" not in result.to_dict()


def _user(*overrides):
    return load_config(None, [f"model={LLAMA8}", *overrides])


def test_8b_at_8k_tokens_fits_24gib_with_the_margin_and_full_fine_tuning_only_without_gradients():
    result = plan(LLAMA8, _user("data.seq_len=8192", "batch.micro_batch=1"), 24 * GiB, host_ram=64 * GiB)
    found, rec = result.search, result.recommendation
    assert rec is not None and rec.device_bytes + found.margin_bytes <= 24 * GiB
    assert rec.device_bytes <= 23 * GiB and found.margin_bytes >= GiB
    assert rec.cfg.data.seq_len == 8192 and rec.cfg.batch.micro_batch * rec.cfg.batch.grad_accum == 1
    # 16-bit weights (15 GiB) leave no room for 15 GiB of gradients: full fine-tuning fits only
    # when each gradient is applied and freed in the backward, on pure bf16 weights
    full = next(f for f in found.families if f.name == "full")
    assert full.fits and full.best.cfg.memory.optimizer_in_backward and full.best.cfg.precision == "bf16-pure"
    # FSDP2's CPU offload leaves the gathered blocks and the step's working set on the GPU: it fits with the
    # chunked loss and the tiled MLP, which the per-rank estimate models as one device's does
    offload = next(f for f in found.families if f.name.startswith("full + CPU offload"))
    assert offload.fits and offload.best.estimate.by_category["weights"] == 0
    assert offload.best.cfg.memory.chunked_loss


def test_the_recommendation_is_the_fastest_fit_unless_a_plan_within_the_tie_gives_up_less():
    found = plan(LLAMA8, _user("data.seq_len=2048", "batch.micro_batch=4"), 24 * GiB, host_ram=64 * GiB).search
    fastest = min(c.step_seconds for c in found.pareto)
    assert found.chosen.step_seconds <= fastest * (1 + TIE)
    assert all(fidelity_rank(found.chosen.cfg) <= fidelity_rank(c.cfg) for c in found.pareto
               if c.step_seconds <= fastest * (1 + TIE))
    memory = [c.device_bytes for c in found.pareto if c is not found.chosen]
    assert memory == sorted(memory, reverse=True)  # each listed plan needs less than every faster one


def test_user_options_hold_and_exclude_other_families():
    found = plan(LLAMA8, _user("method=qlora", "data.seq_len=2048", "batch.micro_batch=1", "optim.name=adamw"),
                 24 * GiB, host_ram=64 * GiB).search
    assert found.chosen.cfg.method == "qlora" and found.chosen.cfg.optim.name == "adamw"
    assert all(c.cfg.method == "qlora" for c in found.pareto)
    full = next(f for f in found.families if f.name == "full")
    assert "excluded by your option" in full.reason and "method=qlora" in full.reason


def test_full_fine_tuning_of_8b_on_one_24gib_gpu_holds_no_host_copy_of_the_model():
    found = plan(LLAMA8, _user("method=full", "data.seq_len=2048", "batch.micro_batch=1"), 24 * GiB, host_ram=256 * GiB).search
    assert found.chosen.cfg.method == "full" and found.chosen.device_bytes + found.margin_bytes <= 24 * GiB
    # one process keeps the whole model on its GPU: the checkpoint streams there (memfit/models/load_plan.py)
    assert found.chosen.estimate.cpu_ram_bytes < 4 * GiB


def test_host_ram_limit_rejects_plans_that_park_too_much_in_host_memory():
    found = plan(LLAMA8, _user("method=qlora", "data.seq_len=49152", "batch.micro_batch=1"), 24 * GiB, host_ram=6 * GiB).search
    qlora = next(f for f in found.families if f.name == "QLoRA")
    assert not qlora.fits and "host RAM" in qlora.reason and found.chosen is None
    roomy = plan(LLAMA8, _user("method=qlora", "data.seq_len=49152", "batch.micro_batch=1"), 24 * GiB,
                 host_ram=128 * GiB, max_seq_len=True).search
    assert roomy.chosen is not None and roomy.chosen.cfg.memory.activation_offload
    assert roomy.max_seq_len >= 49152


def test_longest_sequence_is_the_longest_that_fits():
    found = plan(LLAMA8, _user("method=qlora", "data.seq_len=4096", "batch.micro_batch=1"), 24 * GiB, host_ram=64 * GiB,
                 max_seq_len=True, max_micro_batch=True).search
    config = load_preset_config(LLAMA8)
    one = found.chosen.cfg.updated({"batch.micro_batch": 1, "batch.grad_accum": 1})

    def total(seq):
        return device_total_bytes(analytic_estimate(one.updated({"data.seq_len": seq}), config))

    limit = 24 * GiB - found.margin_bytes
    assert total(found.max_seq_len) <= limit < total(found.max_seq_len + 1)
    assert found.max_micro_batch >= 1


def test_llama8b_96k_context_fits_24gib_with_every_long_context_saver():
    long = _user("method=qlora", "lora.rank=32", "data.seq_len=98304", "batch.micro_batch=1")
    result = plan(LLAMA8, long, 24 * GiB, host_ram=128 * GiB, max_seq_len=True)
    found, chosen = result.search, result.recommendation
    assert chosen is not None and chosen.device_bytes + found.margin_bytes <= 24 * GiB
    memory = chosen.cfg.memory
    assert memory.checkpointing == "full" and memory.tiled_mlp and memory.activation_offload and memory.chunked_loss
    # the saved layer inputs wait in host RAM: 32 layers x 98,304 tokens x 4,096 x 2 B = 24 GiB at least
    assert chosen.estimate.cpu_ram_bytes >= 32 * 98304 * 4096 * 2
    # past public QLoRA tools' ~78k on 24 GB, short of the model's whole 128k window (the recomputed
    # layer's per-adapter fp32 input casts alone are 4 GiB there)
    assert 80_000 < found.max_seq_len < 131072
    # what each saver buys: growing lengths, the last rung this plan's longest, no rung past the budget
    ladder = found.seq_len_ladder
    assert [r.added for r in ladder][:2] == ["none of them", "+ checkpointing full"]
    lengths = [r.max_seq_len for r in ladder]
    assert lengths == sorted(lengths) and lengths[0] < 8192 and 98304 <= lengths[-1] < 131072
    assert all(r.best.device_bytes + found.margin_bytes <= 24 * GiB for r in ladder)
    tiled = next(i for i, r in enumerate(ladder) if r.added == "+ tiled mlp")
    assert lengths[tiled] > lengths[tiled - 1]  # the tiled MLP lengthens the window by itself
    # without the host RAM for the offloaded inputs, the planner refuses the long plan
    short = plan(LLAMA8, long, 24 * GiB, host_ram=16 * GiB).search
    assert short.chosen is None and "host RAM" in next(f for f in short.families if f.name == "QLoRA").reason
    # the whole window misses, and the family says by how much and how long it can go
    window = plan(LLAMA8, long.updated({"data.seq_len": 131072}), 24 * GiB, host_ram=128 * GiB).search
    qlora = next(f for f in window.families if f.name == "QLoRA")
    assert window.chosen is None and not qlora.fits and "misses the budget by" in qlora.reason


def test_every_family_reports_its_longest_sequence_even_when_it_misses_the_requested_one():
    found = plan(LLAMA8, _user("data.seq_len=131072", "batch.micro_batch=1"), 24 * GiB, host_ram=6 * GiB,
                 max_seq_len=True).search
    qlora = next(f for f in found.families if f.name == "QLoRA")
    assert not qlora.fits and 8192 < qlora.max_seq_len < 131072
    # with too little host RAM to offload, the longest of the lean variants keeps activations on the GPU
    assert not qlora.longest.cfg.memory.activation_offload and qlora.longest.estimate.cpu_ram_bytes <= 6 * GiB
    assert qlora.longest.device_bytes + found.margin_bytes <= 24 * GiB


def test_nothing_fits_a_tiny_budget_and_each_family_says_by_how_much():
    result = plan(LLAMA7, load_config(None, []), 1 * GiB)
    assert result.recommendation is None
    misses = [f for f in result.search.families if "misses the budget by" in f.reason]
    assert misses and all(not f.fits for f in result.search.families)


def test_several_gpus_shard_and_70b_fits_8_gpus_of_80gib():
    found = plan("meta-llama/Llama-3.1-70B", load_config(None, ["data.seq_len=4096", "batch.micro_batch=1"]), 80 * GiB,
                 gpus=8, host_ram=2048 * GiB).search
    assert found.chosen is not None and found.chosen.device_bytes + found.margin_bytes <= 80 * GiB
    fits = {f.name: f.fits for f in found.families}
    # 70B in 16 bits is 131 GiB of weights: every replicating family misses, the sharded ones fit
    assert not fits["full, DDP"] and not fits["full, ZeRO-1"] and not fits["LoRA, DDP"]
    assert fits["full, ZeRO-3"] and fits["full, tensor parallel 8"] and fits["full, pipeline parallel 8"]
    assert found.chosen.cfg.method == "full" and found.chosen.cfg.distributed.sharding in ("zero3", "none")
    assert found.chosen.cfg.distributed.sharding == "zero3" or 8 in (found.chosen.cfg.distributed.tensor_parallel,
                                                         found.chosen.cfg.distributed.pipeline_parallel)


@pytest.mark.parametrize("kwargs, message", [(dict(gpus=0), "--gpus"), (dict(gpus=-2), "--gpus"),
                                             (dict(budget_bytes=0), "--budget"), (dict(gpu="GTX 9999"), "RTX 4090")])
def test_bad_plan_options_are_clear_errors(kwargs, message):
    with pytest.raises(MemfitError, match=message):
        plan(LLAMA7, load_config(None, []), **{"budget_bytes": 24 * GiB, **kwargs})


def test_cost_model_charges_recomputation_dequantization_and_offload():
    shape = model_shape(load_preset_config(LLAMA7))
    gpu = find_gpu("RTX 4090")

    def terms(*overrides):
        cfg = load_config(None, ["precision=bf16-mixed", "batch.micro_batch=4", "data.seq_len=1024", *overrides])
        return step_time(StrategyTerms(shape, cfg, "cuda"), gpu)

    def seconds(*overrides):
        return sum(terms(*overrides).values())

    compute = terms()["compute"]
    ckpt = terms("memory.checkpointing=full")["compute"]
    assert ckpt == pytest.approx(compute * 4 / 3, rel=0.01)  # +1 forward of 3
    assert seconds("method=qlora") > seconds("method=lora")
    assert seconds("method=lora") < seconds()  # no weight gradients of the frozen base
    assert seconds("memory.chunked_loss=true") > seconds()
    assert terms("memory.activation_offload=true")["host_link"] > 0 and "host_link" not in terms()
    assert seconds("distributed.sharding=zero3", "distributed.offload=all") > seconds("distributed.sharding=zero3")


def test_estimate_and_speed_model_read_one_optimizer_table():
    shape = model_shape(load_preset_config(LLAMA7))
    for entry in OPTIMIZER_ENTRIES:
        if entry.state_bytes is not None:  # factored states are not a rate per value
            continue
        cfg = load_config(None, ["method=full", f"optim.name={entry.name}"])
        assert optimizer_state_bytes(shape, cfg) == pytest.approx(shape.total_params * entry.state_bytes_per_value(4),
                                                                  rel=1e-6)


@pytest.mark.parametrize("low,high", [(1, 1), (1, 7), (1, 4096), (8, 131072), (3, 100)])
def test_largest_that_fits_finds_the_edge_of_any_monotone_rule(low, high):
    from memfit.memory.fits import largest_that_fits

    for answer in sorted({0, low - 1, low, low + 1, (low + high) // 2, high - 1, high, high + 5}):
        calls = []
        found = largest_that_fits(lambda v: calls.append(v) or v <= answer, low, high)
        assert found == (0 if answer < low else min(answer, high)), (answer, found)
        assert len(calls) <= 2 * max(high - low, 1).bit_length() + 2


def test_the_search_prefetches_offloaded_inputs_where_the_extra_layer_input_fits():
    def chosen(seq_len: int):
        found = plan(LLAMA8, _user("method=qlora", "lora.rank=32", f"data.seq_len={seq_len}", "batch.micro_batch=1"),
                     24 * GiB, host_ram=128 * GiB).search
        return found.chosen.cfg.memory
    roomy, full = chosen(65536), chosen(106496)
    assert roomy.activation_offload and roomy.activation_offload_prefetch  # faster, and 1 GiB fits at 64k
    assert full.activation_offload and not full.activation_offload_prefetch  # at 104k it does not
