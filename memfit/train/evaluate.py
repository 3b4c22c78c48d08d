"""Evaluation: mean loss per target token over held-out batches, and its perplexity.

It runs under no_grad with the run's own loss function (the chunked loss too: evaluation is where
full [tokens x vocab] logits surprise runs that fit in training), in the tracker's `eval` phase so
its memory peak is reported on its own.

An evaluation that fails (a kernel, memory, the held-out data) must not cost the weights trained
before it: `Evaluation.run` records the failure and returns no scores, the loop saves the checkpoint
of the finished step (at the end, the final model too), then stops with `Evaluation.failed`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch

from memfit.checkpoint import CHECKPOINTS_DIR, latest_step_name
from memfit.data.examples import IGNORE_INDEX
from memfit.data.loader import eval_batches
from memfit.errors import MemfitError
from memfit.train.error_log import first_line, write_traceback


class EvaluationFailed(MemfitError):
    """An evaluation raised; the message says what was saved before the run stopped."""


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
        self.out = Path(cfg.output_dir).expanduser()
        self.failure: str | None = None  # what went wrong, once an evaluation has failed
        self.fix = ""  # and what to do about it

    def due(self, step: int) -> bool:
        return self.batches is not None and (step == self.last_step or bool(self.every and step % self.every == 0))

    def run(self, step: int, model, loss_fn, autocast, tracker,
            device: torch.device) -> tuple[EvalResult | None, bool]:
        """The scores, and whether they are the best so far and save_best wants them kept. Scores are
        None when the evaluation failed: the caller saves the weights, then raises `failed(...)`."""
        try:
            scores = evaluate(model, self.batches, loss_fn, autocast, tracker, device)
        except Exception as exc:  # noqa: BLE001 - whatever failed, the trained weights are saved first
            self._record_failure(step, exc)
            return None, False
        self.losses[step] = scores.loss
        best = scores.loss < self.best_loss
        self.best_loss = min(self.best_loss, scores.loss)
        return scores, best and self.save_best

    def _record_failure(self, step: int, exc: Exception) -> None:
        what = str(exc) if isinstance(exc, MemfitError) else first_line(exc)
        logged = None if isinstance(exc, MemfitError) else write_traceback(self.out, f"evaluation at step {step}", exc)
        self.failure = f"evaluation at step {step} failed ({what}{f'; traceback in {logged}' if logged else ''})"
        self.fix = "lower eval.micro_batch" if isinstance(exc, torch.OutOfMemoryError) else "fix the cause"
        if torch.distributed.is_available() and torch.distributed.is_initialized():
            # Saving is collective and the other ranks may have evaluated fine: stop here, as torchrun
            # stops them, pointing at the last checkpoint every rank wrote.
            root = self.out / CHECKPOINTS_DIR
            last = latest_step_name(root)
            raise EvaluationFailed(f"{self.failure}; the last checkpoint is {root / last if last else 'none yet'}; "
                                   f"{self.fix}, then continue with resume=true") from None

    def failed(self, saved: Path, finished: bool) -> EvaluationFailed:
        """The error that ends a run after a failed evaluation, once the checkpoint `saved` (and, when
        `finished`, the final model) are written."""
        if finished:
            return EvaluationFailed(f"{self.failure}; training finished: the final model is saved in {self.out} and "
                                    f"its checkpoint in {saved}; only this evaluation is missing")
        return EvaluationFailed(f"{self.failure}; checkpoint of the finished step saved in {saved}; {self.fix}, "
                                "then continue with resume=true")
