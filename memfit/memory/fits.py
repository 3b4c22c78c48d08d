"""Does a run fit: the memory this machine offers, the margin kept free, and the one rule that says yes.

The planner's search (memory/search.py) and the resolve step before training (memfit/train/resolve.py)
both judge plans by `FitRule`, so `memfit plan --budget` and `memfit train` with `budget:` or
`batch.micro_batch: auto` agree on what fits.
"""

from __future__ import annotations

from dataclasses import dataclass

import psutil
import torch

from memfit.memory.analytic import device_total_bytes
from memfit.memory.estimate import Estimate
from memfit.memory.gpus import find_gpu

GiB = 2**30


def default_margin(budget: int) -> int:
    """Headroom kept free: 5% of the budget (the estimate's error against the tracker is -6%..+2%),
    at least 1 GiB on a card of 10 GiB or more (fragmentation, a second process)."""
    return int(max(0.05 * budget, min(GiB, 0.1 * budget)))


@dataclass(frozen=True)
class FitRule:
    """A plan fits when what the whole device must hold at its peak (nvidia-smi's view: reserved bytes,
    paged states or a larger phase, CUDA context) stays within `device_limit_bytes` (the budget less the
    margin) and its host RAM within `host_ram_bytes` (None: not limited)."""

    device_limit_bytes: int
    host_ram_bytes: int | None = None

    def fits(self, estimate: Estimate) -> bool:
        return device_total_bytes(estimate) <= self.device_limit_bytes and (
            self.host_ram_bytes is None or estimate.cpu_ram_bytes <= self.host_ram_bytes)


def largest_that_fits(fits, low: int, high: int) -> int:
    """Largest value in [low, high] for which fits(value) holds (fits is monotone); 0 if none.
    Doubling from `low`, then bisection: about 2 log2(answer) calls, few when the answer is small
    (each call is one estimate; a traced one takes seconds)."""
    if not fits(low):
        return 0
    top = low
    while top < high and fits(min(2 * top, high)):
        top = min(2 * top, high)
    if top == high:
        return high
    failed = min(2 * top, high)  # the first value that did not fit
    while failed - top > 1:
        middle = (top + failed) // 2
        top, failed = (middle, failed) if fits(middle) else (top, middle)
    return top


def available_bytes(device: torch.device | str) -> int:
    """What a run on `device` may fill before the margin: the GPU's free memory, or half the available
    RAM on the CPU (the other half is for the dataset, the Python runtime and the page cache the data
    loader relies on, none of which a tensor estimate counts). budget: auto and micro_batch: auto both
    use this one rule."""
    device = torch.device(device)
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        return int(free)
    return int(psutil.virtual_memory().available) // 2


def plans_for_this_machine(device: str, gpu: str | None, gpus: int) -> bool:
    """Whether `memfit plan` plans a run on this machine, whose RAM then limits its plans: a CPU run, or a
    CUDA device here with no --gpu naming another card and no more --gpus than it has. A plan for a
    machine elsewhere states the host RAM it needs per node instead (--host-ram sets a limit)."""
    if device == "cpu":
        return True
    if not torch.cuda.is_available() or gpus > torch.cuda.device_count():
        return False
    if gpu is None:
        return True
    local, named = torch.cuda.get_device_name(0).lower(), find_gpu(gpu).name.lower()
    return named.replace("nvidia ", "") in local or local in named


def machine_ram_bytes() -> int:
    """Total RAM of this machine (the host RAM limit `memfit plan` and `memfit train` assume by default)."""
    return int(psutil.virtual_memory().total)
