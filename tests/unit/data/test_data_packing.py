"""Packing never crosses an example boundary, in the labels or in attention (on a real Llama)."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from memfit.data.batching import collate
from memfit.data.examples import IGNORE_INDEX
from memfit.data.packing import pack_examples
from memfit.models.presets import load_preset_config


def example(start, n, masked=2):
    ids = list(range(start, start + n))
    return {"input_ids": ids, "labels": [IGNORE_INDEX] * masked + ids[masked:]}


EXAMPLES = [example(10, 7), example(30, 5), example(50, 9), example(70, 3), example(90, 12), example(5, 4)]


def test_rows_fit_and_keep_examples_whole_and_in_order():
    rows = list(pack_examples(EXAMPLES, seq_len=16))
    assert all(len(r["input_ids"]) <= 16 and sum(r["doc_lengths"]) == len(r["input_ids"]) for r in rows)
    assert [ids for r in rows for ids in r["input_ids"]] == [t for e in EXAMPLES for t in e["input_ids"]]
    assert [n for r in rows for n in r["doc_lengths"]] == [len(e["input_ids"]) for e in EXAMPLES]
    assert len(rows) < len(EXAMPLES)  # something was actually packed


def test_labels_never_cross_a_boundary():
    for row in pack_examples(EXAMPLES, seq_len=16):
        start = 0
        for n in row["doc_lengths"]:
            assert row["labels"][start] == IGNORE_INDEX  # nothing predicts an example's first token
            start += n


def test_collated_position_ids_restart_per_example_and_for_padding():
    rows = list(pack_examples(EXAMPLES[:3], seq_len=16))
    batch = collate(rows, pad_id=0)
    assert "attention_mask" not in batch  # transformers infers the packed mask from position_ids
    assert batch["position_ids"][0].tolist() == list(range(7)) + list(range(5))
    assert batch["position_ids"][1].tolist() == list(range(9)) + list(range(3))  # 3 = padding, its own segment
    assert batch["labels"][1, -3:].tolist() == [IGNORE_INDEX] * 3


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    config = load_preset_config("memfit/tiny-llama")
    config._attn_implementation = "sdpa"
    config.use_cache = False  # as in training (memfit/train/loop.py); a KV cache turns the packed mask off
    return AutoModelForCausalLM.from_config(config).eval()


@pytest.mark.parametrize("attention", ["sdpa", "eager"])
def test_attention_does_not_cross_examples_in_a_real_model(model, attention):
    model.config._attn_implementation = attention
    small = [example(10, 7), example(30, 5), example(50, 4)]
    rows = list(pack_examples(small, seq_len=16))
    assert len(rows) == 1
    batch = collate(rows, pad_id=0)
    with torch.no_grad():
        packed = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
        separate = torch.cat([model(input_ids=torch.tensor([e["input_ids"]])).logits[0] for e in small])
        # Control: the same tokens with plain positions do attend across examples.
        plain = model(input_ids=batch["input_ids"]).logits[0]
    assert torch.allclose(packed, separate, atol=1e-5)
    assert not torch.allclose(plain[7:], separate[7:], atol=1e-3)


def test_packed_loss_equals_the_sum_of_per_example_losses(model):
    model.config._attn_implementation = "sdpa"
    small = [example(10, 7), example(30, 5), example(50, 4)]
    batch = collate(list(pack_examples(small, seq_len=16)), pad_id=0)
    with torch.no_grad():
        packed = model(**batch, num_items_in_batch=1).loss  # num_items 1: the summed token loss
        separate = sum(model(input_ids=torch.tensor([e["input_ids"]]), labels=torch.tensor([e["labels"]]),
                             num_items_in_batch=1).loss for e in small)
    assert torch.allclose(packed, separate, atol=1e-4)
