"""Fine-tuning method: full (all weights train), LoRA adapters through PEFT, or QLoRA
(4-bit base weights + LoRA). `quant: int8` with method lora gives 8-bit base weights + LoRA.

The order is the one QLoRA uses: quantize the base Linear layers (skipped when the model was
loaded already quantized), prepare the quantized model for training (everything frozen; under a
mixed or fp32 precision the remaining 16-bit parameters — norms, embeddings, head — upcast to fp32,
under bf16-pure they stay bf16), then add the adapters.

Every name in `lora.targets` must name a module of the model (peft's rule: the full module name or
its last components); peft itself would drop an unknown one silently when another name matches.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import AutoModelForCausalLM, PreTrainedModel

from memfit.errors import MemfitError, require
from memfit.strategies.precision import precision_entry
from memfit.strategies.quantization import is_quantized, is_quantized_linear, quantize_model


class LoraTargetError(MemfitError):
    """A name in lora.targets that the model has no module for."""


def apply_method(model: PreTrainedModel, *, method: str, targets: list[str] | str, rank: int, alpha: float,
                 dropout: float, use_dora: bool, use_rslora: bool, train_embeddings: bool, train_lm_head: bool,
                 quant_scheme: str, quant_backend: str, quant_dtype: torch.dtype, precision: str,
                 device: torch.device | str | None = None, quant_shards: int = 1) -> PreTrainedModel:
    """Full fine-tuning leaves the model as is; LoRA/QLoRA freeze it and add trainable adapters.

    method: full, lora or qlora; targets ... train_lm_head: the lora settings; quant_scheme and
    quant_backend: the base weights' quantization, computing in quant_dtype, cut into quant_shards FSDP2
    row shards; precision: a precision
    entry's name (bf16-pure keeps the unquantized parameters in bf16). With `device`, the model moves
    there first, so that quantization happens on the device the model trains on (a model loaded
    already quantized stays where its loader put it).
    """
    if device is not None and not is_quantized(model):
        model = model.to(device)
    if method == "full":
        return model
    check_lora_targets(model, targets)
    peft = require("peft", f"method: {method}")
    if quant_scheme != "none":
        quantize_model(model, quant_scheme, quant_backend, quant_dtype, quant_shards)
        prepare_quantized_for_training(model, upcast=precision_entry(precision).weight_dtype == torch.float32)
    saved = modules_to_save(model, train_embeddings=train_embeddings, train_lm_head=train_lm_head)
    # Tied input/output embeddings stay tied when one of them is trained in full.
    tied = bool(saved) and bool(getattr(model.config, "tie_word_embeddings", False))
    lora = peft.LoraConfig(r=rank, lora_alpha=alpha, lora_dropout=dropout, target_modules=targets,
                           use_dora=use_dora, use_rslora=use_rslora, modules_to_save=saved or None,
                           ensure_weight_tying=tied, task_type="CAUSAL_LM")
    try:
        return peft.get_peft_model(model, lora)
    except ValueError as exc:  # e.g. target modules that the model does not have
        raise MemfitError(f"lora.targets {targets!r}: {str(exc).splitlines()[0]}") from None


def prepare_quantized_for_training(model: nn.Module, upcast: bool = True) -> nn.Module:
    """What peft.prepare_model_for_kbit_training does, minus its checkpointing switch (memfit's own
    `checkpointing` setting already chose which layers to checkpoint, non-reentrant, so no input
    gradients are needed) and minus its fp32 cast of torchao NF4 weights (that would dequantize them):
    freeze everything; with `upcast`, keep 16-bit non-quantized parameters (norms, embeddings,
    lm_head) in fp32 so their small values and the logits do not lose precision.

    bf16-pure runs pass upcast=False: fp32 norms and embeddings would turn the residual stream and,
    through bitsandbytes' cast of each output back to its input's dtype, every activation into fp32:
    1.4x the activation memory of the same run without quantization (tracker, tiny Llama)."""
    quantized = {id(m.weight) for m in model.modules() if is_quantized_linear(m)}
    for param in model.parameters():
        param.requires_grad_(False)
        if upcast and id(param) not in quantized and param.dtype in (torch.float16, torch.bfloat16):
            param.data = param.data.float()
    return model


def modules_to_save(model: nn.Module, *, train_embeddings: bool, train_lm_head: bool) -> list[str]:
    """Module names (as peft matches them: the last name component) for lora.train_embeddings /
    lora.train_lm_head."""
    wanted = []
    if train_embeddings:
        wanted.append(("lora.train_embeddings", model.get_input_embeddings()))
    if train_lm_head:
        wanted.append(("lora.train_lm_head", model.get_output_embeddings()))
    names = []
    by_id = {id(module): name for name, module in model.named_modules()}
    for field, module in wanted:
        if module is None or id(module) not in by_id:
            raise MemfitError(f"{field}: {type(model).__name__} has no such module to train")
        names.append(by_id[id(module)].rsplit(".", 1)[-1])
    return names


# Module types peft's LoRA can adapt: the names worth listing when a target is unknown.
_ADAPTABLE = (nn.Linear, nn.Embedding, nn.Conv1d, nn.Conv2d, nn.Conv3d)


def targets_module(name: str, target: str) -> bool:
    """peft's rule for a lora.targets entry: the module's full name, or its last dotted components."""
    return name == target or name.endswith("." + target)


def check_lora_targets(model: nn.Module, targets) -> None:
    """Refuse any name in `targets` that matches no module the way peft matches (`targets_module`),
    listing the names the model does have."""
    if targets == "all-linear":
        return
    names = [name for name, _ in model.named_modules()]
    unknown = [t for t in targets if not any(targets_module(name, t) for name in names)]
    if not unknown:
        return
    have = sorted({name.rsplit(".", 1)[-1] for name, module in model.named_modules()
                   if name and (isinstance(module, _ADAPTABLE) or type(module).__name__ == "Conv1D")})
    raise LoraTargetError(f"lora.targets: {', '.join(map(repr, unknown))}: no such module in "
                          f"{type(model).__name__}; its adaptable module names are {', '.join(have)} "
                          "(or set lora.targets: all-linear)")


def check_lora_targets_on_meta(model_config, *, method: str, targets: list[str] | str,
                               trust_remote_code: bool) -> None:
    """check_lora_targets for `method` and `targets` (lora.targets) on a `meta` build of `model_config`
    (no memory): for the planner, which resolves the targets from the architecture without building the
    model that trains. trust_remote_code: model.trust_remote_code, for a model whose code the hub ships."""
    if method == "full" or targets == "all-linear":
        return
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(model_config, trust_remote_code=trust_remote_code)
    check_lora_targets(model, targets)
