"""Module helpers every engine shares: the decoder blocks to shard, placing a (meta) model."""

from __future__ import annotations

import torch

from memfit.errors import MemfitError


def decoder_blocks(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The transformer blocks (HF `_no_split_modules` classes), also inside a PEFT wrapper."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    names = set(getattr(base, "_no_split_modules", None) or [])
    blocks = [m for m in model.modules() if type(m).__name__ in names]
    if not blocks:
        raise MemfitError(f"distributed.sharding: found no transformer blocks in {type(base).__name__} "
                          "(it declares no _no_split_modules); FSDP2 needs them to shard block by block")
    return blocks


def place(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """Move to the device; a model built on `meta` gets (uninitialised) storage there instead."""
    if any(p.is_meta for p in model.parameters()):
        model = model.to_empty(device=device)
        if hasattr(model, "tie_weights"):  # to_empty gives every parameter its own tensor: re-tie
            model.tie_weights()
        return model
    return model.to(device)
