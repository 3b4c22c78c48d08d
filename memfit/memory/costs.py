"""What a plan costs in time: predicted seconds per optimizer step, one function per term, read by
the planner to rank the plans that fit.

The time model is a roofline sum, not a simulator: matmul FLOPs at a sustained fraction of the
card's dense tensor-core rate, memory-bound passes (optimizer, dequantization) at a fraction of its
memory bandwidth, host<->device copies at the PCIe rate, collectives at the interconnect rate, and
a fixed cost per kernel launch. Only the ratios between plans on the same card are used to rank
them; the absolute seconds are rough (docs/planner.md lists every constant and its source).
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.memory.activations import checkpointed_layers, tokens_of
from memfit.memory.distributed_estimate import data_parallel_ranks
from memfit.memory.families import family_of
from memfit.memory.gpus import GPU
from memfit.memory.model_shape import trainable_params, trainable_value_bytes
from memfit.memory.model_states import weights_bytes
from memfit.strategies.engines import model_parallel_in_use, offload_entry, sharding_entry
from memfit.strategies.optimizers import optimizer_entry
from memfit.strategies.precision import precision_entry
from memfit.strategies.quantization import quant_entry
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
class _Step:
    """The sizes every term reads: one rank's share of the run and the card's sustained rates."""

    terms: object            # memory/single_device.py: StrategyTerms
    gpus: int
    matmul_rate: float       # FLOP/s
    memory_rate: float       # B/s of device memory
    host_rate: float         # B/s over the host link
    link_rate: float         # B/s between GPUs

    @property
    def model_parallel(self) -> int:
        distributed = self.terms.cfg.distributed
        return distributed.tensor_parallel * distributed.pipeline_parallel

    @property
    def data_parallel(self) -> int:
        return data_parallel_ranks(self.terms.cfg, self.gpus)

    @property
    def optimizer_shards(self) -> int:
        """Ranks the optimizer states are split over (each steps its own shard)."""
        sharded = sharding_entry(self.terms.cfg.distributed.sharding).shards("optimizer_states")
        return self.data_parallel if sharded else 1

    @property
    def active_params(self) -> int:
        return family_of(self.terms.shape).active_params(self.terms.shape)

    @property
    def trained_per_rank(self) -> float:
        return trainable_params(self.terms.shape, self.terms.cfg) / self.optimizer_shards / self.model_parallel


def step_time(terms, gpu: GPU, gpus: int = 1) -> dict[str, float]:
    """Predicted seconds per optimizer step on `gpu`, per term (sum them for the step). `terms`: the
    run's shape and config with the sizes its step strategies' work reads (memory/single_device.py:
    StrategyTerms).

    compute      forward 2*N FLOPs per token (N: the family's active parameters) + attention
                 4*L*seq*q_dim; the backward twice the forward for full fine-tuning (input and weight
                 gradients), once under LoRA (input gradients of the frozen base only); each checkpointed
                 layer runs its forward again; a step strategy adds its own matmul FLOPs (the chunked
                 loss: the lm_head matmul again in the backward)
    dequantize   quantized base weights are dequantized once per pass (forward, backward, recompute)
    optimizer    reads and writes parameters, gradients and states once per step (memory-bound); with
                 CPU offload the step runs on the host instead
    host_link    a step strategy's host bytes (activation offload: the saved tensors out and back per
                 micro-batch); FSDP's CPU offload copies the parameters in for the forward and the
                 backward and the gradients out
    collectives  data parallel reduces the gradients (the engine's entry: all-reduce or reduce-scatter)
                 and gathers the weights as its entry says; tensor parallel all-reduces activations four
                 times per layer
    launches     a fixed cost per kernel: what makes larger micro-batches faster per token
    pipeline_bubble  GPipe: (S - 1) of (M + S - 1) slots idle"""
    cfg = terms.cfg
    precision = precision_entry(cfg.precision)
    # fp32 matmuls run at the TF32 rate, 16-bit ones on the bf16/fp16 tensor cores
    matmul = (gpu.tf32_tflops if precision.compute_bytes == 4 else gpu.bf16_tflops) * 1e12 * MATMUL_EFFICIENCY
    step = _Step(terms, gpus, matmul, gpu.memory_gbps * 1e9 * MEMORY_EFFICIENCY,
                 gpu.host_link_gbps * 1e9 * HOST_LINK_EFFICIENCY, gpu.interconnect_gbps * 1e9)
    work = strategy_work(terms)
    seconds = {"compute": compute_seconds(step, work["flops"])}
    dequantize = dequantize_seconds(step)
    if dequantize:
        seconds["dequantize"] = dequantize
    seconds["optimizer"] = optimizer_seconds(step)
    host = host_link_seconds(step, work["host_bytes"])
    if host:
        seconds["host_link"] = host
    collectives = collectives_seconds(step)
    if collectives:
        seconds["collectives"] = collectives
    stages = cfg.distributed.pipeline_parallel  # each stage launches its own layers' kernels
    seconds["launches"] = KERNEL_LAUNCH_SECONDS * KERNELS_PER_LAYER * terms.shape.layers * cfg.batch.grad_accum / stages
    for entry, degree in model_parallel_in_use(cfg.distributed.model_dump()):
        if entry.bubble:  # GPipe: (S - 1) of (M + S - 1) slots idle
            seconds["pipeline_bubble"] = sum(seconds.values()) * (degree - 1) / cfg.batch.grad_accum
    return seconds


def strategy_work(terms) -> dict[str, float]:
    """The FLOPs and host bytes the run's step strategies add (each entry's `work`, memfit/strategies/table.py)."""
    work = {"flops": 0.0, "host_bytes": 0.0}
    for strategy in STEP_STRATEGIES:
        if strategy.work is not None and getattr(terms.cfg.memory, strategy.name):
            for kind, amount in strategy.work(terms).items():
                work[kind] += amount
    return work


def compute_seconds(step: _Step, strategy_flops: float) -> float:
    shape, cfg = step.terms.shape, step.terms.cfg
    tokens = tokens_of(cfg)
    micro_batches = cfg.batch.grad_accum
    forward = tokens * (2 * step.active_params + 4 * shape.layers * cfg.data.seq_len * shape.q_dim)
    backward = forward * (2 if cfg.method == "full" else 1)
    recompute = forward * (checkpointed_layers(shape, cfg) / shape.layers)
    seconds = ((forward + backward + recompute) * micro_batches + strategy_flops) / step.matmul_rate / step.model_parallel
    if cfg.memory.attention == "eager":  # the [heads, seq, seq] scores are written and read back (fp32 + 16-bit)
        seconds += cfg.batch.micro_batch * shape.heads * cfg.data.seq_len ** 2 * 6 * 3 * shape.layers \
            * micro_batches / step.memory_rate / step.model_parallel
    return seconds


def dequantize_seconds(step: _Step) -> float:
    """Each quantized base weight is dequantized once per pass: forward, backward, and recompute."""
    shape, cfg = step.terms.shape, step.terms.cfg
    quant = quant_entry(cfg.quant.scheme)
    if not quant.dequant_bytes:
        return 0.0
    passes = 2 + checkpointed_layers(shape, cfg) / shape.layers
    return shape.block_linear_params * quant.dequant_bytes * passes * cfg.batch.grad_accum / step.memory_rate


def optimizer_seconds(step: _Step) -> float:
    """Read + write the parameters, read the gradients, read + write the states, for this rank's share."""
    cfg = step.terms.cfg
    master = trainable_value_bytes(cfg)
    states = optimizer_entry(cfg.optim.name).state_bytes_per_value(master)
    step_bytes = step.trained_per_rank * (2 * master + master + 2 * states)
    return step_bytes / (CPU_OPTIMIZER_BYTES_PER_S if offload_entry(cfg.distributed.offload).host_states
                         else step.memory_rate)


def host_link_seconds(step: _Step, strategy_bytes: float) -> float:
    """A step strategy's host bytes, and FSDP2's CPU offload: parameters in (forward + backward) in 16
    bits, gradients out."""
    cfg = step.terms.cfg
    host = strategy_bytes
    if offload_entry(cfg.distributed.offload).host_states:
        compute_bytes = 2
        host += (2 * compute_bytes * step.active_params / step.optimizer_shards / step.model_parallel
                 + trainable_value_bytes(cfg) * step.trained_per_rank) * cfg.batch.grad_accum
    return host / step.host_rate if host else 0.0


def collectives_seconds(step: _Step) -> float:
    """Ring collectives: the data-parallel gradient reduction and weight gathers (the engine's entry),
    tensor parallel's activation all-reduces."""
    shape, cfg = step.terms.shape, step.terms.cfg
    micro_batches = cfg.batch.grad_accum
    dp = step.data_parallel
    comm = 0.0
    if dp > 1:
        engine = sharding_entry(cfg.distributed.sharding)
        ring = 2 * (dp - 1) / dp
        # counted at the compute dtype's size
        grad_bytes = trainable_params(shape, cfg) * precision_entry(cfg.precision).compute_bytes / step.model_parallel
        comm += ring * grad_bytes * engine.gradient_traffic()
        # all-gather the weights as they are stored (FSDP2 here has no mixed-precision policy: fp32 weights under
        # bf16-mixed, a quantized base's packed codes and scales), each rank's tensor-parallel part, for the
        # forward and again for the backward
        gathered = weights_bytes(shape, cfg) / step.model_parallel
        comm += engine.weight_gathers() * (dp - 1) / dp * gathered * micro_batches
    for entry, degree in model_parallel_in_use(cfg.distributed.model_dump()):  # tensor parallel's activations
        comm += (entry.all_reduces_per_layer * shape.layers * 2 * (degree - 1) / degree * tokens_of(cfg) * shape.hidden
                 * 2 * micro_batches)
    return comm / step.link_rate if comm else 0.0
