"""Closed-form bytes of a training run on one device: one function per category.

The traced engine (memory/trace.py) runs the real step on fake tensors; this engine reproduces the
same numbers from formulas, fast enough to search hundreds of candidate configurations. Every term
is documented in docs/planner.md; the activation terms count exactly the tensors the transformers
blocks save for backward (read off the tracker on tiny models, see tests/unit/memory/test_analytic.py).

Structure: `model_shape` (memory/model_shape.py) reads the architecture once (parameter counts by kind, from a `meta`
build); `weights_bytes`, `gradient_bytes`, `optimizer_state_bytes`, `activation_bytes`,
`peak_candidates` (temporaries) and `runtime_overheads` each return bytes for one category;
memory/analytic.py assembles the peak from them, with memory/distributed_estimate.py's per-rank terms.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memfit.config import RunConfig
from memfit.data.ram import estimate_data_ram_bytes
from memfit.memory.costs import QUANTS, checkpointed_layers
from memfit.memory.model_shape import (ModelShape, adapted_linears, linear_leaf_names, lora_params, trainable_params,
                                       trainable_value_bytes)
from memfit.strategies.loss import auto_chunk_tokens
from memfit.strategies.optimizers import TrainedParams, optimizer_entry
from memfit.strategies.precision import precision_entry
from memfit.strategies.table import STEP_STRATEGIES

MiB, GiB = 2**20, 2**30

# --- named runtime overheads for CUDA (justified in docs/planner.md) ------------------------------
CUDA_CONTEXT_BYTES = 500 * MiB       # driver context + kernel images (lazy loading); nvidia-smi shows it,
                                     # torch.cuda.max_memory_reserved does not
CUBLAS_WORKSPACE_BYTES = 32 * MiB    # cuBLAS(Lt) workspace, taken from the caching allocator (Hopper size)
ALLOCATOR_SEGMENT_BYTES = 2 * MiB    # caching allocator: large blocks come from segments rounded to 2 MiB
CPU_RUNTIME_BYTES = 400 * MiB        # python + torch + transformers + peft + memfit imported: peak RSS measured
                                     # 0.39 GiB on the 2-core CPU machine (2026-12-02)
CUDA_HOST_BYTES = 1 * GiB            # assumed host RSS of the CUDA runtime and kernels (not measured here;
                                     # bench/gpu_validate.py records the real process RSS)

def _weight_size(cfg: RunConfig) -> int:
    """Bytes per parameter of the model's weights (the precision's weight dtype)."""
    return precision_entry(cfg.precision).weight_bytes


def _compute_size(cfg: RunConfig) -> int:
    """Bytes per element of matmul outputs: the autocast dtype's under autocast, else the weights'."""
    return precision_entry(cfg.precision).compute_bytes


def _half_weights(cfg: RunConfig) -> bool:
    """A 16-bit model: each norm upcasts its input and keeps that fp32 copy instead of the input."""
    return _weight_size(cfg) < 4


def _fp32_compute(cfg: RunConfig) -> bool:
    """Everything computes in fp32, the LoRA adapters' own dtype: peft's cast of their input is a no-op."""
    return _compute_size(cfg) == 4


def _quant_mode(cfg: RunConfig) -> str:
    if cfg.method != "qlora":
        return cfg.quant.scheme or "none"
    quant = cfg.quant.scheme
    return "nf4-dq" if quant in (None, "none") else quant


def quantized_bytes_per_param(mode: str) -> float:
    """Storage of one quantized base weight, block scales included (the table in memory/costs.py)."""
    return QUANTS[mode].bytes_per_param


# --- categories --------------------------------------------------------------------------------------
def weights_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """Base weights (quantized block linears under QLoRA/int8) + LoRA adapters (fp32: peft upcasts)."""
    size = _weight_size(cfg)
    quant = _quant_mode(cfg)
    if quant != "none":
        block = shape.block_linear_params
        rest = shape.total_params - block
        # norms, embeddings, head: bf16 in a bf16-pure run, else fp32 (adapters.prepare_quantized_for_training)
        base = math.ceil(block * quantized_bytes_per_param(quant)) + rest * size
    else:
        base = shape.total_params * size
    return base + lora_params(shape, cfg) * 4


def gradient_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """One gradient per trainable parameter, in the parameter's dtype."""
    return trainable_params(shape, cfg) * trainable_value_bytes(cfg)


def trained_params(shape: ModelShape, cfg: RunConfig) -> TrainedParams:
    """The trainable parameters as an optimizer's states see them: full fine-tuning trains the block
    linears' matrices and everything else whole; LoRA each adapter's A (in x rank) and B (rank x out)."""
    if cfg.method == "full":
        matrices = tuple((i, o) for _, i, o in shape.linear)
        unfactored = shape.total_params - shape.block_linear_params
    else:
        r = cfg.lora.rank
        matrices = tuple(m for _, i, o in adapted_linears(shape, cfg) for m in ((i, r), (r, o)))
        unfactored = 0
    return TrainedParams(trainable_params(shape, cfg), trainable_value_bytes(cfg), matrices, unfactored)


def optimizer_state_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """Optimizer states of the trainable parameters (the optimizer's entry in memfit/strategies/optimizers.py)."""
    return optimizer_entry(cfg.optim.name).states(trained_params(shape, cfg))


def _layer_activation_bytes_per_token(shape: ModelShape, cfg: RunConfig) -> float:
    """Bytes one decoder layer saves for backward, per token (not counting attention scores).

    Derived from the tensors the transformers blocks keep alive between forward and backward:
    the residual stream (read by each norm's backward), each norm's normalised input, what every
    trainable linear needs (its input; under autocast each linear keeps its own 16-bit copy of its
    input), the attention inputs/output (q, k, v, out, log-sum-exp) and the MLP intermediates."""
    h, q, kv, i = shape.hidden, shape.q_dim, shape.kv_dim, shape.intermediate * shape.experts_per_token
    p, c = _weight_size(cfg), _compute_size(cfg)
    mixed = c != p
    full = cfg.method == "full"
    adapted = _adapted_leaves(shape, cfg)

    def trains(*names) -> int:  # number of these linears whose input must be saved
        return sum(1 for n in names if full or n in adapted)

    # residual stream: the input of each norm (its backward reads it). A bf16 model's RMSNorm keeps an
    # fp32 copy of its input instead, so there the residual itself is not kept.
    pure = _half_weights(cfg)
    total = 0 if pure else shape.norms_per_layer * h * p
    # norm internals: fp32 x*rsqrt (kept for the norm weight's gradient), rsqrt; bf16 model: fp32 copy of
    # x and the 16-bit normalised value
    norm_inner = (4 * h + 2 * h * full if pure else 4 * h * full) + 4
    if shape.family == "gpt":  # LayerNorm keeps mean and rstd, and its normalised output for the weight grad
        norm_inner = (p * h if full else 0) + 8
    total += shape.norms_per_layer * norm_inner
    # linear inputs: the attention-block input (q, k, v) and the MLP input (gate, up / fc1)
    leaves = linear_leaf_names(shape)
    n_attn = trains(*[n for n in _ATTENTION_INPUT_LINEARS if n in leaves])
    if full:
        total += n_attn * c * h if mixed else (n_attn > 0) * p * h
    else:  # adapters, and an 8-bit base's own copy of its input
        keeps = _base_keeps_input(cfg)
        total += _adapter_inputs_bytes_per_token(n_attn, h, cfg, kept_elsewhere=keeps) + keeps * p * h
    # attention: q (after RoPE), k, v, the output (also the o_proj input), log-sum-exp (fp32 per head)
    total += c * (2 * q + 2 * kv) + 4 * shape.heads
    for width in _attention_output_adapter_widths(shape, cfg):  # its input is the attention output
        total += _adapter_inputs_bytes_per_token(1, width, cfg, kept_elsewhere=True)
    total += _mlp_saved_bytes_per_token(shape, cfg)
    # LoRA: each adapter keeps its rank-r intermediate (lora_B's input)
    total += len(adapted) * cfg.lora.rank * _adapter_input_size(cfg) if not full else 0
    return total


_ATTENTION_INPUT_LINEARS = ("q_proj", "k_proj", "v_proj", "qkv_proj", "query_key_value", "c_attn", "Wqkv")
_MLP_INPUT_LINEARS = ("gate_proj", "up_proj", "gate_up_proj", "fc1", "c_fc", "dense_h_to_4h", "w1", "w3")


def _attention_output_adapter_widths(shape: ModelShape, cfg: RunConfig) -> list[int]:
    """Input widths of the adapted attention output projections of one layer (o_proj, dense, attn.c_proj)."""
    first = shape.linear[0][0].rsplit(".", 2)[0] if shape.linear else ""  # the first block's prefix
    return [i for name, i, _ in adapted_linears(shape, cfg)
            if name.startswith(first + ".") and ("attn" in name or "attention" in name)
            and name.rsplit(".", 1)[-1] not in _ATTENTION_INPUT_LINEARS]


def _adapter_input_size(cfg: RunConfig) -> int:
    """Bytes per element of what a LoRA adapter computes with: peft casts each adapter's input to the
    adapters' fp32 dtype (`_cast_input_dtype`); under autocast lora_A then recasts it to 16 bits."""
    mixed = _compute_size(cfg) != _weight_size(cfg)
    return _compute_size(cfg) if mixed else 4


def _adapter_inputs_bytes_per_token(n: int, width: int, cfg: RunConfig, kept_elsewhere: bool = False) -> float:
    """What `n` LoRA adapters reading one input of `width` features keep of it for backward, per token.

    Each adapter's lora_A saves the input it computed with: its own 16-bit recast under autocast, its own
    fp32 cast of a bf16 model's input, or, in an fp32 model, the input itself (shared, and nothing new if
    another op already keeps it: `kept_elsewhere`). With lora.dropout > 0 each adapter has its own
    dropout, so lora_A saves that adapter's dropout output instead, and the dropout keeps its mask:
    1 B per element in CUDA's fused kernel, 4 B (the fp32 input's dtype) in the unfused CPU kernel.
    The frozen base linear keeps nothing of its input."""
    if n == 0:
        return 0
    dropout = cfg.lora.dropout > 0
    shared = _fp32_compute(cfg) and not dropout
    copies = (0 if kept_elsewhere else 1) if shared else n
    return width * (copies * _adapter_input_size(cfg) + _dropout_masks_bytes(n, cfg))


def _dropout_masks_bytes(n: int, cfg: RunConfig) -> int:
    """Per input element, the masks of `n` adapters' dropouts: 1 B each in CUDA's fused kernel, 4 B on CPU."""
    return n * (4 if cfg.device == "cpu" else 1) if cfg.lora.dropout > 0 else 0


def _adapted_leaves(shape: ModelShape, cfg: RunConfig) -> set[str]:
    return {name.rsplit(".", 1)[-1] for name, _, _ in adapted_linears(shape, cfg)}


def _mlp_input_bytes_per_token(shape: ModelShape, cfg: RunConfig) -> int:
    """What one layer's MLP keeps of its input for backward, per token: each trainable gate/up linear's
    own 16-bit copy under autocast, else the input itself once."""
    p, c, full = _weight_size(cfg), _compute_size(cfg), cfg.method == "full"
    adapted = _adapted_leaves(shape, cfg)
    leaves = linear_leaf_names(shape)
    n_mlp = sum(1 for n in _MLP_INPUT_LINEARS if n in leaves and (full or n in adapted))
    if not full:
        keeps = _base_keeps_input(cfg)
        return _adapter_inputs_bytes_per_token(n_mlp, shape.hidden, cfg, kept_elsewhere=keeps) + keeps * p * shape.hidden
    return n_mlp * c * shape.hidden if c != p else (n_mlp > 0) * p * shape.hidden


def _mlp_saved_bytes_per_token(shape: ModelShape, cfg: RunConfig) -> int:
    """What one layer's MLP saves for backward, per token: its input and its intermediates: gated = up,
    gate, act(gate) and their product (the down_proj input, kept only if it trains); plain = fc1
    output and the activation output."""
    i, a = shape.intermediate * shape.experts_per_token, _mlp_activation_size(cfg)
    if cfg.method == "full":
        down = a * i
    else:
        keeps = _base_keeps_input(cfg)
        down = _adapter_inputs_bytes_per_token(int(_down_input_saved(shape, cfg)), i, cfg, kept_elsewhere=keeps)
        down += keeps * a * i
    return _mlp_input_bytes_per_token(shape, cfg) + a * i * (3 if shape.family == "llama" else 1) + down


def _mlp_activation_size(cfg: RunConfig) -> int:
    """Bytes per element of the MLP's intermediates: the matmuls' 16-bit outputs under autocast, except
    that bitsandbytes' quantized matmuls return their input's dtype (fp32 in a mixed-precision run):
    its 4-bit op everywhere, its 8-bit op on CUDA (on CPU the 8-bit training path is a plain F.linear,
    which autocast reaches)."""
    quant = _quant_mode(cfg)
    if quant == "none" or (quant == "int8" and cfg.device == "cpu"):
        return _compute_size(cfg)
    return _weight_size(cfg)


def _base_keeps_input(cfg: RunConfig) -> bool:
    """bitsandbytes' 8-bit matmul keeps its input for the backward (`ctx.tensors`/`ctx.A` in
    MatMul8bitLt on CUDA, MatMul8bitFp on CPU, bitsandbytes 0.50); its 4-bit matmul keeps only the
    packed weight."""
    return _quant_mode(cfg) == "int8"


def _attention_scores_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """Eager attention keeps the [batch, heads, seq, seq] probabilities (fp32 softmax, + a 16-bit copy)."""
    if cfg.memory.attention != "eager":
        return 0
    per = 4 if _compute_size(cfg) == 4 else 6
    return cfg.batch.micro_batch * shape.heads * cfg.data.seq_len * cfg.data.seq_len * per


def _weight_copies_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """Under autocast every matmul keeps the 16-bit copy of its weight that it computed with
    (needed for the input gradient); checkpointed layers recompute theirs in the backward."""
    if _compute_size(cfg) == _weight_size(cfg) or _quant_mode(cfg) != "none":
        return 0
    per_layer = shape.block_linear_params / shape.layers
    live_layers = shape.layers - checkpointed_layers(shape, cfg)
    head = shape.lm_head_params or shape.embedding_params
    return int(2 * (per_layer * live_layers + head))


def _norm_bytes_per_token(shape: ModelShape, cfg: RunConfig) -> float:
    """One norm: its input (unless a bf16 model's fp32 copy replaces it) and its internals."""
    h, p, full = shape.hidden, _weight_size(cfg), cfg.method == "full"
    if _half_weights(cfg):
        return 4 * h + 2 * h * full + 4
    return h * p + 4 * h * full + 4


def _layer_bytes(shape: ModelShape, cfg: RunConfig) -> float:
    """Everything one decoder layer saves for one micro-batch."""
    tokens = cfg.batch.micro_batch * cfg.data.seq_len
    return _layer_activation_bytes_per_token(shape, cfg) * tokens + _attention_scores_bytes(shape, cfg)


def _loss_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """The log-softmax output the cross-entropy keeps, fp32 (transformers upcasts the logits)."""
    return cfg.batch.micro_batch * cfg.data.seq_len * shape.vocab * 4


def _chunk_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """One chunk of the chunked loss: its fp32 logits (chunk tokens x vocab x 4 B)."""
    tokens = cfg.batch.micro_batch * cfg.data.seq_len
    return min(tokens, auto_chunk_tokens(tokens, shape.vocab, shape.hidden)) * shape.vocab * 4


def _loss_buffer_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """The loss's two largest transient blocks: d log-softmax and d logits over all tokens, or with
    the chunked loss two of one chunk's buffers."""
    return 2 * (_chunk_bytes(shape, cfg) if cfg.memory.chunked_loss else _loss_bytes(shape, cfg))


def activation_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """Tensors saved for backward at the end of one micro-batch's forward (the backward's start)."""
    tokens = cfg.batch.micro_batch * cfg.data.seq_len
    p, c, full = _weight_size(cfg), _compute_size(cfg), cfg.method == "full"
    ckpt = checkpointed_layers(shape, cfg)
    layers = (shape.layers - ckpt) * _layer_bytes(shape, cfg) + ckpt * tokens * shape.hidden * p  # ckpt: input only
    if not full and shape.layers > ckpt:
        # the first layer's input is the frozen embedding's output: no gradient, so neither it nor the
        # dropout masks of the adapters reading its norm are kept
        layers -= tokens * shape.hidden * p
        n_attn = len(_adapted_leaves(shape, cfg).intersection(_ATTENTION_INPUT_LINEARS))
        layers -= tokens * shape.hidden * (_dropout_masks_bytes(n_attn, cfg) + _base_keeps_input(cfg) * p)
    rope = 2 * cfg.data.seq_len * shape.head_dim * p if shape.family == "llama" else 0
    batch = 4 * tokens * 8  # input_ids, attention_mask, labels and the shifted labels, int64
    return int(layers + _head_bytes(shape, cfg) + _loss_bytes(shape, cfg) + rope + batch
               + _weight_copies_bytes(shape, cfg))


def eval_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """The evaluation after a step (train/evaluate.py): gradients are freed and nothing is saved for
    backward, so beside the weights and optimizer states only the working set of one eval
    micro-batch is alive: the residual stream, the 16-bit copies of trained weights under autocast, and
    the larger of one layer's intermediates and the loss (16-bit logits, their fp32 upcast and the
    fp32 log-softmax; with the chunked loss, one chunk of them)."""
    cfg = cfg.updated({"batch.micro_batch": cfg.eval.micro_batch or cfg.batch.micro_batch})
    tokens = cfg.batch.micro_batch * cfg.data.seq_len
    c = _compute_size(cfg)
    logits_per_token = shape.vocab * (8 + (c if c != 4 else 0))
    loss = logits_per_token * (min(tokens, auto_chunk_tokens(tokens, shape.vocab, shape.hidden))
                               if cfg.memory.chunked_loss else tokens)
    width = shape.intermediate * shape.experts_per_token
    layer = (tokens * width * c * (3 if shape.family == "llama" else 2) + _attention_scores_bytes(shape, cfg)
             + _dequant_bytes(shape, cfg))
    copies = 0  # autocast caches its 16-bit casts of weights that require grad, also under no_grad
    if cfg.method == "full" and c != _weight_size(cfg):
        copies = 2 * (shape.block_linear_params + (shape.lm_head_params or shape.embedding_params))
    return int(weights_bytes(shape, cfg) + optimizer_state_bytes(shape, cfg) + copies
               + 2 * tokens * shape.hidden * c + max(layer, loss))


def _head_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """What the final norm and the lm_head save; both are freed before the last layer's backward."""
    tokens = cfg.batch.micro_batch * cfg.data.seq_len
    p, c, full = _weight_size(cfg), _compute_size(cfg), cfg.method == "full"
    # lm_head input: kept when lm_head trains, or as the 16-bit autocast copy; shared in fp32
    head_input = tokens * shape.hidden * c if (c != p or full) else 0
    return int(tokens * _norm_bytes_per_token(shape, cfg) + head_input)


def _mlp_gradient_buffers(shape: ModelShape, cfg: RunConfig) -> int:
    """The gradients of the MLP's intermediates in its backward (down input, act output, up output:
    3 x tokens x intermediate, 2 for a plain MLP), less the down projection's saved input once its
    own backward has freed it. With an adapter on the down projection of a 16-bit model, peft's cast
    of the adapter's input gives the adapter's gradient a path of its own: its cast back to the
    input's dtype (p), and with dropout one more fp32 gradient (through the mask), before it joins the
    base's; in an fp32 model it accumulates into the base's input gradient (read off the tracker)."""
    tokens = cfg.batch.micro_batch * cfg.data.seq_len
    width = shape.intermediate * shape.experts_per_token
    a = _mlp_activation_size(cfg)
    intermediates = width * a * (3 if shape.family == "llama" else 2)
    freed = width * a if _down_input_saved(shape, cfg) else 0
    adapter = 0
    if cfg.method != "full" and _down_input_saved(shape, cfg) and not _fp32_compute(cfg):
        adapter = width * (_weight_size(cfg) + (4 if cfg.lora.dropout > 0 else 0))
    return int(tokens * (intermediates - freed + adapter))


def _layer_gradient_buffers(shape: ModelShape, cfg: RunConfig) -> int:
    """Gradient buffers alive inside one layer's backward: the MLP's, plus the gradient of the
    residual stream that runs through every layer (in the weights' dtype)."""
    tokens = cfg.batch.micro_batch * cfg.data.seq_len
    return _mlp_gradient_buffers(shape, cfg) + int(tokens * _weight_size(cfg) * shape.hidden)


def _down_input_saved(shape: ModelShape, cfg: RunConfig) -> bool:
    """Whether the MLP's down projection keeps its input (it trains, or carries an adapter)."""
    if cfg.method == "full":
        return True
    adapted = _adapted_leaves(shape, cfg)
    return bool(adapted & {"down_proj", "fc2", "c_proj", "dense_4h_to_h", "w2"})


def _dequant_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """QLoRA: one base linear dequantized to the compute dtype at a time (forward and backward)."""
    return max(i * o for _, i, o in shape.linear) * 2 if _quant_mode(cfg) != "none" else 0


def _optimizer_scratch(shape: ModelShape, cfg: RunConfig) -> int:
    """torch's foreach steps (AdamW, SGD, Adafactor) build one scratch copy of the trainable parameters
    (e.g. Adam's denominator); bitsandbytes/torchao 8-bit optimizers update block by block."""
    if optimizer_entry(cfg.optim.name).foreach_scratch:
        return trainable_params(shape, cfg) * trainable_value_bytes(cfg)
    return 0


def peak_candidates(shape: ModelShape, cfg: RunConfig) -> dict[str, dict[str, int]]:
    """Bytes per category at the moments where a step can peak; the largest total is the peak.

    backward_start  all activations + the loss gradient (d log-softmax and d logits, fp32 T x V)
    backward_last   the last layer's backward: the log-softmax output is freed, that layer's MLP
                    gradient buffers (and, if checkpointed, its recomputed activations) are alive
    backward_first  the first layer's backward: only its activations remain, nearly all gradients exist
    optimizer_step  weights + gradients + states + the optimizer's scratch
    Under gradient accumulation, the gradients of earlier micro-batches are alive throughout."""
    tokens = cfg.batch.micro_batch * cfg.data.seq_len
    weights = weights_bytes(shape, cfg)
    grads = gradient_bytes(shape, cfg)
    states = optimizer_state_bytes(shape, cfg)
    acts = activation_bytes(shape, cfg)
    layer = int(_layer_bytes(shape, cfg))
    buffers = _layer_gradient_buffers(shape, cfg) + _dequant_bytes(shape, cfg)
    accumulated = grads if cfg.batch.grad_accum > 1 else 0
    ckpt_every = cfg.memory.activation_checkpoint_every
    last_ckpt = bool(ckpt_every) and (shape.layers - 1) % ckpt_every == 0
    # a recomputed layer's saved tensors include its residual input (not in bf16-pure, where the
    # norm keeps an fp32 copy instead), which the checkpoint already holds in the activations
    ckpt_input = 0 if _half_weights(cfg) else tokens * shape.hidden * _weight_size(cfg)
    # the first layer's backward: everything else freed; its own activations (recomputed if checkpointed)
    grads_before_first = grads - (grads // shape.layers if cfg.method == "full" else 0)
    small = 4 * tokens * 8 + 2 * cfg.data.seq_len * shape.head_dim * 4
    base = dict(weights=weights, optimizer_states=states)
    return {
        "backward_start": dict(base, gradients=accumulated, activations=acts,
                               temporaries=2 * _loss_bytes(shape, cfg) + _dequant_bytes(shape, cfg)),
        "backward_last": dict(base, gradients=accumulated,
                              activations=acts - _loss_bytes(shape, cfg) - _head_bytes(shape, cfg),
                              temporaries=buffers + (layer - ckpt_input if last_ckpt else 0)),
        "backward_first": dict(base, gradients=max(accumulated, grads_before_first),
                               activations=small + (0 if ckpt_every else layer),
                               temporaries=buffers + (layer if ckpt_every else 0)),
        "optimizer_step": dict(base, gradients=grads, activations=0, temporaries=_optimizer_scratch(shape, cfg)),
    }


def runtime_overheads(cfg: RunConfig, device: str, transient_bytes: int) -> dict[str, int]:
    """Memory the tracker cannot see. On CUDA: the context (outside the allocator), the cuBLAS
    workspace, and the allocator's reserve: blocks freed during the step stay cached and cannot
    always serve differently-sized requests (docs/planner.md)."""
    if device != "cuda":
        return {}
    return {"cuda_context": CUDA_CONTEXT_BYTES, "cublas_workspace": CUBLAS_WORKSPACE_BYTES,
            "allocator_reserve": int(transient_bytes)}


def cpu_ram_bytes(shape: ModelShape, cfg: RunConfig, device: str) -> dict[str, int]:
    """Host RAM: the runtime, the loading path, the data side, anything offloaded."""
    terms = {"runtime": CPU_RUNTIME_BYTES + (CUDA_HOST_BYTES if device == "cuda" else 0)}
    # safetensors are memory-mapped; from_pretrained materialises one full copy in the load dtype, counted
    # at the compute dtype's size (on CUDA it then moves to the GPU and the host copy is freed, so the peak
    # is one copy).
    load = shape.total_params * _compute_size(cfg)
    terms["model_load"] = load
    # The data path's own estimate; a data.path that cannot be read here stops the plan with its DataError.
    terms["data"] = int(estimate_data_ram_bytes(cfg))
    if device == "cpu":  # training on CPU: the whole training state lives in RAM
        terms["training_state"] = 0  # filled in by analytic_estimate
    return terms


def shard_model_states(by_category: dict[str, int], cfg: RunConfig, gpus: int, where: str = "") -> dict[str, int]:
    """ZeRO stages divide the model states over the data-parallel ranks (per-rank bytes):
    zero1 optimizer states, zero2 + gradients, zero3 + weights (FSDP keeps one layer gathered:
    not counted here). offload moves optimizer states (and with params/all the weights and
    gradients) to host RAM. The distributed module may refine these terms."""
    sharding, offload = cfg.distributed.sharding, cfg.distributed.offload
    world = max(gpus // (cfg.distributed.tensor_parallel * cfg.distributed.pipeline_parallel), 1)
    out = dict(by_category)
    stage = {"zero1": 1, "zero2": 2, "zero3": 3}.get(sharding, 0)
    for category, from_stage in (("optimizer_states", 1), ("gradients", 2), ("weights", 3)):
        if stage >= from_stage:
            out[category] = math.ceil(out[category] / world)
    if where == "optimizer_step" and stage >= 1:  # each rank steps its own shard
        out["temporaries"] = math.ceil(out["temporaries"] / world)
    if offload != "none" and stage >= 2:
        out["optimizer_states"] = 0
        if where == "optimizer_step":  # the step runs on the CPU
            out["temporaries"] = 0
        if offload in ("params", "all"):
            out["weights"] = out["gradients"] = 0
    return out


# --- step strategies: chunked loss, optimizer step in backward, activation offload ------------------------
# Their own terms live beside their code (memfit/strategies/{loss,optimizer_in_backward,activation_offload}.py).


def _largest_param_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """The biggest single trainable parameter: the most gradient optimizer_in_backward ever holds."""
    if cfg.method == "full":
        largest = max([i * o for _, i, o in shape.linear] + [shape.embedding_params, shape.lm_head_params or 0])
    else:
        largest = max([cfg.lora.rank * max(i, o) for _, i, o in adapted_linears(shape, cfg)] or [0])
    return largest * trainable_value_bytes(cfg)


@dataclass
class StrategyTerms:
    """The run's sizes a step strategy's memory and work functions read (memfit/strategies/step_strategy.py)."""

    shape: ModelShape
    cfg: RunConfig
    device: str

    @property
    def tokens(self) -> int:
        return self.cfg.batch.micro_batch * self.cfg.data.seq_len

    @property
    def micro_batches(self) -> int:
        return self.cfg.batch.grad_accum

    @property
    def loss_bytes(self) -> int:
        return _loss_bytes(self.shape, self.cfg)

    @property
    def saved_loss_bytes(self) -> int:
        """What the loss keeps for backward: nothing under the chunked loss, which recomputes it."""
        return 0 if self.cfg.memory.chunked_loss else self.loss_bytes

    @property
    def chunk_bytes(self) -> int:
        return _chunk_bytes(self.shape, self.cfg)

    @property
    def layer_bytes(self) -> int:
        return int(_layer_bytes(self.shape, self.cfg))

    @property
    def hidden_bytes(self) -> int:
        """One [tokens x hidden] tensor in the weights' dtype: a checkpointed layer's saved input."""
        return self.tokens * self.shape.hidden * _weight_size(self.cfg)

    @property
    def live_layers(self) -> int:
        """Layers that are not checkpointed (they save all their tensors in the forward)."""
        return self.shape.layers - checkpointed_layers(self.shape, self.cfg)

    @property
    def last_layer_checkpointed(self) -> bool:
        every = self.cfg.memory.activation_checkpoint_every
        return bool(every) and (self.shape.layers - 1) % every == 0

    @property
    def mlp_saved_bytes(self) -> int:
        """What one layer's MLP saves for backward (its input copies and intermediates), all tokens."""
        return self.tokens * _mlp_saved_bytes_per_token(self.shape, self.cfg)

    @property
    def mlp_input_bytes(self) -> int:
        """The part of mlp_saved_bytes that is the MLP's input."""
        return self.tokens * _mlp_input_bytes_per_token(self.shape, self.cfg)

    @property
    def attention_buffer_bytes(self) -> int:
        """The gradients of q, k, v and the attention output in one layer's backward, all tokens."""
        shape = self.shape
        return self.tokens * _compute_size(self.cfg) * (2 * shape.q_dim + 2 * shape.kv_dim)

    @property
    def mlp_buffer_bytes(self) -> int:
        """The gradients of one layer's MLP intermediates in its backward, all tokens."""
        return _mlp_gradient_buffers(self.shape, self.cfg)

    @property
    def largest_param_bytes(self) -> int:
        return _largest_param_bytes(self.shape, self.cfg)

    @property
    def activation_bytes(self) -> int:
        return activation_bytes(self.shape, self.cfg)


def beyond_basics_terms(candidates: dict[str, dict[str, int]], shape: ModelShape, cfg: RunConfig,
                        device: str) -> dict[str, dict[str, int]]:
    """peak_candidates as the run's step strategies change them (memfit/strategies/table.py; each
    entry's `peak`, in the table's order; no-ops when off)."""
    out = {moment: dict(values) for moment, values in candidates.items()}
    terms = StrategyTerms(shape, cfg, device)
    for strategy in STEP_STRATEGIES:
        if strategy.peak is not None and getattr(cfg.memory, strategy.name):
            strategy.peak(out, terms)
    return out


def strategy_host_bytes(shape: ModelShape, cfg: RunConfig, device: str) -> dict[str, int]:
    """The host RAM each of the run's step strategies adds (its entry's `host_bytes`), by name."""
    terms = StrategyTerms(shape, cfg, device)
    found = {strategy.name: strategy.host_bytes(terms) for strategy in STEP_STRATEGIES
             if strategy.host_bytes is not None and getattr(cfg.memory, strategy.name)}
    return {name: value for name, value in found.items() if value}
