"""What one training step keeps alive besides the model states: the tensors each decoder layer saves
for backward, the loss's buffers, and the gradient buffers of one layer's backward.

Derived from the tensors the transformers blocks keep alive between forward and backward (read off
the tracker on tiny models, see tests/unit/memory/test_analytic.py). The block's parts are found by
role (memory/model_shape.py), and what differs between block designs comes from the model's family
(memory/families/). Every term is documented in docs/planner.md.
"""

from __future__ import annotations

import math

from memfit.config import RunConfig
from memfit.memory.families import family_of, gated_dense
from memfit.memory.model_shape import (ATTENTION_INPUT, ATTENTION_OUTPUT, MLP_INPUT, MLP_OUTPUT, ModelShape,
                                       block_linears)
from memfit.memory.model_states import compute_size, fp32_compute, half_weights, quant_backend, quantized, weight_size
from memfit.strategies.loss import auto_chunk_tokens
from memfit.strategies.quantization import compute_dtype, dequantize_peak_per_value


def tokens_of(cfg: RunConfig) -> int:
    return cfg.batch.micro_batch * cfg.data.seq_len


def checkpointed_layers(shape: ModelShape, cfg: RunConfig) -> int:
    """Layers that keep only their input and recompute the rest in the backward (every N-th)."""
    every = cfg.memory.activation_checkpoint_every
    return 0 if not every else math.ceil(shape.layers / every)


def layer_bytes_per_token(shape: ModelShape, cfg: RunConfig) -> float:
    """Bytes one decoder layer saves for backward, per token (not counting attention scores): the
    residual stream (read by each norm's backward), each norm's internals, what every trainable linear
    needs (its input; under autocast each linear keeps its own 16-bit copy of its input), the attention
    inputs/output (q, k, v, out, log-sum-exp) and the MLP's input and intermediates."""
    h, p, c = shape.hidden, weight_size(cfg), compute_size(cfg)
    full = cfg.method == "full"
    pure = half_weights(cfg)
    # residual stream: the input of each norm (its backward reads it). A 16-bit model's norm keeps an
    # fp32 copy of its input instead, so there the residual itself is not kept.
    total = 0 if pure else shape.norms_per_layer * h * p
    total += shape.norms_per_layer * family_of(shape).norm_saved_bytes_per_token(h, p, full, pure)
    # linear inputs of the attention block (q, k, v)
    n_attn = len(block_linears(shape, cfg, ATTENTION_INPUT))
    if full:
        total += n_attn * c * h if c != p else (n_attn > 0) * p * h
    else:  # adapters, and an 8-bit base's own copy of its input
        keeps = base_keeps_input(cfg)
        total += adapter_inputs_bytes_per_token(n_attn, h, cfg, kept_elsewhere=keeps) + keeps * p * h
    # attention: q (after RoPE), k, v, the output (also the output projection's input), log-sum-exp
    # (fp32 per head)
    total += c * (2 * shape.q_dim + 2 * shape.kv_dim) + 4 * shape.heads
    if not full:  # an adapted output projection: its adapter's copy of the attention output
        for _, width, _ in block_linears(shape, cfg, ATTENTION_OUTPUT):
            total += adapter_inputs_bytes_per_token(1, width, cfg, kept_elsewhere=True)
    total += mlp_saved_bytes_per_token(shape, cfg)
    # LoRA: each adapter keeps its rank-r intermediate (lora_B's input)
    if not full:
        adapters = sum(len(block_linears(shape, cfg, role))
                       for role in (ATTENTION_INPUT, ATTENTION_OUTPUT, MLP_INPUT, MLP_OUTPUT))
        total += adapters * cfg.lora.rank * adapter_input_size(cfg)
    return total


def adapter_input_size(cfg: RunConfig) -> int:
    """Bytes per element of what a LoRA adapter computes with: peft casts each adapter's input to the
    adapters' fp32 dtype (`_cast_input_dtype`); under autocast lora_A then recasts it to 16 bits."""
    return compute_size(cfg) if compute_size(cfg) != weight_size(cfg) else 4


def adapter_inputs_bytes_per_token(n: int, width: int, cfg: RunConfig, kept_elsewhere: bool = False) -> float:
    """What `n` LoRA adapters reading one input of `width` features keep of it for backward, per token.

    Each adapter's lora_A saves the input it computed with: its own 16-bit recast under autocast, its own
    fp32 cast of a bf16 model's input, or, in an fp32 model, the input itself (shared, and nothing new if
    another op already keeps it: `kept_elsewhere`). With lora.dropout > 0 each adapter has its own
    dropout, so lora_A saves that adapter's dropout output instead, and the dropout keeps its mask:
    1 B per element in CUDA's fused kernel, 4 B (the fp32 input's dtype) in the unfused CPU kernel.
    The frozen base linear keeps nothing of its input."""
    if n == 0:
        return 0
    shared = fp32_compute(cfg) and not cfg.lora.dropout > 0
    copies = (0 if kept_elsewhere else 1) if shared else n
    return width * (copies * adapter_input_size(cfg) + dropout_masks_bytes(n, cfg))


def dropout_masks_bytes(n: int, cfg: RunConfig) -> int:
    """Per input element, the masks of `n` adapters' dropouts: 1 B each in CUDA's fused kernel, 4 B on CPU."""
    return n * (4 if cfg.device == "cpu" else 1) if cfg.lora.dropout > 0 else 0


def mlp_input_bytes_per_token(shape: ModelShape, cfg: RunConfig) -> int:
    """What one layer's MLP keeps of its input for backward, per token: each trainable input linear's
    own 16-bit copy under autocast, else the input itself once."""
    p, c = weight_size(cfg), compute_size(cfg)
    n_mlp = len(block_linears(shape, cfg, MLP_INPUT))
    if cfg.method != "full":
        keeps = base_keeps_input(cfg)
        return adapter_inputs_bytes_per_token(n_mlp, shape.hidden, cfg, kept_elsewhere=keeps) + keeps * p * shape.hidden
    return n_mlp * c * shape.hidden if c != p else (n_mlp > 0) * p * shape.hidden


def mlp_width(shape: ModelShape) -> int:
    """The MLP width one token passes through (the experts it is routed to, side by side)."""
    return shape.intermediate * shape.experts_per_token


def mlp_saved_bytes_per_token(shape: ModelShape, cfg: RunConfig) -> int:
    """What one layer's MLP saves for backward, per token: its input, the family's intermediates, and
    the output projection's input (kept only if it trains)."""
    i, a = mlp_width(shape), mlp_activation_size(cfg)
    if cfg.method == "full":
        down = a * i
    else:
        keeps = base_keeps_input(cfg)
        down = adapter_inputs_bytes_per_token(int(down_input_saved(shape, cfg)), i, cfg, kept_elsewhere=keeps)
        down += keeps * a * i
    return mlp_input_bytes_per_token(shape, cfg) + a * i * family_of(shape).MLP_SAVED_INTERMEDIATES + down


def mlp_activation_size(cfg: RunConfig) -> int:
    """Bytes per element of the MLP's intermediates: the matmuls' 16-bit outputs under autocast, except
    that bitsandbytes' quantized matmuls return their input's dtype (fp32 in a mixed-precision run):
    its 4-bit op everywhere, its 8-bit op on CUDA (on CPU the 8-bit training path is a plain F.linear,
    which autocast reaches, as it reaches torchao's NF4 matmul)."""
    quant = cfg.quant.scheme
    if quant == "none" or (quant == "int8" and cfg.device == "cpu") or quant_backend(cfg) == "torchao":
        return compute_size(cfg)
    return weight_size(cfg)


def base_keeps_input(cfg: RunConfig) -> bool:
    """bitsandbytes' 8-bit matmul keeps its input for the backward (`ctx.tensors`/`ctx.A` in
    MatMul8bitLt on CUDA, MatMul8bitFp on CPU, bitsandbytes 0.50); its 4-bit matmul keeps only the
    packed weight."""
    return cfg.quant.scheme == "int8"


def down_input_saved(shape: ModelShape, cfg: RunConfig) -> bool:
    """Whether the MLP's output projection keeps its input (it trains, or carries an adapter)."""
    return cfg.method == "full" or bool(block_linears(shape, cfg, MLP_OUTPUT))


def attention_scores_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """Eager attention keeps the [batch, heads, seq, seq] probabilities (fp32 softmax, + a 16-bit copy)."""
    if cfg.memory.attention != "eager":
        return 0
    per = 4 if compute_size(cfg) == 4 else 6
    return cfg.batch.micro_batch * shape.heads * cfg.data.seq_len * cfg.data.seq_len * per


def layer_weight_copies_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """Under autocast every matmul keeps the 16-bit copy of its weight that it computed with (needed for
    the input gradient): one layer's, in the forward of a layer that is not checkpointed or in the
    recompute of one that is."""
    if compute_size(cfg) == weight_size(cfg) or quantized(cfg):
        return 0
    return int(2 * shape.block_linear_params / shape.layers)


def weight_copies_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """The 16-bit weight copies saved at the backward's start: every layer that is not checkpointed, and
    the lm_head (checkpointed layers recompute theirs in the backward)."""
    if not layer_weight_copies_bytes(shape, cfg):
        return 0
    live_layers = shape.layers - checkpointed_layers(shape, cfg)
    return int(layer_weight_copies_bytes(shape, cfg) * live_layers + 2 * shape.head_params)


def norm_bytes_per_token(shape: ModelShape, cfg: RunConfig) -> float:
    """The final norm: its input (unless a 16-bit model's fp32 copy replaces it) and its internals, counted
    as an RMSNorm's for every family (a LayerNorm keeps less: its mean and rstd instead of an fp32 x * rsqrt)."""
    h, p, pure = shape.hidden, weight_size(cfg), half_weights(cfg)
    return (0 if pure else h * p) + gated_dense.norm_saved_bytes_per_token(h, p, cfg.method == "full", pure)


def layer_bytes(shape: ModelShape, cfg: RunConfig) -> float:
    """Everything one decoder layer saves for one micro-batch."""
    return layer_bytes_per_token(shape, cfg) * tokens_of(cfg) + attention_scores_bytes(shape, cfg)


def loss_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """The log-softmax output the cross-entropy keeps, fp32 (transformers upcasts the logits)."""
    return tokens_of(cfg) * shape.vocab * 4 if shape.head else 0


def chunk_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """One chunk of the chunked loss: its fp32 logits (chunk tokens x vocab x 4 B)."""
    tokens = tokens_of(cfg)
    if not shape.head:
        return 0
    return min(tokens, auto_chunk_tokens(tokens, shape.vocab, shape.hidden)) * shape.vocab * 4


def loss_buffer_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """The loss's two largest transient blocks: d log-softmax and d logits over all tokens, or with
    the chunked loss two of one chunk's buffers."""
    return 2 * (chunk_bytes(shape, cfg) if cfg.memory.chunked_loss else loss_bytes(shape, cfg))


def head_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """What the final norm and the lm_head save; both are freed before the last layer's backward."""
    if not shape.head:
        return 0
    tokens = tokens_of(cfg)
    p, c, full = weight_size(cfg), compute_size(cfg), cfg.method == "full"
    # lm_head input: kept when lm_head trains, or as the 16-bit autocast copy; shared in fp32
    head_input = tokens * shape.hidden * c if (c != p or full) else 0
    return int(tokens * norm_bytes_per_token(shape, cfg) + head_input)


def activation_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """Tensors saved for backward at the end of one micro-batch's forward (the backward's start)."""
    tokens = tokens_of(cfg)
    p = weight_size(cfg)
    ckpt = checkpointed_layers(shape, cfg)
    layers = (shape.layers - ckpt) * layer_bytes(shape, cfg) + ckpt * tokens * shape.hidden * p  # ckpt: input only
    if cfg.method != "full" and shape.layers > ckpt:
        # the first layer's input is the frozen embedding's output: no gradient, so neither it nor the
        # dropout masks of the adapters reading its norm are kept
        layers -= tokens * shape.hidden * p
        n_attn = len(block_linears(shape, cfg, ATTENTION_INPUT))
        layers -= tokens * shape.hidden * (dropout_masks_bytes(n_attn, cfg) + base_keeps_input(cfg) * p)
    positions = family_of(shape).position_cache_bytes(cfg.data.seq_len, shape.head_dim, p)
    batch = 4 * tokens * 8  # input_ids, attention_mask, labels and the shifted labels, int64
    return int(layers + head_bytes(shape, cfg) + loss_bytes(shape, cfg) + positions + batch
               + weight_copies_bytes(shape, cfg))


def mlp_gradient_buffers(shape: ModelShape, cfg: RunConfig) -> int:
    """The gradients of the MLP's intermediates in its backward (the family's working intermediates),
    less the output projection's saved input once its own backward has freed it. With an adapter on
    the output projection of a 16-bit model, peft's cast of the adapter's input gives the adapter's
    gradient a path of its own: its cast back to the input's dtype (p), and with dropout one more fp32
    gradient (through the mask), before it joins the base's; in an fp32 model it accumulates into the
    base's input gradient (read off the tracker)."""
    width = mlp_width(shape)
    a = mlp_activation_size(cfg)
    intermediates = width * a * family_of(shape).MLP_WORKING_INTERMEDIATES
    saved = down_input_saved(shape, cfg)
    freed = width * a if saved else 0
    adapter = 0
    if cfg.method != "full" and saved and not fp32_compute(cfg):
        adapter = width * (weight_size(cfg) + (4 if cfg.lora.dropout > 0 else 0))
    return int(tokens_of(cfg) * (intermediates - freed + adapter))


def layer_gradient_buffers(shape: ModelShape, cfg: RunConfig) -> int:
    """Gradient buffers alive inside one layer's backward: the MLP's, plus the gradient of the
    residual stream that runs through every layer (in the weights' dtype)."""
    return mlp_gradient_buffers(shape, cfg) + int(tokens_of(cfg) * weight_size(cfg) * shape.hidden)


def dequant_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """QLoRA: one base linear dequantized to the compute dtype at a time (forward and backward), with what the
    backend allocates while it does (`dequantize_peak_per_value`)."""
    if not quantized(cfg):
        return 0
    size = compute_dtype(cfg.quant.compute_dtype, cfg.precision).itemsize
    return int(shape.largest_linear_params * dequantize_peak_per_value(cfg.quant.scheme, quant_backend(cfg), size))
