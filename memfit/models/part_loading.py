"""Each process loads only the part of the model it keeps, straight from the checkpoint's files.

Engines that give each rank a part of the model (FSDP2's row shards, tensor-parallel slices, pipeline
stages, 2-D meshes of them) build it on `meta` on every rank, place their part on the device with
uninitialised storage, then `fill_parts` writes each parameter's and buffer's local part, one tensor
at a time:

  in the checkpoint      read through safetensors' slice reads: only the rows / columns this rank keeps
                         (sharded safetensors with an index, or one file), converted to the local dtype.
                         A torchao NF4 base weight is read whole and quantized, then this rank's rows kept:
                         NF4's second-level scale is the mean over the whole tensor, and every rank's
                         rows must be dequantized with the same one (as a one-process load quantizes).
  not in the checkpoint  random init (`model.init: random`), rotary tables and other buffers the
                         checkpoint leaves out, tensors `model.new_weights` allows to be missing: made by
                         the model's own `_init_weights` on a host copy of the one module that owns them,
                         with a seed made of the run's seed and the module's name, so that the values do
                         not depend on how many ranks share them
  LoRA adapters          peft's default init (A Kaiming-uniform, B zeros), seeded by name as above; DoRA's
                         magnitude from this rank's rows of the (dequantized) base weight, as peft does

A rank holds its part plus one tensor in flight (the largest: one full tensor for an NF4 base or a
strided shard, a slice otherwise). Names: the filled model's names less the wrappers peft and
activation checkpointing add (`base_model.model.`, `.base_layer`, ...) are the Hugging Face model's,
which are the checkpoint's, or a tied weight's source. Checkpoints whose names transformers converts
while loading (per-expert MoE tensors fused into one) are refused with the engines that load parts.
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path
from typing import Callable

import torch
from safetensors import safe_open
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset
from transformers import AutoModelForCausalLM

from memfit.errors import MemfitError
from memfit.models.loading import (check_weights, initialise_module, load_model_config, name_seed,
                                   parameters_on_meta, weights_folder)
from memfit.models.weights_check import check_loading_info
from memfit.strategies.quantization import is_nf4, quantize_nf4_rows

_WRAPPERS = re.compile(r"(^base_model\.model\.)|(\.base_layer(?=\.))|(\._checkpoint_wrapped_module(?=\.))|"
                       r"(\.modules_to_save\.default(?=\.))|(\.original_module(?=\.))")
_LORA = re.compile(r"\.lora_(A|B|magnitude_vector|embedding_A|embedding_B)\.")


class PartLoadError(MemfitError):
    """The checkpoint cannot be read a part at a time into this model."""


def hf_name(name: str) -> str:
    """The Hugging Face model's name for a parameter or buffer of the (wrapped) model being filled."""
    return _WRAPPERS.sub("", name)


class Checkpoint:
    """The tensors of a local checkpoint folder (safetensors: one file, or several with an index),
    read one slice at a time."""

    def __init__(self, folder: Path):
        self.folder = folder
        index = folder / "model.safetensors.index.json"
        if index.exists():
            files = {key: folder / name for key, name in json.loads(index.read_text())["weight_map"].items()}
        elif (folder / "model.safetensors").exists():
            files = None
        else:
            raise PartLoadError(f"{folder}: no safetensors weights (model.safetensors or an index); loading a part "
                                "per rank reads safetensors only: save the model with safe_serialization")
        self._open = {}
        if files is None:
            with safe_open(folder / "model.safetensors", framework="pt") as handle:
                files = {key: folder / "model.safetensors" for key in handle.keys()}
        self.files = files

    def _handle(self, key: str):
        path = self.files[key]
        if path not in self._open:
            self._open[path] = safe_open(path, framework="pt")
        return self._open[path]

    def shape(self, key: str) -> tuple[int, ...]:
        return tuple(self._handle(key).get_slice(key).get_shape())

    def read(self, key: str, region: tuple[slice, ...] | None = None) -> torch.Tensor:
        part = self._handle(key).get_slice(key)
        if region is not None:
            return part[region]
        return part[:] if part.get_shape() else part[()]


class PartSource:
    """Where every tensor of one run's model comes from (see the module docstring)."""

    def __init__(self, template: nn.Module, checkpoint: Checkpoint | None, seed: int, where: str,
                 new_weights=(), dropped_weights=()):
        self.template, self.checkpoint, self.seed = template, checkpoint, seed
        self.tied = dict(getattr(template, "all_tied_weights_keys", None) or {})
        if checkpoint is not None:
            self._check(where, new_weights, dropped_weights)

    def _key(self, name: str) -> str | None:
        """The checkpoint's key for a Hugging Face name (the tied source for a tied weight)."""
        keys = self.checkpoint.files
        prefix = getattr(self.template, "base_model_prefix", "") + "."
        for key in (name, self.tied.get(name)):
            if key is None:
                continue
            if key in keys:
                return key
            if key.startswith(prefix) and key[len(prefix):] in keys:  # checkpoints saved without the prefix
                return key[len(prefix):]
        return None

    def _check(self, where: str, new_weights, dropped_weights) -> None:
        """The same rules as a whole-model load (memfit/models/weights_check.py), before anything is read."""
        expected = self.template.state_dict(keep_vars=True)
        found = {name: self._key(name) for name in expected}
        missing = [name for name, key in found.items() if key is None]
        used = set(found.values())
        ignored = [re.compile(p) for p in getattr(self.template, "_keys_to_ignore_on_load_unexpected", None) or ()]
        unexpected = [key for key in self.checkpoint.files
                      if key not in used and not any(p.search(key) for p in ignored)]
        mismatched = [(name, self.checkpoint.shape(key), tuple(expected[name].shape)) for name, key in found.items()
                      if key is not None and self.checkpoint.shape(key) != tuple(expected[name].shape)]
        fix = ("Loading a part per rank reads the checkpoint's tensors by the model's own names; a checkpoint "
               "whose names transformers converts while loading (e.g. per-expert MoE tensors) needs "
               "distributed.sharding: ddp")
        check_loading_info(self.template, {"missing_keys": missing, "unexpected_keys": unexpected,
                                           "mismatched_keys": mismatched}, where, new_weights, dropped_weights,
                           fix=fix if unexpected and missing else None)

    def full(self, name: str) -> torch.Tensor:
        """The whole tensor `name` (a Hugging Face name): the checkpoint's, or initialised."""
        return self.region(name, None)

    def region(self, name: str, region: tuple[slice, ...] | None) -> torch.Tensor:
        """The part `region` (None: all) of the tensor `name`, reading only that part from the checkpoint; a
        tensor the checkpoint lacks, or holds with another shape (`model.new_weights`), is initialised."""
        key = self._key(name) if self.checkpoint is not None else None
        if key is not None and self.checkpoint.shape(key) == tuple(self._template_tensor(name).shape):
            return self.checkpoint.read(key, region)
        whole = self._initialised(name)
        return whole if region is None else whole[region]

    def _template_tensor(self, name: str) -> torch.Tensor:
        owner, _, leaf = name.rpartition(".")
        return getattr(self.template.get_submodule(owner), leaf)

    def _initialised(self, name: str) -> torch.Tensor:
        """A buffer as the model builds it; a parameter as `random_model` makes it (the template's own init
        of the module owning it, seeded by the module's name; a tied weight: its source's)."""
        owner_name, _, leaf = self.tied.get(name, name).rpartition(".")
        owner = self.template.get_submodule(owner_name)
        if leaf in owner._buffers:
            return owner._buffers[leaf]
        initialise_module(self.template, owner_name, self.seed)
        value = owner._parameters[leaf].detach()
        for key, param in owner._parameters.items():  # back to no bytes
            if param is not None:
                owner._parameters[key] = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        return value


def lora_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """peft's default init of a LoRA matrix (reset_lora_parameters, init_lora_weights=True), seeded by name."""
    if ".lora_B." in name or ".lora_embedding_A." in name:
        return torch.zeros(shape)
    tensor, generator = torch.empty(shape), torch.Generator().manual_seed(name_seed(seed, name))
    if ".lora_embedding_B." in name:
        return nn.init.normal_(tensor, generator=generator)
    return nn.init.kaiming_uniform_(tensor, a=math.sqrt(5), generator=generator)


def local_region(tensor: torch.Tensor) -> tuple[torch.Tensor, tuple[slice, ...] | None]:
    """This rank's storage of `tensor` and the region of the whole tensor it holds (None: a region that is
    not one block of the whole, e.g. a strided shard of a 2-D mesh)."""
    if not isinstance(tensor, DTensor):
        return tensor, tuple(slice(0, n) for n in tensor.shape)
    local = tensor._local_tensor
    if not all(type(p) in (Shard, Replicate) for p in tensor.placements):
        return local, None
    shape, offset = compute_local_shape_and_global_offset(tensor.shape, tensor.device_mesh, tensor.placements)
    return local, tuple(slice(o, o + n) for o, n in zip(offset, shape))


def fill_parts(model: nn.Module, source: PartSource, names: Callable[[str], str] = hf_name) -> None:
    """Write every parameter and buffer of `model` (placed, with uninitialised storage) from `source`:
    each rank's local part only. `names` maps the model's names to the Hugging Face model's."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    magnitudes = []
    with torch.no_grad():
        for name, tensor in tensors.items():
            if ".lora_magnitude_vector." in name:
                magnitudes.append(name)
                continue
            local, region = local_region(tensor)
            if _LORA.search(name):
                whole = lora_init(name, tuple(tensor.shape), source.seed)
                _copy(local, tensor, whole, region)
            elif is_nf4(local):  # FSDP2 shards dim 0: quantize the whole weight as one process does, keep the rows
                rows = region[0] if region else slice(0, tensor.shape[0])
                quantize_nf4_rows(local, source.full(names(name)), rows)
            elif region is None:
                _copy(local, tensor, source.full(names(name)), None)
            else:
                local.copy_(source.region(names(name), region))
        for name in magnitudes:  # DoRA: the norm of each row of the base weight (B is zero at the start)
            layer = model.get_submodule(name.split(".lora_magnitude_vector.")[0])
            local, _ = local_region(tensors[name])
            base, _ = local_region(layer.get_base_layer().weight)
            local.copy_((base.get_original_weight() if is_nf4(base) else base).float().norm(dim=1))


def _copy(local: torch.Tensor, tensor: torch.Tensor, whole: torch.Tensor, region) -> None:
    if region is not None:
        local.copy_(whole[region])
    elif isinstance(tensor, DTensor):  # each rank cuts its own part from the whole, no communication
        local.copy_(distribute_tensor(whole.to(local.dtype), tensor.device_mesh, tensor.placements,
                                      src_data_rank=None)._local_tensor)
    else:
        local.copy_(whole)


def part_source(spec, seed: int, dtype: torch.dtype) -> PartSource:
    """The source of every tensor of the model `spec` (cfg.model) describes, built in `dtype` (the precision's
    weight dtype), for a run seeded with `seed` (cfg.seed)."""
    config, _ = load_model_config(spec)
    if spec.init == "pretrained":
        check_weights(spec)
    with parameters_on_meta():
        template = AutoModelForCausalLM.from_config(config, dtype=dtype, trust_remote_code=spec.trust_remote_code)
    folder = weights_folder(spec)
    return PartSource(template, Checkpoint(folder) if folder is not None else None, seed,
                      where=f"model.name: {folder}", new_weights=spec.new_weights,
                      dropped_weights=spec.dropped_weights)
