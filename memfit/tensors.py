"""The storages behind a tensor: what memory a tensor really holds, subclasses included."""

from __future__ import annotations

from typing import Iterator

import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass


def storages(tensor: torch.Tensor) -> Iterator[torch.UntypedStorage]:
    """The storages behind a tensor; wrapper subclasses (NF4, 8-bit states) are flattened."""
    if is_traceable_wrapper_subclass(tensor):
        names, _ = tensor.__tensor_flatten__()
        for name in names:
            inner = getattr(tensor, name)
            if isinstance(inner, torch.Tensor):  # DTensor also flattens its (tensor-less) device_mesh
                yield from storages(inner)
        return
    if tensor.layout != torch.strided:
        return
    try:
        yield tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # e.g. functional tensors without storage
        return
