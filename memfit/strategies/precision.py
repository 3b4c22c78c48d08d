"""Numeric precision: where weights live, what the forward computes in, how gradients are scaled.

  fp32        everything fp32.
  bf16-mixed  fp32 master weights, gradients and optimizer states; forward/backward matmuls in
              bf16 under autocast. Saves activation memory, not weight memory.
  fp16-mixed  as bf16-mixed with fp16, plus a dynamic loss scaler (fp16 underflows otherwise).
  bf16-pure   weights, gradients and optimizer states all bf16 (half of every model-state byte).
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass

import torch

from memfit.errors import MemfitError


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
    device_type = device.type
    if name in ("bf16-mixed", "bf16-pure") and device_type == "cuda" and not torch.cuda.is_bf16_supported():
        raise MemfitError(f"precision: {name} needs a GPU with bfloat16 support (Ampere or newer); "
                          "this GPU has none: use precision: fp16-mixed")
    if name == "fp32":
        return PrecisionPlan(name, device_type, torch.float32, None, None)
    if name == "bf16-mixed":
        return PrecisionPlan(name, device_type, torch.float32, torch.bfloat16, None)
    if name == "fp16-mixed":
        return PrecisionPlan(name, device_type, torch.float32, torch.float16, torch.amp.GradScaler(device_type))
    if name == "bf16-pure":
        return PrecisionPlan(name, device_type, torch.bfloat16, None, None)
    raise MemfitError(f"precision: unknown '{name}'; allowed: fp32, bf16-mixed, fp16-mixed, bf16-pure")
