"""Plain dense decoder blocks (GPT-2, Phi-1/2, Falcon): LayerNorm and a two-matrix MLP, fc2(act(fc1(x)))."""

from __future__ import annotations

NAME = "plain_dense"
# the MLP saves act's input (fc1's output) for backward; fc1's output and act's output are alive at once
MLP_SAVED_INTERMEDIATES = 1
MLP_WORKING_INTERMEDIATES = 2


def norm_saved_bytes_per_token(hidden: int, weight_bytes: int, trains: bool, half_weights: bool) -> float:
    """LayerNorm keeps its mean and rstd (fp32), and its normalised output for the weight's gradient
    when the norm trains."""
    return (weight_bytes * hidden if trains else 0) + 8


def position_cache_bytes(seq_len: int, head_dim: int, weight_bytes: int) -> int:
    """Not counted: learned position embeddings are a parameter, and the rotary tables some members build
    (Phi, Falcon) are left to the estimate's small terms."""
    return 0


def active_params(shape) -> int:
    return shape.total_params
