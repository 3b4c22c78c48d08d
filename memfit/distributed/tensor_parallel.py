"""Tensor parallel for Llama-family blocks with DTensor (`parallelize_module`), Megatron-style.

In each decoder block, q/k/v and gate/up projections are split by output features
(ColwiseParallel) and o/down projections by input features (RowwiseParallel), so each rank
computes num_heads / K heads and intermediate_size / K MLP features, and one all-reduce per
attention and per MLP restores the full hidden state. Embeddings, norms and lm_head stay
replicated (identical on every rank). Hugging Face's attention infers the local head count
from the projection's output shape, so the block code runs unchanged on its shard.

Loading: every rank builds the model on `meta`, applies the plan to the weightless module
(parallelize_module on `meta` only records the placements), allocates its shards and reads them from
the checkpoint (memfit/models/part_loading.py): no rank holds more than its part and one tensor in
flight. On a 2-D mesh (with zero2/zero3, memfit/distributed/sharding.py) `parallelize` applies the
same plan over the mesh's "tp" dimension, and FSDP2 then shards the resulting DTensors over "dp".
"""

from __future__ import annotations

import torch
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Replicate, distribute_module
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

from memfit.distributed.modules import decoder_blocks
from memfit.models.part_loading import PartSource, fill_parts

ATTENTION_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                  "self_attn.o_proj": "rowwise"}
MLP_PLAN = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def block_plan() -> dict:
    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {name: styles[style]() for name, style in {**ATTENTION_PLAN, **MLP_PLAN}.items()}


def apply_tensor_parallel(model: torch.nn.Module, degree: int, device: torch.device,
                          source: PartSource) -> torch.nn.Module:
    """Shard `model` (built on `meta`) and fill this rank's part from `source`."""
    mesh = init_device_mesh(device.type, (degree,))
    parallelize(model, mesh)
    model.to_empty(device=device)
    fill_parts(model, source)
    return model


def parallelize(model: torch.nn.Module, mesh) -> None:
    """Apply the block plan over the 1-D `mesh` (all ranks, or a 2-D mesh's "tp" dimension), and make
    every other parameter a replicated DTensor on it. Moves no weights: on `meta` it records placements."""
    for block in decoder_blocks(model):
        parallelize_module(block, mesh, block_plan())
    _replicate_rest(model, mesh)


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
