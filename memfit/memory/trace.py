"""The traced estimate: run the trainer's own step on fake tensors and record its memory.

`trace_estimate(cfg)` builds the model with the trainer's own `memfit.build.build_run`, but on `meta`
(no memory, no init), applies the same strategies, materialises it under `FakeTensorMode`
(tensors that carry shape, dtype and device but no data, so nothing is computed or allocated),
builds the real optimizer and runs `memfit.step.training_step` for two steps under the
same `MemoryTracker` the trainer uses on real tensors. Step 1 allocates the optimizer states
(its forward and backward are replaced by a cheap stand-in, see `_GradientsOnly`), step 2 is the
steady state; the estimate is the peak over both. Because it is the very same
code path, whatever a strategy changes about memory shows up here without a formula.

What a fake run cannot do, and how each is handled:
  * read a tensor's value (`.item()`, `float(t)`, `if t.all()`): `_FakeStepTracker` answers every such
    read with a fixed value (True, 1, 1.0). These only steer control flow; the answers pick the
    path of a full-length batch whose step is taken (no fp16 overflow): the worst case.
  * fp16's GradScaler skips the optimizer step when it found inf/NaN; in the fake run it always
    steps (`_always_step`), or the optimizer states would never be allocated.
  * trace on CUDA: this CPU-only torch build can *create* fake CUDA tensors, but autograd on
    them aborts the process (a C++ terminate in `InputMetadata`, not a catchable exception), and
    SDPA would dispatch its CPU math kernel anyway since no CUDA kernels are compiled in. So the
    trace always runs on the CPU device; see `docs/trace.md` for what differs on a CUDA run and
    what `device="cuda"` changes here (allocator rounding, foreach optimizer kernels, fused dropout).
"""

from __future__ import annotations

import logging
import time
from contextlib import contextmanager, nullcontext
from types import SimpleNamespace

import torch
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode, unset_fake_temporarily
from torch.utils._python_dispatch import _disable_current_modes

from memfit.build import build_run, trainable
from memfit.config import RunConfig
from memfit.distributed.engine import resolve_device
from memfit.errors import MemfitError
from memfit.memory.estimate import Estimate
from memfit.memory.tracker import MemoryTracker
from memfit.step import step_strategies, tracked_steps
from memfit.strategies.optimizers import optimizer_entry

log = logging.getLogger(__name__)

TRACE_DEVICE = torch.device("cpu")  # see the module docstring: fake CUDA autograd aborts on a CPU build
TRACED_STEPS = 2  # step 1 allocates the optimizer states, step 2 is the steady state
CUDA_BLOCK_BYTES = 512  # the CUDA caching allocator hands out multiples of 512 B (c10 kMinBlockSize)


def cuda_block_bytes(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts for a storage of `nbytes` (max_memory_allocated
    sums these rounded block sizes; an empty storage allocates nothing)."""
    return -(-nbytes // CUDA_BLOCK_BYTES) * CUDA_BLOCK_BYTES


def _fake_or_meta(x) -> bool:
    return isinstance(x, torch.Tensor) and (isinstance(x, FakeTensor) or x.is_meta)


def _all_real(args, kwargs) -> bool:
    """Whether an op's tensor inputs (one level of lists, as foreach ops take) are all real."""
    seen = False
    for arg in (*args, *kwargs.values()):
        for x in (arg if isinstance(arg, (list, tuple)) else (arg,)):
            if isinstance(x, torch.Tensor):
                if isinstance(x, FakeTensor) or x.is_meta:  # meta: the model before `to_empty`
                    return False
                seen = True
    return seen


class _FakeStepTracker(MemoryTracker):
    """The trainer's MemoryTracker (same recording and tagging), plus what a fake run needs.

    It sits directly above FakeTensorMode and:
      * answers reads of fake values (`aten._local_scalar_dense`) with fixed values;
      * runs ops whose tensor inputs are all real (the small real attention mask of `fake_batch`
        and what is derived from it; optimizer step counters) on real tensors, so transformers'
        checks of the mask's values see real values;
      * answers `.device` of a fake tensor (`prim.device`, about two thirds of all dispatches in a
        checkpointed backward) at once, without a round trip through the fake mode.
    One mode rather than a tracker stacked on a separate fake mode, because the per-op dispatch cost
    dominates a 70B trace: one mode with the `prim.device` shortcut traced 70B in 47 s wall on a
    busy machine, two stacked modes without it in 82 s.
    """

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is _PRIM_DEVICE and isinstance(args[0], FakeTensor):
            return args[0].fake_device
        if func is _SCALAR_READ and _fake_or_meta(args[0]):
            dtype = args[0].dtype
            if dtype == torch.bool:
                return True
            return 1.0 if dtype.is_floating_point or dtype.is_complex else 1
        kwargs = kwargs or {}
        if _all_real(args, kwargs):
            with unset_fake_temporarily():
                return super().__torch_dispatch__(func, types, args, kwargs)
        return super().__torch_dispatch__(func, types, args, kwargs)


_PRIM_DEVICE = torch.ops.prim.device.default
_SCALAR_READ = torch.ops.aten._local_scalar_dense.default


def _always_step(scaler: torch.amp.GradScaler) -> None:
    """Make the fp16 loss scaler take the optimizer step whatever its (fake) inf check says."""
    scaler._maybe_opt_step = lambda optimizer, optimizer_state, *args, **kwargs: optimizer.step(*args, **kwargs)


def _like_cuda_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """torch's optimizers pick their multi-tensor (foreach) kernels by default on CUDA and the
    per-tensor loop on CPU; foreach allocates intermediates for all parameters of a group at once,
    so a CUDA estimate must trace that path (it runs on CPU tensors too, with the same outputs)."""
    if type(optimizer).__module__.startswith("torch.optim"):
        for group in optimizer.param_groups:
            if "foreach" in group and group["foreach"] is None and not group.get("fused"):
                group["foreach"] = True


@contextmanager
def _compiled_functions_for_trace():
    """`torch.compile` cannot trace under the tracker's dispatch mode (dynamo skips every frame), so
    during a trace compiled functions run eagerly, with one exception: torchao's fused 8-bit AdamW
    update. Compiled, it only writes its arguments in place (parameter and quantised states) and
    allocates nothing that outlives it; run eagerly it would make fp32 copies of each parameter and
    state that the fused kernel never makes. So it is skipped: the states it writes already exist."""
    compile_ = torch.compile

    def compile_for_trace(fn=None, *args, **kwargs):
        if fn is None:  # used as @torch.compile(...)
            return lambda f: compile_for_trace(f)
        if getattr(fn, "__module__", "").startswith("torchao.optim") and fn.__name__ == "single_param_adam":
            return lambda *a, **k: None
        return fn

    torch.compile = compile_for_trace
    try:
        yield
    finally:
        torch.compile = compile_


@contextmanager
def _fused_dropout():
    """CUDA runs training-mode dropout as the fused `native_dropout`, which keeps a 1-byte bool mask for
    the backward; CPU's unfused dropout multiplies by a float mask in the input's dtype (4 B for peft's
    fp32 adapter input). A CUDA trace routes dropout through `torch.native_dropout` (its CPU kernel
    gives the same outputs and the same bool mask), so the mask is counted as on the GPU."""
    original = torch.nn.functional.dropout

    def dropout(input, p=0.5, training=True, inplace=False):
        if not training or p == 0 or inplace:
            return original(input, p, training, inplace)
        return torch.native_dropout(input, p, True)[0]

    torch.nn.functional.dropout = dropout
    try:
        yield
    finally:
        torch.nn.functional.dropout = original


def _materialise(model: torch.nn.Module) -> torch.nn.Module:
    """meta -> fake tensors (call under FakeTensorMode). `to_empty` gives every parameter a new
    tensor, which unties tied embeddings; re-tie them as loading does."""
    model = model.to_empty(device=TRACE_DEVICE)
    model.tie_weights()
    return model


class _GradientsOnly(torch.nn.Module):
    """Stands in for the model in traced step 1, which exists only to let the optimizer create its
    states the way the trainer's first step does (same gradients, same optimizer code).

    Step 1's forward and backward allocate exactly what step 2's do, minus the optimizer states that
    step 2 already holds, so they can never hold the peak; tracing them would nearly double the
    number of ops a trace dispatches. Its loss, the sum of `(p * 0).sum()`, gives every
    trainable parameter a gradient of its own shape and dtype through the same autograd and loss
    scaler; what it allocates besides (one parameter-sized product at a time) is less than the real
    backward does. The tests check the result against the trainer's real two steps.
    """

    def __init__(self, params: list[torch.nn.Parameter]):
        super().__init__()
        self._params = params  # a plain list: not registered, the tracker already holds them as weights

    def forward(self, **batch):
        loss = sum((p * 0).sum() for p in self._params)
        return SimpleNamespace(loss=loss)


def _trace_evaluation(cfg: RunConfig, model, loss_fn, precision, tracker, padded: bool) -> None:
    """The evaluation that follows a step (train/evaluate.py): gradients freed, one full-length
    eval micro-batch through the run's own loss under no_grad, in the tracker's eval phase."""
    eval_cfg = cfg.updated({"batch.micro_batch": cfg.eval.micro_batch or cfg.batch.micro_batch})
    batch = fake_batch(eval_cfg, padded)
    tracker.tag(batch.values(), "activations")
    model.eval()
    with torch.no_grad(), tracker.phase("eval"), precision.autocast():
        loss_fn(model, batch, 1)
    model.train()


def fake_batch(cfg: RunConfig, padded: bool) -> dict[str, torch.Tensor]:
    """A micro-batch shaped like the loader's, every sequence at full length (the worst case).

    input_ids and labels are fake. The attention mask (or, packed, the position ids) is a small
    *real* tensor: transformers reads its values to decide whether attention needs an explicit
    [batch, 1, seq, seq] mask, and treats a fake one as "cannot tell" (mask always built). With
    `padded`, one position is padding (packed: one row holds two examples), so the mask is built,
    as it is for any real batch with padding; without, the mask is skipped as for a batch of
    full-length rows.
    """
    shape = (cfg.batch.micro_batch, cfg.data.seq_len)
    with _real_tensors():
        if cfg.data.packing:  # packed rows carry position_ids instead of an attention mask
            positions = torch.arange(cfg.data.seq_len).expand(shape).clone()
            if padded:
                positions[-1, cfg.data.seq_len // 2:] -= cfg.data.seq_len // 2
            real = {"position_ids": positions}
        else:
            mask = torch.ones(shape, dtype=torch.long)
            if padded:
                mask[-1, -1] = 0
            real = {"attention_mask": mask}
    return {"input_ids": torch.zeros(shape, dtype=torch.long), **real,
            "labels": torch.zeros(shape, dtype=torch.long)}


@contextmanager
def _real_tensors():
    """Step out of the active FakeTensorMode (and the tracker) to make a real tensor."""
    with _disable_current_modes():
        yield


def target_device(cfg: RunConfig, device: str | torch.device | None) -> torch.device:
    """The device the estimate is for: `device`, else cfg.device ('auto' as the engine resolves it)."""
    name = device.type if isinstance(device, torch.device) else (device or cfg.device)
    if name == "auto":
        name = resolve_device(name).type
    if name not in ("cpu", "cuda"):
        raise MemfitError(f"device: cannot estimate for '{name}'; supported: cpu, cuda")
    return torch.device(name)


def trace_estimate(cfg: RunConfig, device: str | torch.device | None = None, padded: bool | None = None) -> Estimate:
    """Peak memory of `cfg`'s training run on `device` (default: cfg.device), traced on fake tensors.

    `padded` (see `fake_batch`): whether the traced batch holds padding. Default: yes when
    micro_batch > 1 or packing (the loader pads rows to the longest in the batch, so such batches
    usually do), no for one unpacked sequence per micro-batch (never padded).
    """
    if padded is None:
        padded = cfg.batch.micro_batch > 1 or cfg.data.packing
    started = time.perf_counter()
    target = target_device(cfg, device)
    notes: list[str] = []
    attention = cfg.memory.attention
    if attention == "flash":
        # flash-attn is CUDA-only; PyTorch's SDPA flash kernel keeps the same tensors (no seq x seq scores).
        attention = "sdpa"
        notes.append("attention: flash traced with SDPA (same saved tensors: output and log-sum-exp)")
    tracker = _FakeStepTracker(cuda_block_bytes if target.type == "cuda" else None)
    fake_mode = FakeTensorMode(allow_non_fake_inputs=True)

    def materialise(model, make_optimizer):
        # Strategies were applied on `meta` (a module of fake tensors cannot be moved: `Module.to`
        # swaps every fake parameter, which fails); now everything becomes fake at once. The
        # optimizer is built outside the fake mode: optimizers make small constant tables
        # (bitsandbytes' quantisation maps) from Python lists, which must stay real. Built for the
        # trace device: a paged optimizer then runs as its unpaged form, with the same state bytes.
        with fake_mode:
            model = _materialise(model)
        optimizer = make_optimizer(trainable(model))
        if target.type == "cuda":
            _like_cuda_optimizer(optimizer)
        return model, optimizer

    run = build_run(cfg, TRACE_DEVICE, on_meta=True, wrap=materialise, attention=attention, quantize_on_load=False)
    model, optimizer, precision, params = run.model, run.optimizer, run.precision, run.params
    if precision.scaler is not None:
        _always_step(precision.scaler)
    dropout = _fused_dropout() if target.type == "cuda" else nullcontext()
    with fake_mode, _compiled_functions_for_trace(), dropout:
        strategies = step_strategies(cfg, target, optimizer, params, traced=True)
        with tracker:  # the trainer's own tracked steps; step 1 only lets the optimizer create its states
            for _ in tracked_steps(tracker, run, strategies, cfg.optim.max_grad_norm, range(TRACED_STEPS),
                                   lambda _: [fake_batch(cfg, padded) for _ in range(cfg.batch.grad_accum)],
                                   stand_in_first=_GradientsOnly(params)):
                pass
            if cfg.eval.enabled:
                _trace_evaluation(cfg, model, strategies["loss_fn"], precision, tracker, padded)

    peak = tracker.peak_bytes
    if target.type == "cuda" and optimizer_entry(cfg.optim.name).paged:
        notes.append(f"{cfg.optim.name}: its states live in CUDA unified memory, which "
                     "max_memory_allocated does not count; they are included here")
    estimate = Estimate(peak_allocated_bytes=peak, peak_reserved_bytes=peak,
                        by_category=tracker.peak_by_category(), engine="traced", notes=notes,
                        step_phase_peaks=dict(tracker.phase_peaks))
    if target.type == "cpu":
        estimate.cpu_ram_bytes = peak  # on CPU the training tensors are host RAM
    else:
        notes.append("allocator: block sizes rounded up to 512 B; runtime overheads not included")
    log.info("traced estimate of %s on %s in %.1f s", cfg.model.name, target.type, time.perf_counter() - started)
    return estimate
