"""The step's loss weighs every target token equally, however tokens are split into micro-batches."""

import torch

from memfit.config import ModelConfig
from memfit.data.examples import IGNORE_INDEX
from memfit.memory.tracker import NullTracker
from memfit.models.loading import build_model
from memfit.strategies.precision import make_precision
from memfit.step import training_step


def _batches(split: int):
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (4, 24), generator=generator)
    labels = ids.clone()
    labels[0, :20] = IGNORE_INDEX  # rows carry different numbers of target tokens
    mask = torch.ones_like(ids)
    return [{"input_ids": ids[i:i + split], "attention_mask": mask[i:i + split], "labels": labels[i:i + split]}
            for i in range(0, 4, split)]


def _grads_after_step(split: int):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="memfit/tiny-llama", init="random"))
    params = list(model.parameters())
    grads = {}

    class Capture(torch.optim.SGD):  # records gradients at the moment of the update
        def step(self, closure=None):
            grads.update({id(p): p.grad.clone() for p in params})

    result = training_step(model, Capture(params, lr=0.0), _batches(split), make_precision("fp32", torch.device("cpu")),
                           NullTracker(), params, max_grad_norm=None)
    return result.loss, [grads[id(p)] for p in params]


def test_accumulation_matches_one_big_batch():
    loss_whole, grads_whole = _grads_after_step(split=4)
    loss_split, grads_split = _grads_after_step(split=1)
    assert abs(loss_whole - loss_split) < 1e-5
    for whole, split in zip(grads_whole, grads_split):
        torch.testing.assert_close(split, whole, rtol=1e-4, atol=1e-7)


def test_clipping_reuses_the_checked_norm(monkeypatch):
    """The NaN check's global gradient norm is the one clipping uses: one pass over the gradients,
    and the update sees gradients scaled to max_grad_norm."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="memfit/tiny-llama", init="random"))
    params = list(model.parameters())
    seen = {}

    class Capture(torch.optim.SGD):
        def step(self, closure=None):
            seen["norm"] = float(torch.stack([p.grad.norm() for p in params]).norm())

    calls = []  # torch computes every global norm (get_total_norm, clip_grad_norm_) with _foreach_norm
    original = torch._foreach_norm
    monkeypatch.setattr(torch, "_foreach_norm", lambda *a, **k: calls.append(1) or original(*a, **k))
    result = training_step(model, Capture(params, lr=0.0), _batches(4), make_precision("fp32", torch.device("cpu")),
                           NullTracker(), params, max_grad_norm=0.01)
    assert len(calls) == 1
    assert result.grad_norm > 0.01  # reported: the norm before clipping
    assert abs(seen["norm"] - 0.01) < 1e-4  # applied: clipped to max_grad_norm
