"""Model families: what the analytic engine needs to know about one kind of decoder block.

The generic terms (memory/activations.py, memory/model_states.py, memory/single_device.py) count
what every decoder-only transformer keeps: the residual stream, each trainable linear's input, the
attention tensors, the loss. What differs between block designs is a family's, behind the
`ModelFamily` protocol: one module per family in this package, registered in `FAMILIES`.
`model_shape` (memory/model_shape.py) names a model's family from the model's own structure.
"""

from __future__ import annotations

from types import ModuleType
from typing import TYPE_CHECKING, Protocol

from memfit.memory.families import gated_dense, plain_dense

if TYPE_CHECKING:  # model_shape names a model's family from these modules
    from memfit.memory.model_shape import ModelShape


class ModelFamily(Protocol):
    NAME: str                      # the value of ModelShape.family
    MLP_SAVED_INTERMEDIATES: int   # MLP-width tensors one layer saves for backward, besides the output
                                   # projection's input
    MLP_WORKING_INTERMEDIATES: int  # MLP-width tensors alive at once inside the MLP: its forward's
                                    # intermediates (evaluation) and their gradients (backward)

    def norm_saved_bytes_per_token(self, hidden: int, weight_bytes: int, trains: bool, half_weights: bool) -> float:
        """What one of the block's norms keeps for backward beyond its input, per token."""

    def position_cache_bytes(self, seq_len: int, head_dim: int, weight_bytes: int) -> int:
        """The position tables the forward builds once and every layer's backward reads."""

    def active_params(self, shape: ModelShape) -> int:
        """The parameters one token's forward multiplies with: what its FLOPs are counted from."""


FAMILIES: dict[str, ModuleType] = {module.NAME: module for module in (gated_dense, plain_dense)}


def family_of(shape: ModelShape) -> ModelFamily:
    return FAMILIES[shape.family]
