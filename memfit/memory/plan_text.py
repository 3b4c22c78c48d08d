"""What `memfit plan` prints: the estimate as a table, then the search's decision (chosen plan, the
fastest plans that fit, one line per family, what each memory saver buys). Every byte count is in
GiB (2^30 bytes), said where it is printed."""

from __future__ import annotations

from memfit.config import RunConfig
from memfit.memory.candidates import config_summary
from memfit.memory.model_shape import model_shape, trainable_params, trainable_value_bytes
from memfit.memory.planner import Plan
from memfit.models.loading import load_model_config
from memfit.models.validate import POSITIONS
from memfit.strategies.table import STEP_STRATEGIES


def plan_text(result: Plan) -> str:
    """The plan as a table; every number in GiB (2^30 bytes), said in the header."""
    est, cfg = result.estimate, result.cfg
    shape = model_shape(_model_config(cfg))
    trainable = trainable_params(shape, cfg)
    master = min(trainable * trainable_value_bytes(cfg), est.by_category["weights"])
    lines = [f"memfit plan: {result.model} ({_params(shape.total_params)} parameters, "
             f"{_params(trainable)} trainable), engine {est.engine}, per GPU",
             f"run as described: {config_summary(cfg)}",
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
    if est.phases:
        top = max(est.phases, key=lambda name: est.phases[name]["gpu"])
        lines.append("Phases, GPU tensors / host RAM (GiB): " + ", ".join(
            f"{name.replace('_', ' ')} {p['gpu'] / 2**30:.2f} / {p['cpu_ram'] / 2**30:.2f}"
            for name, p in est.phases.items()) + f"; the GPU peak is set by: {top.replace('_', ' ')}")
    lines += [f"note: {n}" for n in est.notes]
    if result.search is None:
        return "\n".join(lines)
    return "\n".join(lines + [""] + search_lines(result))


def search_lines(result: Plan) -> list[str]:
    """The decision: the chosen plan, the Pareto table, one line per family."""
    found = result.search
    budget, margin = found.budget_bytes, found.margin_bytes
    lines = [f"Budget {budget / 2**30:.2f} GiB per GPU x {result.gpus} GPU(s), margin {margin / 2**30:.2f} GiB "
             f"(plan + margin <= budget); "
             + ("host RAM not limited: each plan states what it needs per node (--host-ram SIZE sets a limit); "
                if found.host_ram is None else f"host RAM {found.host_ram / 2**30:.1f} GiB per node (--host-ram); ")
             + f"step times predicted for {found.gpu.name} (--gpu); {found.evaluated} plans estimated in "
             f"{result.seconds:.2f} s"]
    chosen = found.chosen
    if chosen is None:
        lines.append("Recommendation: nothing fits this budget; each family's closest plan and its miss are below "
                     "(more GPUs with --gpus, a shorter --seq-len, or a larger budget)")
    else:
        lines += [f"Recommendation: {chosen.family}: {_settings(chosen.cfg)}",
                  f"  GPU {chosen.device_bytes / 2**30:.2f} GiB (reserved peak "
                  f"{chosen.estimate.peak_reserved_bytes / 2**30:.2f}"
                  f" + CUDA context), CPU RAM {chosen.estimate.cpu_ram_bytes / 2**30:.2f} GiB, "
                  f"~{chosen.step_seconds:.2f} s per step ({chosen.tokens_per_second:,.0f} tokens/s predicted), "
                  f"gives up: {'; '.join(chosen.gives_up) or 'nothing'}",
                  f"  at its peak{' (each GPU)' if result.gpus > 1 else ''}: "
                  + ", ".join(f"{name.replace('_', ' ')} {value / 2**30:.2f} GiB"
                              for name, value in chosen.estimate.by_category.items())]
        if found.max_seq_len is not None:
            lines.append(f"  longest seq_len that fits this plan at micro_batch 1: {_count(found.max_seq_len)}"
                         + _position_cap(result.cfg, found.max_seq_len))
            lines += ladder_lines(found.seq_len_ladder)
        if found.max_micro_batch is not None:
            lines.append(f"  largest micro_batch that fits this plan at seq_len {chosen.cfg.data.seq_len}: "
                         f"{found.max_micro_batch or 'none'}")
        fastest = found.pareto[0].step_seconds
        lines += ["", "Fastest plans that fit (each needs less memory than every faster one; time relative to the "
                      "fastest)",
                  f"  {'GPU GiB':>8} {'CPU GiB':>8} {'time':>6}  family: settings  [gives up]"]
        for c in found.pareto:
            mark = "*" if c is chosen else " "
            lines.append(f"{mark} {c.device_bytes / 2**30:8.2f} {c.estimate.cpu_ram_bytes / 2**30:8.2f} "
                         f"{c.step_seconds / fastest:5.2f}x  {c.family}: {_settings(c.cfg)}"
                         f"  [{'; '.join(c.gives_up) or 'nothing'}]")
    lines += ["", "Families"]
    for family in found.families:
        mark = "FITS" if family.fits else "no  "
        lines.append(f"  [{mark}] {family.name}: {family.reason}")
        limits = []
        if family.max_seq_len is not None:
            limits.append(f"longest seq_len at micro_batch 1: {_count(family.max_seq_len)}" + (
                f" (GPU {family.longest.device_bytes / 2**30:.2f} GiB, host RAM "
                f"{family.longest.estimate.cpu_ram_bytes / 2**30:.1f} GiB) with {_settings(family.longest.cfg)}"
                if family.longest else ""))
        if family.max_micro_batch is not None:
            limits.append(f"largest micro_batch at seq_len {result.cfg.data.seq_len}: "
                          f"{family.max_micro_batch or 'none'}")
        if limits:
            lines.append("         " + "; ".join(limits) + " (the family's leanest settings)")
    return lines


def ladder_lines(ladder) -> list[str]:
    """What each memory saver buys: the longest seq_len as they are switched on one after another."""
    if not ladder:
        return []
    lines = ["  what each memory saver buys (this plan at micro_batch 1, savers added one after another):",
             f"    {'memory savers':<26} {'longest seq_len':>15} {'GPU there':>10} {'host RAM there':>15} "
             f"{'step there':>11}"]
    for rung in ladder:
        best = rung.best
        length = _count(rung.max_seq_len)
        gpu = f"{best.device_bytes / 2**30:.2f} GiB" if best else "-"
        host = f"{best.estimate.cpu_ram_bytes / 2**30:.1f} GiB" if best else "-"
        step = f"{best.step_seconds:.1f} s" if best else "-"
        lines.append(f"    {rung.added:<26} {length:>15} {gpu:>10} {host:>15} {step:>11}")
    return lines


def _settings(cfg: RunConfig) -> str:
    """The plan's choices in the words of RunConfig keys, defaults left out."""
    parts = [f"{cfg.precision}", cfg.optim.name, f"checkpointing {cfg.memory.checkpointing}"]
    for strategy in STEP_STRATEGIES:
        if getattr(cfg.memory, strategy.name):
            parts.append(strategy.name.replace("_", " "))
            parts += [option.replace("_", " ") + ("" if value is True else f" {value}") for option in strategy.options
                      if (value := getattr(cfg.memory, option)) not in (None, False)]
    parts.append(f"micro_batch {cfg.batch.micro_batch} x grad_accum {cfg.batch.grad_accum}")
    return ", ".join(parts)


def _position_cap(cfg: RunConfig, longest: int) -> str:
    """Says so when the longest seq_len is the model's position table, not the memory, talking."""
    config = _model_config(cfg)
    name, limit = next(((n, getattr(config, n)) for n in POSITIONS if getattr(config, n, None)), (None, None))
    return f" (the model's {name}: memory would allow more)" if limit == longest else ""


def _model_config(cfg: RunConfig):
    return load_model_config(cfg.model)[0]


def _gib(n: int) -> str:
    """A byte count in GiB, right-aligned in a column of 8."""
    return f"{n / 2**30:8.2f}"


def _params(n: int) -> str:
    """A parameter count in short form: 8.03 B, 124.44 M."""
    return f"{n / 1e9:.2f} B" if n >= 1e9 else f"{n / 1e6:.2f} M"


def _count(value: int) -> str:
    """A token count in full (131,072), or "none" when nothing fits."""
    return f"{value:,}" if value else "none"
