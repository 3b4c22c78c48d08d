"""Gradient (activation) checkpointing: keep only each checkpointed layer's input in the forward
and recompute the layer in the backward. Costs about one extra forward per checkpointed layer.
"""

from __future__ import annotations

from transformers import PreTrainedModel


def apply_checkpointing(model: PreTrainedModel, every: int) -> PreTrainedModel:
    """Checkpoint every `every`-th decoder layer (1 = all layers); 0 leaves the model unchanged."""
    if every:
        # Non-reentrant checkpointing works with frozen inputs (LoRA) and needs no input grads.
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False},
                                              every_n_layers=every)
        model.config.use_cache = False
    return model
