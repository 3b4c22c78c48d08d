"""Sequence-tiled MLP: each decoder block's MLP runs over slices of the tokens, so only one slice's
intermediate tensors exist at a time.

At long context the MLP dominates a layer's working set: Llama-3.1-8B's gate, up and act(gate) * up
are each tokens x 14,336 x 2 B, 3.5 GiB apiece at 128k tokens. The MLP treats every token on its
own, so running it over slices of the tokens, each under non-reentrant checkpointing (recomputed
slice by slice in the backward, as the chunked loss treats the logits), gives the same outputs and
gradients while one slice's intermediates are alive: in the forward, in the backward, and in the
recompute of a checkpointed layer. Each slice keeps only its input, a view of the layer's
[tokens x hidden] MLP input. Adapters inside the MLP (LoRA) and 4-bit base weights work unchanged:
a quantized linear dequantizes its weight inside each call and frees it, one slice at a time.

Slices hold `hidden` tokens each (the rule of Arctic Long Sequence Training's TiledMLP: one slice's
[slice x intermediate] tensor then weighs intermediate/hidden times a [hidden x hidden] block), or
the tokens split in `memory.tiled_mlp_slices` parts. It costs one more MLP forward per token.

Tiled: gated MLPs with gate_proj, up_proj, down_proj and act_fn (Llama, Mistral, Qwen2, Qwen3,
Gemma and their relatives); any other MLP is refused with its class named.
"""

from __future__ import annotations

import functools
import logging
import math

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from memfit.errors import MemfitError
from memfit.strategies.step_strategy import WAITING, StepSettings, StepStrategy

log = logging.getLogger(__name__)

GATED = ("gate_proj", "up_proj", "down_proj", "act_fn")  # what a tileable MLP has
KNOWN = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP", "GemmaMLP", "Gemma2MLP")  # for the error
_CLAMP_SAID: set[tuple[int, int]] = set()


def slice_tokens(tokens: int, hidden: int, slices: int | None) -> int:
    """Tokens per slice: `hidden` by default; with `slices` given, the tokens split in that many parts
    (more slices than tokens: one token each)."""
    if slices is None:
        return max(1, hidden)
    if slices > tokens and (slices, tokens) not in _CLAMP_SAID:
        _CLAMP_SAID.add((slices, tokens))
        log.info("memory.tiled_mlp_slices=%d is more than the %d tokens of this batch: %d slices of one token",
                 slices, tokens, tokens)
    return max(1, math.ceil(tokens / min(slices, tokens)))


def tiled_forward(mlp_forward, hidden: int, slices: int | None, x: torch.Tensor) -> torch.Tensor:
    """`mlp_forward(x)` over slices of the tokens of x [..., hidden]; one slice's intermediates at a time."""
    tokens = x.shape[:-1].numel()
    size = slice_tokens(tokens, hidden, slices)
    if size >= tokens:
        return mlp_forward(x)
    flat = x.reshape(tokens, x.shape[-1])
    if torch.is_grad_enabled():  # recomputed in backward: each slice saves only its input
        parts = [checkpoint(mlp_forward, part, use_reentrant=False) for part in flat.split(size)]
    else:  # evaluation: nothing is saved anyway
        parts = [mlp_forward(part) for part in flat.split(size)]
    return torch.cat(parts).view(*x.shape[:-1], -1)


def decoder_mlps(model: nn.Module) -> list[tuple[str, nn.Module]]:
    """(name, module) of each decoder layer's MLP: the `mlp` child of every module that has one."""
    return [(f"{name}.mlp" if name else "mlp", module.mlp) for name, module in model.named_modules()
            if isinstance(getattr(module, "mlp", None), nn.Module)]


def apply_tiled_mlp(model: nn.Module, slices: int | None = None) -> nn.Module:
    """Tile every decoder MLP's forward in place (parameter names and state dicts are unchanged); `slices`
    is memory.tiled_mlp_slices (`slice_tokens`)."""
    mlps = decoder_mlps(model)
    if not mlps:
        raise MemfitError(f"memory.tiled_mlp: {type(model).__name__} has no decoder layer with an `mlp` module to "
                          f"tile; supported: {', '.join(KNOWN)} (any MLP with {', '.join(GATED)}); "
                          "set memory.tiled_mlp: false")
    for name, mlp in mlps:
        if not all(hasattr(mlp, part) for part in GATED):
            raise MemfitError(f"memory.tiled_mlp: {type(mlp).__name__} ({name}) is not a gated MLP it can tile; "
                              f"supported: {', '.join(KNOWN)} (any MLP with {', '.join(GATED)}); "
                              "set memory.tiled_mlp: false")
        hidden = mlp.down_proj.out_features if hasattr(mlp.down_proj, "out_features") else mlp.hidden_size
        # The instance's forward, so nn.Module.__call__ (and its hooks) still runs around the tiles.
        mlp.forward = functools.partial(tiled_forward, mlp.forward, hidden, slices)
    return model


# ---------------------------------------------------------------- its entry: memory and work


def _fraction(terms) -> float:
    """One slice's share of the tokens."""
    return min(1.0, slice_tokens(terms.tokens, terms.shape.hidden, terms.options["tiled_mlp_slices"]) / terms.tokens)


def _tiled_peak(moments: dict, terms) -> None:
    """Layers that are not checkpointed save their MLP input instead of its intermediates. In a layer's
    backward one slice's intermediates (recomputed, if the layer is checkpointed) and their gradients
    are alive instead of all tokens'; the attention's gradient buffers then bound that moment from
    below, as they exceed one slice's; under full fine-tuning the sum of the slices' weight gradients too."""
    kept = _fraction(terms)
    if kept >= 1:  # one slice holds every token: `tiled_forward` runs the MLP as it is
        return
    intermediates = terms.mlp_saved_bytes - terms.mlp_input_bytes
    saved_delta = max(0, terms.mlp_saved_bytes - terms.hidden_bytes)
    buffers_freed = terms.mlp_buffer_bytes - max(kept * terms.mlp_buffer_bytes, terms.attention_buffer_bytes)
    # autograd sums the slices' weight gradients in its own buffer before they reach .grad: that sum and
    # the newest slice's gradients are alive in a tiled layer's backward (full fine-tuning)
    summed = 2 * terms.mlp_weight_gradient_bytes
    for moment in ("backward_start", "backward_last", WAITING):
        if moment in moments:
            moments[moment]["activations"] -= terms.live_layers * saved_delta
    for moment, checkpointed in (("backward_last", terms.last_layer_checkpointed),
                                 ("backward_first", terms.any_layer_checkpointed)):
        recomputed = (1 - kept) * intermediates if checkpointed else 0
        moments[moment]["temporaries"] += summed - int(recomputed + max(0, buffers_freed))
    if not terms.any_layer_checkpointed:  # the first layer's own saved MLP tensors
        moments["backward_first"]["activations"] -= saved_delta


def _tiled_work(terms) -> dict[str, float]:
    """Each slice's MLP forward runs again in the backward: 2 x tokens x 3 x hidden x intermediate per layer
    (nothing when one slice holds every token)."""
    if _fraction(terms) >= 1:
        return {}
    shape = terms.shape
    per_token = 2 * 3 * shape.hidden * shape.intermediate * shape.experts_per_token
    return {"flops": per_token * terms.tokens * shape.layers * terms.micro_batches}


def _tiled_problems(settings: StepSettings, tiled_mlp_slices: int | None) -> list[str]:
    if settings.tensor_parallel > 1 and settings.checkpointing != "none":
        # measured on 2 gloo ranks (tiny Llama, fp32, micro_batch 8): 25.8 MiB tiled against ~10.6 MiB untiled
        return [f"memory.tiled_mlp with distributed.tensor_parallel: {settings.tensor_parallel} and "
                f"memory.checkpointing: {settings.checkpointing}: a checkpointed layer's recompute keeps every "
                "slice's (DTensor) intermediates alive, so tiling costs memory instead of saving it; use "
                "memory.checkpointing: none with the tiled MLP, or switch the tiled MLP off"]
    return []


TILED_MLP = StepStrategy(
    "tiled_mlp", "Run each decoder MLP over slices of the tokens, each recomputed in backward: one slice's "
                 "intermediates alive at a time (same gradients; one more MLP forward). Gated MLPs "
                 "(Llama, Mistral, Qwen2 ...).",
    hooks=lambda device, optimizer, params, traced, tiled_mlp_slices: {},
    model_hook=lambda model, tiled_mlp_slices: apply_tiled_mlp(model, tiled_mlp_slices),
    peak=_tiled_peak, work=_tiled_work, rules=_tiled_problems,
    model_problem=lambda shape: None if shape.gated_mlp else
    "memory.tiled_mlp tiles gated MLPs only (gate_proj, up_proj, down_proj); this model's MLP is not one",
    options={"tiled_mlp_slices": (int | None, dict(default=None, ge=1, description=(
        "Slices per MLP with memory.tiled_mlp (null: slices of `hidden` tokens each; more than the "
        "tokens: one token each)")))},
    gives_up="one more MLP forward per token")
