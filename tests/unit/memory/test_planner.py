"""The planner: tiers against a budget, the largest batch that fits, the cost model, budget resolution."""

from __future__ import annotations

import pytest

from memfit.config import load_config
from memfit.errors import MemfitError
from memfit.memory.analytic import analytic_estimate, device_total_bytes, model_shape
from memfit.memory.planner import plan, resolve_budget, step_seconds
from memfit.models.presets import load_preset_config

GiB = 2**30
LLAMA7 = "meta-llama/Llama-2-7b-hf"


def test_without_budget_only_the_described_run_is_estimated():
    result = plan(LLAMA7, load_config(None, ["precision=bf16-mixed"]))
    assert result.tiers == [] and result.recommendation is None
    assert result.estimate.peak_allocated_bytes > 16 * 6.7e9  # 16 B per parameter of model states alone
    assert "tiers" not in result.to_dict()


def test_7b_on_24gib_recommends_qlora_and_says_why_tier_1_does_not_fit():
    result = plan(LLAMA7, load_config(None, ["micro_batch=4", "seq_len=1024"]), 24 * GiB)
    tier1, tier2, tier3 = result.tiers
    assert not tier1.fits and "does not fit" in tier1.reason and "GiB" in tier1.reason
    assert tier2.fits
    assert not tier3.available and "gpus" in tier3.reason  # one GPU: nothing to shard over
    rec = result.recommendation
    assert rec.cfg.method == "qlora" and rec.device_bytes <= 24 * GiB
    # the tokens per optimizer step stay what the user asked for
    assert rec.cfg.micro_batch * rec.cfg.grad_accum == 4


def test_largest_micro_batch_is_the_largest_that_fits():
    cfg = load_config(None, ["seq_len=2048"])
    budget = 24 * GiB
    tier2 = plan(LLAMA7, cfg, budget).tiers[1]
    assert tier2.max_micro_batch >= 1
    lean = tier2.best.cfg if tier2.best else cfg
    config = load_preset_config(LLAMA7)

    def total(mb):
        leanest = lean.model_copy(update={"micro_batch": mb, "grad_accum": 1, "checkpointing": "full"})
        return device_total_bytes(analytic_estimate(leanest, config))

    assert total(tier2.max_micro_batch) <= budget < total(tier2.max_micro_batch + 1)


def test_nothing_fits_a_tiny_budget():
    result = plan(LLAMA7, load_config(None, []), 1 * GiB)
    assert result.recommendation is None
    assert all(not t.fits for t in result.tiers)


def test_sharding_tier_with_several_gpus_divides_the_model_states():
    result = plan(LLAMA7, load_config(None, ["micro_batch=1", "seq_len=512"]), 40 * GiB, gpus=8)
    tier3 = result.tiers[2]
    assert tier3.available and tier3.fits
    assert tier3.best.cfg.sharding in ("zero2", "zero3")


def test_cost_model_charges_recomputation_and_dequantization():
    shape = model_shape(load_preset_config(LLAMA7))
    base = load_config(None, ["precision=bf16-mixed", "micro_batch=4", "seq_len=1024"])
    ckpt = base.model_copy(update={"checkpointing": "full"})
    assert step_seconds(shape, ckpt) == pytest.approx(step_seconds(shape, base) * 4 / 3, rel=0.05)  # +1 forward of 3
    lora = load_config(None, ["method=lora", "precision=bf16-mixed", "micro_batch=4", "seq_len=1024"])
    qlora = load_config(None, ["method=qlora", "precision=bf16-mixed", "micro_batch=4", "seq_len=1024"])
    assert step_seconds(shape, qlora) > step_seconds(shape, lora)
    assert step_seconds(shape, lora) < step_seconds(shape, base)  # no weight gradients of the frozen base


def test_resolve_budget_is_a_no_op_without_budget(tiny_config):
    cfg = tiny_config()
    assert resolve_budget(cfg) is cfg


def test_resolve_budget_keeps_a_run_that_fits_and_refuses_an_impossible_one(tiny_config):
    fits = resolve_budget(tiny_config(budget="8GiB"))
    assert fits.budget is None and fits.method == "full" and fits.micro_batch == 8
    with pytest.raises(MemfitError, match="no configuration"):
        resolve_budget(tiny_config(budget="1MiB"))


def test_resolve_budget_changes_the_setup_when_the_run_does_not_fit(tiny_config):
    cfg = tiny_config(micro_batch=8, seq_len=512, budget="40MiB")
    assert device_total_bytes(analytic_estimate(cfg, load_preset_config("memfit/tiny-llama"), "cpu")) > 40 * 2**20
    chosen = resolve_budget(cfg)
    assert chosen is not cfg and chosen.budget is None
    assert chosen.micro_batch * chosen.grad_accum == 8
    assert device_total_bytes(analytic_estimate(chosen, load_preset_config("memfit/tiny-llama"), "cpu")) <= 40 * 2**20
