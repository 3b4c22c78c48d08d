"""Model states: the bytes of the weights, gradients and optimizer states of a run on one device, and
the element sizes every analytic term reads from the run's precision and quantization entries."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from memfit.config import RunConfig
from memfit.memory.model_shape import ModelShape, adapted_linears, lora_params, trainable_params, trainable_value_bytes
from memfit.strategies.optimizers import TrainedParams, optimizer_entry
from memfit.strategies.precision import precision_entry
from memfit.strategies.quantization import QuantizationError, choose_backend, quant_entry


def weight_size(cfg: RunConfig) -> int:
    """Bytes per parameter of the model's weights (the precision's weight dtype)."""
    return precision_entry(cfg.precision).weight_bytes


def compute_size(cfg: RunConfig) -> int:
    """Bytes per element of matmul outputs: the autocast dtype's under autocast, else the weights'."""
    return precision_entry(cfg.precision).compute_bytes


def half_weights(cfg: RunConfig) -> bool:
    """A 16-bit model: each norm upcasts its input and keeps that fp32 copy instead of the input."""
    return weight_size(cfg) < 4


def fp32_compute(cfg: RunConfig) -> bool:
    """Everything computes in fp32, the LoRA adapters' own dtype: peft's cast of their input is a no-op."""
    return compute_size(cfg) == 4


def quantized(cfg: RunConfig) -> bool:
    """The frozen base is stored quantized (the config gives each method its default scheme)."""
    return cfg.quant.scheme != "none"


def quant_backend(cfg: RunConfig) -> str | None:
    """The backend that stores the quantized base here (None when nothing is quantized; bitsandbytes' terms
    when no backend here can: the trainer refuses such a run before it loads)."""
    if not quantized(cfg):
        return None
    try:
        return choose_backend(cfg.quant.scheme, cfg.quant_backend)
    except QuantizationError:
        return "bitsandbytes"


def weights_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """Base weights (quantized block linears under QLoRA/int8) + LoRA adapters (fp32: peft upcasts)."""
    size = weight_size(cfg)
    if quantized(cfg):
        block = shape.block_linear_params
        rest = shape.total_params - block
        # norms, embeddings, head: bf16 in a bf16-pure run, else fp32 (adapters.prepare_quantized_for_training)
        base = math.ceil(block * quant_entry(cfg.quant.scheme).bytes_per_param) + rest * size
    else:
        base = shape.total_params * size
    return base + lora_params(shape, cfg) * 4


def block_and_root_weight_bytes(shape: ModelShape, cfg: RunConfig) -> tuple[int, int]:
    """`weights_bytes` of one block (its linears quantized under QLoRA/int8, its adapters) and of everything
    outside the blocks (embeddings, final norm, lm_head): what FSDP2 gathers for one block or for the root."""
    layers = max(shape.layers, 1)
    size = weight_size(cfg)
    root = shape.embedding_params + shape.lm_head_params + shape.hidden  # + final norm
    linears = shape.block_linear_params // layers
    others = (shape.total_params - root) // layers - linears  # the block's norms
    linear_size = quant_entry(cfg.quant.scheme).bytes_per_param if quantized(cfg) else size
    block = math.ceil(linears * linear_size) + others * size + lora_params(shape, cfg) * 4 // layers
    return block, root * size


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


# torch's single-tensor AdamW loop keeps 2 temporaries of the tensor it updates (measured with bench/rank_matrix.py
# on a 124.7M-parameter Llama: 187.5 MiB at the optimizer step, twice its 93.75 MiB embedding matrix)
CPU_OPTIMIZER_SCRATCH_TENSORS = 2


def optimizer_scratch(cfg: RunConfig, device: str, trainable_bytes: int, largest_tensor_bytes: int) -> int:
    """The optimizer step's temporaries. On CUDA torch's foreach kernels build one scratch copy of the
    trainable parameters (e.g. Adam's denominator); on the CPU (no foreach kernels) it steps one tensor at
    a time, 2 temporaries of the largest; bitsandbytes/torchao 8-bit optimizers and Lion update block by
    block."""
    if not optimizer_entry(cfg.optim.name).foreach_scratch:
        return 0
    return trainable_bytes if device == "cuda" else CPU_OPTIMIZER_SCRATCH_TENSORS * largest_tensor_bytes


@dataclass
class ModelStates:
    """One process's model-state bytes and when it holds them. One device holds every state all the time;
    memory/distributed_estimate.py gives a rank's share and what its engine holds beside it."""

    weights: int
    gradients: int                  # every trainable gradient, once the backward has made them
    optimizer_states: int
    optimizer_scratch: int          # the optimizer step's temporaries
    persistent_gradients: int = 0   # allocated at every moment (DDP's gradient buckets)
    beside: dict = field(default_factory=dict)  # moment -> {category: bytes} the engine holds then (FSDP2's
                                                # gathered weights and gradient buffers)
    host_bytes: int = 0             # offloaded to host RAM
    notes: list = field(default_factory=list)


def model_states(shape: ModelShape, cfg: RunConfig, device: str) -> ModelStates:
    """The model states of a run on one device."""
    grads = gradient_bytes(shape, cfg)
    return ModelStates(weights_bytes(shape, cfg), grads, optimizer_state_bytes(shape, cfg),
                       optimizer_scratch(cfg, device, grads, largest_param_bytes(shape, cfg)))


def head_gradient_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """The gradient of the lm_head (of the embeddings, when tied), when it trains."""
    trained = cfg.method == "full" or getattr(cfg.lora, "train_lm_head", False)
    return shape.head_params * trainable_value_bytes(cfg) if trained else 0


def largest_param_bytes(shape: ModelShape, cfg: RunConfig) -> int:
    """The biggest single trainable parameter: the most gradient optimizer_in_backward ever holds."""
    if cfg.method == "full":
        largest = shape.largest_tensor_params
    else:
        largest = max([cfg.lora.rank * max(i, o) for _, i, o in adapted_linears(shape, cfg)] or [0])
    return largest * trainable_value_bytes(cfg)
