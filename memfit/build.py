"""Build one run's pieces from a RunConfig: precision, model, checkpointing, method, model-changing
strategies, optimizer.

The trainer, the planner's tracer, the GPU validation script and the tests all call `build_run`,
so the model the estimate traces is built by the very code that builds the model that trains.
What differs between them is passed in: where the model is built (`on_meta`), where its
weights go before quantization (`place_on`), and `wrap`, which turns the model into what runs
the step and builds the optimizer for it (one process: nothing to wrap; torch FSDP2/DDP/TP/PP or
DeepSpeed: memfit/distributed; the tracer: materialise on fake tensors).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn

from memfit.config import RunConfig
from memfit.models.loading import build_model
from memfit.strategies.adapters import apply_method
from memfit.strategies.checkpointing import apply_checkpointing
from memfit.strategies.optimizers import build_optimizer
from memfit.strategies.precision import PrecisionPlan, make_precision
from memfit.strategies.quantization import quantized_loading
from memfit.strategies.table import STEP_STRATEGIES

OptimizerFactory = Callable[[list[nn.Parameter]], torch.optim.Optimizer]
Wrap = Callable[[nn.Module, OptimizerFactory], tuple[nn.Module, torch.optim.Optimizer]]


@dataclass
class Run:
    model: nn.Module
    optimizer: torch.optim.Optimizer
    precision: PrecisionPlan
    params: list[nn.Parameter]  # the trainable ones, in the order the optimizer holds them


def trainable(model: nn.Module) -> list[nn.Parameter]:
    return [p for p in model.parameters() if p.requires_grad]


def single_process(model: nn.Module, make_optimizer: OptimizerFactory) -> tuple[nn.Module, torch.optim.Optimizer]:
    """One process: the model runs as built."""
    return model, make_optimizer(trainable(model))


def build_run(cfg: RunConfig, device: torch.device, on_meta: bool = False, wrap: Wrap = single_process,
              place_on: torch.device | str | None = None, attention: str | None = None,
              quantize_on_load: bool = True) -> Run:
    """The model in training mode with its optimizer and precision plan.

    on_meta: build without memory (a sharded rank that receives its weights, or the tracer).
    place_on: where the weights go before a quantized method quantizes them (None: stay put).
    attention: overrides cfg.memory.attention (the tracer traces flash-attn with SDPA's kernel).
    quantize_on_load: quantize while loading weights (transformers' quantization config); the
    tracer, which loads nothing, quantizes the meta model instead."""
    precision = make_precision(cfg.precision, device)
    load_kwargs = quantized_loading(cfg, device) if quantize_on_load else None
    model = build_model(cfg.model, attention or cfg.memory.attention, dtype=precision.weight_dtype, on_meta=on_meta,
                        load_kwargs=load_kwargs)
    model.config.use_cache = False  # no KV cache in training; a cache also turns off packed masks (data/packing.py)
    model = apply_method(apply_checkpointing(model, cfg.memory.activation_checkpoint_every), cfg, place_on)
    for strategy in STEP_STRATEGIES:  # strategies that change the model (memfit/strategies/table.py)
        if strategy.model_hook is not None and getattr(cfg.memory, strategy.name):
            model = strategy.model_hook(model, cfg)
    model, optimizer = wrap(model, lambda params: build_optimizer(
        cfg.optim.name, params, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.backend, device))
    model.train()
    return Run(model, optimizer, precision, trainable(model))
