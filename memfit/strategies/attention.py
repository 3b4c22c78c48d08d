"""Attention kernel choice: eager, SDPA (default) or FlashAttention-2.

SDPA dispatches to flash / memory-efficient kernels on CUDA by itself, so attention memory
is linear in sequence length there; `eager` materialises the [batch, heads, seq, seq] scores.
"""

from __future__ import annotations

import importlib.util

from memfit.errors import MissingPackageError

TRANSFORMERS_NAMES = {"eager": "eager", "sdpa": "sdpa", "flash": "flash_attention_2"}


def attention_implementation(attention: str) -> str:
    """memfit's attention name -> transformers' `attn_implementation`, checking the package."""
    if attention == "flash" and importlib.util.find_spec("flash_attn") is None:
        raise MissingPackageError("attention: flash needs the flash-attn package (CUDA only): "
                                  "pip install flash-attn --no-build-isolation; or use attention: sdpa")
    return TRANSFORMERS_NAMES[attention]
