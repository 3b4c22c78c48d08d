"""The training run: build everything from a RunConfig, one straight loop, save the results."""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from tqdm.auto import tqdm

from memfit.config import RunConfig
from memfit.data.loader import BatchStream, load_examples
from memfit.errors import MemfitError
from memfit.memory.report import MemoryReport, format_bytes
from memfit.memory.tracker import MemoryTracker, NullTracker
from memfit.models.loading import build_model, load_tokenizer
from memfit.strategies.adapters import apply_method
from memfit.strategies.checkpointing import apply_checkpointing
from memfit.strategies.optimizers import build_optimizer
from memfit.strategies.precision import make_precision
from memfit.train.schedule import make_scheduler
from memfit.train.step import training_step

log = logging.getLogger(__name__)
RUN_MARKERS = ("run_config.yaml", "metrics.jsonl")  # files that say a folder already holds a run


@dataclass
class RunResult:
    output_dir: Path
    losses: list[float]
    report: MemoryReport


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise MemfitError("device: cuda was asked for, but torch sees no CUDA GPU; use device: cpu or auto")
    return torch.device(name)


def prepare_output_dir(cfg: RunConfig) -> Path:
    out = Path(cfg.output_dir)
    if any((out / marker).exists() for marker in RUN_MARKERS) and not cfg.overwrite:
        raise MemfitError(f"output_dir {out} already holds a run; choose another output_dir "
                          "or set overwrite=true to replace it")
    out.mkdir(parents=True, exist_ok=True)
    (out / "metrics.jsonl").unlink(missing_ok=True)
    (out / "run_config.yaml").write_text(cfg.to_yaml())
    return out


def train(cfg: RunConfig, progress: bool = True) -> RunResult:
    device = resolve_device(cfg.device)
    torch.manual_seed(cfg.seed)
    precision = make_precision(cfg.precision, device)
    tokenizer = load_tokenizer(cfg.model)
    examples = load_examples(cfg.data, tokenizer, cfg.seq_len)
    model = build_model(cfg.model, cfg.attention, dtype=precision.weight_dtype)
    model = apply_method(apply_checkpointing(model, cfg.checkpoint_every), cfg).to(device)
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg.optimizer, params, cfg.lr, cfg.weight_decay, cfg.optimizer_backend, device)
    scheduler = make_scheduler(optimizer, cfg.lr_schedule, cfg.warmup_steps, cfg.max_steps)
    stream = BatchStream(examples, cfg.micro_batch, tokenizer.pad_token_id, cfg.seed)
    out = prepare_output_dir(cfg)
    tracker = MemoryTracker() if cfg.track_memory else NullTracker()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    losses: list[float] = []
    bar = tqdm(range(1, cfg.max_steps + 1), desc="training", unit="step", disable=not progress)
    with tracker, (out / "metrics.jsonl").open("a") as metrics:
        tracker.tag_module(model)
        for step in bar:
            started = time.perf_counter()
            micro_batches = [{k: v.to(device) for k, v in stream.next_batch().items()} for _ in range(cfg.grad_accum)]
            for batch in micro_batches:
                tracker.tag(batch.values(), "activations")
            result = training_step(model, optimizer, micro_batches, precision, tracker, params, cfg.max_grad_norm)
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            losses.append(result.loss)
            tokens_per_s = result.tokens / (time.perf_counter() - started)
            bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{tokens_per_s:,.0f}",
                            peak=format_bytes(tracker.peak_bytes))
            if step % cfg.log_every == 0 or step in (1, cfg.max_steps):
                metrics.write(json.dumps({
                    "step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
                    "skipped": result.skipped, "tokens_per_s": round(tokens_per_s, 1),
                    "epoch": stream.epoch, "peak_bytes": tracker.peak_bytes,
                    "peak_by_category_bytes": tracker.peak_by_category()}) + "\n")
                metrics.flush()

    report = measured_report(tracker, device)
    save_model(model, tokenizer, out)
    (out / "memory_report.txt").write_text(report.to_text() + "\n")
    (out / "memory_report.json").write_text(report.to_json() + "\n")
    return RunResult(out, losses, report)


def measured_report(tracker, device: torch.device) -> MemoryReport:
    import resource

    report = MemoryReport(measured_peak_bytes=tracker.peak_bytes, measured_by_category=tracker.peak_by_category())
    report.process_peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if device.type == "cuda":
        report.cuda_max_allocated_bytes = torch.cuda.max_memory_allocated(device)
        report.cuda_max_reserved_bytes = torch.cuda.max_memory_reserved(device)
    return report


def save_model(model, tokenizer, out: Path) -> None:
    """Weights as safetensors (adapters in PEFT's format), plus the tokenizer."""
    model.save_pretrained(out, safe_serialization=True)
    tokenizer.save_pretrained(out)
