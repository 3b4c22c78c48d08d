"""Pack several examples into one sequence of at most seq_len tokens, without crossing boundaries.

A packed row keeps `doc_lengths` (the length of each example in it). At batch time they become
`position_ids` that restart at 0 for every example, and no `attention_mask` is passed: from that,
transformers (5.x, `masking_utils.find_packed_sequence_indices`) builds a block-diagonal causal
mask for eager/sdpa attention, and flash-attention uses the same position ids as varlen
boundaries, so a token never attends to another example. The loss never crosses a boundary
either: the first label of every example is IGNORE_INDEX, so the last token of one example is
never trained to predict the first token of the next. Padding at the end of a row is its own
"example" (positions from 0, labels ignored). Tests check both properties on a real model.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from memfit.data.examples import IGNORE_INDEX


def pack_examples(examples: Iterable[dict], seq_len: int) -> Iterator[dict]:
    """Greedy, order-preserving: append examples to the current row while they fit."""
    ids: list[int] = []
    labels: list[int] = []
    lengths: list[int] = []
    for example in examples:
        n = len(example["input_ids"])
        if lengths and len(ids) + n > seq_len:
            yield {"input_ids": ids, "labels": labels, "doc_lengths": lengths}
            ids, labels, lengths = [], [], []
        ids += list(example["input_ids"])
        labels += [IGNORE_INDEX] + list(example["labels"][1:])  # nothing predicts across the boundary
        lengths.append(n)
    if lengths:
        yield {"input_ids": ids, "labels": labels, "doc_lengths": lengths}


def position_ids_for(doc_lengths: list[int]) -> list[int]:
    return [p for n in doc_lengths for p in range(n)]


def collate_packed(rows: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """input_ids, labels, position_ids (restarting per example); right padding as its own segment."""
    length = max(len(r["input_ids"]) for r in rows)
    batch = {"input_ids": [], "labels": [], "position_ids": []}
    for r in rows:
        pad = length - len(r["input_ids"])
        lengths = list(r["doc_lengths"]) + ([pad] if pad else [])
        batch["input_ids"].append(list(r["input_ids"]) + [pad_id] * pad)
        batch["labels"].append(list(r["labels"]) + [IGNORE_INDEX] * pad)
        batch["position_ids"].append(position_ids_for(lengths))
    return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}
