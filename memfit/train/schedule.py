"""Learning-rate schedule: linear warm-up, then cosine / linear decay to 10% or constant."""

from __future__ import annotations

import math

import torch


def make_scheduler(optimizer: torch.optim.Optimizer, optim, max_steps: int):
    """Linear warm-up over optim.warmup_steps, then optim.schedule down to 10% of the peak lr at max_steps."""
    schedule, warmup_steps = optim.schedule, optim.warmup_steps

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / (warmup_steps + 1)
        progress = (step - warmup_steps) / max(1, max_steps - warmup_steps)
        if schedule == "cosine":
            return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0)))
        if schedule == "linear":
            return 1.0 - 0.9 * min(progress, 1.0)
        return 1.0

    return torch.optim.lr_scheduler.LambdaLR(optimizer, factor)
