"""Tensor parallel for Llama-family blocks with DTensor (`parallelize_module`), Megatron-style.

In each decoder block, q/k/v and gate/up projections are split by output features
(ColwiseParallel) and o/down projections by input features (RowwiseParallel), so each rank
computes num_heads / K heads and intermediate_size / K MLP features, and one all-reduce per
attention and per MLP restores the full hidden state. Embeddings, norms and lm_head stay
replicated (identical on every rank). Hugging Face's attention infers the local head count
from the projection's output shape, so the block code runs unchanged on its shard.

Every rank builds the model and `parallelize_module` keeps each rank's shard of rank 0's
weights (src_data_rank=0), so the ranks start identical to a single-process run.
"""

from __future__ import annotations

import torch

from memfit.distributed.sharding import decoder_blocks, place

ATTENTION_PLAN = {"self_attn.q_proj": "colwise", "self_attn.k_proj": "colwise", "self_attn.v_proj": "colwise",
                  "self_attn.o_proj": "rowwise"}
MLP_PLAN = {"mlp.gate_proj": "colwise", "mlp.up_proj": "colwise", "mlp.down_proj": "rowwise"}


def block_plan() -> dict:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
    return {name: styles[style]() for name, style in {**ATTENTION_PLAN, **MLP_PLAN}.items()}


def apply_tensor_parallel(model: torch.nn.Module, degree: int, device: torch.device) -> torch.nn.Module:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.parallel import parallelize_module

    model = place(model, device)
    mesh = init_device_mesh(device.type, (degree,))
    for block in decoder_blocks(model):
        parallelize_module(block, mesh, block_plan())
    _replicate_rest(model, mesh)
    return model


def _replicate_rest(model: torch.nn.Module, mesh) -> None:
    """Make the remaining parameters (embeddings, norms, lm_head) replicated DTensors.

    Gradient clipping and the foreach optimizers cannot mix DTensor and plain tensors, so every
    module that owns plain parameters gets them as Replicate DTensors, with its inputs turned
    into Replicate DTensors and its outputs back into local tensors (no communication: every
    rank already holds the same values).
    """
    from torch.distributed.tensor import DTensor, Replicate, distribute_module

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
