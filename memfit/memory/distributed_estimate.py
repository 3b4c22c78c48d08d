"""Per-rank memory of a distributed run: the single-device moments (memory/single_device.py, with every
step strategy's own terms) computed for one rank's part of the model and one rank's share of its states.

What a rank computes on:
  tp K   the model with every block linear split K ways (q/k/v, gate/up by output features, o/down by
         input features): K times fewer heads and K times narrower MLP, the same hidden size, embeddings,
         norms and lm_head (replicated). Its activations and the step strategies' terms follow from that
         narrower shape (`rank_shape`), as do its weights, gradients and optimizer states.
  pp S   rank s: its blocks (+ embeddings on the first, norm + lm_head + loss on the last; a tied lm_head
         is a second copy there: `stage_shape`), one pipeline micro-batch (one sequence padded to seq_len)
         at a time; GPipe keeps what every other micro-batch's forward saved until its backward
         (`pipeline_moments`).
Every other engine runs the whole model on its own micro-batch: its activations are one device's.

Model states per rank (W weights, G gradients, O optimizer states of that shape; N = data-parallel ranks):
  ddp    W + G + O; DDP's gradient buckets (gradients are views into them) stay allocated
         between steps, so G counts at every moment, not only after the backward.
  zero1  W + G (buckets) + O/N                        ZeroRedundancyOptimizer
  zero2  W/N + G/N + O/N; from the forward to each block's backward every block's gathered
         (unsharded) weights stay: + W at the backward's start   FSDP2 reshard_after_forward=False
  zero3  W/N + G/N + O/N; gathered: the root (embeddings, norm, lm_head) + 2 blocks (the one
         computing and the one prefetched)                       FSDP2 reshard_after_forward=True
  FSDP2 also holds one block's flat all-gather output while copying it out (+1 block), in a block's
         backward its unsharded gradients until they are reduce-scattered, and under full fine-tuning the
         root's unsharded gradients until the backward's end, when they are reduce-scattered (`backward_end`).
  offload (params/all, FSDP2 CPUOffloadPolicy): the sharded W, G, O live in host RAM; on a
         CUDA device only the gathered blocks remain. On a CPU device nothing moves.
  tp K x zero2/zero3 (a 2-D mesh): the tp shape's states, sharded over the N = GPUs / K data-parallel ranks.
The optimizer step's scratch is that of the rank's trainable values (memory/model_states.py).

Validated against the tracker rank by rank on 2 gloo ranks (4 for 2-D meshes): bench/rank_matrix.py,
tests/integration/test_rank_matrix.py.
"""

from __future__ import annotations

import dataclasses

from memfit.distributed.pipeline import stage_blocks
from memfit.memory.activations import activation_bytes, tokens_of, weight_copies_bytes
from memfit.memory.model_shape import ATTENTION_OUTPUT, MLP_OUTPUT, ModelShape
from memfit.memory.model_states import (ModelStates, block_and_root_weight_bytes, compute_size, gradient_bytes,
                                        largest_param_bytes, model_states, optimizer_scratch, optimizer_state_bytes,
                                        weight_size, weights_bytes)
from memfit.memory.single_device import beyond_basics_terms, load_bytes, peak_candidates
from memfit.strategies.step_strategy import WAITING
from memfit.strategies.engines import offload_entry, sharding_entry

ROW_SPLIT = (ATTENTION_OUTPUT, MLP_OUTPUT)  # tensor parallel splits these by input features, the rest by output


def distributed(cfg) -> bool:
    """More than one process holds the model: a data-parallel engine, tensor or pipeline parallel."""
    d = cfg.distributed
    return d.sharding != "none" or d.tensor_parallel > 1 or d.pipeline_parallel > 1


def data_parallel_ranks(cfg, gpus: int) -> int:
    """The ranks that each train on their own micro-batches: the GPUs over the tensor x pipeline degree."""
    return max(gpus // (cfg.distributed.tensor_parallel * cfg.distributed.pipeline_parallel), 1)


def rank_shape(shape: ModelShape, cfg) -> ModelShape:
    """The part of the model one tensor-parallel rank computes (the shape itself when K = 1)."""
    k = cfg.distributed.tensor_parallel
    if k == 1:
        return shape
    roles = tuple((path, role, i // k if role in ROW_SPLIT else i, o if role in ROW_SPLIT else o // k)
                  for path, role, i, o in shape.roles)
    split = {path: (i, o) for path, _, i, o in roles}

    def leaf(name: str) -> tuple[int, int] | None:
        return next((io for path, io in split.items() if name.endswith("." + path)), None)

    linear = tuple((name, *(leaf(name) or (i, o))) for name, i, o in shape.linear)
    block_linears = sum(i * o for _, i, o in linear)
    return dataclasses.replace(
        shape, q_dim=shape.q_dim // k, kv_dim=shape.kv_dim // k, heads=shape.heads // k,
        intermediate=shape.intermediate // k, linear=linear, roles=roles,
        total_params=shape.total_params - shape.block_linear_params + block_linears)


def _counts(shape: ModelShape) -> tuple[int, int]:
    """(params of one block, params outside the blocks)."""
    root = shape.embedding_params + shape.lm_head_params + shape.hidden  # + final norm
    return (shape.total_params - root) // max(shape.layers, 1), root


def _share(nbytes: int, ranks: int) -> int:
    return -(-nbytes // ranks)


def rank_model_states(shape: ModelShape, cfg, gpus: int, device: str = "cuda") -> ModelStates:
    """One data-parallel rank's model states (`shape`: the part of the model it computes, `rank_shape`)."""
    weights, grads, states = weights_bytes(shape, cfg), gradient_bytes(shape, cfg), optimizer_state_bytes(shape, cfg)
    largest = largest_param_bytes(shape, cfg)
    n = data_parallel_ranks(cfg, gpus)
    engine = sharding_entry(cfg.distributed.sharding)
    stepped = _share(grads, n) if engine.shards("optimizer_states") else grads  # the values this rank's optimizer steps
    if not engine.fsdp2:  # one process, DDP, ZeRO-1: DDP's gradient buckets stay allocated
        w, g, o = engine.split(weights, grads, states, n)
        return ModelStates(w, g, o, optimizer_scratch(cfg, device, stepped, largest),
                           persistent_gradients=grads if engine.gradient_buckets else 0)
    # FSDP2 shards every state at rest (zero2 as well); the stages differ in what stays gathered
    w, g, o = engine.split(weights, grads, states, n, at_rest=True)
    out = ModelStates(w, g, o, optimizer_scratch(cfg, device, g, _share(largest, n)))
    out.beside = fsdp2_gathered(shape, cfg, grads, engine.reshard_after_forward, n)
    if offload_entry(cfg.distributed.offload).host_states and device == "cuda":
        # the optimizer steps on the host, one tensor at a time: its scratch is host RAM too
        host_scratch = optimizer_scratch(cfg, "cpu", g, _share(largest, n))
        out.host_bytes = out.weights + out.gradients + out.optimizer_states + host_scratch
        out.weights = out.gradients = out.optimizer_states = out.optimizer_scratch = 0
        out.notes.append("offload: sharded weights, gradients, optimizer states and the optimizer step in host RAM")
    return out


def fsdp2_gathered(shape: ModelShape, cfg, grads: int, reshard: bool, ranks: int) -> dict:
    """What FSDP2 holds beside the shards at each moment, by the tracker's category: weights gathered in the
    forward that outlive it are activations, those gathered again for the backward (and one block's flat
    all-gather output) temporaries, a block's unsharded gradients (until reduce-scattered) gradients.

    zero3 (reshard): the root (kept from the forward to the backward) and 2 blocks (the one computing and the
    one prefetched); zero2: every weight from the forward until each block's backward has used it.
    Full fine-tuning: the root's gradients stay unsharded until the backward's end (the lm_head's from the
    loss on), when the root is reduce-scattered: its unsharded gradients, their flat copy and this rank's
    share of the result (`backward_end`). A quantized base is gathered as it is stored (NF4 blocks)."""
    full = cfg.method == "full"
    _, root = _counts(shape)
    block_weights, root_weights = block_and_root_weight_bytes(shape, cfg)
    weights = shape.layers * block_weights + root_weights
    block_grads = grads // max(shape.layers, 1)
    grad_size = grads / max(shape.total_params, 1) if full else 0
    head_grads = int(shape.head_params * grad_size)
    root_grads = int(root * grad_size)
    end = {"backward_end": {"temporaries": 2 * root_grads + root_grads // ranks}} if full else {}
    if reshard:
        blocks = 2 * block_weights
        return {"backward_start": {"activations": root_weights, "temporaries": blocks + block_weights},
                "backward_last": {"activations": root_weights, "temporaries": blocks + head_grads,
                                  "gradients": block_grads},
                "backward_first": {"activations": root_weights, "temporaries": blocks + head_grads,
                                   "gradients": block_grads}} | end
    return {"backward_start": {"activations": weights, "temporaries": block_weights},
            "backward_last": {"activations": weights, "temporaries": head_grads, "gradients": block_grads},
            "backward_first": {"activations": root_weights + block_weights, "temporaries": head_grads,
                               "gradients": block_grads}} | end


def stage_shape(shape: ModelShape, cfg, stage: int) -> ModelShape:
    """The part of the model pipeline stage `stage` computes: its blocks, the embeddings on the first, the
    final norm, lm_head (its own copy when tied to the embeddings) and the loss on the last."""
    s = cfg.distributed.pipeline_parallel
    first, last = stage == 0, stage == s - 1
    block, _ = _counts(shape)
    blocks = stage_blocks(shape.layers, s, stage)
    layers = len(blocks)
    per_block = len(shape.linear) // max(shape.layers, 1)  # `linear` lists every block's linears, block by block
    embeddings = shape.embedding_params if first else 0
    head = shape.head_params if last else 0
    return dataclasses.replace(shape, layers=layers, embedding_params=embeddings, lm_head_params=head,
                               vocab=shape.vocab if last else 0, head=last,
                               linear=shape.linear[blocks.start * per_block:blocks.stop * per_block],
                               total_params=layers * block + embeddings + (shape.hidden + head if last else 0))


def stage_states(shape: ModelShape, cfg, stage: int, device: str) -> ModelStates:
    """Pipeline stage `stage`'s model states: those of its part of the model (`stage_shape`)."""
    states = model_states(stage_shape(shape, cfg, stage), cfg, device)
    return dataclasses.replace(states, notes=[*states.notes,
                                              f"pipeline stage {stage} of {cfg.distributed.pipeline_parallel}"])


def pipeline_moments(shape: ModelShape, cfg, device: str, stage: int) -> dict[str, dict[str, int]]:
    """Bytes per category on pipeline stage `stage` at the moments that can peak.

    The schedule (GPipe) cuts the step's micro-batch into n pipeline micro-batches of one sequence, runs
    every forward, then every backward. Each pipeline micro-batch's backward is one device's moments
    (`peak_candidates` with every step strategy's terms) on the stage's part of the model, while the
    micro-batches not yet through their backward wait with what their forwards saved (the WAITING moment,
    which the strategies change too) and the stage's output, which the schedule keeps for the backward.
    The first backward starts with no gradients; the later ones (the largest: the second) add to every
    gradient of the stage, with one micro-batch fewer waiting."""
    n = cfg.batch.micro_batch
    part = stage_shape(shape, cfg, stage)
    one = cfg.updated({"batch.micro_batch": 1})
    states = stage_states(shape, one, stage, device)
    # what the schedule keeps of each pipeline micro-batch's forward until its backward: the stage's output
    # (the logits on the last stage, the residual stream before it)
    output = tokens_of(one) * (shape.vocab * compute_size(cfg) if part.head else shape.hidden * weight_size(cfg))

    def backwards(run, waiting: int) -> dict[str, dict[str, int]]:
        moments = peak_candidates(part, run, states)
        # the whole schedule runs in one autocast region: its 16-bit weight copies are cast once, for all
        moments[WAITING] = {"activations": activation_bytes(part, run) - weight_copies_bytes(part, run)}
        moments = beyond_basics_terms(moments, part, run, device)
        held = waiting * (moments.pop(WAITING)["activations"] + output) + output
        return {name: dict(values, activations=values["activations"] + held) for name, values in moments.items()
                if name.startswith("backward")} | {"optimizer_step": moments["optimizer_step"]}

    out = backwards(one, n - 1)
    if n > 1:
        later = backwards(one.updated({"batch.grad_accum": 2}), n - 2)
        out |= {f"pipeline_{name}": values for name, values in later.items() if name != "optimizer_step"}
    return out


def fullest_stage(shape: ModelShape, cfg, device: str,
                  stage: int | None = None) -> tuple[dict[str, dict[str, int]], ModelStates]:
    """The moments of the pipeline stage whose peak is largest (or of `stage`), and that stage's model states."""
    chosen = range(cfg.distributed.pipeline_parallel) if stage is None else [stage]
    stages = [(pipeline_moments(shape, cfg, device, s), stage_states(shape, cfg, s, device)) for s in chosen]
    return max(stages, key=lambda found: max(sum(c.values()) for c in found[0].values()))


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
    """Host RAM of one node running `gpus` ranks, from the single-process terms (`ram`): every rank has its
    own runtime, data pipeline, offloaded shards (and on a CPU device its training state); the load is the
    node's by memfit/models/load_plan.py (each rank reads its part where the engine hands out parts, streams
    to its GPU or builds its own copy otherwise)."""
    if gpus <= 1:
        return ram
    out = {key: value * gpus for key, value in ram.items() if key != "model_load"}
    out["model_load"] = load_bytes(shape, cfg, device, gpus)
    return out
