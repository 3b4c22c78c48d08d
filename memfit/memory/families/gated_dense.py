"""Gated dense decoder blocks (Llama, Mistral, Qwen2/3, Gemma, Phi-3): RMSNorm, rotary positions and a
gated MLP, down(act(gate(x)) * up(x))."""

from __future__ import annotations

NAME = "gated_dense"
# the MLP saves up(x), gate(x) and act(gate(x)) for backward; three MLP-width tensors are alive at once
MLP_SAVED_INTERMEDIATES = 3
MLP_WORKING_INTERMEDIATES = 3


def norm_saved_bytes_per_token(hidden: int, weight_bytes: int, trains: bool, half_weights: bool) -> float:
    """RMSNorm keeps its fp32 x * rsqrt for the weight's gradient (when the norm trains) and the fp32
    rsqrt; in a 16-bit model it upcasts its input and keeps that fp32 copy and the 16-bit normalised
    value instead of the input itself."""
    if half_weights:
        return 4 * hidden + 2 * hidden * trains + 4
    return 4 * hidden * trains + 4


def position_cache_bytes(seq_len: int, head_dim: int, weight_bytes: int) -> int:
    """The rotary embedding's cos and sin tables, in the weights' dtype."""
    return 2 * seq_len * head_dim * weight_bytes


def active_params(shape) -> int:
    return shape.total_params
