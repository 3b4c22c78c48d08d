"""The training run: build everything from the resolved run, one straight loop, save the results."""

from __future__ import annotations

import logging
import os
import resource
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from memfit.build import build_run
from memfit.checkpoint import CHECKPOINTS_DIR, keep_configured_hyperparameters, latest_step_name
from memfit.config import RunConfig
from memfit.data.loader import build_batch_stream
from memfit.data.notes import DataNotes
from memfit.distributed.checkpoint import unwrap
from memfit.distributed.engine import Engine, make_engine
from memfit.errors import MemfitError
from memfit.memory.report import MemoryReport
from memfit.memory.timeline import write_timeline
from memfit.memory.trace import trace_estimate
from memfit.models.loading import check_tokenizer, check_weights, load_model_config, load_tokenizer
from memfit.models.validate import check_model, model_where
from memfit.models.merge import save_adapter_outputs
from memfit.step import step_strategies, tracked_steps
from memfit.strategies.adapters import check_lora_targets_on_meta
from memfit.train.error_log import ThreadErrorsToLog
from memfit.train.evaluate import Evaluation
from memfit.train.metrics import MetricsLog, OutputWriteError
from memfit.train.output_dir import (check_output_dir, planned_disk_bytes, prepare_output_dir, record_finished,
                                     record_outputs, record_resumed_run)
from memfit.train.run_lock import hold_output_dir
from memfit.train.oom import OomRecovery, make_tracker, split_batches
from memfit.train.resolved_run import ResolvedRun
from memfit.train.schedule import make_scheduler
from memfit.train.signals import StopOnSignal, TrainingStopped
from memfit.units import format_bytes

log = logging.getLogger(__name__)


class NonFiniteError(MemfitError):
    """Too many steps in a row with NaN/inf loss or gradients."""


@dataclass(frozen=True)
class BatchShape:
    """The micro-batches of the step where the measured peak happened: what its estimate is made for."""

    micro_batch: int  # rows of the largest micro-batch
    seq_len: int      # its tokens per row, as padded (to the longest example, not to cfg.data.seq_len)
    grad_accum: int   # micro-batches in the step (more than configured after an OOM recovery)
    padded: bool | None  # whether it holds padding (None: packed rows, left to the trace's default)

    @classmethod
    def of(cls, pieces: list[dict]) -> "BatchShape":
        largest = max(pieces, key=lambda b: b["input_ids"].numel())
        rows, length = largest["input_ids"].shape
        mask = largest.get("attention_mask")
        return cls(rows, length, len(pieces), None if mask is None else bool((mask == 0).any()))


@dataclass
class RunResult:
    output_dir: Path
    losses: list[float]
    report: MemoryReport
    eval_losses: dict[int, float] = field(default_factory=dict)  # step -> eval loss, this run's evaluations
    data_notes: DataNotes | None = None  # records read, truncated and dropped; a micro-batch smaller than asked


def preflight(cfg: RunConfig) -> None:
    """What can be known wrong before the data and the model take time and memory."""
    model_config = load_model_config(cfg.model)[0]
    check_model(cfg, model_config, model_where(cfg.model), int(os.environ.get("WORLD_SIZE", 1)))
    # before the data loads: a typo'd target name stops the run
    check_lora_targets_on_meta(model_config, method=cfg.method, targets=cfg.lora.targets,
                               trust_remote_code=cfg.model.trust_remote_code)
    check_weights(cfg.model)
    check_output_dir(cfg, planned_disk_bytes(cfg))
    check_tokenizer(cfg.model)  # real weights need their own tokenizer; its ids must fit the embedding


def train(resolved: ResolvedRun, progress: bool = True) -> RunResult:
    """Train the run that memfit/train/resolve.py's `resolve_run` made (its device, budget: and
    micro_batch: auto already decided)."""
    with hold_output_dir(resolved.cfg):  # one run per output_dir, claimed before it is judged (run_lock.py)
        return _train(resolved, progress)


def _train(resolved: ResolvedRun, progress: bool) -> RunResult:
    cfg = resolved.cfg
    preflight(cfg)
    engine = make_engine(cfg, resolved.device)  # under torchrun, joins the group
    device = engine.device
    torch.manual_seed(cfg.seed)
    tokenizer = load_tokenizer(cfg.model)
    stream = build_batch_stream(cfg, tokenizer, device, engine.ctx.dp_rank, engine.ctx.dp_size)  # this rank's slice
    run = build_run(cfg, device, on_meta=engine.builds_on_meta, place_on=engine.place_on, wrap=engine.wrap,
                    quant_shards=engine.quant_shards)
    run.precision = engine.precision(run.model, run.precision)  # DeepSpeed's engine runs backward and step
    model, optimizer, precision = run.model, run.optimizer, run.precision
    scheduler = make_scheduler(engine.torch_optimizer(optimizer), cfg.optim, cfg.max_steps)
    out = engine.on_main_first(prepare_output_dir)
    with keep_configured_hyperparameters(engine.torch_optimizer(optimizer), scheduler):  # a resume may change lr
        state = engine.resume(out, model, optimizer, scheduler, precision.scaler, stream)
    if engine.is_main and cfg.resume:  # loaded: this run's settings and data are the record from now on
        record_resumed_run(out, cfg)
    tracker = make_tracker(cfg)  # a MemoryBudget (OOM above memory_budget) when set
    strategies = step_strategies(cfg, device, optimizer, run.params)  # chunked loss, offload, optimizer in backward
    oom = OomRecovery.for_run(cfg)  # on OOM: finer micro-batches, same data, same step
    evaluation = Evaluation(cfg, tokenizer)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    bar = tqdm(range(state.step + 1, cfg.max_steps + 1), initial=state.step, total=cfg.max_steps,
               desc="training", unit="step", disable=not (progress and engine.is_main))
    nonfinite_in_row, peak_shape = 0, None
    config = cfg.model_dump(mode="json")
    # Threads' tracebacks go to errors.log, so that a failure ends with memfit's one-line message.
    with (tracker, StopOnSignal() as stop, ThreadErrorsToLog(out),
          MetricsLog(out, cfg.logging.report_to, config, engine.is_main) as metrics):
        try:
            for tracked in tracked_steps(tracker, run, strategies, cfg.optim.max_grad_norm, bar,
                                         lambda _: next_micro_batches(stream, cfg.batch.grad_accum, device),
                                         attempt=lambda train, pieces: oom.run(train, pieces, optimizer),
                                         target_count=engine.target_count):
                step, result = tracked.key, tracked.result
                if tracked.raised_peak:  # the same pieces oom.run just trained on
                    peak_shape = BatchShape.of(split_batches(tracked.micro_batches, oom.micro_batch))
                result.loss = engine.reduce_loss(result.loss)  # what one process would report
                lr = float(scheduler.get_last_lr()[0])  # torchao keeps lr as a tensor (so compile does not retrace)
                scheduler.step()
                state.losses.append(result.loss)
                nonfinite_in_row = nonfinite_in_row + 1 if result.nonfinite else 0
                state.nonfinite_total += result.nonfinite
                log_step(metrics, bar, cfg, step, result, lr, time.perf_counter() - tracked.started_s, stream.epoch,
                         tracker, nonfinite_in_row, state.nonfinite_total)
                if evaluation.due(step):
                    scores, keep = evaluation.run(step, model, strategies["loss_fn"], precision.autocast, tracker, device)
                    if scores is not None:  # None: it failed; the checkpoint below keeps the weights, then it stops
                        log_eval(metrics, bar if progress and engine.is_main else None, step, scores)
                    if keep:  # sharded: every rank takes part
                        engine.save_final(model, tokenizer, out / "best")
                check_finite(step, nonfinite_in_row, cfg, out)
                # Checkpoint on schedule, at the end, when asked to stop or after a failed evaluation; never
                # inside a non-finite streak otherwise.
                if stop.requested or evaluation.failure or (not nonfinite_in_row and (step == cfg.max_steps or (
                        cfg.checkpoints.every and step % cfg.checkpoints.every == 0))):
                    state.step, state.data = step, stream.state_dict()
                    saved = engine.save(out, state, model, optimizer, scheduler, precision.scaler)
                    if engine.is_main:
                        record_outputs(out)
                if stop.requested and step < cfg.max_steps:
                    raise TrainingStopped(f"{stop.name} received; checkpoint of step {step} saved in {saved}; "
                                          "continue with resume=true", stop.signum)
                if evaluation.failure and step < cfg.max_steps:
                    raise evaluation.failed(saved, finished=False)
        except OutputWriteError as exc:  # metrics or a sink could not be written: keep the work so far
            raise keep_work(exc, engine, out, state, step, stream, model, optimizer, scheduler, precision) from None
    report = measured_report(tracker, device, tracked=cfg.logging.track_memory)
    if cfg.logging.track_memory and engine.traced:  # the plan beside the measurement (trace.py)
        add_estimate(report, cfg, device, peak_shape)
    finish(engine, model, tokenizer, out, report, tracker.timeline)
    if engine.is_main:  # a later resume=true up to this step has nothing to do
        record_finished(out, max(state.step, cfg.max_steps))
    if evaluation.failure:  # the last evaluation failed after the final model was written
        raise evaluation.failed(saved, finished=True)
    return RunResult(out, state.losses, report, evaluation.losses, stream.notes)


def keep_work(exc: OutputWriteError, engine: Engine, out: Path, state, step: int, stream, model, optimizer,
              scheduler, precision) -> MemfitError:
    """A write failed mid-run: save a checkpoint of the finished step if the disk still takes one
    (one process; under torchrun the other ranks are not told), and say what was kept."""
    root = out / CHECKPOINTS_DIR
    kept = None
    if not engine.ctx.enabled:
        state.step, state.data = step, stream.state_dict()
        try:
            saved = engine.save(out, state, model, optimizer, scheduler, precision.scaler)
            kept = f"checkpoint of step {step} saved in {saved}"
        except (MemfitError, OSError) as save_exc:
            log.warning("after the failed write, the checkpoint of step %d could not be saved either: %s", step,
                        save_exc)
    if kept is None:
        last = latest_step_name(root)
        kept = f"the last good checkpoint is {root / last}" if last else "no checkpoint exists yet"
    return OutputWriteError(f"{exc}; training stopped at step {step}: {kept}. Free space or fix the output "
                            "folder, then continue with resume=true")


def next_micro_batches(stream, count: int, device: torch.device) -> list[dict]:
    """One step's micro-batches on the device."""
    return [{k: v.to(device) for k, v in stream.next_batch().items()} for _ in range(count)]


def log_step(metrics: MetricsLog, bar, cfg: RunConfig, step: int, result, lr: float, step_time_s: float,
             epoch: int, tracker, nonfinite_in_row: int, nonfinite_total: int) -> None:
    """The progress bar after every step; a metrics line every log_every steps (and the first and last)."""
    if result.nonfinite:
        log.warning("step %d: non-finite loss or gradients (loss %s); update skipped "
                    "(%d in a row, %d in this run)", step, result.loss, nonfinite_in_row, nonfinite_total)
    tokens_per_s = result.tokens / step_time_s
    bar.set_postfix(loss=f"{result.loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", peak=format_bytes(tracker.peak_bytes))
    if step % cfg.logging.every == 0 or step in (1, cfg.max_steps):
        metrics.write({
            "step": step, "loss": result.loss, "lr": lr, "grad_norm": result.grad_norm,
            "skipped": result.skipped, "nonfinite": result.nonfinite, "tokens_per_s": round(tokens_per_s, 1),
            "tokens": result.tokens, "step_time_s": round(step_time_s, 4), "epoch": epoch,
            "peak_bytes": tracker.peak_bytes, "peak_by_category_bytes": tracker.peak_by_category()})


def log_eval(metrics: MetricsLog, bar, step: int, scores) -> None:
    metrics.write(scores.record(step), prefix="eval")
    if bar is not None:
        bar.write(f"step {step}: eval loss {scores.loss:.4f}, perplexity {scores.perplexity:,.2f} "
                  f"({scores.tokens:,} tokens)")


def check_finite(step: int, nonfinite_in_row: int, cfg: RunConfig, out: Path) -> None:
    """Stop after max_nonfinite_steps NaN/inf steps in a row, pointing at the last good checkpoint."""
    if nonfinite_in_row < cfg.optim.max_nonfinite_steps:
        return
    last = latest_step_name(out / CHECKPOINTS_DIR)
    raise NonFiniteError(
        f"step {step}: loss or gradients were NaN/inf for {nonfinite_in_row} steps in a row (steps "
        f"{step - nonfinite_in_row + 1}-{step}, optim.max_nonfinite_steps={cfg.optim.max_nonfinite_steps}); stopped. "
        f"Last good checkpoint: {out / CHECKPOINTS_DIR / last if last else 'none'}. "
        "Lower lr or check the data, then resume=true")


def finish(engine: Engine, model, tokenizer, out: Path, report: MemoryReport, timeline: list[dict]) -> None:
    """The final model and the memory report; under torchrun every rank calls this (the saves are collective)."""
    engine.note_memory(report, out)  # every rank's peak; what the tracker cannot see inside DeepSpeed
    gathered = engine.save_final(model, tokenizer, out)
    if engine.is_main:  # random-init base next to the adapter; merged if asked
        save_adapter_outputs(unwrap(model), engine.cfg, out, gathered)
        (out / "memory_report.txt").write_text(report.to_text() + "\n")
        (out / "memory_report.json").write_text(report.to_json() + "\n")
        write_timeline(out, timeline, report)  # memory_timeline.json, and its picture when matplotlib is there
        record_outputs(out)
    engine.teardown()


def measured_report(tracker, device: torch.device, tracked: bool = True) -> MemoryReport:
    report = MemoryReport(tracked=tracked, measured_peak_bytes=tracker.peak_bytes,
                          measured_by_category=tracker.peak_by_category(),
                          measured_phase_peaks=dict(tracker.phase_peaks))
    report.process_peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if device.type == "cuda":
        report.cuda_max_allocated_bytes = torch.cuda.max_memory_allocated(device)
        report.cuda_max_reserved_bytes = torch.cuda.max_memory_reserved(device)
    return report


def add_estimate(report: MemoryReport, cfg: RunConfig, device: torch.device, shape: BatchShape | None) -> None:
    """Put the traced estimate beside the measurement, made for the batch shape the measured peak ran on:
    real batches are padded to their longest example, so comparing them with the full-length plan would
    mix a shape effect into the estimator's error. The full-length plan stays as the worst-case line.
    An estimate is a side result: if tracing fails, the report says so instead of the run failing."""
    try:
        worst = trace_estimate(cfg, device=device.type)
        at_peak = worst
        if shape is not None:
            measured = cfg.updated({"data.seq_len": shape.seq_len, "batch.micro_batch": shape.micro_batch,
                                    "batch.grad_accum": shape.grad_accum})
            default_padded = cfg.batch.micro_batch > 1 or cfg.data.packing  # what the worst-case trace assumed
            if measured != cfg or shape.padded not in (None, default_padded):
                at_peak = trace_estimate(measured, device=device.type, padded=shape.padded)
    except Exception as exc:  # noqa: BLE001 - never lose a finished training run to its estimate
        log.warning("no traced estimate for this run: %s", exc)
        report.notes.append(f"traced estimate unavailable: {type(exc).__name__}: {str(exc).splitlines()[0][:200]}")
        return
    report.estimated_peak_bytes = at_peak.peak_allocated_bytes
    report.estimated_by_category = dict(at_peak.by_category)
    report.estimated_phase_peaks = dict(at_peak.step_phase_peaks)
    if shape is not None:
        report.estimated_shape = {"micro_batch": shape.micro_batch, "seq_len": shape.seq_len,
                                  "grad_accum": shape.grad_accum}
    report.worst_case_seq_len, report.worst_case_peak_bytes = cfg.data.seq_len, worst.peak_allocated_bytes
