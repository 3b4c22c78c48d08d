"""Fine-tuning method: full (all weights train) or LoRA adapters through PEFT."""

from __future__ import annotations

from transformers import PreTrainedModel

from memfit.config import RunConfig
from memfit.errors import MemfitError, require


def apply_method(model: PreTrainedModel, cfg: RunConfig) -> PreTrainedModel:
    """Full fine-tuning leaves the model as is; LoRA freezes it and adds trainable adapters."""
    if cfg.method == "full":
        return model
    if cfg.method == "qlora":
        raise MemfitError("method: qlora is not available in this build yet; use method: lora")
    peft = require("peft", "method: lora")
    lora = peft.LoraConfig(r=cfg.lora.rank, lora_alpha=cfg.lora.alpha, lora_dropout=cfg.lora.dropout,
                           target_modules=cfg.lora.targets, task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as exc:  # e.g. target modules that the model does not have
        raise MemfitError(f"lora.targets {cfg.lora.targets!r}: {str(exc).splitlines()[0]}") from None
