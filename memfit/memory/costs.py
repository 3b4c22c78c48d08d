"""What each strategy costs: bytes per parameter (read by the memory estimate) and time per step
(read by the planner to rank the plans that fit). One table per strategy dimension, one function
that turns a run into predicted seconds.

The time model is a roofline sum, not a simulator: matmul FLOPs at a sustained fraction of the
card's dense tensor-core rate, memory-bound passes (optimizer, dequantization) at a fraction of its
memory bandwidth, host<->device copies at the PCIe rate, collectives at the interconnect rate, and
a fixed cost per kernel launch. Only the ratios between plans on the same card are used to rank
them; the absolute seconds are rough (docs/planner.md lists every constant and its source).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from memfit.memory.gpus import GPU
from memfit.memory.model_shape import ModelShape, trainable_params, trainable_value_bytes
from memfit.strategies.optimizers import optimizer_entry
from memfit.strategies.precision import precision_entry
from memfit.strategies.table import STEP_STRATEGIES

# --- efficiency assumptions (fractions of the spec sheet a training step sustains) ----------------------
MATMUL_EFFICIENCY = 0.5      # large bf16 GEMMs in a training step: ~40-60% MFU is what well-tuned
                             # single-GPU fine-tuning reports (PaLM/Megatron MFU figures, docs/planner.md)
MEMORY_EFFICIENCY = 0.8      # streaming kernels (optimizer step, dequantization) reach ~80% of HBM peak
HOST_LINK_EFFICIENCY = 0.8   # pinned-memory copies reach ~25 of PCIe 4.0 x16's 32 GB/s
CPU_OPTIMIZER_BYTES_PER_S = 20e9  # an AdamW step on the host streams ~20 GB/s of states (DeepSpeed's
                                  # CPU Adam reports ~1-2 s per billion parameters on a server CPU)
KERNEL_LAUNCH_SECONDS = 10e-6     # ~40 kernels per layer per micro-batch (forward + backward)
KERNELS_PER_LAYER = 40


@dataclass(frozen=True)
class QuantCost:
    """Quantized base weights: storage per value, and the bytes a dequantization pass moves."""
    bytes_per_param: float     # 4-bit/8-bit value + block scales (bitsandbytes layout)
    dequant_bytes: float       # read the packed weight + write the 16-bit copy, per value per pass
    gives_up: str


# nf4/fp4: 4 bits + one fp32 absmax per 64 values; nf4-dq: that absmax quantized to 8 bits with one
# fp32 scale per 256 blocks; int8 (LLM.int8): 1 byte + one fp32 scale per output row (negligible).
QUANTS = {
    "none": QuantCost(0.0, 0.0, ""),
    "nf4": QuantCost(0.5 + 4 / 64, 0.5 + 4 / 64 + 2, "4-bit NF4 base weights"),
    "fp4": QuantCost(0.5 + 4 / 64, 0.5 + 4 / 64 + 2, "4-bit FP4 base weights"),
    "nf4-dq": QuantCost(0.5 + 1 / 64 + 4 / (64 * 256), 0.5 + 1 / 64 + 2, "4-bit NF4 base weights"),
    "int8": QuantCost(1.0, 1.0 + 2, "8-bit base weights"),
}

# What a method gives up against full fine-tuning (for the plan's table).
METHOD_GIVES_UP = {"full": "", "lora": "trains LoRA adapters only", "qlora": "trains LoRA adapters only"}


def checkpointed_layers(shape: ModelShape, cfg) -> int:
    every = cfg.memory.activation_checkpoint_every
    return 0 if not every else math.ceil(shape.layers / every)


def step_time(terms, gpu: GPU, gpus: int = 1) -> dict[str, float]:
    """Predicted seconds per optimizer step on `gpu`, per term (sum them for the step). `terms`: the
    run's shape and config with the sizes its step strategies' work reads (memory/single_device.py:
    StrategyTerms).

    compute      forward 2*N FLOPs per token + attention 4*L*seq*q_dim; the backward twice the forward
                 for full fine-tuning (input and weight gradients), once under LoRA (input gradients of the
                 frozen base only); each checkpointed layer runs its forward again; a step strategy
                 adds its own matmul FLOPs (the chunked loss: the lm_head matmul again in the backward)
    dequantize   quantized base weights are dequantized once per pass (forward, backward, recompute)
    optimizer    reads and writes parameters, gradients and states once per step (memory-bound); with
                 CPU offload the step runs on the host instead
    host_link    a step strategy's host bytes (activation offload: the saved tensors out and back per
                 micro-batch); FSDP's CPU offload copies the parameters in for the forward and the
                 backward and the gradients out
    collectives  data parallel all-reduces the gradients; zero3 gathers the parameters twice per
                 micro-batch; tensor parallel all-reduces activations four times per layer
    launches     a fixed cost per kernel: what makes larger micro-batches faster per token"""
    shape, cfg = terms.shape, terms.cfg
    tp, pp = cfg.distributed.tensor_parallel, cfg.distributed.pipeline_parallel
    model_parallel = tp * pp
    tokens = cfg.batch.micro_batch * cfg.data.seq_len
    micro_batches = cfg.batch.grad_accum
    n = shape.total_params
    ckpt = checkpointed_layers(shape, cfg) / shape.layers
    forward = tokens * (2 * n + 4 * shape.layers * cfg.data.seq_len * shape.q_dim)
    backward = forward * (2 if cfg.method == "full" else 1)
    recompute = forward * ckpt
    precision = precision_entry(cfg.precision)
    # fp32 matmuls run at the TF32 rate, 16-bit ones on the bf16/fp16 tensor cores
    rate = (gpu.tf32_tflops if precision.compute_bytes == 4 else gpu.bf16_tflops) * 1e12 * MATMUL_EFFICIENCY
    memory_rate = gpu.memory_gbps * 1e9 * MEMORY_EFFICIENCY
    host_rate = gpu.host_link_gbps * 1e9 * HOST_LINK_EFFICIENCY
    link_rate = gpu.interconnect_gbps * 1e9
    work = {"flops": 0.0, "host_bytes": 0.0}  # what the step strategies add (memfit/strategies/table.py)
    for strategy in STEP_STRATEGIES:
        if strategy.work is not None and getattr(cfg.memory, strategy.name):
            for kind, amount in strategy.work(terms).items():
                work[kind] += amount
    terms = {"compute": ((forward + backward + recompute) * micro_batches + work["flops"]) / rate / model_parallel}
    if cfg.memory.attention == "eager":  # the [heads, seq, seq] scores are written and read back (fp32 + 16-bit)
        terms["compute"] += cfg.batch.micro_batch * shape.heads * cfg.data.seq_len ** 2 * 6 * 3 * shape.layers \
            * micro_batches / memory_rate / model_parallel

    quant = QUANTS[cfg.quant.scheme]
    if quant.dequant_bytes:
        passes = 2 + ckpt
        terms["dequantize"] = shape.block_linear_params * quant.dequant_bytes * passes * micro_batches / memory_rate

    trainable = trainable_params(shape, cfg)
    master = trainable_value_bytes(cfg)
    states = optimizer_entry(cfg.optim.name).state_bytes_per_value(master)
    data_parallel = max(gpus // model_parallel, 1)
    sharded = data_parallel if cfg.distributed.sharding in ("zero1", "zero2", "zero3") else 1
    per_rank = trainable / sharded / model_parallel
    step_bytes = per_rank * (2 * master + master + 2 * states)  # read + write params, read grads, states
    offloaded = cfg.distributed.offload != "none"
    terms["optimizer"] = step_bytes / (CPU_OPTIMIZER_BYTES_PER_S if offloaded else memory_rate)

    host = work["host_bytes"]
    if offloaded:  # FSDP2 CPUOffloadPolicy: parameters in (forward + backward), gradients out
        compute_bytes = 2
        host += (2 * compute_bytes * n / sharded / model_parallel + master * per_rank) * micro_batches
    if host:
        terms["host_link"] = host / host_rate

    comm = 0.0
    if data_parallel > 1:
        ring = 2 * (data_parallel - 1) / data_parallel
        grad_bytes = trainable * precision.compute_bytes / model_parallel  # counted at the compute dtype's size
        comm += ring * grad_bytes / 2 if cfg.distributed.sharding in ("zero2", "zero3") else ring * grad_bytes
        if cfg.distributed.sharding == "zero3":  # all-gather the parameters for the forward and the backward
            comm += 2 * (data_parallel - 1) / data_parallel * n * 2 * micro_batches
    if tp > 1:
        comm += 4 * shape.layers * 2 * (tp - 1) / tp * tokens * shape.hidden * 2 * micro_batches
    if comm:
        terms["collectives"] = comm / link_rate
    terms["launches"] = KERNEL_LAUNCH_SECONDS * KERNELS_PER_LAYER * shape.layers * micro_batches / max(pp, 1)
    if pp > 1:  # GPipe bubble: (S - 1) of (M + S - 1) slots idle
        busy = sum(terms.values())
        terms["pipeline_bubble"] = busy * (pp - 1) / micro_batches
    return terms
