"""The tracker's peak of real training steps on the CPU, set up as `memfit train` sets them up
(memfit's build, checkpointing, optimizer, and the trainer's tracked steps): what the estimators are
checked against in the tests and the benchmarks.

Activation offload is a no-op on a CPU run; `emulate_offload` runs its CUDA path with the CPU as the
device instead: every saved tensor is copied out to memory the tracker does not count (as host
memory is not the GPU's) and comes back as a new allocation in backward, so the tracked peak is
what the GPU would hold. Compare it with an estimate for device "cuda".
"""

from __future__ import annotations

import torch

from memfit.build import build_run
from memfit.config import RunConfig
from memfit.memory.tracker import MemoryTracker
from memfit.step import step_strategies, tracked_steps
from memfit.strategies.activation_offload import OffloadActivations

WARM_UP_TOKENS = 16  # a first short step creates the optimizer states, as any step after the first has them
CPU = torch.device("cpu")


def full_length_batches(vocab: int, rows: int, seq_len: int, count: int = 1) -> list[dict]:
    """`count` micro-batches of `rows` random full-length sequences (no padding), sharing their input ids."""
    ids = torch.randint(0, vocab, (rows, seq_len))
    return [dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone()) for _ in range(count)]


def tracked_step_peaks(cfg: RunConfig, seq_lens: list[int], emulate_offload: bool = True,
                       warm_up: bool = True) -> list[int]:
    """Tracked peak bytes of one CPU training step per seq_len (full-length random sequences, the
    config's micro_batch, one micro-batch per step), on one model built from `cfg`."""
    torch.manual_seed(0)
    run = build_run(cfg, CPU)
    strategies = step_strategies(cfg, CPU, run.optimizer, run.params)
    if emulate_offload and cfg.memory.activation_offload:
        strategies["saved_activations"] = lambda: OffloadActivations(
            run.params, min_bytes=0, force=True, prefetch=cfg.memory.activation_offload_prefetch)
    vocab, rows = run.model.config.vocab_size, cfg.batch.micro_batch
    lengths = ([WARM_UP_TOKENS] if warm_up else []) + list(seq_lens)
    tracker = MemoryTracker()
    with tracker:
        peaks = [tracker.peak_bytes for _ in tracked_steps(
            tracker, run, strategies, cfg.optim.max_grad_norm, lengths,
            lambda seq_len: full_length_batches(vocab, rows, seq_len), peak_per_step=True)]
    return peaks[1:] if warm_up else peaks


def measure_peak(cfg: RunConfig, steps: int = 2) -> tuple[int, dict[str, int]]:
    """Peak tracked bytes (total and by category) of `steps` CPU training steps of full-length random
    sequences in cfg's micro-batches and accumulation, without the step strategies' hooks: the plain
    step the analytic matrix (tests/unit/memory/test_analytic.py) checks its estimate against."""
    torch.manual_seed(0)
    run = build_run(cfg, CPU)
    vocab = run.model.config.vocab_size
    tracker = MemoryTracker()
    with tracker:
        for _ in tracked_steps(tracker, run, {}, cfg.optim.max_grad_norm, range(steps), lambda _: full_length_batches(
                vocab, cfg.batch.micro_batch, cfg.data.seq_len, cfg.batch.grad_accum)):
            pass
    return tracker.peak_bytes, tracker.peak_by_category()
