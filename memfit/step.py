"""One optimizer step: forward and backward over the micro-batches, then the update.

The planner runs this same function on fake tensors to estimate memory, so whatever a
strategy changes about a step must happen in here or in the objects passed in.
`tracked_steps` is the sequence of steps as the memory tracker sees them, shared the same way by the
trainer's loop, the trace and the measurements.
"""

from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

from torch._subclasses.fake_tensor import FakeTensor

from memfit.build import Run
from memfit.config.step_rules import strategy_options
from memfit.data.examples import IGNORE_INDEX
from memfit.strategies.loss import plain_loss
from memfit.strategies.precision import PrecisionPlan, total_grad_norm
from memfit.strategies.table import STEP_STRATEGIES


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool  # no update: fp16 overflow (the scaler's call) or a non-finite loss/gradient
    tokens: int    # tokens processed (padding excluded)
    nonfinite: bool = False  # loss or gradients were NaN/inf; the loop counts these in a row


def _finite(value: torch.Tensor) -> bool:
    """Whether a tensor is all finite; assumed so on fake/meta tensors (the planner traces this step)."""
    if isinstance(value, FakeTensor) or value.device.type == "meta":
        return True
    if hasattr(value, "full_tensor"):  # a DTensor norm (FSDP2 gradients): the same global value on every rank
        value = value.full_tensor()
    return bool(torch.isfinite(value).all())


def count_tokens(micro_batches: list[dict]) -> int:
    """Tokens processed, padding excluded; packed batches carry no attention_mask (position_ids
    mark the examples instead, see memfit/data/packing.py) and are counted whole."""
    return sum(int(mb["attention_mask"].sum()) if "attention_mask" in mb else mb["input_ids"].numel()
               for mb in micro_batches)


def count_targets(micro_batches: list[dict]) -> int:
    """Tokens that carry loss across the whole step (labels are shifted by one inside the model)."""
    return sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches)


def step_strategies(cfg, device: torch.device, optimizer: torch.optim.Optimizer, params: list,
                    traced: bool = False) -> dict:
    """training_step's strategy hooks for this run, as keyword arguments (all no-ops when off).
    The loop and the planner's trace both call this, once per model (it registers the
    optimizer-in-backward hooks). `traced`: fake tensors estimating `device`."""
    hooks = {"loss_fn": plain_loss, "saved_activations": nullcontext, "update": None}
    for strategy in STEP_STRATEGIES:  # memfit/strategies/table.py
        if getattr(cfg.memory, strategy.name):
            hooks.update(strategy.hooks(device, optimizer, params, traced, **strategy_options(cfg, strategy)))
    return hooks


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[dict],
                  precision: PrecisionPlan, tracker, params: list[torch.nn.Parameter],
                  max_grad_norm: float | None, loss_fn=plain_loss, saved_activations=nullcontext,
                  update=None, target_count=count_targets) -> StepResult:
    """One optimizer step. loss_fn, saved_activations and update are the strategy hooks, no-ops when
    off: loss_fn (strategies/loss.py: plain or chunked), saved_activations (a context factory around
    each forward: strategies/activation_offload.py) and update (replaces precision.step:
    strategies/optimizer_in_backward.py, which already updated the weights during backward).
    target_count: what each loss is divided by; data parallel divides by all ranks' targets / ranks,
    so the averaged gradients equal one process's (memfit/distributed/launch.py)."""
    # Sum of per-token losses over the step / target tokens in the step: every token weighs
    # the same, however the tokens are split into micro-batches.
    targets = max(target_count(micro_batches), 1)
    total = torch.zeros((), device=micro_batches[0]["input_ids"].device)
    for batch in micro_batches:
        with tracker.phase("forward"), precision.autocast(), saved_activations():
            loss = loss_fn(model, batch, targets)
        with tracker.phase("backward"):
            precision.backward(loss)
        total += loss.detach()
    tracker.tag_gradients(params)
    # A NaN/inf loss, or (without a loss scaler, which checks for itself) a NaN/inf gradient, would
    # poison the weights and optimizer states for good: drop this step's gradients instead.
    finite_loss = _finite(total)
    norm = total_grad_norm(params) if finite_loss and precision.scaler is None else None
    if not finite_loss or (norm is not None and not _finite(norm)):
        optimizer.zero_grad(set_to_none=True)
        tokens = count_tokens(micro_batches)
        return StepResult(float(total), float("nan"), True, tokens, nonfinite=True)
    with tracker.phase("optimizer"):
        if update is not None:
            grad_norm, skipped = update(optimizer, params, max_grad_norm)
        else:  # clipping reuses the norm the check above computed
            grad_norm, skipped = precision.step(optimizer, params, max_grad_norm, norm)
        optimizer.zero_grad(set_to_none=True)  # frees gradient memory until the next backward
    tracker.tag_optimizer(optimizer)
    tokens = count_tokens(micro_batches)
    return StepResult(float(total), grad_norm, skipped, tokens)


@dataclass
class TrackedStep:
    """One step of `tracked_steps`, as the tracker saw it."""

    key: object            # what `steps` gave for it (the trainer: the step number)
    result: StepResult
    started_s: float       # time.perf_counter() before its micro-batches were drawn: a step's time includes them
    raised_peak: bool      # it set a new highest tracked peak
    micro_batches: list[dict] | None  # what it trained on; let go once the next step's are drawn


def _try_once(train: Callable[[list[dict]], StepResult], micro_batches: list[dict]) -> StepResult:
    return train(micro_batches)


def tracked_steps(tracker, run: Run, hooks: dict, max_grad_norm: float | None, steps: Iterable,
                  draw: Callable[[object], list[dict]], attempt=_try_once, target_count=count_targets,
                  stand_in_first: torch.nn.Module | None = None, peak_per_step: bool = False) -> Iterator[TrackedStep]:
    """Training steps as the memory tracker sees them. The trainer's loop, the planner's trace
    (memory/trace.py) and the measurements the estimates are checked against (memory/measure.py) all
    step through here, so that they record the same thing.

    The model's tensors are tagged once; then for each of `steps`: a step is marked (the tracker keeps
    the timeline of the highest one), its micro-batches `draw(key)` are tagged as activations, and
    `training_step` runs with `hooks` (`step_strategies`).
    attempt(train, micro_batches): how the step is tried (the trainer's OOM recovery retries it in
    smaller pieces). stand_in_first: a module that runs the first step in the model's place, with the
    plain loss (the trace's stand-in that only lets the optimizer create its states). peak_per_step:
    reset the peak once the batches are drawn, so that `tracker.peak_bytes` after a step is its own.
    """
    tracker.tag_module(run.model)
    last = None
    for index, key in enumerate(steps):
        started, peak_before = time.perf_counter(), tracker.peak_bytes
        tracker.mark_step()
        micro_batches = draw(key)
        tracker.tag((t for batch in micro_batches for t in batch.values()), "activations")
        if last is not None:  # held through this step, the last step's batches would count in its peak
            last.micro_batches = None
        if peak_per_step:
            tracker.reset_peak()
        model, step_hooks = run.model, hooks
        if index == 0 and stand_in_first is not None:
            model, step_hooks = stand_in_first, {**hooks, "loss_fn": plain_loss}
        result = attempt(lambda pieces: training_step(
            model, run.optimizer, pieces, run.precision, tracker, run.params, max_grad_norm,
            target_count=target_count, **step_hooks), micro_batches)
        last = TrackedStep(key, result, started, tracker.peak_bytes > peak_before, micro_batches)
        yield last
