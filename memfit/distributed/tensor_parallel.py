"""Tensor parallel for Llama-family blocks with DTensor (`parallelize_module`), Megatron-style.

In each decoder block, q/k/v and gate/up projections are split by output features
(ColwiseParallel) and o/down projections by input features (RowwiseParallel), so each rank
computes num_heads / K heads and intermediate_size / K MLP features, and one all-reduce per
attention and per MLP restores the full hidden state. Embeddings, norms and lm_head stay
replicated (identical on every rank). Hugging Face's attention infers the local head count
from the projection's output shape, so the block code runs unchanged on its shard.

Loading without a full model on every rank: ranks other than 0 build the model on `meta` (no
bytes; `sharding.builds_on_meta`); rank 0 builds or loads it once. Every rank then applies the
plan to the weightless module (parallelize_module on `meta` only records the placements), and
`load_from_rank0` walks the parameters in the same order on every rank: rank 0 scatters each
full tensor's shards (broadcasts the replicas) through the mesh's process group, as
`distribute_tensor(..., src_data_rank=0)` does but straight into each rank's local tensor, and
drops its reference at once. So rank 0 peaks at about one full copy and the others at their
shards (measured: docs/distributed.md). Buffers that `state_dict` leaves out (rotary
`inv_freq`) are broadcast too. The ranks start with exactly rank 0's weights, i.e. a
single-process run's random init.

On a 2-D mesh (with zero2/zero3, memfit/distributed/sharding.py) `parallelize` applies the same plan
over the mesh's "tp" dimension, FSDP2 then shards the resulting DTensors over "dp", and the weights
arrive through FSDP2's loading instead of `load_from_rank0`.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from memfit.distributed.modules import decoder_blocks

ATTENTION_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                  "self_attn.o_proj": "rowwise"}
MLP_PLAN = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def block_plan() -> dict:
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {name: styles[style]() for name, style in {**ATTENTION_PLAN, **MLP_PLAN}.items()}


def apply_tensor_parallel(model: torch.nn.Module, degree: int, device: torch.device) -> torch.nn.Module:
    """Shard `model` (real on rank 0, on `meta` or real elsewhere) and give every rank its part of rank 0's weights."""
    # Rank 0's full tensors, by name, held here only; the module itself becomes shapes like the others'.
    full = _named_tensors(model) if dist.get_rank() == 0 else {}
    model = model.to("meta")
    if hasattr(model, "tie_weights"):  # moving to meta unties shared weights (embeddings/lm_head): tie again
        model.tie_weights()
    mesh = init_device_mesh(device.type, (degree,))
    parallelize(model, mesh)
    load_from_rank0(model, full, mesh, device)
    return model


def parallelize(model: torch.nn.Module, mesh) -> None:
    """Apply the block plan over the 1-D `mesh` (all ranks, or a 2-D mesh's "tp" dimension), and make
    every other parameter a replicated DTensor on it. Moves no weights: on `meta` it records placements."""
    for block in decoder_blocks(model):
        parallelize_module(block, mesh, block_plan())
    _replicate_rest(model, mesh)


def _named_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Every parameter and buffer (persistent or not) by dotted name; shared ones under each name."""
    tensors = dict(model.named_parameters(remove_duplicate=False))
    tensors.update(model.named_buffers(remove_duplicate=False))
    return {name: tensor.detach() for name, tensor in tensors.items()}


def load_from_rank0(model: torch.nn.Module, full: dict[str, torch.Tensor], mesh, device: torch.device) -> None:
    """Replace every (meta) parameter and buffer of `model` with this rank's part of rank 0's tensor.

    `full` (rank 0 only; empty elsewhere) is consumed as it goes, so each full tensor is freed
    once its shards are sent. Tensors shared by several modules (tied embeddings) are sent once
    and assigned to every owner, so they stay one Parameter.
    """
    group = mesh.get_group()
    done: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}  # id(meta tensor) -> (it, kept alive; its replacement)
    for module_name, module in model.named_modules():
        for table in (module._parameters, module._buffers):
            for key, old in list(table.items()):
                if old is None:
                    continue
                name = f"{module_name}.{key}" if module_name else key
                source = full.pop(name, None)
                if id(old) not in done:
                    if isinstance(old, DTensor):
                        tensor = _distribute(source, old, mesh, device)
                    else:  # a plain buffer: the same on every rank
                        tensor = _receive_full(source, old, device)
                        dist.broadcast(tensor, src=dist.get_global_rank(group, 0), group=group)
                    if isinstance(old, torch.nn.Parameter):
                        tensor = torch.nn.Parameter(tensor, requires_grad=old.requires_grad)
                    done[id(old)] = (old, tensor)
                del source  # rank 0: the last reference to this full tensor (unless another name shares it)
                table[key] = done[id(old)][1]
    full.clear()  # names under a module reached twice (none in Llama) are not left holding full tensors


def _receive_full(source: torch.Tensor | None, like: torch.Tensor, device: torch.device) -> torch.Tensor:
    """Rank 0: its full tensor on the device; elsewhere: uninitialised storage of the full shape."""
    if source is not None:
        return source.to(device).contiguous()
    return torch.empty(like.shape, dtype=like.dtype, device=device)


def _distribute(source: torch.Tensor | None, like, mesh, device: torch.device):
    """This rank's DTensor of rank 0's `source`, placed like the (meta) DTensor `like`.

    The block plan only ever needs Shard(d) (split evenly: heads and MLP width are checked
    divisible) or Replicate on the 1-D mesh: one `scatter` or `broadcast` straight into the local
    tensor, so a receiving rank allocates only what it keeps (`distribute_tensor` would also
    allocate the full tensor and its chunks on every rank: measured 0.74x instead of 0.50x of the
    blocks on rank 1, docs/distributed.md). Any other placement goes through `distribute_tensor`.
    """
    group, ranks = mesh.get_group(), mesh.size()
    src = dist.get_global_rank(group, 0)
    placement = like.placements[0] if len(like.placements) == 1 else None
    if type(placement) is Shard and like.shape[placement.dim] % ranks == 0:
        shape = list(like.shape)
        shape[placement.dim] //= ranks
        local = torch.empty(shape, dtype=like.dtype, device=device)
        chunks = None
        if source is not None:  # rank 0: the pieces in rank order (views of rows, copies of columns)
            chunks = [c.contiguous() for c in source.to(device).chunk(ranks, dim=placement.dim)]
        dist.scatter(local, chunks, src=src, group=group)
    elif type(placement) is Replicate:
        local = _receive_full(source, like, device)
        dist.broadcast(local, src=src, group=group)
    else:
        return distribute_tensor(_receive_full(source, like, device), mesh, like.placements, src_data_rank=0)
    return DTensor.from_local(local, mesh, like.placements, run_check=False, shape=like.shape, stride=like.stride())


def _replicate_rest(model: torch.nn.Module, mesh) -> None:
    """Make the remaining parameters (embeddings, norms, lm_head) replicated DTensors.

    Gradient clipping and the foreach optimizers cannot mix DTensor and plain tensors, so every
    module that owns plain parameters gets them as Replicate DTensors, with its inputs turned
    into Replicate DTensors and its outputs back into local tensors (no communication: every
    rank already holds the same values).
    """
    def inputs_to_dtensor(module, inputs, device_mesh):
        return tuple(DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
                     if isinstance(x, torch.Tensor) and not isinstance(x, DTensor) else x for x in inputs)

    def output_to_local(module, output, device_mesh):
        return output.to_local() if isinstance(output, DTensor) else output

    for module in list(model.modules()):
        own = list(module.parameters(recurse=False))
        if own and not any(isinstance(p, DTensor) for p in own):
            distribute_module(module, mesh, input_fn=inputs_to_dtensor, output_fn=output_to_local)
    if hasattr(model, "tie_weights"):  # distributing replaced shared parameters one module at a time
        model.tie_weights()


def sharded_fraction(name: str) -> bool:
    """Whether a parameter (by its name) is split across the tensor-parallel ranks."""
    return any(f"{module}." in name for module in {**ATTENTION_PLAN, **MLP_PLAN})
