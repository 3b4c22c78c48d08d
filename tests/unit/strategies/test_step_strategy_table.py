"""Each step strategy's table entry reaches every place that needs it: the config, the trainer's step
hooks, the analytic estimate, the speed model, the search and the `memfit plan` flags."""

import pytest
import torch

from memfit.cli import PLAN_OPTIONS
from memfit.config import MemoryConfig, load_config
from memfit.memory.costs import step_time
from memfit.memory.gpus import find_gpu
from memfit.memory.model_shape import model_shape
from memfit.memory.search_space import SEARCHED, inner_choices
from memfit.memory.model_states import model_states
from memfit.memory.single_device import StrategyTerms, beyond_basics_terms, peak_candidates
from memfit.models.loading import load_preset_config
from memfit.step import step_strategies
from memfit.strategies.table import STEP_STRATEGIES

LLAMA8 = "meta-llama/Llama-3.1-8B"


@pytest.mark.parametrize("strategy", STEP_STRATEGIES, ids=lambda s: s.name)
def test_the_entry_makes_its_config_switch_flag_and_search_dimension(strategy):
    field = MemoryConfig.model_fields[strategy.name]
    assert field.annotation is bool and field.default is False and field.description == strategy.description
    assert PLAN_OPTIONS[strategy.name.replace("_", "-")][0] == strategy.path
    assert strategy.path in SEARCHED
    assert inner_choices(load_config(None, []), "cuda")[strategy.path] == strategy.searched
    if strategy.cuda_only:
        assert inner_choices(load_config(None, []), "cpu")[strategy.path] == (False,)


@pytest.mark.parametrize("strategy", STEP_STRATEGIES, ids=lambda s: s.name)
def test_switching_it_on_changes_the_step_hooks_and_the_estimate(strategy):
    on = load_config(None, [f"{strategy.path}=true", "data.seq_len=8192", "batch.micro_batch=1",
                            *(f"{path}={'null' if value is None else value}" for path, value in strategy.forces.items())])
    off = on.updated({strategy.path: False})
    params = [torch.nn.Parameter(torch.zeros(2))]
    optimizer = torch.optim.SGD(params, lr=0.1)
    hooks_on = step_strategies(on, torch.device("cpu"), optimizer, params)
    hooks_off = step_strategies(off, torch.device("cpu"), optimizer, params)
    assert set(hooks_on) == set(hooks_off) == {"loss_fn", "saved_activations", "update"}
    changed = [key for key in hooks_on if hooks_on[key] is not hooks_off[key]]
    # off CUDA a cuda-only strategy's hook is a no-op; a model-changing one changes the model instead
    assert changed or strategy.cuda_only or strategy.model_hook is not None
    config = load_preset_config(LLAMA8)
    shape, gpu = model_shape(config), find_gpu("RTX 4090")
    moments_on = beyond_basics_terms(peak_candidates(shape, on, model_states(shape, on, "cuda")), shape, on, "cuda")
    moments_off = beyond_basics_terms(peak_candidates(shape, off, model_states(shape, off, "cuda")), shape, off, "cuda")
    # its peak terms are applied, and each saves memory somewhere and costs none anywhere, but for the
    # optimizer in the backward's update of the lm_head inside the last layer's backward
    total = {m: (sum(moments_on[m].values()), sum(moments_off[m].values())) for m in moments_on}
    assert any(on_ < off_ for on_, off_ in total.values())
    assert all(on_ <= off_ for m, (on_, off_) in total.items()
               if not (strategy.name == "optimizer_in_backward" and m == "backward_last"))
    time_on = sum(step_time(StrategyTerms(shape, on, "cuda"), gpu).values())
    time_off = sum(step_time(StrategyTerms(shape, off, "cuda"), gpu).values())
    assert time_on >= time_off if strategy.work is not None else time_on == pytest.approx(time_off)


@pytest.mark.parametrize("strategy", [s for s in STEP_STRATEGIES if s.model_hook is not None], ids=lambda s: s.name)
def test_a_model_changing_entry_is_applied_by_build_run(strategy):
    from memfit.build import build_run

    on = load_config(None, [f"{strategy.path}=true", "device=cpu"])
    built_on = build_run(on, torch.device("cpu")).model
    built_off = build_run(on.updated({strategy.path: False}), torch.device("cpu")).model
    assert [type(m) for m in built_on.modules()] == [type(m) for m in built_off.modules()]
    assert [n for n, _ in built_on.named_parameters()] == [n for n, _ in built_off.named_parameters()]
    changed = [name for (name, a), (_, b) in zip(built_on.named_modules(), built_off.named_modules())
               if "forward" in vars(a) and "forward" not in vars(b)]
    assert changed  # the hook ran on the very model build_run returns


def test_the_search_offers_no_strategy_the_model_cannot_run():
    """GPT-2's MLP is not gated: the tiled MLP (which the trainer refuses there) is never in its plans,
    and the full family still fits as it did without it."""
    from memfit.memory.planner import plan

    cfg = load_config(None, ["model=openai-community/gpt2", "data.seq_len=1024", "batch.micro_batch=4"])
    result = plan("openai-community/gpt2", cfg, 4 * 2**30, device="cuda")
    assert not any(c.cfg.memory.tiled_mlp for c in result.search.pareto)
    full = next(f for f in result.search.families if f.name == "full")
    assert full.fits, full.reason
    lora = next(f for f in result.search.families if f.name == "LoRA")
    assert not lora.fits and "name none of this model's block linears (c_attn, c_fc, c_proj)" in lora.reason


def test_the_rules_get_the_run_settings_as_values_and_refuse_what_the_config_refuses():
    """memfit/config/step_rules.py gives each switched-on entry's `rules` the run's StepSettings and its own
    options; the config's validator refuses the same combinations with the same messages."""
    from memfit.config import ConfigError
    from memfit.config.step_rules import step_strategy_problems

    on = load_config(None, ["memory.optimizer_in_backward=true", "optim.max_grad_norm=null",
                            "memory.activation_offload=true", "memory.checkpointing=full"])
    assert step_strategy_problems(on) == []
    changes = {"batch.grad_accum": 2, "memory.activation_offload_prefetch": True, "memory.checkpointing": "none"}
    unchecked = on.model_copy(update={  # the same settings, past the validator
        "batch": on.batch.model_copy(update={"grad_accum": 2}),
        "memory": on.memory.model_copy(update={"activation_offload_prefetch": True, "checkpointing": "none"})})
    problems = step_strategy_problems(unchecked)
    assert [p.split(" ")[0] for p in problems] == ["memory.optimizer_in_backward:", "memory.activation_offload_prefetch"]
    assert "got batch.grad_accum=2" in problems[0] and "(got none)" in problems[1]
    with pytest.raises(ConfigError) as refused:
        on.updated(changes)
    assert all(problem in str(refused.value) for problem in problems)


SHARDED_RUNS = {  # per-rank estimates on 4 GPUs: each engine family the search offers full fine-tuning
    "zero1": ["distributed.sharding=zero1"], "zero3": ["distributed.sharding=zero3"],
    "zero3+offload": ["distributed.sharding=zero3", "distributed.offload=all"],
    "tensor parallel": ["distributed.tensor_parallel=4"],
    "pipeline parallel": ["distributed.pipeline_parallel=4", "optim.max_grad_norm=null"]}


@pytest.mark.parametrize("engine", list(SHARDED_RUNS))
@pytest.mark.parametrize("strategy", STEP_STRATEGIES, ids=lambda s: s.name)
def test_its_entry_alone_models_it_in_every_per_rank_estimate(strategy, engine):
    """The per-rank estimate reads the same entry as one device's: switching a strategy on changes the
    plan of a sharded run too (or the config refuses the pair, naming both)."""
    from memfit.config import ConfigError
    from memfit.memory.analytic import analytic_estimate, step_moments

    forced = [f"{path}={'null' if value is None else value}" for path, value in strategy.forces.items()]
    base = ["precision=bf16-mixed", "data.seq_len=8192", "batch.micro_batch=1", *SHARDED_RUNS[engine], *forced]
    try:
        on = load_config(None, [*base, f"{strategy.path}=true"])
    except ConfigError as refused:
        assert strategy.path in str(refused) and "distributed" in str(refused)
        return
    off = on.updated({strategy.path: False})
    config = load_preset_config(LLAMA8)
    peak_on, peak_off = (analytic_estimate(cfg, config, device="cuda", gpus=4).peak_allocated_bytes
                         for cfg in (on, off))
    assert peak_on <= peak_off, (strategy.name, engine)
    shape = model_shape(config)
    assert step_moments(shape, on, "cuda", 4)[0] != step_moments(shape, off, "cuda", 4)[0], (strategy.name, engine)


@pytest.mark.parametrize("sharding", ["zero2", "zero3"])
def test_a_strategy_never_takes_away_what_the_engine_holds(sharding):
    """FSDP2's gathered weights are the engine's, not the step's: activation offload (which caps the
    activations a step keeps on the GPU) leaves them in the per-rank estimate."""
    from memfit.memory.analytic import step_moments

    config = load_preset_config(LLAMA8)
    cfg = load_config(None, ["precision=bf16-pure", "data.seq_len=2048", "batch.micro_batch=1",
                             "memory.checkpointing=full", "memory.activation_offload=true",
                             f"distributed.sharding={sharding}"])
    moments, states = step_moments(model_shape(config), cfg, "cuda", 4)
    gathered = states.beside["backward_start"]["activations"]
    assert gathered > 0 and moments["backward_start"]["activations"] >= gathered


@pytest.mark.parametrize("strategy", [s for s in STEP_STRATEGIES if s.without_pipeline], ids=lambda s: s.name)
def test_pipeline_parallel_refuses_what_it_cannot_run_naming_both(strategy):
    from memfit.config import ConfigError

    forced = [f"{path}={'null' if value is None else value}" for path, value in strategy.forces.items()]
    with pytest.raises(ConfigError) as refused:
        load_config(None, [f"{strategy.path}=true", "distributed.pipeline_parallel=2", "optim.max_grad_norm=null",
                           *forced])
    assert f"{strategy.path}: true with distributed.pipeline_parallel: 2" in str(refused.value)
    assert strategy.without_pipeline in str(refused.value)
