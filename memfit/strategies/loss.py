"""The training loss: plain (the model's own) or chunked cross-entropy.

The plain loss lets the model compute `logits = lm_head(hidden)` for every token and then
upcasts them to fp32: for a 128k vocabulary at 8k tokens that is a 4 GiB fp32 tensor (plus
the model-dtype copy and its gradient). The chunked loss runs the decoder, then applies
`lm_head` + cross-entropy to a chunk of tokens at a time (default: about vocab/hidden chunks,
at least 64 tokens each) under non-reentrant checkpointing, so
only one chunk's logits exist at once in the forward and each chunk's logits are recomputed
one chunk at a time in the backward. Same loss and gradients as the plain loss (summed
per-token losses divided by the target tokens of the whole step), at the cost of one extra
`lm_head` matmul per token.

A loss function has the signature `loss_fn(model, batch, num_targets) -> scalar tensor`.
"""

from __future__ import annotations

import functools
import logging

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from memfit.errors import MemfitError
from memfit.strategies.step_strategy import StepStrategy

log = logging.getLogger(__name__)

IGNORE_INDEX = -100  # label that cross-entropy skips (Hugging Face / memfit.data convention)
MIN_CHUNK_TOKENS = 64  # below this the per-chunk overhead (checkpoint, small matmuls) dominates


def auto_chunk_tokens(tokens: int, vocab: int, hidden: int) -> int:
    """About vocab/hidden chunks, so that one chunk's fp32 logits weigh about as much as the hidden
    states they come from (the rule Liger-Kernel's fused linear cross-entropy uses)."""
    return max(MIN_CHUNK_TOKENS, -(-tokens // max(1, -(-vocab // hidden))))


def plain_loss(model: torch.nn.Module, batch: dict, num_targets: int) -> torch.Tensor:
    """The model's own loss (Hugging Face's ForCausalLMLoss): full logits, then cross-entropy."""
    return model(**batch, num_items_in_batch=num_targets).loss


def _base_model(model: torch.nn.Module) -> torch.nn.Module:
    """The transformers CausalLM under a DDP and/or PEFT wrapper (or the model itself)."""
    model = getattr(model, "module", model)  # DistributedDataParallel
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def split_head(model: torch.nn.Module) -> tuple[torch.nn.Module, torch.nn.Module, float | None]:
    """(decoder that returns hidden states, lm_head module, final logit soft-cap or None)."""
    base = _base_model(model)
    head = base.get_output_embeddings() if hasattr(base, "get_output_embeddings") else None
    decoder = getattr(base, getattr(base, "base_model_prefix", "model"), None)
    if head is None or decoder is None or decoder is base:
        raise MemfitError(f"chunked_loss: cannot find the decoder and lm_head of {type(base).__name__}; "
                          "set chunked_loss: false for this model")
    softcap = getattr(getattr(base, "config", None), "final_logit_softcapping", None)
    return decoder, head, softcap


def _chunk_loss_sum(head: torch.nn.Module, softcap: float | None, hidden: torch.Tensor,
                    labels: torch.Tensor) -> torch.Tensor:
    logits = head(hidden).float()  # fp32 like the plain loss; only this chunk's rows exist
    if softcap:
        logits = torch.tanh(logits / softcap) * softcap
    return F.cross_entropy(logits, labels, ignore_index=IGNORE_INDEX, reduction="sum")


def chunked_cross_entropy(hidden: torch.Tensor, labels: torch.Tensor, head: torch.nn.Module, num_targets: int,
                          chunk_tokens: int | None = None, softcap: float | None = None) -> torch.Tensor:
    """Sum over tokens of CE(head(hidden), next-token label) / num_targets, chunk by chunk.

    hidden [batch, seq, hidden_size], labels [batch, seq] (unshifted, IGNORE_INDEX where no loss).
    """
    shifted = F.pad(labels, (0, 1), value=IGNORE_INDEX)[..., 1:]  # token t predicts label t+1
    flat_hidden = hidden.reshape(-1, hidden.shape[-1])
    flat_labels = shifted.reshape(-1)
    if chunk_tokens is None:
        vocab = getattr(head, "out_features", None) or head.weight.shape[0]
        chunk_tokens = auto_chunk_tokens(flat_hidden.shape[0], vocab, flat_hidden.shape[1])
    piece = functools.partial(_chunk_loss_sum, head, softcap)
    total = hidden.new_zeros((), dtype=torch.float32)
    for h, y in zip(flat_hidden.split(chunk_tokens), flat_labels.split(chunk_tokens)):
        # Non-reentrant checkpoint keeps only (h, y); the chunk's logits are rebuilt in backward.
        total = total + checkpoint(piece, h, y, use_reentrant=False)
    return total / num_targets


def chunked_loss(model: torch.nn.Module, batch: dict, num_targets: int,
                 chunk_tokens: int | None = None) -> torch.Tensor:
    """Drop-in for `plain_loss` that never materialises the full [tokens x vocab] logits.

    The whole model runs its own forward, so every engine sees one ordinary forward (DDP's gradient
    reduction, FSDP2's gathered root weights), with `logits_to_keep` set to no position. The chunks apply the
    lm_head to the decoder's output inside that forward (a hook on the decoder), while an engine's weights
    are gathered; the model's own lm_head call keeps only the last position (`logits_to_keep=1`: an empty
    one fails in DTensor's sharding propagation). Those logits join the loss times zero, so the engine's
    backward hooks on the model's output run as they do after a plain loss."""
    decoder, head, softcap = split_head(model)
    inputs = {k: v for k, v in batch.items() if k != "labels"}  # incl. position_ids of packed batches
    losses = []

    def on_hidden(module, args, out):
        losses.append(chunked_cross_entropy(out.last_hidden_state, batch["labels"], head, num_targets,
                                            chunk_tokens, softcap))

    handle = decoder.register_forward_hook(on_hidden)
    try:
        logits = model(**inputs, use_cache=False, logits_to_keep=1).logits
    finally:
        handle.remove()
    return losses[-1] + 0 * logits.float().sum()


def loss_function(chunked: bool, chunk_tokens: int | None = None):
    """The loss a run uses: `plain_loss` when chunked is off (unchanged behaviour)."""
    if not chunked:
        return plain_loss
    return functools.partial(chunked_loss, chunk_tokens=chunk_tokens)


def _chunked_peak(moments: dict, terms) -> None:
    """The fp32 [tokens x vocab] log-softmax is never saved; in backward one chunk's logits,
    log-softmax and their gradient exist at a time (3 x chunk x vocab x 4 B). When the lm_head trains,
    autograd sums the chunks' lm_head gradients as they come: the running sum and the next chunk's
    (measured with bench/rank_matrix.py on a 32,000-token vocabulary: 2 x 93.75 MiB beside the chunk's own)."""
    moments["backward_start"]["activations"] -= terms.loss_bytes
    moments["backward_start"]["temporaries"] += (3 * terms.chunk_bytes - 2 * terms.loss_bytes
                                                 + 2 * terms.head_gradient_bytes)
    # the lm_head's gradient is made in the chunks, before the last layer's backward
    moments["backward_last"]["temporaries"] -= terms.head_gradient_in_flight_bytes


def _chunked_work(terms) -> dict[str, float]:
    """The lm_head matmul runs again for each chunk in the backward."""
    return {"flops": 2 * terms.tokens * terms.shape.hidden * terms.shape.vocab * terms.micro_batches}


CHUNKED_LOSS = StepStrategy(
    "chunked_loss", "Cross-entropy over chunks of tokens with recomputation: the full [tokens x vocab] fp32 "
                    "logits never exist (same loss and gradients).",
    hooks=lambda device, optimizer, params, traced: {"loss_fn": loss_function(True)},
    peak=_chunked_peak, work=_chunked_work,
    without_deepspeed="it applies the lm_head inside the model's forward, which DeepSpeed's ZeRO-3 hooks do not expect",
    without_pipeline="the pipeline's last stage computes the loss inside its schedule")
