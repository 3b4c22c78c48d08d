"""What a step strategy is: one entry that says everything the rest of memfit needs to know about it.

A step strategy is a switch (`memory.<name>: true`, off by default) that changes how one optimizer
step runs: the chunked loss, activation offload, optimizer in backward and the tiled MLP are the
ones memfit has (memfit/strategies/table.py lists them). Its entry, beside its torch code, gives:

  hooks       the keyword arguments it gives `memfit.step.training_step` when on (the trainer and the
              planner's trace both get them from `memfit.step.step_strategies`)
  model_hook  for a strategy that changes the model rather than the step: (model, **options) -> model,
              applied by `memfit.build.build_run` after the method (so the trace sees it too)
  options     its settings besides the switch: config field name -> (type, pydantic Field keywords);
              `hooks`, `model_hook` and `rules` receive their values as keyword arguments of those names
  peak        what it changes in the analytic estimate's peak candidates (memory/single_device.py; and
              the WAITING moment below, when a pipeline stage's estimate has it)
  host_bytes  the host RAM it adds (memory/analytic.py)
  work        the work it adds to a step: matmul "flops", "host_bytes" over the host link
              (memory/costs.py turns them into the seconds the planner ranks plans by)
  rules       its rules against the rest of the run's settings (`StepSettings`), checked on every
              construction of a config (memfit/config/step_rules.py)
  without_deepspeed, without_pipeline  why that engine cannot run it (a config error names both settings)
  model_problem  why it cannot run on a model of this shape (memory/model_shape.py: ModelShape), or
              None: the planner's search never offers it there (the trainer refuses it at build)
  searched    the values the planner's search tries (memory/search_space.py), `lean` those of its leanest
              pre-check; `cuda_only` strategies are tried on CUDA runs only; `searched_options` the
              values of its options tried in plans that switch it on (its rules prune the rest)

The config field, the `memfit plan --<name>` flag and the search dimension are made from the entry,
so a new step strategy is its own module plus one line in table.py.

The memory and time functions get a `terms` object (memory/single_device.py: StrategyTerms) with the
run's sizes and settings: shape, device, options (the strategies' own settings by name), tokens,
micro_batches, loss_bytes (the fp32 log-softmax the plain loss saves), saved_loss_bytes (what the loss
keeps for backward under this run's strategies), chunk_bytes, layer_bytes, hidden_bytes, live_layers,
any_layer_checkpointed, last_layer_checkpointed, mlp_saved_bytes, mlp_input_bytes,
attention_buffer_bytes, mlp_buffer_bytes, mlp_weight_gradient_bytes, largest_param_bytes,
largest_param_update_bytes, head_gradient_bytes, head_gradient_in_flight_bytes and activation_bytes.
A strategy whose memory depends on a size not listed there adds a property to StrategyTerms.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable


# A moment a pipeline schedule adds to the peak candidates (memory/distributed_estimate.py): one pipeline
# micro-batch's saved tensors from the end of its forward until its backward, {"activations": bytes} on
# the device. A strategy that changes what a forward saves, or where it keeps it, changes this moment too.
WAITING = "waiting"


@dataclass(frozen=True)
class StepSettings:
    """The run's settings that step strategies' rules are checked against (the config makes it)."""

    grad_accum: int                # micro-batches per optimizer step
    max_grad_norm: float | None    # clipping by global norm (None: off)
    precision: str                 # a precision entry's name (memfit/strategies/precision.py)
    sharding: str                  # distributed.sharding ("none": one copy of the weights per process)
    checkpointing: str             # memory.checkpointing: none, full or every-N
    tensor_parallel: int = 1       # distributed.tensor_parallel (1: off)
    pipeline_parallel: int = 1     # distributed.pipeline_parallel (1: off)


def _no_problems(settings: StepSettings, **options) -> list[str]:
    return []


@dataclass(frozen=True)
class StepStrategy:
    name: str                              # the config switch memory.<name>
    description: str                       # help for the config field and the `memfit plan` flag
    hooks: Callable[..., dict]             # (device, optimizer, params, traced, **options) -> training_step
                                           # kwargs, when on
    peak: Callable[[dict, object], None] | None = None   # (peak candidates, terms): adjusts them in place
    host_bytes: Callable[[object], int] | None = None    # (terms) -> host RAM it adds
    work: Callable[[object], dict[str, float]] | None = None  # (terms) -> {"flops" | "host_bytes": per step}
    rules: Callable[..., list[str]] = _no_problems  # (StepSettings, **options) -> its problems, when on
    model_problem: Callable[[object], str | None] | None = None  # (model shape) -> why not on this model
    searched: tuple = (False, True)        # values the planner's search tries
    lean: tuple = (True,)                  # values the leanest-member pre-check tries
    cuda_only: bool = False                # a no-op off CUDA: searched on CUDA only
    without_deepspeed: str = ""            # why DeepSpeed cannot run it ("" = it can)
    without_pipeline: str = ""             # why memfit's pipeline parallel cannot run it ("" = it can)
    forces: dict = field(default_factory=dict)  # settings the planner sets with it, unless the user fixed them
    gives_up: str = ""                     # what it trades, for the plan's table
    model_hook: Callable[..., object] | None = None  # (model, **options) -> model, when on
    options: dict = field(default_factory=dict)  # memory.<option>: (type, Field keywords)
    searched_options: dict = field(default_factory=dict)  # memory.<option>: values the search tries when on

    @property
    def path(self) -> str:
        return f"memory.{self.name}"
