"""Out-of-memory recovery, and a memory budget that makes OOM testable on CPU.

OOM recovery: the loop draws each step's data exactly as configured (grad_accum batches of
micro_batch sequences), and `OomRecovery.run` cuts those batches into smaller micro-batches
before the step. After an out-of-memory error it drops the partial gradients, doubles the
number of pieces (micro_batch halves, grad_accum doubles: the effective batch, the data and
its order are unchanged) and redoes the same step. The step's loss is the sum over its target
tokens divided by their count, so it does not depend on how the step is cut. The smaller
micro-batch stays for the rest of the run.

Evaluation is separate (`evaluate_with_retry`): an OOM there splits the evaluation batch
only, never the training batch.

`MemoryBudget` is a MemoryTracker that raises `torch.OutOfMemoryError` when the tracked bytes
go above a limit, as a full GPU would; `memory.limit: 512MiB` in the config turns it on.
"""

from __future__ import annotations

import gc
import logging
from typing import Callable

import torch

from memfit.errors import MemfitError
from memfit.memory.tracker import MemoryTracker, NullTracker
from memfit.units import format_bytes

log = logging.getLogger(__name__)


class MemoryBudget(MemoryTracker):
    """A MemoryTracker that fails an allocation taking the tracked total above `limit_bytes`."""

    def __init__(self, limit_bytes: int, size_fn=None, timeline: bool = False):
        super().__init__(size_fn, timeline)
        self.limit_bytes = limit_bytes

    def _add(self, nbytes: int, category: str) -> None:
        if nbytes > 0 and self.current_bytes + nbytes > self.limit_bytes:
            # Like a real failed allocation, it never counts toward the peak. The storage is already
            # recorded, and its weak reference gives the bytes back when the failed op's output is
            # dropped, so current_bytes carries them until then.
            self._snapshot_if_pending()
            self.current_bytes += nbytes
            self._by_category[category] += nbytes
            raise torch.OutOfMemoryError(
                f"memory.limit: allocating {format_bytes(nbytes)} would hold "
                f"{format_bytes(self.current_bytes)}, above the budget of {format_bytes(self.limit_bytes)}")
        super()._add(nbytes, category)

    def tag_module(self, module: torch.nn.Module) -> None:
        """The weights are tracked before the first step: a limit below them leaves nothing to recover
        by splitting batches, so it is the user's setting that is wrong."""
        try:
            super().tag_module(module)
        except torch.OutOfMemoryError:
            weights = sum(t.untyped_storage().nbytes() for t in [*module.parameters(), *module.buffers()])
            raise MemfitError(f"memory.limit: {format_bytes(self.limit_bytes)} is below the model's own weights "
                              f"and buffers ({format_bytes(weights)}), before any step; raise memory.limit, or "
                              "use a smaller model or method") from None


def make_tracker(cfg):
    """The run's tracker (with the peak step's timeline): a MemoryBudget when memory.limit is set, else as
    logging.track_memory says."""
    if cfg.memory.limit is not None:
        return MemoryBudget(cfg.memory.limit_bytes, timeline=True)
    return MemoryTracker(timeline=True) if cfg.logging.track_memory else NullTracker()


def smaller_split(micro_batch: int) -> int:
    """The next micro-batch after an OOM: about half, and a divisor of the current one so that
    every drawn batch splits evenly (6 -> 3, 5 -> 1, 4 -> 2)."""
    return max(d for d in range(1, micro_batch // 2 + 1) if micro_batch % d == 0)


def _trim_padding(batch: dict) -> dict:
    """Drop trailing columns that are padding in every row (right-padded batches only)."""
    mask = batch.get("attention_mask")
    if mask is None or mask.shape[1] == 0:
        return batch
    keep = int(mask.sum(dim=1).max())
    if keep == mask.shape[1] or not bool((mask[:, keep:] == 0).all()):
        return batch
    return {k: v[:, :keep] if v.dim() == 2 and v.shape[1] == mask.shape[1] else v for k, v in batch.items()}


def split_batches(micro_batches: list[dict], rows: int) -> list[dict]:
    """Cut each micro-batch into pieces of `rows` sequences (the last piece may be shorter)."""
    pieces = []
    for batch in micro_batches:
        n = batch["input_ids"].shape[0]
        if n <= rows:
            pieces.append(batch)
            continue
        for start in range(0, n, rows):
            pieces.append(_trim_padding({k: v[start:start + rows] for k, v in batch.items()}))
    return pieces


class OomRecovery:
    """Runs a training step; on out-of-memory, splits the step's micro-batches finer and redoes it."""

    def __init__(self, micro_batch: int, grad_accum: int, enabled: bool = True, reason_disabled: str = ""):
        self.micro_batch, self.grad_accum = micro_batch, grad_accum
        self.drawn_micro_batch = micro_batch  # rows per batch the loop draws (never changes)
        self.enabled, self.reason_disabled = enabled, reason_disabled
        self.shrinks: list[tuple[int, int]] = []  # (micro_batch, grad_accum) after each recovery

    @classmethod
    def for_run(cls, cfg) -> "OomRecovery":
        distributed = torch.distributed.is_available() and torch.distributed.is_initialized()
        reason = ("optimizer_in_backward already updated part of the model when the OOM struck" if
                  cfg.memory.optimizer_in_backward else "a distributed run cannot change one rank's batch alone"
                  if distributed else "")
        return cls(cfg.batch.micro_batch, cfg.batch.grad_accum, enabled=not reason, reason_disabled=reason)

    def run(self, step_fn: Callable[[list[dict]], object], micro_batches: list[dict], optimizer) -> object:
        while True:
            try:
                return step_fn(split_batches(micro_batches, self.micro_batch))
            except torch.OutOfMemoryError as exc:
                message = str(exc).splitlines()[0] if str(exc) else "out of memory"
            # Outside the `except`: the traceback (and the tensors its frames hold) is gone now.
            self._shrink(message)
            optimizer.zero_grad(set_to_none=True)  # the failed attempt's partial gradients
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()

    def _shrink(self, message: str) -> None:
        if not self.enabled:
            raise MemfitError(f"out of memory during a training step ({message}); automatic recovery is off "
                              f"because {self.reason_disabled}: lower micro_batch (now {self.micro_batch})")
        if self.micro_batch == 1:
            raise MemfitError(f"out of memory during a training step even at micro_batch 1 ({message}); "
                              "turn on memory savings (checkpointing, chunked_loss, lora, an 8-bit optimizer, "
                              "shorter seq_len) or see `memfit plan`")
        smaller = smaller_split(self.micro_batch)
        self.grad_accum = self.grad_accum * self.micro_batch // smaller
        self.micro_batch = smaller
        self.shrinks.append((self.micro_batch, self.grad_accum))
        log.warning("out of memory (%s): redoing the step with micro_batch %d x grad_accum %d (same effective "
                    "batch, same data)", message, self.micro_batch, self.grad_accum)


def evaluate_with_retry(eval_fn: Callable[[dict], tuple[torch.Tensor, int]], batch: dict,
                        rows: int | None = None) -> tuple[float, int]:
    """(sum of per-token losses, tokens) over `batch`, in pieces of `rows`; on OOM the pieces
    are halved for this evaluation only (the training micro-batch is not touched)."""
    rows = rows or batch["input_ids"].shape[0]
    while True:
        try:
            total, count = 0.0, 0
            for piece in split_batches([batch], rows):
                loss_sum, tokens = eval_fn(piece)
                total, count = total + float(loss_sum), count + tokens
            return total, count
        except torch.OutOfMemoryError as exc:
            message = str(exc).splitlines()[0]
        if rows == 1:
            raise MemfitError(f"out of memory during evaluation even one sequence at a time ({message})")
        rows = max(1, rows // 2)
        gc.collect()
        log.warning("out of memory in evaluation (%s): evaluating %d sequences at a time", message, rows)

