"""The tracker's peak of real training steps on the CPU, set up as `memfit train` sets them up
(memfit's build, checkpointing, optimizer and step strategies): what the estimators are checked
against in the tests and the benchmarks.

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
from memfit.step import step_strategies, training_step
from memfit.strategies.activation_offload import OffloadActivations

WARM_UP_TOKENS = 16  # a first short step creates the optimizer states, as any step after the first has them


def tracked_step_peaks(cfg: RunConfig, seq_lens: list[int], emulate_offload: bool = True,
                       warm_up: bool = True) -> list[int]:
    """Tracked peak bytes of one CPU training step per seq_len (full-length random sequences, the
    config's micro_batch, one micro-batch per step), on one model built from `cfg`."""
    device = torch.device("cpu")
    torch.manual_seed(0)
    run = build_run(cfg, device)
    strategies = step_strategies(cfg, device, run.optimizer, run.params)
    if emulate_offload and cfg.memory.activation_offload:
        strategies["saved_activations"] = lambda: OffloadActivations(
            run.params, min_bytes=0, force=True, prefetch=cfg.memory.activation_offload_prefetch)
    vocab, rows = run.model.config.vocab_size, cfg.batch.micro_batch
    tracker, peaks = MemoryTracker(), []
    with tracker:
        tracker.tag_module(run.model)
        for seq_len in ([WARM_UP_TOKENS] if warm_up else []) + list(seq_lens):
            ids = torch.randint(0, vocab, (rows, seq_len))
            batch = dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())
            tracker.tag(batch.values(), "activations")
            tracker.reset_peak()
            training_step(run.model, run.optimizer, [batch], run.precision, tracker, run.params,
                          cfg.optim.max_grad_norm, **strategies)
            peaks.append(tracker.peak_bytes)
            del ids, batch
    return peaks[1:] if warm_up else peaks
