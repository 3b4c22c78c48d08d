"""Optimizer step in backward: the same update as a normal step, without model-sized gradients."""

import contextlib

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.config import load_config
from memfit.errors import MemfitError
from memfit.memory.tracker import MemoryTracker
from memfit.strategies.precision import make_precision
from memfit.step import step_strategies, training_step

CONFIG = dict(vocab_size=259, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=4, max_position_embeddings=256)


def _model():
    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG)
    config._attn_implementation = "sdpa"
    return LlamaForCausalLM(config).train()


def _hooks(in_backward: bool, optimizer, params, traced: bool = False) -> dict:
    """training_step's strategy hooks as the trainer and the planner's trace get them."""
    cfg = load_config(None, [f"memory.optimizer_in_backward={str(in_backward).lower()}", "optim.max_grad_norm=null"])
    return step_strategies(cfg, torch.device("cpu"), optimizer, params, traced=traced)


def _batches(steps=3, batch=4, seq=32):
    generator = torch.Generator().manual_seed(1)
    out = []
    for _ in range(steps):
        ids = torch.randint(0, 259, (batch, seq), generator=generator)
        out.append([{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}])
    return out


def _train(in_backward: bool, optimizer_cls=torch.optim.AdamW, steps=2, batch=4, seq=32):
    model = _model()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = optimizer_cls(params, lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 1.0 / (1 + step))  # lr changes per step
    hooks = _hooks(in_backward, optimizer, params)
    precision = make_precision("fp32", torch.device("cpu"))
    norms = []
    with MemoryTracker() as tracker:
        tracker.tag_module(model)
        for micro_batches in _batches(steps, batch, seq):
            result = training_step(model, optimizer, micro_batches, precision, tracker, params, None, **hooks)
            scheduler.step()
            norms.append(result.grad_norm)
    return model, norms, tracker


@pytest.mark.parametrize("optimizer_cls", [torch.optim.AdamW, torch.optim.SGD])
def test_same_weights_as_a_normal_step(optimizer_cls):
    reference, ref_norms, _ = _train(False, optimizer_cls)
    fused, norms, _ = _train(True, optimizer_cls)
    for (name, expected), actual in zip(reference.state_dict().items(), fused.state_dict().values()):
        torch.testing.assert_close(actual, expected, rtol=1e-5, atol=1e-6, msg=name)
    assert norms == pytest.approx(ref_norms, rel=1e-5)  # the reported gradient norm is the real one
    assert all(n > 0 for n in norms)


def test_gradients_of_the_whole_model_never_coexist():
    # A short batch, so that model states (not activations) make the peak.
    _, _, normal = _train(False, steps=2, batch=1, seq=8)
    _, _, fused = _train(True, steps=2, batch=1, seq=8)
    weight_bytes = sum(p.numel() * 4 for p in _model().parameters())
    assert normal.peak_by_category()["gradients"] >= 0.9 * weight_bytes  # all gradients at the peak
    largest = max(p.numel() * 4 for p in _model().parameters())
    assert fused.peak_by_category()["gradients"] <= largest  # at most one parameter's gradient
    assert fused.peak_bytes <= normal.peak_bytes - 0.5 * weight_bytes  # measured: 0.68 x weights saved


def test_traced_peak_matches_the_real_one():
    """The planner traces the step on fake tensors: the hooks must run there and give the same peak."""
    peaks = {}
    for fake in (False, True):
        with FakeTensorMode(allow_non_fake_inputs=True) if fake else contextlib.nullcontext():
            model = _model()
            params = list(model.parameters())
            optimizer = torch.optim.AdamW(params, lr=1e-2)
            update = _hooks(True, optimizer, params, traced=fake)["update"]
            with MemoryTracker() as tracker:
                tracker.tag_module(model)
                for micro_batches in _batches(2):
                    with tracker.phase("forward"):
                        loss = model(**micro_batches[0]).loss
                    with tracker.phase("backward"):
                        loss.backward()
                    assert all(p.grad is None for p in params)  # freed as soon as used
                    update(optimizer, params, None)
                    tracker.tag_optimizer(optimizer)
            peaks[fake] = tracker.peak_bytes
    assert peaks[True] == pytest.approx(peaks[False], rel=0.05)


def test_refuses_clipping_and_is_off_by_default():
    model = _model()
    params = list(model.parameters())
    optimizer = torch.optim.SGD(params, lr=0.1)
    assert _hooks(False, optimizer, params)["update"] is None
    update = _hooks(True, optimizer, params)["update"]
    with pytest.raises(MemfitError, match="max_grad_norm"):
        update(optimizer, params, 1.0)
    update.remove()
    model(**_batches(1)[0][0]).loss.backward()
    assert all(p.grad is not None for p in params)  # hooks removed: gradients stay
