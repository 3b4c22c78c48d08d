"""What the trainer receives: the run as resolving decided it (memfit/train/resolve.py makes it).

Its own module so that the loop can name the type without importing the resolve step, which plans."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from memfit.config import RunConfig


@dataclass(frozen=True)
class ResolvedRun:
    cfg: RunConfig               # the run that trains: budget cleared, micro_batch a number
    device: torch.device         # where this process trains
    host_ram_bytes: int          # this machine's RAM: the host-RAM check's and the budget search's limit
    budget_bytes: int | None     # what `budget:` came to (None: no budget)
    notes: tuple[str, ...] = ()  # what resolving chose, as logged
