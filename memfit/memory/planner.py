"""The planner: estimate a run, walk the roadmap tiers against a memory budget, recommend the fastest fit.

Tiers, in the roadmap's order (easy to hard):
  1. bf16 mixed precision + gradient checkpointing + 8-bit AdamW (full fine-tune)
  2. QLoRA (4-bit NF4 base, LoRA adapters)
  3. ZeRO/FSDP sharding + CPU offload (when this build's RunConfig has the sharding keys)

Inside a tier the search varies checkpointing (none, every-4, every-2, full) and the micro-batch (with
grad_accum raised so the tokens per optimizer step stay what the user asked for); the analytic engine
scores every candidate instantly. Among the candidates that fit, the recommendation is the one with the
highest predicted throughput by the cost model in `step_seconds` (documented in docs/planner.md). The
traced engine, when asked for, confirms the chosen configuration.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from memfit.config import RunConfig
from memfit.errors import MemfitError
from memfit.memory.analytic import analytic_estimate, device_total_bytes, _checkpointed_layers
from memfit.memory.estimate import Estimate
from memfit.memory.model_shape import ModelShape, model_shape, trainable_params
from memfit.memory.report import format_bytes, parse_bytes

log = logging.getLogger(__name__)

# --- cost model constants (a reference GPU; only ratios between candidates matter) ---------------------
MATMUL_FLOPS_16BIT = 400e12   # sustained bf16/fp16 tensor-core matmul FLOP/s
MATMUL_FLOPS_FP32 = 100e12    # fp32 matmuls run as TF32 at about a quarter of that
MEMORY_BANDWIDTH = 3e12       # HBM bytes/s (optimizer steps and dequantization are bandwidth-bound)
HOST_LINK_BANDWIDTH = 25e9    # PCIe bytes/s each way (CPU offload traffic)
KERNEL_LAUNCH_SECONDS = 10e-6  # fixed cost per kernel; ~40 kernels per layer per micro-batch (fwd + bwd)
CHECKPOINT_CHOICES = ("none", "every-4", "every-2", "full")
TIER_NAMES = {
    1: "bf16-mixed + gradient checkpointing + 8-bit AdamW",
    2: "QLoRA (4-bit NF4 base + LoRA adapters)",
    3: "ZeRO/FSDP sharding + CPU offload",
}


@dataclass
class Candidate:
    cfg: RunConfig
    estimate: Estimate
    device_bytes: int          # what the GPU must hold (nvidia-smi): reserved + CUDA context
    step_seconds: float
    tokens_per_second: float
    fits: bool


@dataclass
class TierResult:
    tier: int
    name: str
    available: bool
    fits: bool
    reason: str
    best: Candidate | None = None
    max_micro_batch: int = 0   # at the requested seq_len
    max_seq_len: int = 0       # at micro_batch 1

    def to_dict(self) -> dict:
        out = {"tier": self.tier, "name": self.name, "available": self.available, "fits": self.fits,
               "reason": self.reason, "max_micro_batch": self.max_micro_batch, "max_seq_len": self.max_seq_len}
        if self.best is not None:
            out["config"] = _config_summary(self.best.cfg)
            out["estimate"] = self.best.estimate.to_dict()
            out["device_bytes"] = self.best.device_bytes
            out["tokens_per_second"] = round(self.best.tokens_per_second, 1)
        return out


@dataclass
class Plan:
    model: str
    cfg: RunConfig
    estimate: Estimate
    device_bytes: int
    budget_bytes: int | None
    gpus: int
    tiers: list[TierResult] = field(default_factory=list)
    recommendation: Candidate | None = None

    def to_dict(self) -> dict:
        out = {"model": self.model, "gpus": self.gpus, "budget_bytes": self.budget_bytes,
               "estimate": self.estimate.to_dict(), "device_bytes": self.device_bytes}
        if self.budget_bytes is not None:
            out["tiers"] = [t.to_dict() for t in self.tiers]
            out["recommendation"] = (self.recommendation.cfg.model_dump(mode="json")
                                     if self.recommendation else None)
        return out


def _config_summary(cfg: RunConfig) -> dict:
    keys = ("method", "precision", "optimizer", "checkpointing", "attention", "micro_batch", "grad_accum", "seq_len")
    out = {k: getattr(cfg, k) for k in keys}
    for extra in ("quant", "sharding", "offload"):
        if hasattr(cfg, extra):
            out[extra] = getattr(cfg, extra)
    return out


# --- cost model -------------------------------------------------------------------------------------
def step_seconds(shape: ModelShape, cfg: RunConfig, gpus: int = 1) -> float:
    """Predicted seconds per optimizer step on the reference GPU (per rank).

    compute   forward 2*N FLOPs per token (+ attention 4*L*seq*q_dim); backward twice the forward for
              full fine-tuning, once for LoRA (no weight gradients of the frozen base); each
              checkpointed layer runs its forward again in the backward
    quantized each 4-bit base weight is dequantized to 16 bits per pass (forward, backward, recompute):
              0.5 B read + 2 B written per parameter per pass, bandwidth-bound
    optimizer reads and writes weights, gradients and states once per step: bandwidth-bound
    offload   optimizer states (offload=optimizer) or parameters too (params/all) cross the host link
              twice per step (there and back)
    launches  a fixed cost per kernel; this is what makes larger micro-batches faster per token"""
    tokens = cfg.micro_batch * cfg.seq_len
    n = shape.total_params
    attention = 4 * shape.layers * cfg.seq_len * shape.q_dim
    forward = tokens * (2 * n + attention)
    backward = forward * (2 if cfg.method == "full" else 1)
    recompute = forward * _checkpointed_layers(shape, cfg) / shape.layers
    flops = (forward + backward + recompute) * cfg.grad_accum
    rate = MATMUL_FLOPS_FP32 if cfg.precision == "fp32" else MATMUL_FLOPS_16BIT
    seconds = flops / rate
    if cfg.method == "qlora" or getattr(cfg, "quant", "none") not in (None, "none"):
        passes = 2 + _checkpointed_layers(shape, cfg) / shape.layers
        seconds += shape.block_linear_params * 2.5 * passes * cfg.grad_accum / MEMORY_BANDWIDTH
    trainable = trainable_params(shape, cfg)
    state_bytes = {"adamw": 8, "adamw-8bit": 2, "paged-adamw-8bit": 2, "lion": 4, "lion-8bit": 1,
                   "sgd": 4, "adafactor": 0.1}[cfg.optimizer]
    weight_bytes = 2 if cfg.precision == "bf16-pure" and cfg.method == "full" else 4
    optimizer_bytes = trainable * (2 * weight_bytes + weight_bytes + 2 * state_bytes) / max(gpus, 1)
    seconds += optimizer_bytes / MEMORY_BANDWIDTH
    offload = getattr(cfg, "offload", "none")
    if offload != "none":
        moved = trainable * state_bytes + (trainable * weight_bytes * 2 if offload in ("params", "all") else 0)
        seconds += 2 * moved / max(gpus, 1) / HOST_LINK_BANDWIDTH
    seconds += KERNEL_LAUNCH_SECONDS * 40 * shape.layers * cfg.grad_accum
    return seconds


# --- evaluating candidates ----------------------------------------------------------------------------
def _evaluate(cfg: RunConfig, model_config, shape: ModelShape, budget: int | None, gpus: int,
              device: str) -> Candidate:
    est = analytic_estimate(cfg, model_config, device=device, gpus=gpus)
    total = device_total_bytes(est)
    seconds = step_seconds(shape, cfg, gpus)
    tokens = cfg.micro_batch * cfg.seq_len * cfg.grad_accum * _data_parallel(cfg, gpus)
    return Candidate(cfg, est, total, seconds, tokens / seconds, budget is None or total <= budget)


def _data_parallel(cfg: RunConfig, gpus: int) -> int:
    model_parallel = getattr(cfg, "tensor_parallel", 1) * getattr(cfg, "pipeline_parallel", 1)
    return max(gpus // model_parallel, 1)


def _with(cfg: RunConfig, **changes) -> RunConfig:
    """A validated copy of cfg with changes (nested keys as dicts)."""
    raw = cfg.model_dump(mode="json")
    raw.update(changes)
    return RunConfig.model_validate(raw)


def _batch_shapes(cfg: RunConfig) -> list[tuple[int, int]]:
    """(micro_batch, grad_accum) pairs keeping the user's sequences per optimizer step."""
    mb = cfg.micro_batch if isinstance(cfg.micro_batch, int) else 1
    sequences = mb * cfg.grad_accum
    shapes = []
    m = 1
    while m <= sequences:
        if sequences % m == 0:
            shapes.append((m, sequences // m))
        m *= 2
    if (sequences, 1) not in shapes:
        shapes.append((sequences, 1))
    return shapes


def _largest(fits, low: int, high: int) -> int:
    """Largest value in [low, high] for which fits(value) holds (fits is monotone); 0 if none."""
    if not fits(low):
        return 0
    while low < high:
        mid = (low + high + 1) // 2
        low, high = (mid, high) if fits(mid) else (low, mid - 1)
    return low


def tier_configs(tier: int, cfg: RunConfig) -> list[RunConfig] | str:
    """The candidate configurations of a tier, or the reason the tier is not available."""
    fields = RunConfig.model_fields
    base = dict(budget=None) if "budget" in fields else {}
    if tier == 1:
        variants = [dict(method="full", precision="bf16-mixed", optimizer="adamw-8bit", checkpointing=c)
                    for c in CHECKPOINT_CHOICES]
    elif tier == 2:
        if "quant" not in fields:
            return "QLoRA is not available in this build (RunConfig has no `quant`)"
        targets = cfg.lora.targets if cfg.method in ("lora", "qlora") else "all-linear"
        variants = [dict(method="qlora", quant="nf4-dq", precision="bf16-mixed", optimizer="adamw",
                         checkpointing=c, lora=dict(cfg.lora.model_dump(mode="json"), targets=targets))
                    for c in CHECKPOINT_CHOICES]
    else:
        if "sharding" not in fields:
            return "sharding/offload are not available in this build (RunConfig has no `sharding`)"
        variants = [dict(method="full", precision="bf16-mixed", optimizer="adamw", sharding=s, offload=o,
                         checkpointing=c)
                    for s, o in (("zero2", "none"), ("zero3", "none"), ("zero3", "optimizer"), ("zero3", "all"))
                    for c in CHECKPOINT_CHOICES]
    out = []
    for v in variants:
        for mb, ga in _batch_shapes(cfg):
            try:
                out.append(_with(cfg, **base, **v, micro_batch=mb, grad_accum=ga))
            except Exception as exc:  # noqa: BLE001 - a combination this build refuses is not a candidate
                log.debug("tier %d candidate %s refused: %s", tier, v, exc)
    return out or "no valid configuration in this tier for this build"


def _run_tier(tier: int, cfg: RunConfig, model_config, shape: ModelShape, budget: int, gpus: int,
              device: str) -> TierResult:
    configs = tier_configs(tier, cfg)
    name = TIER_NAMES[tier]
    if isinstance(configs, str):
        return TierResult(tier, name, available=False, fits=False, reason=configs)
    if tier == 3 and gpus < 2:
        return TierResult(tier, name, available=False, fits=False,
                          reason="sharding needs --gpus 2 or more (offload alone is not planned on one GPU)")
    candidates = [_evaluate(c, model_config, shape, budget, gpus, device) for c in configs]
    fitting = [c for c in candidates if c.fits]
    smallest = min(candidates, key=lambda c: c.device_bytes)
    lean = smallest.cfg  # the tier's most memory-saving settings, for the largest batch / sequence

    def fits_with(**changes) -> bool:
        return _evaluate(_with(lean, **changes), model_config, shape, budget, gpus, device).fits

    max_mb = _largest(lambda m: fits_with(micro_batch=m, grad_accum=1), 1, 4096)
    limit = getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", 4096)
    max_seq = _largest(lambda s: fits_with(micro_batch=1, grad_accum=1, seq_len=s), 8, int(limit))
    if not fitting:
        reason = (f"does not fit: needs at least {format_bytes(smallest.device_bytes)} per GPU "
                  f"({_top_category(smallest.estimate)}), budget {format_bytes(budget)}")
        return TierResult(tier, name, True, False, reason, smallest, max_mb, max_seq)
    best = max(fitting, key=lambda c: c.tokens_per_second)
    reason = (f"fits: {format_bytes(best.device_bytes)} of {format_bytes(budget)} with checkpointing "
              f"{best.cfg.checkpointing}, micro_batch {best.cfg.micro_batch} x grad_accum {best.cfg.grad_accum}")
    return TierResult(tier, name, True, True, reason, best, max_mb, max_seq)


def _top_category(est: Estimate) -> str:
    cat, size = max(est.by_category.items(), key=lambda kv: kv[1])
    return f"largest: {cat.replace('_', ' ')} {format_bytes(size)}"


def plan(model_name: str, cfg: RunConfig, budget_bytes: int | None = None, gpus: int = 1,
         engine: str = "analytic", device: str = "cuda") -> Plan:
    """Estimate `cfg` for `model_name`; with a budget, run the tiers and recommend the fastest fit."""
    from memfit.models.loading import load_model_config

    if cfg.model.name != model_name:
        cfg = _with(cfg, model=dict(cfg.model.model_dump(mode="json"), name=model_name))
    model_config, _ = load_model_config(cfg.model)
    shape = model_shape(model_config)
    described = cfg
    if not isinstance(cfg.micro_batch, int):
        described = _with(cfg, micro_batch=1)
    estimate = _engine_estimate(described, model_config, device, engine, gpus)
    result = Plan(model_name, described, estimate, device_total_bytes(estimate), budget_bytes, gpus)
    if budget_bytes is None:
        return result
    result.tiers = [_run_tier(t, described, model_config, shape, budget_bytes, gpus, device) for t in (1, 2, 3)]
    fitting = [t.best for t in result.tiers if t.fits and t.best is not None]
    if fitting:
        result.recommendation = max(fitting, key=lambda c: c.tokens_per_second)
        if engine == "traced":  # confirm the choice on the trainer's own step
            confirmed = _engine_estimate(result.recommendation.cfg, model_config, device, "traced", gpus)
            result.recommendation.estimate = confirmed
            result.recommendation.device_bytes = device_total_bytes(confirmed)
            result.recommendation.fits = result.recommendation.device_bytes <= budget_bytes
    return result


def _engine_estimate(cfg: RunConfig, model_config, device: str, engine: str, gpus: int = 1) -> Estimate:
    if engine == "analytic":
        return analytic_estimate(cfg, model_config, device=device, gpus=gpus)
    if engine != "traced":
        raise MemfitError(f"--engine: unknown '{engine}'; allowed: analytic, traced")
    try:
        from memfit.memory.trace import trace_estimate
    except ImportError:
        raise MemfitError("--engine traced: the traced engine (memfit.memory.trace) is not in this build; "
                          "use --engine analytic") from None
    traced = trace_estimate(cfg, device=device)
    analytic = analytic_estimate(cfg, model_config, device=device, gpus=gpus)
    # host RAM beyond the training tensors (runtime, loading path, data) comes from the analytic terms
    on_host = traced.peak_allocated_bytes if device == "cpu" else 0
    analytic_on_host = analytic.peak_allocated_bytes if device == "cpu" else 0
    traced.cpu_ram_bytes = analytic.cpu_ram_bytes - analytic_on_host + on_host
    if device == "cuda" and not traced.overheads:
        # the tracker sees tensors only: add the same named runtime terms the analytic engine uses
        traced.overheads = dict(analytic.overheads)
        traced.peak_reserved_bytes = (traced.peak_allocated_bytes + analytic.overheads["cublas_workspace"]
                                      + analytic.overheads["allocator_reserve"])
    return traced


# --- budget: auto / size, before training ----------------------------------------------------------------
def available_bytes(device: str) -> int:
    """Memory the run may use: free GPU memory on CUDA, available RAM on CPU."""
    if device == "cuda":
        import torch

        free, _total = torch.cuda.mem_get_info()
        return int(free)
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except ImportError:
        import os

        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def resolve_budget(cfg: RunConfig) -> RunConfig:
    """`budget: auto | <size>`: let the planner choose the setup before training; no-op when unset.

    The returned config is the recommendation (budget cleared, so it is not planned again), or cfg
    unchanged when the described run already fits. Raises MemfitError when nothing fits."""
    budget = getattr(cfg, "budget", None)
    if budget is None:
        return cfg
    import torch

    device = "cuda" if cfg.device == "cuda" or (cfg.device == "auto" and torch.cuda.is_available()) else "cpu"
    budget_bytes = available_bytes(device) if budget == "auto" else parse_bytes(budget)
    result = plan(cfg.model.name, cfg, budget_bytes, gpus=1, device=device)
    current = _with(cfg, budget=None)
    model_config = _model_config(cfg)
    described = _evaluate(result.cfg, model_config, model_shape(model_config), budget_bytes, 1, device)
    if isinstance(cfg.micro_batch, int) and described.fits:
        log.info("budget %s: the configured run fits (%s predicted); training it as configured",
                 format_bytes(budget_bytes), format_bytes(described.device_bytes))
        return current
    if result.recommendation is None:
        reasons = "; ".join(f"tier {t.tier}: {t.reason}" for t in result.tiers)
        raise MemfitError(f"budget {format_bytes(budget_bytes)}: no configuration of {cfg.model.name} fits ({reasons})")
    chosen = result.recommendation.cfg
    log.info("budget %s: planner chose %s (predicted %s)", format_bytes(budget_bytes),
             _config_summary(chosen), format_bytes(result.recommendation.device_bytes))
    return chosen


def _model_config(cfg: RunConfig):
    from memfit.models.loading import load_model_config

    return load_model_config(cfg.model)[0]


def parse_budget(text: str | None) -> int | None:
    if text is None:
        return None
    try:
        return parse_bytes(text)
    except ValueError as exc:
        raise MemfitError(f"--budget: {exc}") from None



# --- output ---------------------------------------------------------------------------------------------
def _gib(n: int) -> str:
    return f"{n / 2**30:8.2f}"


def _count(n: int) -> str:
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def plan_text(result: Plan) -> str:
    """The plan as a table; every number in GiB (2^30 bytes), said in the header."""
    from memfit.memory.analytic import _trainable_size

    est, cfg = result.estimate, result.cfg
    shape = model_shape(_model_config(cfg))
    trainable = trainable_params(shape, cfg)
    master = min(trainable * _trainable_size(cfg), est.by_category["weights"])
    lines = [f"memfit plan: {result.model} ({_count(shape.total_params)} parameters, "
             f"{_count(trainable)} trainable), engine {est.engine}, per GPU",
             f"run: {_config_summary(cfg)}",
             "", "Predicted peak GPU memory (GiB = 2^30 bytes)"]
    rows = [("weights (frozen / base)", est.by_category["weights"] - master),
            ("trainable master weights", master),
            ("gradients", est.by_category["gradients"]),
            ("optimizer states", est.by_category["optimizer_states"]),
            ("activations (at the peak)", est.by_category["activations"]),
            ("temporaries", est.by_category["temporaries"])]
    lines += [f"  {name:<34}{_gib(value)} GiB" for name, value in rows]
    lines.append(f"  {'= allocator peak (max_memory_allocated)':<34}{_gib(est.peak_allocated_bytes)} GiB")
    for name, value in est.overheads.items():
        lines.append(f"  {'+ ' + name.replace('_', ' '):<34}{_gib(value)} GiB")
    if est.overheads:
        lines.append(f"  {'= reserved peak (max_memory_reserved)':<34}{_gib(est.peak_reserved_bytes)} GiB")
        lines.append(f"  {'= whole GPU (nvidia-smi)':<34}{_gib(result.device_bytes)} GiB")
    lines.append(f"Predicted CPU RAM (loading path, data, offload): {_gib(est.cpu_ram_bytes).strip()} GiB")
    lines += [f"note: {n}" for n in est.notes]
    if result.budget_bytes is None:
        return "\n".join(lines)
    lines += ["", f"Budget {result.budget_bytes / 2**30:.2f} GiB per GPU x {result.gpus} GPU(s): roadmap tiers"]
    for t in result.tiers:
        mark = "FITS" if t.fits else ("n/a " if not t.available else "no  ")
        lines.append(f"  [{mark}] tier {t.tier}: {t.name}: {t.reason}")
        if t.available:
            lines.append(f"         largest micro_batch at seq_len {cfg.seq_len}: {t.max_micro_batch or 'none'}; "
                         f"largest seq_len at micro_batch 1: {t.max_seq_len or 'none'}")
    rec = result.recommendation
    if rec is None:
        lines.append("Recommendation: nothing fits this budget; more GPUs (--gpus) or a larger budget")
    else:
        lines.append(f"Recommendation (fastest that fits, {rec.tokens_per_second:,.0f} tokens/s predicted on the "
                     f"reference GPU): {_config_summary(rec.cfg)}, {rec.device_bytes / 2**30:.2f} GiB per GPU "
                     f"({rec.estimate.engine} engine)")
    return "\n".join(lines)


def write_config(result: Plan, path: str) -> RunConfig:
    """Write the recommendation (or the described run) as a RunConfig YAML `memfit train` accepts."""
    from pathlib import Path

    cfg = result.recommendation.cfg if result.recommendation else result.cfg
    Path(path).write_text(cfg.to_yaml())
    return cfg
