"""The numeric precisions memfit offers: one entry each, listed in one table, and the plan the trainer runs.

  fp32        everything fp32.
  bf16-mixed  fp32 master weights, gradients and optimizer states; forward/backward matmuls in
              bf16 under autocast. Saves activation memory, not weight memory.
  fp16-mixed  as bf16-mixed with fp16, plus a dynamic loss scaler (fp16 underflows otherwise).
  bf16-pure   weights, gradients and optimizer states all bf16 (half of every model-state byte).

An entry (`PrecisionEntry`) gives the dtypes the trainer builds and computes in (`make_precision` turns
it into the `PrecisionPlan` the step runs) and what the planner reads of them: bytes per weight, per
trained value and per computed element (the dtypes' own sizes), what the search tries and what it gives
up. Everything else reads `PRECISION_ENTRIES`: the config's `precision` choices, `memfit plan
--precision`, the analytic memory terms (memory/model_states.py, memory/activations.py), the speed
model (memory/costs.py) and the search (memory/search_space.py). Entries hold values, never the RunConfig.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from memfit.errors import MemfitError
from memfit.strategies.entries import entry_lookup


@dataclass(frozen=True)
class PrecisionEntry:
    name: str                                   # the value of `precision`
    weight_dtype: torch.dtype                   # the dtype the model's weights are built in
    autocast_dtype: torch.dtype | None = None   # the matmuls' dtype under autocast; None: no autocast
    scaler: bool = False                        # a dynamic loss scaler (fp16's range underflows small gradients)
    searched: bool = False                      # one of the precisions the planner's search tries
    gives_up: str = ""                          # what it trades against bf16-mixed, for the plan's table

    @property
    def compute_dtype(self) -> torch.dtype:
        """The dtype of the forward's and backward's matmul outputs."""
        return self.weight_dtype if self.autocast_dtype is None else self.autocast_dtype

    @property
    def master_dtype(self) -> torch.dtype:
        """The dtype of the values the optimizer updates, their gradients and states: the weights
        themselves, since memfit trains the model's own parameters (it keeps no separate master copy)."""
        return self.weight_dtype

    @property
    def weight_bytes(self) -> int:
        return self.weight_dtype.itemsize

    @property
    def compute_bytes(self) -> int:
        return self.compute_dtype.itemsize

    @property
    def master_bytes(self) -> int:
        return self.master_dtype.itemsize

    @property
    def needs_bf16(self) -> bool:
        return torch.bfloat16 in (self.weight_dtype, self.autocast_dtype)


FP32 = PrecisionEntry("fp32", torch.float32)
BF16_MIXED = PrecisionEntry("bf16-mixed", torch.float32, torch.bfloat16, searched=True)
FP16_MIXED = PrecisionEntry("fp16-mixed", torch.float32, torch.float16, scaler=True,
                            gives_up="fp16 range (loss scaling)")
BF16_PURE = PrecisionEntry("bf16-pure", torch.bfloat16, searched=True, gives_up="no fp32 master weights")

# The table: the order of the config's choices, of `memfit plan --precision` and of the search.
PRECISION_ENTRIES = (FP32, BF16_MIXED, FP16_MIXED, BF16_PURE)
PRECISIONS, precision_entry = entry_lookup(PRECISION_ENTRIES, "precision")


@dataclass
class PrecisionPlan:
    name: str
    device_type: str
    weight_dtype: torch.dtype
    autocast_dtype: torch.dtype | None
    scaler: torch.amp.GradScaler | None

    def autocast(self):
        if self.autocast_dtype is None:
            return nullcontext()
        return torch.autocast(self.device_type, dtype=self.autocast_dtype)

    def backward(self, loss: torch.Tensor) -> None:
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, optimizer: torch.optim.Optimizer, params: list[torch.nn.Parameter],
             max_grad_norm: float | None, norm: torch.Tensor | None = None) -> tuple[float, bool]:
        """Unscale, clip, step. Returns (gradient norm before clipping, whether the step was skipped).
        `norm`: the global gradient norm when the caller already has it (one pass over the gradients less)."""
        if self.scaler:
            self.scaler.unscale_(optimizer)
        if norm is None:
            norm = total_grad_norm(params)
        if max_grad_norm is not None:
            torch.nn.utils.clip_grads_with_norm_(params, max_grad_norm, norm)
        if self.scaler:
            scale = self.scaler.get_scale()
            self.scaler.step(optimizer)  # skips the step when gradients overflowed
            self.scaler.update()
            return float(norm), self.scaler.get_scale() < scale
        optimizer.step()
        return float(norm), False


def total_grad_norm(params: list[torch.nn.Parameter]) -> torch.Tensor:
    """The global L2 norm of the gradients (0 when there are none)."""
    grads = [p.grad for p in params if p.grad is not None]
    return torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())


def make_precision(name: str, device: torch.device) -> PrecisionPlan:
    """The plan the trainer's step runs for the entry `name` on `device`."""
    entry = precision_entry(name)
    device_type = device.type
    if entry.needs_bf16 and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise MemfitError(f"precision: {name} needs a GPU with bfloat16 support (Ampere or newer); "
                          "this GPU has none: use precision: fp16-mixed")
    scaler = torch.amp.GradScaler(device_type) if entry.scaler else None
    return PrecisionPlan(entry.name, device_type, entry.weight_dtype, entry.autocast_dtype, scaler)
