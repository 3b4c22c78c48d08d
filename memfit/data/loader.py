"""Tokenize records into (input_ids, labels) and serve padded micro-batches.

`BatchStream` walks a seeded permutation of the examples, epoch after epoch, and its exact
position is part of `state_dict()` so a resumed run sees every example exactly once per epoch.
"""

from __future__ import annotations

import logging

import torch

from memfit.config import DataConfig
from memfit.data.formats import DataError, read_jsonl, render, resolve_path

log = logging.getLogger(__name__)
IGNORE_INDEX = -100  # label value that cross-entropy skips


def encode(prompt: str, response: str, tokenizer, seq_len: int, train_on_prompt: bool) -> dict:
    prompt_ids = tokenizer(prompt, add_special_tokens=False).input_ids if prompt else []
    response_ids = tokenizer(response, add_special_tokens=False).input_ids + [tokenizer.eos_token_id]
    if tokenizer.bos_token_id is not None:
        prompt_ids = [tokenizer.bos_token_id] + prompt_ids
    input_ids = (prompt_ids + response_ids)[:seq_len]
    prompt_labels = list(prompt_ids) if train_on_prompt else [IGNORE_INDEX] * len(prompt_ids)
    labels = (prompt_labels + response_ids)[:seq_len]
    return {"input_ids": input_ids, "labels": labels}


def load_examples(cfg: DataConfig, tokenizer, seq_len: int) -> list[dict]:
    path = resolve_path(cfg.path)
    examples, all_masked = [], 0
    for where, record in read_jsonl(path):
        example = encode(*render(record, cfg.format, tokenizer, where), tokenizer, seq_len, cfg.train_on_prompt)
        if all(label == IGNORE_INDEX for label in example["labels"]):
            all_masked += 1  # prompt alone fills seq_len: nothing to learn from
            continue
        examples.append(example)
        if cfg.limit and len(examples) >= cfg.limit:
            break
    if all_masked:
        log.warning("%d example(s) in %s skipped: the prompt fills seq_len=%d, leaving no response tokens",
                    all_masked, path, seq_len)
    if not examples:
        raise DataError(f"{path}: no usable examples")
    return examples


def collate(examples: list[dict], pad_id: int) -> dict[str, torch.Tensor]:
    """Right-pad to the longest example; padding is masked in attention and loss."""
    length = max(len(e["input_ids"]) for e in examples)
    batch = {"input_ids": [], "attention_mask": [], "labels": []}
    for e in examples:
        pad = length - len(e["input_ids"])
        batch["input_ids"].append(e["input_ids"] + [pad_id] * pad)
        batch["attention_mask"].append([1] * len(e["input_ids"]) + [0] * pad)
        batch["labels"].append(e["labels"] + [IGNORE_INDEX] * pad)
    return {k: torch.tensor(v, dtype=torch.long) for k, v in batch.items()}


class BatchStream:
    """Endless micro-batches over seeded per-epoch permutations; resumable from `state_dict`."""

    def __init__(self, examples: list[dict], micro_batch: int, pad_id: int, seed: int):
        self.examples, self.micro_batch, self.pad_id, self.seed = examples, micro_batch, pad_id, seed
        self.epoch, self.position = 0, 0

    def _order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return torch.randperm(len(self.examples), generator=generator).tolist()

    def next_batch(self) -> dict[str, torch.Tensor]:
        order = self._order()
        if self.position >= len(order):
            self.epoch, self.position = self.epoch + 1, 0
            order = self._order()
        indices = order[self.position:self.position + self.micro_batch]
        self.position += len(indices)  # the last batch of an epoch may be short
        return collate([self.examples[i] for i in indices], self.pad_id)

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
