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

from memfit.distributed.sharding import decoder_blocks

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

    model = model.to(device)
    mesh = init_device_mesh(device.type, (degree,))
    for block in decoder_blocks(model):
        parallelize_module(block, mesh, block_plan())
    return model


def sharded_fraction(name: str) -> bool:
    """Whether a parameter (by its name) is split across the tensor-parallel ranks."""
    return any(f"{module}." in name for module in {**ATTENTION_PLAN, **MLP_PLAN})
