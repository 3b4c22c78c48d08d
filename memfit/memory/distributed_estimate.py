"""Per-rank memory of a distributed run: model states and activations for ddp, zero1/2/3,
CPU offload, tensor parallel (K) and pipeline parallel (S), as memfit/distributed runs them.

Closed form, in the same categories as the single-device terms, whose model states
(memory/model_states.py) and per-token activation and loss terms (memory/activations.py) it reuses;
what each data-parallel engine shards and keeps gathered is its entry's (memfit/strategies/engines.py).
N = data-parallel ranks.

Model states per rank (W weights, G gradients, O optimizer states of one process):
  ddp    W + G + O; DDP's gradient buckets (gradients are views into them) stay allocated
         between steps, so G counts at every moment, not only after the backward.
  zero1  W + G (buckets) + O/N                        ZeroRedundancyOptimizer
  zero2  W/N + G/N + O/N; from the forward to each block's backward every block's gathered
         (unsharded) weights stay: + W at the backward's start   FSDP2 reshard_after_forward=False
  zero3  W/N + G/N + O/N; gathered: the root (embeddings, norm, lm_head) + 2 blocks (the one
         computing and the one prefetched)                       FSDP2 reshard_after_forward=True
  FSDP2 also holds one block's flat all-gather output while copying it out (+1 block).
  offload (params/all, FSDP2 CPUOffloadPolicy): the sharded W, G, O live in host RAM; on a
         CUDA device only the gathered blocks remain. On a CPU device nothing moves.
  tp K   block linears split K ways (weights, grads, states, and the head/MLP-width
         activations); embeddings, norms, lm_head and hidden-size activations replicated.
  pp S   rank s: its blocks (+ embeddings on the first, norm + lm_head on the last; a tied
         lm_head is a second copy there); GPipe keeps the activations of every pipeline
         micro-batch of the step (micro_batch sequences padded to seq_len) until the backward.

Peak = the largest of these moments: the backward's start (activations, loss buffers, gathered
weights), for pipelines the end of the first pipeline micro-batch's backward, and the optimizer step (all gradients + the optimizer's scratch: on CUDA torch's
foreach kernels take one copy of the parameters; on CPU the per-tensor loop ~4 x the largest
tensor). Validated against the tracker on 2 gloo ranks in tests/integration/test_distributed.py.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.distributed.pipeline import stage_blocks
from memfit.memory.activations import (attention_scores_bytes, activation_bytes, layer_bytes, layer_bytes_per_token,
                                       layer_gradient_buffers, loss_bytes, tokens_of)
from memfit.memory.model_shape import adapted_linears, trainable_value_bytes
from memfit.memory.model_states import compute_size, gradient_bytes, optimizer_state_bytes, weight_size, weights_bytes
from memfit.strategies.engines import offload_entry, sharding_entry
from memfit.strategies.optimizers import optimizer_entry

CPU_OPTIMIZER_SCRATCH_TENSORS = 4  # torch's single-tensor AdamW: ~4 temporaries of the tensor updated


@dataclass
class RankStates:
    """One rank's bytes, by what holds them."""

    weights: int
    gradients: int                  # when every gradient exists (after the backward)
    optimizer_states: int
    persistent_gradients: int = 0   # allocated at every moment (DDP buckets)
    gathered_weights: int = 0       # FSDP2 unsharded weights alive at the backward's start
    gather_buffer: int = 0          # FSDP2 flat all-gather output (one block)
    host_bytes: int = 0             # offloaded to CPU RAM
    notes: list[str] = field(default_factory=list)


def _counts(shape) -> tuple[int, int, int]:
    """(params of one block, params outside the blocks, params of one block's linears)."""
    root = shape.embedding_params + shape.lm_head_params + shape.hidden  # + final norm
    block = (shape.total_params - root) // max(shape.layers, 1)
    return block, root, shape.block_linear_params // max(shape.layers, 1)


def data_parallel_ranks(cfg, gpus: int) -> int:
    """The ranks that each train on their own micro-batches: the GPUs over the tensor x pipeline degree."""
    return max(gpus // (cfg.distributed.tensor_parallel * cfg.distributed.pipeline_parallel), 1)


def rank_states(shape, cfg, gpus: int, device: str = "cuda", stage: int = 0) -> RankStates:
    """Model-state bytes on one rank (stage: which pipeline stage, 0 = first)."""
    weights, grads, states = (weights_bytes(shape, cfg), gradient_bytes(shape, cfg),
                              optimizer_state_bytes(shape, cfg))
    size = weights / max(shape.total_params, 1)  # bytes per weight
    block, root, block_linear = _counts(shape)
    n = data_parallel_ranks(cfg, gpus)
    if cfg.distributed.tensor_parallel > 1:
        k = cfg.distributed.tensor_parallel
        kept = (shape.total_params - shape.layers * block_linear * (1 - 1 / k)) / shape.total_params
        return RankStates(int(weights * kept), int(grads * kept), int(states * kept),
                          notes=[f"tensor parallel {k}: block linears split {k} ways"])
    if cfg.distributed.pipeline_parallel > 1:
        s = cfg.distributed.pipeline_parallel
        blocks = len(stage_blocks(shape.layers, s, stage))
        params = blocks * block + (shape.embedding_params if stage == 0 else 0)
        if stage == s - 1:  # final norm + lm_head (its own copy when tied to the embeddings)
            params += shape.hidden + (shape.lm_head_params or shape.embedding_params)
        kept = params / shape.total_params
        return RankStates(int(weights * kept), int(grads * kept), int(states * kept),
                          notes=[f"pipeline stage {stage} of {s}: {blocks} blocks"])
    engine = sharding_entry(cfg.distributed.sharding)
    if not engine.fsdp2:  # one process, DDP, ZeRO-1: DDP's gradient buckets stay allocated
        return RankStates(*engine.split(weights, grads, states, n),
                          persistent_gradients=grads if engine.gradient_buckets else 0)
    # FSDP2 shards every state at rest (zero2 as well); the stages differ in what stays gathered
    out = RankStates(*engine.split(weights, grads, states, n, at_rest=True))
    gathered = int((root + 2 * block) * size) if engine.reshard_after_forward else weights
    out.gathered_weights, out.gather_buffer = gathered, int(block * size)
    if offload_entry(cfg.distributed.offload).host_states and device == "cuda":
        out.host_bytes = out.weights + out.gradients + out.optimizer_states
        out.weights = out.gradients = out.optimizer_states = 0
        out.notes.append("offload: sharded weights, gradients and optimizer states in host RAM")
    return out


def rank_activations(shape, cfg, stage: int = 0) -> int:
    """Activation bytes at the backward's start on one rank."""
    acts = activation_bytes(shape, cfg)
    if cfg.distributed.tensor_parallel > 1:
        k = cfg.distributed.tensor_parallel
        layer = layer_bytes(shape, cfg)
        per_token = layer_bytes_per_token(shape, cfg)
        # split tensors per token: q, k, v, attention output (head width), MLP gate/up/act/product (MLP width)
        c = compute_size(cfg)
        split = min((2 * shape.q_dim + 2 * shape.kv_dim + 4 * shape.intermediate) * c, per_token)
        tokens = tokens_of(cfg)
        saved = shape.layers * (split * tokens + attention_scores_bytes(shape, cfg)) * (1 - 1 / k)
        return int(acts - min(saved, shape.layers * layer))
    if cfg.distributed.pipeline_parallel > 1:
        s = cfg.distributed.pipeline_parallel
        blocks = len(stage_blocks(shape.layers, s, stage))
        layer = layer_bytes(shape, cfg)
        hidden_in = tokens_of(cfg) * shape.hidden * weight_size(cfg)
        out = blocks * layer + hidden_in  # + the stage's received (or embedded) input
        if stage == s - 1:  # logits and the fp32 log-softmax of every pipeline micro-batch
            out += 2 * loss_bytes(shape, cfg)
        return int(out)
    return acts


def _largest_tensor_bytes(shape, cfg, gpus: int) -> int:
    size = trainable_value_bytes(cfg)
    if cfg.method != "full":
        return max((cfg.lora.rank * max(i, o) for _, i, o in adapted_linears(shape, cfg)), default=0) * 4
    largest = shape.largest_tensor_params
    if cfg.distributed.tensor_parallel > 1:
        largest = max(shape.embedding_params, shape.lm_head_params,
                      shape.largest_linear_params // cfg.distributed.tensor_parallel)
    if sharding_entry(cfg.distributed.sharding).fsdp2:  # each rank steps its shard of every tensor
        largest = -(-largest // data_parallel_ranks(cfg, gpus))
    return largest * size


def optimizer_scratch(shape, cfg, states: RankStates, device: str, gpus: int) -> int:
    if not optimizer_entry(cfg.optim.name).foreach_scratch:  # 8-bit and Lion steps update block by block
        return 0
    if device == "cuda":  # foreach kernels: one scratch copy of the rank's trainable parameters
        return states.gradients
    return CPU_OPTIMIZER_SCRATCH_TENSORS * _largest_tensor_bytes(shape, cfg, gpus)


def rank_moments(shape, cfg, gpus: int, device: str = "cuda", stage: int = 0) -> dict[str, dict[str, int]]:
    """Bytes per category on one rank at the two moments that can peak."""
    st = rank_states(shape, cfg, gpus, device, stage)
    acts = rank_activations(shape, cfg, stage)
    loss_buffers = 0 if cfg.distributed.pipeline_parallel > 1 else 2 * loss_bytes(shape, cfg)
    base = dict(weights=st.weights, optimizer_states=st.optimizer_states)
    moments = {}
    if cfg.distributed.pipeline_parallel > 1:
        # GPipe, after the first pipeline micro-batch's backward: every gradient of the stage exists,
        # the other micro-batches' activations still wait, plus one micro-batch's backward buffers.
        n = cfg.batch.micro_batch
        one = cfg.updated({"batch.micro_batch": 1})
        last = stage == cfg.distributed.pipeline_parallel - 1
        moments["pipeline_backward"] = dict(
            base, gradients=st.gradients, activations=acts * (n - 1) // n,
            temporaries=layer_gradient_buffers(shape, one) + (2 * loss_bytes(shape, one) if last else 0))
    return moments | {
        "backward_start": dict(base, gradients=st.persistent_gradients, activations=acts + st.gathered_weights,
                               temporaries=loss_buffers + st.gather_buffer),
        "optimizer_step": dict(base, gradients=max(st.gradients, st.persistent_gradients), activations=0,
                               temporaries=optimizer_scratch(shape, cfg, st, device, gpus)),
    }


def per_rank_candidates(candidates: dict, shape, cfg, gpus: int, device: str = "cuda") -> dict:
    """For analytic.analytic_estimate: replace its moments by the per-rank ones when distributed."""
    if cfg.distributed.sharding == "none" and cfg.distributed.tensor_parallel == 1 and cfg.distributed.pipeline_parallel == 1:
        return candidates
    stages = [rank_moments(shape, cfg, gpus, device, stage) for stage in range(cfg.distributed.pipeline_parallel)]
    return max(stages, key=lambda moments: max(sum(c.values()) for c in moments.values()))  # the fullest stage


# --- DeepSpeed's published ZeRO formulas, for docs/distributed.md ---------------------------------

def zero_model_states_like_deepspeed(total_params: int, largest_layer_params: int, gpus: int, stage: int) -> int:
    """Per-GPU model-state bytes by memfit's ZeRO rule (`ShardingEntry.split`) applied to DeepSpeed's byte
    layout for mixed-precision Adam: fp16 weights 2, fp16 gradients 2, and what memfit files under
    optimizer states: fp32 gradients 4 + fp32 master weights 4 + Adam moments 8 = 16 bytes/param.
    Stage 3 adds the largest layer gathered in fp32 (4 bytes/param), as DeepSpeed counts it.
    Compare with deepspeed.runtime.zero.stage_1_and_2 / stage3 estimate_zero*_model_states_mem_needs."""
    weights, grads, states = sharding_entry(f"zero{stage}").split(2 * total_params, 2 * total_params, 16 * total_params,
                                                                  gpus)
    gathered = 4 * largest_layer_params if stage == 3 else 0
    return weights + grads + states + gathered


def node_cpu_ram(ram: dict[str, int], shape, cfg, gpus: int, device: str = "cuda") -> dict[str, int]:
    """Host RAM of one node running `gpus` ranks, from the single-process terms (`ram`).

    Every rank has its own runtime, data pipeline, offloaded shards (and on a CPU device its
    training state). Loading: with zero2/zero3 only rank 0 materialises the model (the others
    build on meta and receive shards); ddp/zero1 and tensor/pipeline parallel build it on every rank."""
    if gpus <= 1:
        return ram
    out = {key: value * gpus for key, value in ram.items() if key != "model_load"}
    if "model_load" in ram:
        out["model_load"] = ram["model_load"] * (1 if sharding_entry(cfg.distributed.sharding).fsdp2 else gpus)
    return out
