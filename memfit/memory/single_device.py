"""The peak of one training step on one device: the moments where it can peak, with the bytes of each
category at each (model states from memory/model_states.py, activations and buffers from
memory/activations.py), what the run's step strategies change in them, the CUDA runtime's own
overheads and the host RAM. memory/analytic.py takes the largest moment.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.config import RunConfig
from memfit.config.step_rules import strategy_options
from memfit.data.ram import estimate_data_ram_bytes
from memfit.memory.activations import (activation_bytes, attention_scores_bytes, chunk_bytes, checkpointed_layers,
                                       dequant_bytes, head_bytes, layer_bytes, layer_gradient_buffers,
                                       layer_weight_copies_bytes, loss_bytes,
                                       mlp_gradient_buffers, mlp_input_bytes_per_token, mlp_saved_bytes_per_token,
                                       mlp_width, tokens_of)
from memfit.memory.families import family_of
from memfit.memory.model_shape import MLP_INPUT, MLP_OUTPUT, ModelShape, block_linears, trainable_value_bytes
from memfit.memory.model_states import (ModelStates, compute_size, gradient_bytes, half_weights, head_gradient_bytes,
                                        largest_param_bytes, optimizer_scratch, optimizer_state_bytes, weight_size,
                                        weights_bytes)
from memfit.models.load_plan import node_load_bytes
from memfit.strategies.engines import sharding_entry
from memfit.strategies.loss import auto_chunk_tokens
from memfit.strategies.quantization import (QuantizationError, compute_dtype, quantizes_after_loading,
                                           quantizes_while_loading, torchao_quantize_peak_per_value)
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


def peak_candidates(shape: ModelShape, cfg: RunConfig, states: ModelStates) -> dict[str, dict[str, int]]:
    """Bytes per category at the moments where a step can peak; the largest total is the peak.

    backward_start  all activations + the loss gradient (d log-softmax and d logits, fp32 T x V)
    backward_last   the last layer's backward: the log-softmax output is freed, that layer's MLP
                    gradient buffers (and, if checkpointed, its recomputed activations) are alive, and
                    under full fine-tuning the lm_head's gradient (and as it is made, its 16-bit copy's)
    backward_first  the first layer's backward: only its activations remain, nearly all gradients exist
    optimizer_step  weights + gradients + states + the optimizer's scratch
    Under gradient accumulation, the gradients of earlier micro-batches are alive throughout. `states`:
    one device's (memory/model_states.py) or one rank's (memory/distributed_estimate.py); what its engine
    holds beside them is added by `with_engine_holdings`."""
    tokens = tokens_of(cfg)
    grads = states.gradients
    acts = activation_bytes(shape, cfg)
    layer = int(layer_bytes(shape, cfg))
    buffers = layer_gradient_buffers(shape, cfg) + dequant_bytes(shape, cfg)
    accumulated = max(grads if cfg.batch.grad_accum > 1 else 0, states.persistent_gradients)
    ckpt_every = cfg.memory.activation_checkpoint_every
    last_ckpt = bool(ckpt_every) and (shape.layers - 1) % ckpt_every == 0
    # a recomputed layer's saved tensors include its residual input (not in bf16-pure, where the
    # norm keeps an fp32 copy instead), which the checkpoint already holds in the activations
    ckpt_input = 0 if half_weights(cfg) else tokens * shape.hidden * weight_size(cfg)
    recomputed = layer + layer_weight_copies_bytes(shape, cfg)  # a checkpointed layer in its backward
    # the first layer's backward: everything else freed; its own activations (recomputed if checkpointed)
    grads_before_first = grads - (grads // shape.layers if cfg.method == "full" else 0)
    head_grads = grads * head_gradient_bytes(shape, cfg) // max(gradient_bytes(shape, cfg), 1)  # this rank's share
    small = 4 * tokens * 8 + 2 * cfg.data.seq_len * shape.head_dim * 4
    new_head = head_gradient_in_flight_bytes(shape, cfg)
    base = dict(weights=states.weights, optimizer_states=states.optimizer_states)
    moments = {
        "backward_start": dict(base, gradients=accumulated, activations=acts,
                               temporaries=2 * loss_bytes(shape, cfg)),
        "backward_last": dict(base, gradients=max(accumulated, head_grads),
                              activations=acts - loss_bytes(shape, cfg) - head_bytes(shape, cfg),
                              temporaries=buffers + new_head + (recomputed - ckpt_input if last_ckpt else 0)),
        "backward_first": dict(base, gradients=max(accumulated, grads_before_first),
                               activations=small + (0 if ckpt_every else layer),
                               temporaries=buffers + (recomputed if ckpt_every else 0)),
        "optimizer_step": dict(base, gradients=max(grads, states.persistent_gradients), activations=0,
                               temporaries=states.optimizer_scratch),
    }
    return moments


def head_gradient_in_flight_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """The lm_head's new gradient as autograd makes it, beside the gradients already counted (full
    fine-tuning): under autocast its 16-bit copy's gradient, cast to the weight's dtype; where gradients
    already exist (earlier micro-batches, DDP's buckets) that cast is a temporary too until it is added to
    them. Measured on a 124.7M-parameter Llama (32,000-token vocabulary, bf16-mixed, grad_accum 2): 6 bytes
    per lm_head parameter beside the accumulated gradients."""
    if cfg.method != "full":
        return 0
    copy = shape.head_params * compute_size(cfg) if compute_size(cfg) != weight_size(cfg) else 0
    accumulating = cfg.batch.grad_accum > 1 or sharding_entry(cfg.distributed.sharding).gradient_buckets
    return copy + (head_gradient_bytes(shape, cfg) if accumulating else 0)


def with_engine_holdings(moments: dict[str, dict[str, int]], states: ModelStates) -> dict[str, dict[str, int]]:
    """The moments with what the engine holds beside the model states (`states.beside`: FSDP2's gathered
    weights and gradient buffers), added after the step strategies' terms, which change only what the step
    itself allocates; an engine's own moments (FSDP2's backward end) start from the states alone."""
    base = dict(weights=states.weights, optimizer_states=states.optimizer_states,
                gradients=max(states.gradients, states.persistent_gradients), activations=0, temporaries=0)
    out = {moment: dict(values) for moment, values in moments.items()}
    for moment, held in states.beside.items():
        at = out.setdefault(moment, dict(base))
        for category, nbytes in held.items():
            at[category] += nbytes
    return out


def runtime_overheads(cfg: RunConfig, device: str, transient_bytes: int) -> dict[str, int]:
    """Memory the tracker cannot see. On CUDA: the context (outside the allocator), the cuBLAS
    workspace, and the allocator's reserve: blocks freed during the step stay cached and cannot
    always serve differently-sized requests (docs/planner.md)."""
    if device != "cuda":
        return {}
    return {"cuda_context": CUDA_CONTEXT_BYTES, "cublas_workspace": CUBLAS_WORKSPACE_BYTES,
            "allocator_reserve": int(transient_bytes)}


def load_bytes(shape: ModelShape, cfg: RunConfig, device: str, ranks: int = 1) -> int:
    """Host RAM the loading processes of a node hold while they load (memfit/models/load_plan.py)."""
    method = dict(method=cfg.method, scheme=cfg.quant.scheme, backend=cfg.quant_backend)
    try:
        after, during = quantizes_after_loading(**method), quantizes_while_loading(**method)
    except QuantizationError:  # nothing here can quantize it: the trainer refuses such a run before it loads
        after = during = False
    compute = compute_dtype(cfg.quant.compute_dtype, cfg.precision).itemsize
    quantizing = int(shape.largest_linear_params * (shape.checkpoint_bytes + torchao_quantize_peak_per_value(compute)))
    return node_load_bytes(cfg, device, ranks, shape.total_params, weight_size(cfg), shape.checkpoint_bytes,
                           shape.largest_tensor_params, quantized_after_load=after, quantized_while_loading=during,
                           quantizing_bytes=quantizing if after else 0)


def host_peak_bytes(ram: dict[str, int], load_beside_states: bool = False) -> int:
    """The host RAM peak from its terms: the runtime and the data side throughout, and the larger of the
    load (before the first step) and what the steps hold (offloaded states, parked activations, a CPU
    run's training state); both together where the engine places its host states while loading
    (`load_plan.load_beside_host_states`)."""
    base = ram.get("runtime", 0) + ram.get("data", 0)
    step = sum(value for key, value in ram.items() if key not in ("runtime", "data", "model_load"))
    load = ram.get("model_load", 0)
    return base + (load + step if load_beside_states else max(load, step))


def cpu_ram_bytes(shape: ModelShape, cfg: RunConfig, device: str) -> dict[str, int]:
    """Host RAM of one process by term: the runtime, the load (memfit/models/load_plan.py), the data side;
    analytic_estimate adds what the steps park there. `host_peak_bytes` makes the peak of them."""
    terms = {"runtime": CPU_RUNTIME_BYTES + (CUDA_HOST_BYTES if device == "cuda" else 0)}
    terms["model_load"] = load_bytes(shape, cfg, device)
    # The data path's own estimate; a data.path that cannot be read here stops the plan with its DataError.
    terms["data"] = int(estimate_data_ram_bytes(cfg))
    if device == "cpu":  # training on CPU: the whole training state lives in RAM
        terms["training_state"] = 0  # filled in by analytic_estimate
    return terms


def eval_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """The evaluation after a step (train/evaluate.py): gradients are freed and nothing is saved for
    backward, so beside the weights and optimizer states only the working set of one eval
    micro-batch is alive: the residual stream, the 16-bit copies of trained weights under autocast, and
    the larger of one layer's intermediates and the loss (16-bit logits, their fp32 upcast and the
    fp32 log-softmax; with the chunked loss, one chunk of them)."""
    cfg = cfg.updated({"batch.micro_batch": cfg.eval.micro_batch or cfg.batch.micro_batch})
    tokens = tokens_of(cfg)
    c = compute_size(cfg)
    logits_per_token = shape.vocab * (8 + (c if c != 4 else 0))
    loss = logits_per_token * (min(tokens, auto_chunk_tokens(tokens, shape.vocab, shape.hidden))
                               if cfg.memory.chunked_loss else tokens)
    width = mlp_width(shape)
    layer = (tokens * width * c * family_of(shape).MLP_WORKING_INTERMEDIATES + attention_scores_bytes(shape, cfg)
             + dequant_bytes(shape, cfg))
    copies = 0  # autocast caches its 16-bit casts of weights that require grad, also under no_grad
    if cfg.method == "full" and c != weight_size(cfg):
        copies = 2 * (shape.block_linear_params + shape.head_params)
    return int(weights_bytes(shape, cfg) + optimizer_state_bytes(shape, cfg) + copies
               + 2 * tokens * shape.hidden * c + max(layer, loss))


@dataclass
class StrategyTerms:
    """The run's sizes a step strategy's memory and work functions read (memfit/strategies/step_strategy.py)."""

    shape: ModelShape
    cfg: RunConfig
    device: str

    @property
    def options(self) -> dict:
        """The step strategies' own settings (`memory.<option>`), by option name."""
        return {name: value for strategy in STEP_STRATEGIES for name, value in strategy_options(self.cfg, strategy).items()}

    @property
    def any_layer_checkpointed(self) -> bool:
        return bool(self.cfg.memory.activation_checkpoint_every)

    @property
    def tokens(self) -> int:
        return tokens_of(self.cfg)

    @property
    def micro_batches(self) -> int:
        return self.cfg.batch.grad_accum

    @property
    def loss_bytes(self) -> int:
        return loss_bytes(self.shape, self.cfg)

    @property
    def saved_loss_bytes(self) -> int:
        """What the loss keeps for backward: nothing under the chunked loss, which recomputes it."""
        return 0 if self.cfg.memory.chunked_loss else self.loss_bytes

    @property
    def chunk_bytes(self) -> int:
        return chunk_bytes(self.shape, self.cfg)

    @property
    def layer_bytes(self) -> int:
        return int(layer_bytes(self.shape, self.cfg))

    @property
    def hidden_bytes(self) -> int:
        """One [tokens x hidden] tensor in the weights' dtype: a checkpointed layer's saved input."""
        return self.tokens * self.shape.hidden * weight_size(self.cfg)

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
        return self.tokens * mlp_saved_bytes_per_token(self.shape, self.cfg)

    @property
    def mlp_input_bytes(self) -> int:
        """The part of mlp_saved_bytes that is the MLP's input."""
        return self.tokens * mlp_input_bytes_per_token(self.shape, self.cfg)

    @property
    def attention_buffer_bytes(self) -> int:
        """The gradients of q, k, v and the attention output in one layer's backward, all tokens."""
        shape = self.shape
        return self.tokens * compute_size(self.cfg) * (2 * shape.q_dim + 2 * shape.kv_dim)

    @property
    def mlp_buffer_bytes(self) -> int:
        """The gradients of one layer's MLP intermediates in its backward, all tokens."""
        return mlp_gradient_buffers(self.shape, self.cfg)

    @property
    def mlp_weight_gradient_bytes(self) -> int:
        """One layer's MLP weight gradients, when they train (full fine-tuning)."""
        if self.cfg.method != "full":
            return 0
        params = sum(i * o for role in (MLP_INPUT, MLP_OUTPUT) for _, i, o in block_linears(self.shape, self.cfg, role))
        return params * trainable_value_bytes(self.cfg)

    @property
    def head_gradient_in_flight_bytes(self) -> int:
        return head_gradient_in_flight_bytes(self.shape, self.cfg)

    @property
    def largest_param_bytes(self) -> int:
        return largest_param_bytes(self.shape, self.cfg)

    @property
    def head_gradient_bytes(self) -> int:
        return head_gradient_bytes(self.shape, self.cfg)

    @property
    def largest_param_update_bytes(self) -> int:
        """The optimizer's scratch while it updates the largest parameter alone."""
        largest = self.largest_param_bytes
        return optimizer_scratch(self.cfg, self.device, largest, largest)

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
