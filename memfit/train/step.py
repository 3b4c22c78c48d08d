"""One optimizer step: forward and backward over the micro-batches, then the update.

The planner runs this same function on fake tensors to estimate memory, so whatever a
strategy changes about a step must happen in here or in the objects passed in.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.data.loader import IGNORE_INDEX
from memfit.strategies.precision import PrecisionPlan


@dataclass
class StepResult:
    loss: float
    grad_norm: float
    skipped: bool  # fp16 overflow: the scaler skipped the update
    tokens: int    # tokens processed (padding excluded)


def count_targets(micro_batches: list[dict]) -> int:
    """Tokens that carry loss across the whole step (labels are shifted by one inside the model)."""
    return sum(int((mb["labels"][:, 1:] != IGNORE_INDEX).sum()) for mb in micro_batches)


def training_step(model: torch.nn.Module, optimizer: torch.optim.Optimizer, micro_batches: list[dict],
                  precision: PrecisionPlan, tracker, params: list[torch.nn.Parameter],
                  max_grad_norm: float | None) -> StepResult:
    # Sum of per-token losses over the step / target tokens in the step: every token weighs
    # the same, however the tokens are split into micro-batches.
    targets = max(count_targets(micro_batches), 1)
    total = torch.zeros((), device=micro_batches[0]["input_ids"].device)
    for batch in micro_batches:
        with tracker.phase("forward"), precision.autocast():
            loss = model(**batch, num_items_in_batch=targets).loss
        with tracker.phase("backward"):
            precision.backward(loss)
        total += loss.detach()
    tracker.tag_gradients(params)
    with tracker.phase("optimizer"):
        grad_norm, skipped = precision.step(optimizer, params, max_grad_norm)
        optimizer.zero_grad(set_to_none=True)  # frees gradient memory until the next backward
    tracker.tag_optimizer(optimizer)
    tokens = sum(int(mb["attention_mask"].sum()) for mb in micro_batches)
    return StepResult(float(total), grad_norm, skipped, tokens)
