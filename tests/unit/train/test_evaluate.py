"""Evaluation: the token-weighted mean loss and perplexity, the same with the chunked loss, no gradients."""

from __future__ import annotations

import math
from contextlib import nullcontext

import pytest
import torch
import torch.nn.functional as F

from memfit.config import ModelConfig
from memfit.memory.tracker import MemoryTracker
from memfit.models.loading import build_model
from memfit.strategies.loss import loss_function
from memfit.train.evaluate import evaluate


def _batches():
    generator = torch.Generator().manual_seed(0)
    out = []
    for rows, length in ((2, 24), (3, 16)):  # batches of different sizes: a token-weighted mean is not a batch mean
        ids = torch.randint(0, 256, (rows, length), generator=generator)
        labels = ids.clone()
        labels[:, : length // 3] = -100  # a masked prompt
        out.append({"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": labels})
    return out


def _reference(model, batches) -> float:
    total, count = 0.0, 0
    with torch.no_grad():
        for batch in batches:
            logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits.float()
            shifted, targets = logits[:, :-1].flatten(0, 1), batch["labels"][:, 1:].flatten()
            total += float(F.cross_entropy(shifted, targets, ignore_index=-100, reduction="sum"))
            count += int((targets != -100).sum())
    return total / count


@pytest.mark.parametrize("chunked", [False, True])
def test_loss_is_the_token_weighted_mean_and_leaves_no_gradients(chunked):
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="memfit/tiny-llama", init="random"), "sdpa", dtype=torch.float32).train()
    batches = _batches()
    tracker = MemoryTracker()
    with tracker:
        result = evaluate(model, batches, loss_function(chunked, chunk_tokens=7), nullcontext, tracker,
                          torch.device("cpu"))
    expected = _reference(model, batches)
    assert result.loss == pytest.approx(expected, rel=1e-5)
    assert result.perplexity == pytest.approx(math.exp(expected), rel=1e-5)
    assert result.tokens == sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches) and result.batches == 2
    assert model.training and all(p.grad is None for p in model.parameters())
    assert tracker.peak_bytes > 0  # evaluation allocations are seen (its own phase)


def test_batches_without_targets_give_no_number():
    model = build_model(ModelConfig(name="memfit/tiny-llama", init="random"), "sdpa", dtype=torch.float32)
    ids = torch.zeros(1, 8, dtype=torch.long)
    empty = [{"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.full_like(ids, -100)}]
    result = evaluate(model, empty, loss_function(False), nullcontext, MemoryTracker(), torch.device("cpu"))
    assert math.isnan(result.loss) and result.tokens == 0
