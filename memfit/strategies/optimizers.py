"""The optimizers memfit offers: one entry each, beside the torch code that builds it, listed in one table.

  adamw             8 bytes of state per fp32 parameter (momentum + variance, in the weights' dtype)
  adamw-8bit        2 (+ small per-block scales); bitsandbytes, or torchao as the other backend
  paged-adamw-8bit  2  bitsandbytes, state in CUDA unified memory that pages to CPU under pressure
  lion              4  (momentum only)      lion-8bit  1 (+ scales)
  adafactor         ~0 (factored second moment: rows + columns per matrix, no momentum)
  sgd               4  (momentum 0.9)

An entry (`OptimizerEntry`) gives what the trainer needs (`build`: the optimizer over the trainable
parameters) and what the planner and the config rules need (state and scratch bytes, whether it runs
on sharded parameters and under DeepSpeed, what the search tries, what it gives up). Everything else
reads `OPTIMIZERS`: the config's `optim.name` choices, `memfit plan --optimizer`, the analytic memory
terms (memory/model_states.py, memory/distributed_estimate.py, memory/phases.py), the speed model
(memory/costs.py), the search (memory/search_space.py) and the engine rules (config/distributed.py,
config/deepspeed.py). A new optimizer is one entry here and its name in `OPTIMIZERS`.
Entries receive values (parameters, learning rate, sizes), never the RunConfig.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from memfit.errors import MemfitError, require
from memfit.strategies.entries import entry_lookup

log = logging.getLogger(__name__)

# 8-bit states carry one fp32 scale per 2048-value block (bitsandbytes blockwise quantization).
_BLOCK = 2048


@dataclass(frozen=True)
class TrainedParams:
    """The trainable parameters as an optimizer's state sees them (memory/ describes them from the model's shape)."""

    count: int                                     # trainable values
    bytes_per_value: int                           # their dtype's size: 4 (fp32, adapters) or 2 (bf16-pure)
    matrices: tuple[tuple[int, int], ...] = ()     # (rows, columns) of the matrices a factored optimizer factors
    unfactored: int = 0                            # values a factored optimizer keeps whole (norms, embeddings)


def _elementwise(state: TrainedParams, per_value: float) -> int:
    return math.ceil(state.count * per_value)


@dataclass(frozen=True)
class OptimizerEntry:
    name: str                                          # the value of optim.name
    build: Callable[..., torch.optim.Optimizer]        # (params, lr, weight_decay, backend, device) -> optimizer
    state_bytes_per_value: Callable[[int], float]      # (bytes per parameter value) -> state bytes per trainable
                                                       # value that the step reads and writes (memory/costs.py)
    state_bytes: Callable[[TrainedParams], int] | None = None  # its states' bytes, when not per value
    foreach_scratch: bool = False  # torch's foreach step builds one scratch copy of the parameters (e.g. Adam's
                                   # denominator); block-wise 8-bit steps need none
    on_dtensor: bool = True        # runs on sharded (DTensor) parameters: FSDP2, tensor parallel
    deepspeed_client: bool = False  # plain torch.optim states DeepSpeed's ZeRO can flatten and partition
    backends: tuple[str, ...] = ()  # optim.backend values that pick between its implementations (auto: the first
                                    # that imports); optim.backend: torchao is refused unless listed here
    searched: bool = False         # one of the optimizers the planner's search tries
    lean: bool = False             # tried by the search's leanest pre-check (no one optimizer is smallest everywhere)
    paged: bool = False            # on CUDA its states live in unified memory, outside torch's allocator statistics
    gives_up: str = ""             # what it trades against AdamW, for the plan's table

    def states(self, params: TrainedParams) -> int:
        """Bytes of optimizer state for `params` on one device."""
        if self.state_bytes is not None:
            return self.state_bytes(params)
        return _elementwise(params, self.state_bytes_per_value(params.bytes_per_value))


def _bnb(purpose: str):
    return require("bitsandbytes.optim", purpose, install="bitsandbytes")


def _adamw_8bit(params, lr, weight_decay, backend, device):
    if backend in ("auto", "bitsandbytes"):
        try:
            return _bnb("optim.name: adamw-8bit").AdamW8bit(params, lr=lr, weight_decay=weight_decay)
        except ImportError:
            if backend == "bitsandbytes":
                raise
    if backend in ("auto", "torchao"):
        # torchao compiles its 8-bit step on first use (several seconds); it runs on CPU and CUDA.
        optim = require("torchao.optim", "optim.name: adamw-8bit (torchao backend)", install="torchao")
        return optim.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    raise MemfitError(f"optim.backend: '{backend}' cannot run adamw-8bit; supported: {', '.join(ADAMW_8BIT.backends)}")


def _paged_adamw_8bit(params, lr, weight_decay, backend, device):
    bnb = _bnb("optim.name: paged-adamw-8bit")
    if device.type != "cuda":
        # Paging needs CUDA unified memory; on CPU the state already lives in host RAM.
        log.warning("paged-adamw-8bit: paging needs CUDA; on %s it runs as plain 8-bit AdamW", device.type)
        return bnb.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    return bnb.PagedAdamW8bit(params, lr=lr, weight_decay=weight_decay)


def _factored_states(params: TrainedParams) -> int:
    """Adafactor: a row and a column second-moment factor per matrix, whole states for the rest, in fp32."""
    return (sum(rows + cols for rows, cols in params.matrices) + params.unfactored) * 4


ADAMW = OptimizerEntry(
    "adamw", lambda params, lr, wd, backend, device: torch.optim.AdamW(params, lr=lr, weight_decay=wd),
    state_bytes_per_value=lambda size: 2.0 * size, foreach_scratch=True, deepspeed_client=True, searched=True)
ADAMW_8BIT = OptimizerEntry(
    "adamw-8bit", _adamw_8bit, state_bytes_per_value=lambda size: 2.0 + 8 / _BLOCK, on_dtensor=False,
    backends=("bitsandbytes", "torchao"), searched=True, gives_up="8-bit Adam states")
PAGED_ADAMW_8BIT = OptimizerEntry(
    "paged-adamw-8bit", _paged_adamw_8bit, state_bytes_per_value=lambda size: 2.0 + 8 / _BLOCK, on_dtensor=False,
    searched=True, paged=True, gives_up="8-bit Adam states (paged)")
ADAFACTOR = OptimizerEntry(
    "adafactor", lambda params, lr, wd, backend, device: torch.optim.Adafactor(params, lr=lr, weight_decay=wd),
    # the factored states are a few values per row and column: next to nothing for the step to stream
    state_bytes_per_value=lambda size: 0.0, state_bytes=_factored_states, foreach_scratch=True, searched=True,
    lean=True, gives_up="Adafactor (factored second moment, no momentum)")
LION = OptimizerEntry(
    "lion", lambda params, lr, wd, backend, device: _bnb("optim.name: lion").Lion(params, lr=lr, weight_decay=wd),
    state_bytes_per_value=lambda size: 1.0 * size, gives_up="Lion sign updates (needs a smaller lr)")
LION_8BIT = OptimizerEntry(
    "lion-8bit",
    lambda params, lr, wd, backend, device: _bnb("optim.name: lion-8bit").Lion8bit(params, lr=lr, weight_decay=wd),
    state_bytes_per_value=lambda size: 1.0 + 4 / _BLOCK, on_dtensor=False, searched=True, lean=True,
    gives_up="8-bit Lion sign updates")
SGD = OptimizerEntry(
    "sgd", lambda params, lr, wd, backend, device: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd),
    state_bytes_per_value=lambda size: 1.0 * size, foreach_scratch=True, deepspeed_client=True,
    gives_up="plain SGD with momentum")

# The table: the order of the config's choices, of `memfit plan --optimizer` and of the search.
OPTIMIZER_ENTRIES = (ADAMW, ADAMW_8BIT, PAGED_ADAMW_8BIT, ADAFACTOR, LION, LION_8BIT, SGD)
OPTIMIZERS, optimizer_entry = entry_lookup(OPTIMIZER_ENTRIES, "optim.name")


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                    backend: str = "auto", device: torch.device = torch.device("cpu")) -> torch.optim.Optimizer:
    entry = optimizer_entry(name)
    if problem := _backend_mismatch(name, backend):
        raise MemfitError(problem)
    params = [p for p in params if p.requires_grad]
    if not params:
        raise MemfitError("no trainable parameters: nothing for the optimizer to update")
    return entry.build(params, lr, weight_decay, backend, device)


def _backend_mismatch(name: str, backend: str) -> str | None:
    """The one check both config validation and direct callers of build_optimizer go through."""
    if backend == "torchao" and "torchao" not in optimizer_entry(name).backends:
        offered = [entry.name for entry in OPTIMIZER_ENTRIES if "torchao" in entry.backends]
        return f"optim.backend: torchao only provides {', '.join(offered)} here, not {name}"
    return None


def optimizer_problems(name: str, backend: str, track_memory: bool) -> list[str]:
    """Combinations no optimizer backend can run, for the config's list of problems."""
    if problem := _backend_mismatch(name, backend):
        return [problem]
    if backend == "torchao" and track_memory:
        # torchao's step is torch.compile(fullgraph=True); compiled frames never run under a dispatch
        # mode such as the tracker (dynamo skips them, then refuses for the rest of the process).
        return ["optim.backend: torchao's compiled 8-bit step cannot run under memfit's memory tracker; "
                "set logging.track_memory: false, or use optim.backend: bitsandbytes (or auto)"]
    return []
