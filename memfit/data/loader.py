"""Micro-batches for the training loop, from whichever data path the config chooses.

- in memory (default, small data such as the demo): `load_examples` tokenizes everything up front;
- prepared (`data.prepared_dir`, written by `memfit data prepare`): memory-mapped Arrow on disk;
- streaming (`data.streaming: true`): raw files read and tokenized on the fly (see streaming.py).

`BatchStream` serves the first two: it walks a seeded permutation of the examples, epoch after
epoch, through a torch DataLoader (worker processes, pinned memory on CUDA), and its exact
position is `state_dict()`, so a resumed run sees every example exactly once per epoch.
"""

from __future__ import annotations

import functools
import logging
from typing import Iterator, Sequence

import torch

from memfit.config import DataConfig
from memfit.data.examples import IGNORE_INDEX, EncodeSpec, ProblemLog, encode_chunk
from memfit.data.packing import collate_packed, pack_examples
from memfit.data.sources import DataError, iter_raw

log = logging.getLogger(__name__)
__all__ = ["IGNORE_INDEX", "BatchStream", "build_batch_stream", "collate", "load_examples", "chunked"]
CHUNK_RECORDS = 256  # records per unit of work (one batched tokenizer call)
LENGTH_GROUP_BATCHES = 64  # group_by_length sorts within windows of this many micro-batches


def chunked(items, size: int) -> Iterator[list]:
    chunk = []
    for item in items:
        chunk.append(item)
        if len(chunk) == size:
            yield chunk
            chunk = []
    if chunk:
        yield chunk


def load_examples(cfg: DataConfig, tokenizer, seq_len: int, packing: bool = False) -> list[dict]:
    """Tokenize the whole dataset into a list in RAM (fine for small data; see `memfit data prepare`)."""
    spec, problems, examples = EncodeSpec.from_config(cfg, tokenizer, seq_len), ProblemLog(cfg.skip_bad_records), []
    for chunk in chunked(iter_raw(cfg.path, cfg.split, cfg.limit), CHUNK_RECORDS):
        result = encode_chunk(chunk, spec)
        problems.add_all(result.problems)
        examples += result.examples
    problems.report()
    if not examples:
        raise DataError(f"{cfg.path}: no usable examples" + "".join(f"\n  {s}" for s in problems.summary()))
    return list(pack_examples(examples, seq_len)) if packing else examples


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


class BatchStream:
    """Endless micro-batches over seeded per-epoch permutations; resumable from `state_dict`.

    `examples` is any sequence of example dicts (a list, or a memory-mapped PreparedDataset).
    `num_workers` > 0 collates in that many DataLoader worker processes; `pin_memory` pins the
    batches (CUDA) so the host-to-device copy can overlap compute.
    """

    def __init__(self, examples: Sequence[dict], micro_batch: int, pad_id: int, seed: int, num_workers: int = 0,
                 pin_memory: bool = False, prefetch_factor: int = 2, group_by_length: bool = False,
                 rank: int = 0, world: int = 1):
        if len(examples) == 0:
            raise DataError("no examples to train on")
        self.examples, self.micro_batch, self.pad_id, self.seed = examples, micro_batch, pad_id, seed
        self.num_workers, self.pin_memory, self.prefetch_factor = num_workers, pin_memory, prefetch_factor
        self.group_by_length = group_by_length
        self.rank, self.world = rank, world
        self.epoch, self.position = 0, 0
        self._batches: Iterator[dict] | None = None

    def _order(self) -> list[int]:
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        order = torch.randperm(len(self.examples), generator=generator).tolist()
        if self.group_by_length:  # similar lengths in a batch = less padding; windows keep it shuffled
            lengths = self._lengths()
            window = self.micro_batch * LENGTH_GROUP_BATCHES
            order = [i for s in range(0, len(order), window)
                     for i in sorted(order[s:s + window], key=lambda i: -lengths[i])]
        # Data parallel: rank r takes every world-th example; an epoch's last len % world examples are
        # dropped so every rank gets as many batches (a rank with one batch more would hang the others).
        return order[:len(order) - len(order) % self.world][self.rank::self.world]

    def _lengths(self) -> Sequence[int]:
        if hasattr(self.examples, "lengths"):
            return self.examples.lengths()
        return [len(e["input_ids"]) for e in self.examples]

    def _start_epoch(self) -> None:
        order = self._order()[self.position:]
        index_batches = [order[i:i + self.micro_batch] for i in range(0, len(order), self.micro_batch)]
        loader = torch.utils.data.DataLoader(
            self.examples, batch_sampler=index_batches, collate_fn=functools.partial(collate, pad_id=self.pad_id),
            num_workers=self.num_workers, pin_memory=self.pin_memory,
            prefetch_factor=self.prefetch_factor if self.num_workers else None)
        self._batches = iter(loader)

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self._batches is None:
            self._start_epoch()
        batch = next(self._batches, None)
        if batch is None:  # epoch done (the last batch of an epoch may be short)
            self.epoch, self.position = self.epoch + 1, 0
            self._start_epoch()
            batch = next(self._batches)
        self.position += batch["input_ids"].shape[0]
        return batch

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._batches = None


def build_batch_stream(cfg, tokenizer, device: torch.device, rank: int = 0, world: int = 1):
    """The batch stream a RunConfig asks for: prepared on disk, streamed from raw files, or in memory.
    `rank`/`world`: data-parallel position (memfit/distributed); each rank gets its slice."""
    data = cfg.data
    pin = device.type == "cuda"
    if data.prepared_dir:
        from memfit.data.prepare import PreparedDataset

        examples = PreparedDataset.open(data.prepared_dir, expect=cfg)
    elif data.streaming:
        from memfit.data.streaming import StreamingBatches

        return StreamingBatches(cfg, tokenizer, pin_memory=pin, rank=rank, world=world)
    else:
        examples = load_examples(data, tokenizer, cfg.seq_len, cfg.packing)
    return BatchStream(examples, cfg.micro_batch, tokenizer.pad_token_id, cfg.seed, data.num_workers, pin,
                       data.prefetch_factor, data.group_by_length, rank, world)
