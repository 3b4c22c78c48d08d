"""Activation offloading: tensors saved for backward wait in CPU memory instead of on the GPU.

A `torch.autograd.graph.saved_tensors_hooks` pair around each forward: `pack` copies a
saved activation to pinned host memory on a side CUDA stream (so the copy overlaps the
forward's compute) and lets the GPU copy go; `unpack` copies it back when the backward
needs it. The values are bit-identical, so gradients are identical to no offload.

Not offloaded: parameters and views of parameters (the weights stay on the GPU anyway),
tensors already on the CPU, and small tensors (below `min_bytes`, where the copy costs more
than it saves). The copy back happens on demand in backward, one tensor at a time, so expect a
slowdown roughly equal to the host-device traffic; with `memory.activation_offload_prefetch`,
bringing one tensor back also starts copying the one saved before it (in backward order the next
one needed: with every layer checkpointed, the next layer's input) on the side stream, so that copy
overlaps the current layer's recompute and backward, at the cost of holding one more saved tensor
on the GPU.

On a CPU-only run activations already live in host memory: the strategy is a no-op and says so.
"""

from __future__ import annotations

import logging
import weakref
from contextlib import nullcontext

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._python_dispatch import _disable_current_modes

from memfit.strategies.step_strategy import WAITING, StepSettings, StepStrategy

log = logging.getLogger(__name__)

DEFAULT_MIN_BYTES = 1 << 20  # 1 MiB


class OffloadActivations:
    """Use as a context manager around a forward pass (a new instance per forward is fine)."""

    def __init__(self, params=(), min_bytes: int = DEFAULT_MIN_BYTES, device: str = "cpu",
                 pin_memory: bool | None = None, force: bool = False, simulate: bool = False, prefetch: bool = False):
        self.param_ids = {id(p) for p in params}
        self.min_bytes, self.device = min_bytes, torch.device(device)
        # Copy even tensors already on `device`: on a CPU run this is the CUDA path with the CPU as its
        # device, so the memory tracker (which never sees host copies, see _copy_out) measures offloading.
        self.force = force
        # The planner's trace (fake tensors, traced on the CPU for a CUDA target): drop the saved tensor and
        # re-create one of the same shape in backward, so the tracker sees exactly the GPU bytes offloading
        # frees and brings back, and no host copy (host memory is not the GPU's).
        self.simulate = simulate
        self.pin_memory = torch.cuda.is_available() if pin_memory is None else pin_memory
        self.offloaded_bytes = 0  # what went to the host in this forward (for reports and tests)
        self.prefetch = prefetch
        self._last: _Packed | None = None  # the latest packed tensor: the next one's `earlier`
        self._seen: dict[int, tuple[weakref.ref, _Packed]] = {}
        self._counted: dict[int, weakref.ref] = {}
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    def _keep(self, tensor: torch.Tensor) -> bool:
        base = tensor._base if tensor._base is not None else tensor
        same_device = tensor.device == self.device and not (self.force or self.simulate)
        return (isinstance(tensor, torch.nn.Parameter) or id(tensor) in self.param_ids or id(base) in self.param_ids
                or same_device or tensor.untyped_storage().nbytes() < self.min_bytes)

    def _pack(self, tensor: torch.Tensor):
        simulated = self.simulate and _is_fake(tensor)
        if not simulated and self.simulate or self._keep(tensor):
            return tensor
        # Autograd often saves one tensor several times (x feeds q, k and v): copy it once.
        seen = self._seen.get(id(tensor))
        if seen is not None and seen[0]() is tensor:
            return seen[1]
        packed = _Packed(tensor)
        if self.prefetch:
            packed.earlier, self._last = self._last, packed
        if not simulated:
            self._copy_out(tensor, packed)
        self._seen[id(tensor)] = (weakref.ref(tensor), packed)
        storage = tensor.untyped_storage()
        if self._counted.get(id(storage), lambda: None)() is not storage:  # views of one storage count once
            self._counted[id(storage)] = weakref.ref(storage)
            self.offloaded_bytes += storage.nbytes()
        return packed

    def _copy_out(self, tensor: torch.Tensor, packed: "_Packed") -> None:
        if _is_fake(tensor):  # no real streams or pinned pages for fake tensors
            return self._copy_to_host(tensor, packed, fake=True)
        # The host copy is host memory, not the device's: made outside any dispatch mode, so a
        # MemoryTracker measuring the device does not count it.
        with _disable_current_modes():
            self._copy_to_host(tensor, packed, fake=False)

    def _copy_to_host(self, tensor: torch.Tensor, packed: "_Packed", fake: bool) -> None:
        packed.pinned = self.pin_memory and not fake
        packed.host = torch.empty_strided(tensor.size(), tensor.stride(), dtype=tensor.dtype, device=self.device,
                                          pin_memory=packed.pinned)
        if tensor.is_cuda and not fake:
            stream = _side_stream(tensor.device)
            stream.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor must be computed first
            with torch.cuda.stream(stream):
                packed.host.copy_(tensor, non_blocking=True)
                packed.event = torch.cuda.Event()
                packed.event.record(stream)
            tensor.record_stream(stream)  # the allocator must not reuse it before the copy ends
        else:
            packed.host.copy_(tensor)

    @staticmethod
    def _unpack(packed):
        if isinstance(packed, torch.Tensor):
            return packed
        return packed.restore()

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        return self._hooks.__exit__(*exc)


class _Packed:
    """An offloaded tensor: its host copy (None when simulated) and how to rebuild it on its device.
    `earlier`: the tensor packed before it (with prefetch), the next one the backward will need."""

    __slots__ = ("size", "stride", "dtype", "device", "host", "event", "pinned", "restored", "earlier", "fetched",
                 "fetched_event")

    def __init__(self, tensor: torch.Tensor):
        self.size, self.stride, self.dtype, self.device = tensor.size(), tensor.stride(), tensor.dtype, tensor.device
        self.host, self.event, self.pinned, self.restored = None, None, False, None
        self.earlier, self.fetched, self.fetched_event = None, None, None

    def restore(self) -> torch.Tensor:
        """Back on the device, once per backward however many times autograd asks for it; with
        prefetch, the earlier tensor starts its way back now."""
        alive = self.restored() if self.restored is not None else None
        if alive is not None:
            return alive
        if self.fetched is not None:  # prefetched: wait for its copy on the side stream, not for the host
            tensor, self.fetched = self.fetched, None
            if self.fetched_event is not None:
                torch.cuda.current_stream(tensor.device).wait_event(self.fetched_event)
                tensor.record_stream(torch.cuda.current_stream(tensor.device))
        else:
            tensor = self._to_device()
        self.restored = weakref.ref(tensor)
        if self.earlier is not None:
            self.earlier.start_fetch()
            self.earlier = None
        return tensor

    def start_fetch(self) -> None:
        """Copy back ahead of need (on CUDA on the side stream, overlapping the compute)."""
        if self.fetched is not None or (self.restored is not None and self.restored() is not None):
            return
        if self.host is not None and self.host.is_pinned() and self.device.type == "cuda":
            stream = _side_stream(self.device)
            if self.event is not None:
                stream.wait_event(self.event)  # the copy out has finished
            with torch.cuda.stream(stream):
                self.fetched = self.host.to(self.device, non_blocking=True)
                self.fetched_event = torch.cuda.Event()
                self.fetched_event.record(stream)
        else:
            self.fetched = self._to_device()

    def _to_device(self) -> torch.Tensor:
        if self.host is None:  # simulated: same shape, same bytes, values irrelevant (fake tensors)
            return torch.empty_strided(self.size, self.stride, dtype=self.dtype, device=self.device)
        if self.event is not None:
            self.event.synchronize()  # the copy to host has finished (pinned memory is now valid)
        return self.host.to(self.device, non_blocking=self.pinned, copy=True)  # a copy even on a CPU run


def _is_fake(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, FakeTensor)


_SAID_NOOP = False
_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    if device not in _STREAMS:
        _STREAMS[device] = torch.cuda.Stream(device)
    return _STREAMS[device]


def activation_offload(enabled: bool, device: torch.device, params=(), min_bytes: int = DEFAULT_MIN_BYTES,
                       traced: bool = False, prefetch: bool = False):
    """The step's `saved_activations` context factory: `nullcontext` when off or on a CPU run.

    traced: the planner's fake-tensor run estimating `device` (see OffloadActivations.simulate)."""
    if not enabled:
        return nullcontext
    if traced and torch.device(device).type != "cpu":
        params = list(params)
        return lambda: OffloadActivations(params, min_bytes, simulate=True, prefetch=prefetch)
    if torch.device(device).type == "cpu":
        global _SAID_NOOP
        if not _SAID_NOOP:  # once per process, not once per planner trace
            _SAID_NOOP = True
            log.info("activation_offload: this run is on the CPU, where activations already live in host memory; "
                     "nothing to offload (no-op)")
        return nullcontext
    params = list(params)
    return lambda: OffloadActivations(params, min_bytes, prefetch=prefetch)


def _offload_peak(moments: dict, terms) -> None:
    """(CUDA) saved activations wait in host RAM; the backward brings back one layer's (and, at its
    start, what the loss saved) at a time."""
    if terms.device != "cuda":
        return
    # a checkpointed last layer brings back only its input; its recomputed tensors are temporaries
    back = terms.hidden_bytes if terms.last_layer_checkpointed else terms.layer_bytes
    if terms.options["activation_offload_prefetch"]:
        back += terms.hidden_bytes  # the next layer's input, on its way back while this layer runs
        # the second layer's backward holds the first layer's input too (an upper bound: it has one
        # layer's gradients fewer than the first layer's backward)
        moments["backward_first"]["activations"] += terms.hidden_bytes
    moments["backward_start"]["activations"] = min(moments["backward_start"]["activations"],
                                                   terms.saved_loss_bytes + back)
    moments["backward_last"]["activations"] = min(moments["backward_last"]["activations"], back)
    if WAITING in moments:  # a pipeline micro-batch waiting for its backward keeps its saved tensors on the host
        moments[WAITING]["activations"] = 0


def _offload_host_bytes(terms) -> int:
    """The forward's saved tensors wait in pinned host memory."""
    return terms.activation_bytes - terms.loss_bytes + terms.saved_loss_bytes if terms.device == "cuda" else 0


def _offload_work(terms) -> dict[str, float]:
    """Out in the forward, back in the backward, every micro-batch; with prefetch the copies back
    run under the recompute and backward of the layer before, and are not charged."""
    trips = 1 if terms.options["activation_offload_prefetch"] else 2
    return {"host_bytes": trips * terms.activation_bytes * terms.micro_batches}


def _offload_problems(settings: StepSettings, activation_offload_prefetch: bool) -> list[str]:
    if activation_offload_prefetch and settings.checkpointing != "full":
        return [f"memory.activation_offload_prefetch prefetches each layer's checkpointed input: it needs "
                f"memory.checkpointing: full (got {settings.checkpointing})"]
    return []


ACTIVATION_OFFLOAD = StepStrategy(
    "activation_offload", "Keep tensors saved for backward in pinned CPU memory (CUDA runs; a no-op on CPU). "
                          "Same gradients, slower steps.",
    hooks=lambda device, optimizer, params, traced, activation_offload_prefetch: {"saved_activations":
        activation_offload(True, device, params, traced=traced, prefetch=activation_offload_prefetch)},
    peak=_offload_peak, host_bytes=_offload_host_bytes, work=_offload_work, rules=_offload_problems,
    lean=(False, True), cuda_only=True, without_deepspeed="not supported",
    options={"activation_offload_prefetch": (bool, dict(default=False, description=(
        "With memory.activation_offload and memory.checkpointing: full, bring the next layer's input back "
        "while the current layer recomputes (the copy overlaps compute; one more layer input on the GPU)")))},
    searched_options={"activation_offload_prefetch": (False, True)})
