"""Optimizers, by how many bytes of state they keep per trainable parameter (fp32 weights):

  adamw             8  (momentum + variance, in the weights' dtype)
  adamw-8bit        2  (+ small per-block scales); bitsandbytes, or torchao as the other backend
  paged-adamw-8bit  2  bitsandbytes, state in CUDA unified memory that pages to CPU under pressure
  lion              4  (momentum only)      lion-8bit  1 (+ scales)
  adafactor         ~0 (factored second moment: rows + columns per matrix, no momentum)
  sgd               4  (momentum 0.9)
"""

from __future__ import annotations

import logging
from typing import Iterable

import torch

from memfit.errors import MemfitError, require

log = logging.getLogger(__name__)

BACKENDS_8BIT = ("bitsandbytes", "torchao")


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
    raise MemfitError(f"optim.backend: '{backend}' cannot run adamw-8bit; supported: {', '.join(BACKENDS_8BIT)}")


def _paged_adamw_8bit(params, lr, weight_decay, backend, device):
    bnb = _bnb("optim.name: paged-adamw-8bit")
    if device.type != "cuda":
        # Paging needs CUDA unified memory; on CPU the state already lives in host RAM.
        log.warning("paged-adamw-8bit: paging needs CUDA; on %s it runs as plain 8-bit AdamW", device.type)
        return bnb.AdamW8bit(params, lr=lr, weight_decay=weight_decay)
    return bnb.PagedAdamW8bit(params, lr=lr, weight_decay=weight_decay)


_FACTORIES = {
    "adamw": lambda params, lr, wd, backend, device: torch.optim.AdamW(params, lr=lr, weight_decay=wd),
    "sgd": lambda params, lr, wd, backend, device: torch.optim.SGD(params, lr=lr, momentum=0.9, weight_decay=wd),
    "adafactor": lambda params, lr, wd, backend, device: torch.optim.Adafactor(params, lr=lr, weight_decay=wd),
    "lion": lambda params, lr, wd, backend, device: _bnb("optim.name: lion").Lion(params, lr=lr, weight_decay=wd),
    "lion-8bit": lambda params, lr, wd, backend, device: _bnb("optim.name: lion-8bit").Lion8bit(params, lr=lr, weight_decay=wd),
    "adamw-8bit": _adamw_8bit,
    "paged-adamw-8bit": _paged_adamw_8bit,
}
OPTIMIZERS = tuple(_FACTORIES)


def build_optimizer(name: str, params: Iterable[torch.nn.Parameter], lr: float, weight_decay: float = 0.0,
                    backend: str = "auto", device: torch.device = torch.device("cpu")) -> torch.optim.Optimizer:
    if name not in _FACTORIES:
        raise MemfitError(f"optim.name: unknown '{name}'; allowed: {', '.join(OPTIMIZERS)}")
    if problem := _backend_mismatch(name, backend):
        raise MemfitError(problem)
    params = [p for p in params if p.requires_grad]
    if not params:
        raise MemfitError("no trainable parameters: nothing for the optimizer to update")
    return _FACTORIES[name](params, lr, weight_decay, backend, device)


def _backend_mismatch(name: str, backend: str) -> str | None:
    """The one check both config validation and direct callers of build_optimizer go through."""
    if backend == "torchao" and name != "adamw-8bit":
        return f"optim.backend: torchao only provides adamw-8bit here, not {name}"
    return None


def optimizer_problems(cfg) -> list[str]:
    """Config combinations no optimizer backend can run, for build_config's list of problems."""
    if problem := _backend_mismatch(cfg.optim.name, cfg.optim.backend):
        return [problem]
    if cfg.optim.backend == "torchao" and cfg.logging.track_memory:
        # torchao's step is torch.compile(fullgraph=True); compiled frames never run under a dispatch
        # mode such as the tracker (dynamo skips them, then refuses for the rest of the process).
        return ["optim.backend: torchao's compiled 8-bit step cannot run under memfit's memory tracker; "
                "set logging.track_memory: false, or use optim.backend: bitsandbytes (or auto)"]
    return []

