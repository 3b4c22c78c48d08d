"""Wrap a model and its optimizer for the chosen data-parallel engine.

  none    unchanged (single process): model moved to the device, optimizer built as usual
  ddp     DistributedDataParallel: full replica per rank, gradients all-reduced (averaged)
  zero1   DDP + ZeroRedundancyOptimizer: each rank keeps the optimizer states of 1/N of the
          parameters and broadcasts its updated parameters after the step
  zero2   FSDP2 `fully_shard(reshard_after_forward=False)`: parameters, gradients and states
          are sharded at rest; parameters gathered in the forward stay unsharded until the
          backward has used them (no second all-gather), gradients are reduce-scattered
  zero3   FSDP2 `fully_shard(reshard_after_forward=True)`: parameters re-sharded after each
          block's forward and gathered again for its backward
  offload (zero2/zero3) FSDP2 CPUOffloadPolicy: sharded parameters, gradients and the
          optimizer step live on the CPU; only the block being computed is on the device

FSDP2 wraps each decoder block, then the root (embeddings, final norm, lm_head), so at most
one block (two with prefetch) is unsharded at a time.

2-D mesh (tensor_parallel K with zero2/zero3): `init_device_mesh(..., (N / K, K), mesh_dim_names=
("dp", "tp"))`; tensor parallel splits each block over "tp" (memfit/distributed/tensor_parallel.py),
then FSDP2 shards those DTensors over "dp" as above. Each group of K ranks trains on one data slice.

Loading (zero2/zero3, tensor and pipeline parallel): every rank builds the model on `meta`, places
its own part and reads it from the checkpoint (memfit/models/part_loading.py), so no rank ever holds
a full copy. DeepSpeed ZeRO-3 converts rank 0's model (memfit/distributed/deepspeed_engine.py).
"""

from __future__ import annotations

import inspect
from typing import Callable

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard
from torch.distributed.fsdp._fully_shard import _fsdp_param, _fsdp_param_group
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

from memfit.build import trainable
from memfit.distributed.deepspeed_engine import loads_from_rank0
from memfit.distributed.launch import DistContext
from memfit.distributed.modules import decoder_blocks, place
from memfit.distributed.pipeline import build_pipeline
from memfit.distributed.tensor_parallel import apply_tensor_parallel, parallelize
from memfit.models.load_plan import hands_out_parts
from memfit.models.part_loading import PartSource, fill_parts, part_source
from memfit.strategies.engines import offload_entry, sharding_entry
from memfit.strategies.precision import precision_entry


def loads_parts(cfg, ctx: DistContext) -> bool:
    """Every rank builds the model on `meta` and reads only the part it keeps (FSDP2, tensor and pipeline
    parallel: memfit/models/load_plan.py)."""
    return ctx.enabled and hands_out_parts(cfg)


def builds_on_meta(cfg, ctx: DistContext) -> bool:
    """Ranks that read their part, and those DeepSpeed ZeRO-3 gives rank 0's partitions, build on `meta`."""
    return loads_parts(cfg, ctx) or (ctx.enabled and ctx.rank != 0 and loads_from_rank0(cfg, ctx))


def shard(model: torch.nn.Module, optimizer_factory: Callable[[list], torch.optim.Optimizer], cfg,
          ctx: DistContext, device: torch.device) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    """`model, optimizer = shard(model, optimizer_factory, cfg, ctx, device)`; unchanged when off."""
    if not ctx.enabled:
        model = place(model, device)
        return model, optimizer_factory(trainable(model))
    engine = sharding_entry(cfg.distributed.sharding)
    weight_dtype = precision_entry(cfg.precision).weight_dtype
    source = part_source(cfg.model, cfg.seed, weight_dtype) if loads_parts(cfg, ctx) else None
    if cfg.distributed.tensor_parallel > 1 and not engine.fsdp2:
        model = apply_tensor_parallel(model, cfg.distributed.tensor_parallel, device, source)
        return model, optimizer_factory(trainable(model))
    if cfg.distributed.pipeline_parallel > 1:
        model = build_pipeline(model, cfg, ctx, device, source)
        return model, optimizer_factory(trainable(model))
    if engine.fsdp2:  # with tensor_parallel > 1: a 2-D mesh
        model = _fully_shard(model, cfg, ctx, device, source)
        return model, optimizer_factory(trainable(model))
    return _ddp(model, optimizer_factory, engine, device)


def _ddp(model, optimizer_factory, engine, device):
    model = place(model, device)
    # Gradients as views into DDP's all-reduce buckets: no second copy of every gradient.
    wrapped = DDP(model, device_ids=[device.index] if device.type == "cuda" else None,
                  gradient_as_bucket_view=True)
    optimizer = optimizer_factory(trainable(model))
    if engine.shards("optimizer_states"):  # ZeRO-1
        optimizer = _zero_redundancy(optimizer, trainable(model))
    return wrapped, optimizer


def _zero_redundancy(template: torch.optim.Optimizer, params: list) -> torch.optim.Optimizer:
    """ZeroRedundancyOptimizer around the same optimizer class and settings as `template`."""
    # Imported here: torch.distributed.optim takes 0.3-0.4 s to import, which runs without
    # zero1 should not pay.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    cls = type(template)
    accepted = inspect.signature(cls.__init__).parameters
    settings = {k: v for k, v in template.defaults.items() if k in accepted}
    del template  # its (still empty) states are never used
    optimizer = ZeroRedundancyOptimizer(params, optimizer_class=cls, **settings)
    # The local shard's states live in `.optim.state`; alias them so memory tracking and
    # inspection find them where every other optimizer keeps them.
    optimizer.state = optimizer.optim.state
    return optimizer


def _fully_shard(model, cfg, ctx: DistContext, device: torch.device, source: PartSource):
    """Shard the (meta) model's blocks, then its root, and fill this rank's shards from `source`."""
    follow_fsdp_storage()
    mesh = _data_parallel_mesh(model, cfg, ctx, device)
    offload = offload_entry(cfg.distributed.offload).host_states
    # pin_memory needs an accelerator; on a CPU-only machine the offload target is where the shards already are.
    policy = CPUOffloadPolicy(pin_memory=device.type == "cuda") if offload else OffloadPolicy()
    reshard = sharding_entry(cfg.distributed.sharding).reshard_after_forward
    for block in decoder_blocks(model):
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard, offload_policy=policy)
    model.to_empty(device="cpu" if offload else device)
    if offload:  # buffers are not sharded or offloaded: they belong with the compute
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    module._buffers[key] = buffer.to(device)
    fill_parts(model, source)
    return model


def _data_parallel_mesh(model, cfg, ctx: DistContext, device: torch.device):
    """The mesh FSDP2 shards over: every rank, or the "dp" dimension of a 2-D mesh, after tensor
    parallel has split the (meta) model over its "tp" dimension (torchtitan's order: TP, then FSDP2).
    Rank r sits at (r // K, r % K), as launch.data_parallel_position assumes when it picks the data."""
    tp = cfg.distributed.tensor_parallel
    if tp == 1:
        return init_device_mesh(device.type, (ctx.world_size,))
    mesh = init_device_mesh(device.type, (ctx.dp_size, tp), mesh_dim_names=("dp", "tp"))
    parallelize(model, mesh["tp"])
    return mesh["dp"]


def initial_device(cfg, ctx: DistContext, device: torch.device) -> torch.device | None:
    """Where the built model goes before sharding: ranks that read their part keep it on `meta` and place
    only that part (DeepSpeed ZeRO-3 moves rank 0's partitions one module at a time); everything else
    moves to the device now."""
    return None if loads_parts(cfg, ctx) or (ctx.enabled and loads_from_rank0(cfg, ctx)) else device


def follow_fsdp_storage() -> None:
    """Let memfit's MemoryTracker see FSDP2 free and re-allocate unsharded parameters.

    FSDP2 (torch 2.13: fsdp/_fully_shard/_fsdp_param.py) releases a block's gathered parameters
    with `storage.resize_(0)` and re-grows them with `storage.resize_(n)`: storage methods that
    no TorchDispatchMode sees, so a tracker would count them as alive for the whole step.
    This wraps those two helpers (once per process) to tell every active tracker the new size.
    """
    if getattr(_fsdp_param.free_storage, "_memfit", False):
        return

    def notify(tensor: torch.Tensor) -> None:
        for mode in _get_current_dispatch_mode_stack():
            if hasattr(mode, "resized"):
                mode.resized(tensor.untyped_storage())

    def wrap(original):
        def resize(tensor: torch.Tensor) -> None:
            original(tensor)
            notify(tensor)

        resize._memfit = True
        return resize

    _fsdp_param.free_storage = wrap(_fsdp_param.free_storage)
    _fsdp_param.alloc_storage = wrap(_fsdp_param.alloc_storage)
    if hasattr(_fsdp_param_group, "alloc_storage"):
        _fsdp_param_group.alloc_storage = _fsdp_param.alloc_storage
