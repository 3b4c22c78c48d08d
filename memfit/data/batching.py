"""Pieces every data path shares: records in chunks (one batched tokenizer call each), and
tokenized examples collated into a padded micro-batch."""

from __future__ import annotations

import zlib
from array import array
from typing import Iterator

import torch

from memfit.data.examples import IGNORE_INDEX
from memfit.data.packing import collate_packed

CHUNK_RECORDS = 256  # records per unit of work (one batched tokenizer call)


def chunked(items, size: int) -> Iterator[list]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding is masked in attention and loss. Packed rows
    (with `doc_lengths`) get per-example position_ids instead (see packing.py)."""
    if "doc_lengths" in examples[0]:
        return collate_packed(examples, pad_id)
    length = max(len(e["input_ids"]) for e in examples)
    batch = {"input_ids": [], "attention_mask": [], "labels": []}
    for e in examples:
        pad = length - len(e["input_ids"])
        batch["input_ids"].append(list(e["input_ids"]) + [pad_id] * pad)
        batch["attention_mask"].append([1] * len(e["input_ids"]) + [0] * pad)
        batch["labels"].append(list(e["labels"]) + [IGNORE_INDEX] * pad)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}


def is_held_out(example: dict, fraction: float) -> bool:
    """Whether an example belongs to the evaluation share: decided by a hash of its tokens, so the
    same examples are held out in every run with the same data and seq_len, whatever the order."""
    digest = zlib.crc32(array("q", example["input_ids"]).tobytes())
    return digest < fraction * 2**32
