"""Evaluation: mean loss per target token over held-out batches, and its perplexity.

It runs under no_grad with the run's own loss function (the chunked loss too: evaluation is where
full [tokens x vocab] logits surprise runs that fit in training), in the tracker's `eval` phase so
its memory peak is reported on its own.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from memfit.data.examples import IGNORE_INDEX
from memfit.data.loader import eval_batches


@dataclass
class EvalResult:
    loss: float        # mean cross-entropy per target token (nats)
    perplexity: float  # exp(loss)
    tokens: int        # target tokens evaluated
    batches: int

    def record(self, step: int) -> dict:
        """One metrics.jsonl line; its eval_ names keep it apart from the training lines."""
        return {"step": step, "eval_loss": self.loss, "eval_perplexity": self.perplexity, "eval_tokens": self.tokens}


@torch.no_grad()
def evaluate(model: torch.nn.Module, batches: Iterable[dict], loss_fn, autocast, tracker,
             device: torch.device) -> EvalResult:
    """Every token weighs the same, however the tokens fall into batches: the sum of per-token
    losses over all batches divided by the number of target tokens."""
    was_training = model.training
    model.eval()
    total, targets, count = 0.0, 0, 0
    try:
        for batch in batches:
            batch = {k: v.to(device) for k, v in batch.items()}
            n = int((batch["labels"][:, 1:] != IGNORE_INDEX).sum())
            if n == 0:
                continue
            with tracker.phase("eval"), autocast():
                total += float(loss_fn(model, batch, 1))  # divided by 1: the sum over this batch's targets
            targets, count = targets + n, count + 1
    finally:
        model.train(was_training)
    if targets == 0:
        return EvalResult(float("nan"), float("nan"), 0, count)
    loss = total / targets
    return EvalResult(loss, math.exp(min(loss, 700.0)), targets, count)


class Evaluation:
    """When a run evaluates, on which batches, and whether a result is its best so far (save_best)."""

    def __init__(self, cfg, tokenizer):
        self.every, self.last_step, self.save_best = cfg.eval.every, cfg.max_steps, cfg.eval.save_best
        self.batches = eval_batches(cfg, tokenizer) if cfg.eval.enabled else None
        self.best_loss = float("inf")
        self.losses: dict[int, float] = {}  # step -> eval loss

    def due(self, step: int) -> bool:
        return self.batches is not None and (step == self.last_step or bool(self.every and step % self.every == 0))

    def run(self, step: int, model, loss_fn, autocast, tracker, device: torch.device) -> tuple[EvalResult, bool]:
        """The scores, and whether they are the best so far and save_best wants them kept."""
        scores = evaluate(model, self.batches, loss_fn, autocast, tracker, device)
        self.losses[step] = scores.loss
        best = scores.loss < self.best_loss
        self.best_loss = min(self.best_loss, scores.loss)
        return scores, best and self.save_best
