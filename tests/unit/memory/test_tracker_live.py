"""The tracker's running total is the sum of the storages that are really alive.

Ground truth, computed independently of the tracker at four points of a real training step:
every tensor reachable from the Python frames on the stack (locals, containers, modules'
parameters and buffers, gradients, optimizer state) plus every tensor the autograd graph keeps
for backward (`grad_fn._saved_*`, following `next_functions`), counted once per storage.
"""

from __future__ import annotations

import gc
import sys

import pytest
import torch

from memfit.config import ModelConfig
from memfit.memory.tracker import MemoryTracker
from memfit.models.loading import build_model
from memfit.strategies.optimizers import build_optimizer
from memfit.strategies.precision import make_precision
from memfit.step import training_step
from memfit.tensors import storages


def _tensors_in(obj, depth: int = 0):
    if isinstance(obj, torch.Tensor):
        yield obj
        if obj.is_leaf and obj.grad is not None:
            yield obj.grad
    elif depth > 4:
        return
    elif isinstance(obj, dict):
        for value in obj.values():
            yield from _tensors_in(value, depth + 1)
    elif isinstance(obj, (list, tuple)):
        for value in obj:
            yield from _tensors_in(value, depth + 1)
    elif isinstance(obj, torch.nn.Module):
        yield from _tensors_in(list(obj.parameters()) + list(obj.buffers()), depth + 1)
    elif isinstance(obj, torch.optim.Optimizer):
        yield from _tensors_in([dict(s) for s in obj.state.values()], depth + 1)


def _saved_by_graph(roots):
    """Tensors the autograd graph behind `roots` saved for backward."""
    seen_nodes, stack = set(), [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or node in seen_nodes:
            continue
        seen_nodes.add(node)
        for name in dir(node):
            if name.startswith("_saved_"):
                try:
                    yield from _tensors_in(getattr(node, name))
                except RuntimeError:  # already freed (after backward)
                    pass
        stack.extend(fn for fn, _ in node.next_functions)


def live_storage_bytes() -> int:
    """Bytes of the unique storages alive now, found without the tracker."""
    gc.collect()
    roots, frame = [], sys._getframe(1)
    while frame is not None:
        for value in list(frame.f_locals.values()):
            if not isinstance(value, MemoryTracker):
                roots.extend(_tensors_in(value))
        frame = frame.f_back
    unique = {}
    for tensor in [*roots, *_saved_by_graph(roots)]:
        for storage in storages(tensor):
            if storage.nbytes():
                unique[storage.data_ptr()] = storage.nbytes()
    return sum(unique.values())


class _Checkpoints(MemoryTracker):
    """Takes a reading right after backward (tag_gradients) and after the update (tag_optimizer)."""

    def __init__(self):
        super().__init__()
        self.readings: list[tuple[str, int, int]] = []

    def read(self, name: str) -> None:
        truth = live_storage_bytes()
        self.readings.append((name, self.current_bytes, truth))

    def tag_gradients(self, params):
        super().tag_gradients(params)
        self.read("after backward")

    def tag_optimizer(self, optimizer):
        super().tag_optimizer(optimizer)
        self.read("after optimizer step")


@pytest.mark.slow  # ~10 s alone; over 20 s on a busy machine (gc and graph walks)
def test_tracker_total_equals_live_storages_through_a_step():
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="memfit/tiny-llama", init="random"))
    model.config.use_cache = False
    model.train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer("adamw", params, lr=1e-3)
    precision = make_precision("fp32", torch.device("cpu"))
    tracker = _Checkpoints()
    model.model.layers[2].register_forward_hook(lambda module, args, output: tracker.read("mid-forward"))
    ids = torch.randint(0, 256, (2, 48))
    batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}
    with tracker:
        tracker.tag_module(model)
        tracker.tag(batch.values(), "activations")
        tracker.read("after setup")
        for _ in range(2):  # step 2 runs with optimizer states alive
            training_step(model, optimizer, [batch], precision, tracker, params, max_grad_norm=1.0)
    names = [name for name, _, _ in tracker.readings]
    assert names == ["after setup"] + ["mid-forward", "after backward", "after optimizer step"] * 2
    for name, tracked, truth in tracker.readings:
        assert tracked == truth, f"{name}: tracker {tracked} B, live storages {truth} B"
    # The readings are not trivially equal: they move through the step.
    totals = dict((name, tracked) for name, tracked, _ in tracker.readings)  # step 2's
    assert totals["mid-forward"] > totals["after setup"]
    assert totals["after optimizer step"] > totals["after setup"]
