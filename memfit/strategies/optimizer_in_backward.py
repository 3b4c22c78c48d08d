"""Optimizer step fused into the backward pass.

Each trainable parameter gets a post-accumulate-grad hook: as soon as its gradient is
complete the optimizer updates that one parameter and the gradient is freed. Gradients of
the whole model therefore never coexist: the gradient peak drops from one model-sized set
to roughly the largest single parameter.

The hook calls the run's ordinary optimizer with only this parameter's `.grad` set (every
other gradient is None, so torch and bitsandbytes optimizers skip those parameters). One
optimizer object keeps the learning-rate scheduler, `state_dict()` and the memory tracker's
`tag_optimizer` working unchanged.

What this cannot do, and why the config refuses it:
  - gradient accumulation (grad_accum > 1): the update would happen after the first
    micro-batch, not after the sum over all of them;
  - clipping by global norm (max_grad_norm): the global norm is known only after the last
    gradient, but by then every other parameter has already been updated;
  - fp16-mixed: the loss scaler must see every gradient for inf/NaN before any update.
The gradient norm is still reported (the square root of the sum of per-parameter squares).
"""

from __future__ import annotations

import torch
from torch._subclasses.fake_tensor import FakeTensor

from memfit.errors import MemfitError
from memfit.strategies.precision import precision_entry
from memfit.strategies.step_strategy import StepSettings, StepStrategy


class InBackwardUpdate:
    """Registers the hooks; calling it (as the step's `update`) returns (grad norm, skipped)."""

    def __init__(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter]):
        self.optimizer = optimizer
        self._sum_squares = None  # a tensor on the parameters' device; no host sync per parameter
        self.handles = [p.register_post_accumulate_grad_hook(self._update) for p in params if p.requires_grad]
        if not self.handles:
            raise MemfitError("memory.optimizer_in_backward: no trainable parameters to update")

    def _update(self, param: torch.Tensor) -> None:
        squares = param.grad.detach().float().pow(2).sum()
        self._sum_squares = squares if self._sum_squares is None else self._sum_squares + squares
        self.optimizer.step()  # only `param` has a gradient right now
        param.grad = None      # free it before the next parameter's gradient is computed

    def __call__(self, optimizer, params, max_grad_norm) -> tuple[float, bool]:
        """Stands in for PrecisionPlan.step: the updates already happened during backward."""
        if max_grad_norm is not None:
            raise MemfitError("optimizer_in_backward cannot clip by global norm; set optim.max_grad_norm: null")
        # Under the planner's fake tensors there is no value to read.
        done = self._sum_squares is None or isinstance(self._sum_squares, FakeTensor)
        norm = 0.0 if done else float(self._sum_squares.sqrt())
        self._sum_squares = None
        return norm, False

    def remove(self) -> None:
        """Take the hooks off (the model then trains with an ordinary step again)."""
        for handle in self.handles:
            handle.remove()
        self.handles = []


def in_backward_problems(settings: StepSettings) -> list[str]:
    """Settings optimizer_in_backward cannot honour (reported with all other problems of the config)."""
    problems = []
    if settings.grad_accum != 1:
        problems.append("memory.optimizer_in_backward: needs batch.grad_accum: 1 (each parameter is updated as soon "
                        "as one "
                        f"micro-batch's gradient is ready); got batch.grad_accum={settings.grad_accum}")
    if settings.max_grad_norm is not None:
        problems.append("memory.optimizer_in_backward: cannot clip by global norm (other parameters are already "
                        "updated "
                        f"when it is known); set optim.max_grad_norm: null (got {settings.max_grad_norm})")
    if precision_entry(settings.precision).scaler:
        problems.append(f"memory.optimizer_in_backward: {settings.precision}'s loss scaler must check every gradient "
                        "before any update; use bf16-mixed or fp32")
    if settings.sharding != "none":
        problems.append(f"memory.optimizer_in_backward: not with distributed.sharding: {settings.sharding} (the "
                        "gradient must be reduced "
                        "across ranks before the update); use distributed.sharding: none")
    return problems


def _in_backward_peak(moments: dict, terms) -> None:
    """At most one parameter's gradient (and the optimizer's scratch for it) at a time. The lm_head's (the
    largest, or one of them) is applied once the loss's backward is done, just before the last layer's
    backward, beside the same activations: its gradient and the update's scratch, or that layer's buffers."""
    largest = terms.largest_param_bytes
    for values in moments.values():
        values["gradients"] = min(values["gradients"], largest)
    last = moments["backward_last"]
    last.update(gradients=largest, temporaries=max(last["temporaries"], terms.largest_param_update_bytes))
    moments["optimizer_step"].update(gradients=largest, temporaries=min(moments["optimizer_step"]["temporaries"],
                                                                        largest))


OPTIMIZER_IN_BACKWARD = StepStrategy(
    "optimizer_in_backward", "Update each parameter as soon as its gradient is ready and free that gradient; "
                             "needs batch.grad_accum: 1 and optim.max_grad_norm: null.",
    hooks=lambda device, optimizer, params, traced: {"update": InBackwardUpdate(optimizer, params)},
    peak=_in_backward_peak, rules=in_backward_problems, lean=(True, False),
    without_deepspeed="the DeepSpeed engine owns the optimizer step",
    without_pipeline="the pipeline schedule accumulates each gradient over its pipeline micro-batches before it "
                     "is complete",
    forces={"optim.max_grad_norm": None}, gives_up="no gradient clipping")
