"""MemoryTracker: exact, per-category accounting of tensor storage bytes.

A `TorchDispatchMode` sees the output of every aten op. Each new storage it sees is recorded
with its size and a category, and a weak reference tells us when the storage is freed. The
same code runs on real tensors (the "measured" side on CPU) and under `FakeTensorMode` (the
planner's traced estimate), so estimate and measurement share one bookkeeping.

Categories:
  weights           parameters and buffers (registered with `tag` before the step)
  gradients         `.grad` storages (tagged after backward)
  optimizer_states  everything in `optimizer.state` (tagged after the step)
  activations       storages allocated in the forward pass that outlive it (saved for backward)
  temporaries       everything else: forward intermediates freed inside the forward, backward
                    intermediates (including checkpoint recomputation), optimizer scratch

Tags can change after allocation (a forward intermediate turns out to be freed before the
forward ends; a backward allocation turns out to be a gradient). The per-category peak is
therefore computed from the set of storages alive at the peak, read with their final tags.

The tracker only knows storages created while it is active or registered with `tag`; tensors
made earlier (a data batch, say) are invisible until tagged.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager
from typing import Callable, Iterable, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from memfit.tensors import storages

CATEGORIES = ("weights", "gradients", "optimizer_states", "activations", "temporaries")
TIMELINE_POINTS = 300  # samples kept of one step: enough for a picture, small in the run folder
# eval: under no_grad nothing is kept for a backward; everything it allocates is transient
_PHASE_DEFAULT = {"forward": "activations", "backward": "temporaries", "optimizer": "temporaries", "eval": "temporaries",
                  None: "temporaries"}


class _Block:
    """One tracked storage. Kept (dead) after free only while a peak snapshot refers to it."""

    __slots__ = ("nbytes", "category", "phase")

    def __init__(self, nbytes: int, category: str, phase: str | None):
        self.nbytes, self.category, self.phase = nbytes, category, phase


def _tensors(obj) -> Iterator[torch.Tensor]:
    for leaf in tree_leaves(obj):
        if isinstance(leaf, torch.Tensor):
            yield leaf


class MemoryTracker(TorchDispatchMode):
    """Use as a context manager around the code to measure; query bytes afterwards."""

    def __init__(self, size_fn: Callable[[int], int] | None = None, timeline: bool = False) -> None:
        """`size_fn` maps a storage's bytes to the bytes the device's allocator really hands out
        (the CUDA caching allocator rounds every block up to 512 B); default: the bytes as they are.
        `timeline`: also keep, for the step with the highest peak, live bytes by category after every
        allocation and free (at most TIMELINE_POINTS samples, the peak among them; see `timeline`)."""
        super().__init__()
        self._size = size_fn or (lambda nbytes: nbytes)
        self._by_category = dict.fromkeys(CATEGORIES, 0)  # live bytes, kept current for the timeline
        self._timeline_on = timeline
        self._events: list[tuple[str | None, tuple[int, ...]]] = []  # this step's samples
        self._kept: list[tuple[str | None, tuple[int, ...]]] = []    # the highest step's, downsampled
        self._live: dict[int, tuple[weakref.ref, _Block]] = {}
        self._phase: str | None = None
        self.current_bytes = 0
        self.peak_bytes = 0
        self.phase_peaks: dict[str, int] = {}  # the highest live bytes seen inside each phase
        self._peak_blocks: list[_Block] = []
        self._peak_pending = False  # the live set is the peak but has not been copied yet

    # --- recording -------------------------------------------------------------------------
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        category = _PHASE_DEFAULT[self._phase]
        for tensor in _tensors(out):
            for storage in storages(tensor):
                self._record(storage, category)
        return out

    def _record(self, storage: torch.UntypedStorage, category: str) -> _Block:
        key = id(storage)
        entry = self._live.get(key)
        if entry is not None and entry[0]() is storage:
            block = entry[1]
            grown = self._size(storage.nbytes()) - block.nbytes  # resize_ (e.g. FSDP freeing a shard)
            if grown:
                # a new block of the new size: a peak snapshot keeps the old one, with the size it had then
                if grown < 0:
                    self._snapshot_if_pending()
                resized = _Block(block.nbytes + grown, block.category, block.phase)
                self._live[key] = (weakref.ref(storage, lambda _, k=key, b=resized: self._free(k, b)), resized)
                self._add(grown, block.category)
                return resized
            return block
        block = _Block(self._size(storage.nbytes()), category, self._phase)
        self._live[key] = (weakref.ref(storage, lambda _, k=key, b=block: self._free(k, b)), block)
        self._add(block.nbytes, category)
        return block

    def _add(self, nbytes: int, category: str) -> None:
        if nbytes < 0:
            self._snapshot_if_pending()
        self.current_bytes += nbytes
        self._by_category[category] += nbytes
        if self._phase is not None and self.current_bytes > self.phase_peaks.get(self._phase, 0):
            self.phase_peaks[self._phase] = self.current_bytes
        if self.current_bytes > self.peak_bytes:
            self.peak_bytes = self.current_bytes
            self._peak_pending = True
        self._sample()

    def _free(self, key: int, block: _Block) -> None:
        if self._live.get(key, (None, None))[1] is not block:
            return
        self._snapshot_if_pending()
        del self._live[key]
        self.current_bytes -= block.nbytes
        self._by_category[block.category] -= block.nbytes
        self._sample()
        # A forward allocation that dies inside the forward was never an activation.
        if self._phase == "forward" and block.phase == "forward" and block.category == "activations":
            block.category = "temporaries"

    def _snapshot_if_pending(self) -> None:
        if self._peak_pending:
            self._peak_blocks = [block for _, block in self._live.values()]
            self._peak_pending = False

    # --- control ---------------------------------------------------------------------------
    @contextmanager
    def phase(self, name: str):
        """Mark allocations as belonging to 'forward', 'backward', 'optimizer' or 'eval'."""
        previous, self._phase = self._phase, name
        try:
            yield self
        finally:
            self._phase = previous

    def tag(self, tensors: Iterable[torch.Tensor], category: str) -> None:
        """Record pre-existing tensors, or re-label tracked ones (grads, optimizer states)."""
        assert category in CATEGORIES, category
        for tensor in tensors:
            if tensor is None:
                continue
            for storage in storages(tensor):
                block = self._record(storage, category)
                if block.category != category:
                    self._by_category[block.category] -= block.nbytes
                    self._by_category[category] += block.nbytes
                    block.category = category

    def tag_module(self, module: torch.nn.Module) -> None:
        self.tag(module.parameters(), "weights")
        self.tag(module.buffers(), "weights")

    def tag_gradients(self, params: Iterable[torch.Tensor]) -> None:
        self.tag((p.grad for p in params), "gradients")

    def tag_optimizer(self, optimizer: torch.optim.Optimizer) -> None:
        self.tag(_tensors([dict(s) for s in optimizer.state.values()]), "optimizer_states")

    def resized(self, storage: torch.UntypedStorage) -> None:
        """A storage changed size outside any op (FSDP2 frees and re-allocates its unsharded
        parameters with `storage.resize_`, which no dispatch mode sees); keeps its category."""
        self._record(storage, _PHASE_DEFAULT[self._phase])

    def reset_peak(self) -> None:
        self.peak_bytes = self.current_bytes
        self._peak_pending = True

    # --- timeline --------------------------------------------------------------------------
    def _sample(self) -> None:
        if self._timeline_on:
            self._events.append((self._phase, tuple(self._by_category[c] for c in CATEGORIES)))

    def mark_step(self) -> None:
        """A training step begins: keep the step just ended if its peak is the highest so far."""
        if self._events and max(map(_total, self._events)) >= max(map(_total, self._kept), default=-1):
            self._kept = _downsample(self._events, TIMELINE_POINTS)
        self._events = []

    @property
    def timeline(self) -> list[dict]:
        """The step with the highest peak: [{"phase": ..., "by_category": {category: bytes}}, ...] in
        order, at most TIMELINE_POINTS samples; the largest total among them is the peak of that step."""
        self.mark_step()
        return [{"phase": phase, "by_category": dict(zip(CATEGORIES, values))} for phase, values in self._kept]

    # --- reading ---------------------------------------------------------------------------
    def _sum(self, blocks: Iterable[_Block]) -> dict[str, int]:
        totals = dict.fromkeys(CATEGORIES, 0)
        for block in blocks:
            totals[block.category] += block.nbytes
        return totals

    def current_by_category(self) -> dict[str, int]:
        return self._sum(block for _, block in self._live.values())

    def peak_by_category(self) -> dict[str, int]:
        self._snapshot_if_pending()
        return self._sum(self._peak_blocks)


def _total(event: tuple[str | None, tuple[int, ...]]) -> int:
    return sum(event[1])


def _downsample(events: list, points: int) -> list:
    """At most `points` events, in order: the largest of each of `points` equal runs, so no peak is lost."""
    if len(events) <= points:
        return list(events)
    size = len(events) / points
    return [max(events[int(i * size):int((i + 1) * size)] or events[int(i * size):int(i * size) + 1], key=_total)
            for i in range(points)]


class NullTracker:
    """Stands in when tracking is off, so the training loop needs no `if`s."""

    current_bytes = peak_bytes = 0
    phase_peaks: dict[str, int] = {}

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    @contextmanager
    def phase(self, name: str):
        yield self

    def tag(self, tensors, category):
        pass

    tag_gradients = tag_optimizer = tag_module = reset_peak = mark_step = lambda self, *a: None
    timeline: list[dict] = []

    def current_by_category(self) -> dict[str, int]:
        return dict.fromkeys(CATEGORIES, 0)

    peak_by_category = current_by_category
