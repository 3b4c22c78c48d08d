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
from memfit.config.step_rules import strategy_options
from memfit.models.load_plan import streams_to_device
from memfit.models.loading import build_model
from memfit.strategies.adapters import apply_method
from memfit.strategies.checkpointing import apply_checkpointing
from memfit.strategies.optimizers import build_optimizer
from memfit.strategies.precision import PrecisionPlan, make_precision
from memfit.strategies.quantization import compute_dtype, quantized_loading, quantizes_after_loading
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
              quantize_on_load: bool = True, quant_shards: int = 1) -> Run:
    """The model in training mode with its optimizer and precision plan.

    on_meta: build without memory (a sharded rank that receives its weights, or the tracer).
    place_on: where the weights go before a quantized method quantizes them (None: stay put).
    attention: overrides cfg.memory.attention (the tracer traces flash-attn with SDPA's kernel).
    quantize_on_load: quantize while loading weights (transformers' quantization config); the
    tracer, which loads nothing, quantizes the meta model instead.
    quant_shards: the FSDP2 row shards each quantized weight is cut into (its data-parallel size)."""
    precision = make_precision(cfg.precision, device)
    load_kwargs = loading_kwargs(cfg, device, place_on) if quantize_on_load else None
    model = build_model(cfg.model, attention or cfg.memory.attention, dtype=precision.weight_dtype, on_meta=on_meta,
                        load_kwargs=load_kwargs)
    model.config.use_cache = False  # no KV cache in training; a cache also turns off packed masks (data/packing.py)
    model = apply_configured_method(apply_checkpointing(model, cfg.memory.activation_checkpoint_every), cfg, place_on,
                                    quant_shards)
    for strategy in STEP_STRATEGIES:  # strategies that change the model (memfit/strategies/table.py)
        if strategy.model_hook is not None and getattr(cfg.memory, strategy.name):
            model = strategy.model_hook(model, **strategy_options(cfg, strategy))
    model, optimizer = wrap(model, lambda params: build_optimizer(
        cfg.optim.name, params, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.backend, device))
    model.train()
    return Run(model, optimizer, precision, trainable(model))


def apply_configured_method(model: nn.Module, cfg: RunConfig, device: torch.device | str | None = None,
                            quant_shards: int = 1) -> nn.Module:
    """`apply_method` (memfit/strategies/adapters.py) with the run's method, lora, quant and precision settings."""
    lora = cfg.lora
    return apply_method(model, method=cfg.method, targets=lora.targets, rank=lora.rank, alpha=lora.alpha,
                        dropout=lora.dropout, use_dora=lora.use_dora, use_rslora=lora.use_rslora,
                        train_embeddings=lora.train_embeddings, train_lm_head=lora.train_lm_head,
                        quant_scheme=cfg.quant.scheme, quant_backend=cfg.quant_backend,
                        quant_dtype=quant_compute_dtype(cfg), precision=cfg.precision, device=device,
                        quant_shards=quant_shards)


def loading_kwargs(cfg: RunConfig, device: torch.device, place_on: torch.device | str | None) -> dict:
    """from_pretrained's extra keywords: bitsandbytes' quantization config, and for a process that keeps the
    whole model on its CUDA device (`place_on`) a device map, so the checkpoint goes there tensor by tensor
    and never whole to the host (memfit/models/load_plan.py)."""
    kwargs = configured_quantized_loading(cfg, device)
    after = quantizes_after_loading(method=cfg.method, scheme=cfg.quant.scheme, backend=cfg.quant_backend)
    if place_on is not None and streams_to_device(cfg, torch.device(place_on).type, after):
        kwargs = {"device_map": {"": str(place_on)}, **kwargs}
    return kwargs


def configured_quantized_loading(cfg: RunConfig, device: torch.device | None = None) -> dict:
    """`quantized_loading` (memfit/strategies/quantization.py) for the run's method and quant settings."""
    return quantized_loading(method=cfg.method, scheme=cfg.quant.scheme, backend=cfg.quant_backend,
                             dtype=quant_compute_dtype(cfg), device=device)


def quant_compute_dtype(cfg: RunConfig) -> torch.dtype:
    """The dtype quantized base weights compute in: quant.compute_dtype, or the precision's when auto."""
    return compute_dtype(cfg.quant.compute_dtype, cfg.precision)
