"""Gradient checkpointing changes memory, never the math."""

import pytest
import torch

from memfit.config import ModelConfig
from memfit.memory.tracker import MemoryTracker
from memfit.models.loading import build_model
from memfit.strategies.checkpointing import apply_checkpointing


def _batch(seed=0, batch=4, seq=48):
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, seq), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def _model(every: int):
    torch.manual_seed(0)
    model = apply_checkpointing(build_model(ModelConfig(name="memfit/tiny-llama", init="random")), every)
    model.train()
    return model


def _grads_and_activations(every: int):
    model = _model(every)
    batch = _batch()
    with MemoryTracker() as tracker:
        tracker.tag_module(model)
        tracker.tag(batch.values(), "activations")
        with tracker.phase("forward"):
            loss = model(**batch).loss
        activations = tracker.current_by_category()["activations"]
        with tracker.phase("backward"):
            loss.backward()
    return {n: p.grad.clone() for n, p in model.named_parameters()}, activations


@pytest.mark.parametrize("every", [1, 2])
def test_gradients_equal_without_checkpointing(every):
    reference, _ = _grads_and_activations(0)
    grads, _ = _grads_and_activations(every)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def test_activation_bytes_fall_with_checkpointing():
    _, none = _grads_and_activations(0)
    _, every_2 = _grads_and_activations(2)
    _, full = _grads_and_activations(1)
    assert full < every_2 < none
    assert full < 0.5 * none


def test_off_leaves_the_model_unchanged():
    model = _model(0)
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    checkpointed = [m.gradient_checkpointing for m in _model(2).model.layers]
    assert checkpointed == [True, False, True, False]
