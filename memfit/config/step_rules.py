"""The step strategies' rules against the rest of a config: each entry's `rules` (memfit/strategies)
gets the run's settings as values (`StepSettings`) and its own options, never the config itself."""

from __future__ import annotations

from memfit.strategies.step_strategy import StepSettings, StepStrategy
from memfit.strategies.table import STEP_STRATEGIES


def step_settings(cfg) -> StepSettings:
    """What the step strategies' rules read of `cfg` (a RunConfig)."""
    return StepSettings(grad_accum=cfg.batch.grad_accum, max_grad_norm=cfg.optim.max_grad_norm,
                        precision=cfg.precision, sharding=cfg.distributed.sharding,
                        checkpointing=cfg.memory.checkpointing,
                        tensor_parallel=cfg.distributed.tensor_parallel,
                        pipeline_parallel=cfg.distributed.pipeline_parallel)


def strategy_options(cfg, strategy: StepStrategy) -> dict:
    """The values of a step strategy's own settings (memory.<option>), as its hooks and rules take them."""
    return {option: getattr(cfg.memory, option) for option in strategy.options}


def step_strategy_problems(cfg) -> list[str]:
    """The problems of every step strategy `cfg` switches on, with the rest of its settings."""
    settings = step_settings(cfg)
    problems = []
    for strategy in STEP_STRATEGIES:
        if getattr(cfg.memory, strategy.name):
            problems += strategy.rules(settings, **strategy_options(cfg, strategy))
            if strategy.without_pipeline and settings.pipeline_parallel > 1:
                problems.append(f"{strategy.path}: true with distributed.pipeline_parallel: "
                                f"{settings.pipeline_parallel}: {strategy.without_pipeline}; switch one of them off")
    return problems
