"""Stream a raw dataset straight into training: read, tokenize, shuffle, pack and batch on the fly.

RAM stays flat whatever the corpus size: the process holds the shuffle buffer (`data.shuffle_buffer`
examples), one packed row, and `num_workers x prefetch_factor` chunks of CHUNK_RECORDS records.

With `data.num_workers` = W > 0, record chunk c is tokenized by DataLoader worker c mod W; the
DataLoader returns the workers' results round-robin, i.e. in chunk order, so the example order is
the same for any W and the stream is deterministic. Resume is exact: the epoch is replayed from
its start with the same seed and the first `position` items are dropped (re-reading costs time,
not correctness), so every example is seen exactly once per epoch across a restart. With data
parallel ranks, rank r tokenizes and serves records r, r + world, ... (disjoint shares).

`notes` counts what was read, truncated and dropped: the first complete pass once there is one,
else the pass in progress (so far). The first pass this process reads warns the first time it meets
each kind of dropped or truncated record: a run may stop long before an epoch ends.
"""

from __future__ import annotations

import os
import random
from typing import Iterator

import torch

from memfit.data.batching import CHUNK_RECORDS, chunked, collate
from memfit.data.examples import EncodeSpec, ProblemLog, encode_chunk
from memfit.data.notes import DataNotes
from memfit.data.packing import pack_examples
from memfit.data.sources import MAX_RECORD_BYTES, DataError, iter_raw


class EncodedChunks(torch.utils.data.IterableDataset):
    """Yields one ChunkResult per chunk of raw records; each worker encodes its share only."""

    def __init__(self, path: str, split: str, limit: int | None, spec: EncodeSpec, rank: int = 0, world: int = 1,
                 chunk_records: int = CHUNK_RECORDS, max_record_bytes: int = MAX_RECORD_BYTES):
        self.path, self.split, self.limit, self.spec = path, split, limit, spec
        self.rank, self.world, self.chunk_records = rank, world, chunk_records
        self.max_record_bytes = max_record_bytes

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        # data parallel: rank r owns records r, r + world, ... (reading a record is cheap, parsing
        # and tokenizing it is not); chunk k of the rank's records goes to worker k mod W.
        # Every worker reads every record; one of them reports invalid UTF-8.
        raw = iter_raw(self.path, self.split, self.limit, self.max_record_bytes, warn=worker == 0)
        records = (item for index, item in enumerate(raw) if index % self.world == self.rank)
        for index, chunk in enumerate(chunked(records, self.chunk_records)):
            if index % workers == worker:
                yield encode_chunk(chunk, self.spec)


def _identity(item):
    return item


def shuffled(items: Iterator, buffer_size: int, rng: random.Random) -> Iterator:
    """Approximate shuffle with a fixed-size buffer (the whole stream is never held)."""
    if buffer_size <= 1:
        yield from items
        return
    buffer = []
    for item in items:
        if len(buffer) < buffer_size:
            buffer.append(item)
            continue
        index = rng.randrange(buffer_size)
        yield buffer[index]
        buffer[index] = item
    rng.shuffle(buffer)
    yield from buffer


class StreamingBatches:
    """Same interface as BatchStream (`next_batch`, `epoch`, `state_dict`/`load_state_dict`);
    `position` counts the examples (packed rows when packing) consumed in the current epoch."""

    def __init__(self, cfg, tokenizer, pin_memory: bool = False, rank: int = 0, world: int = 1):
        data = cfg.data
        self.spec = EncodeSpec.from_config(data, tokenizer, cfg.data.seq_len)
        self.data, self.seq_len, self.packing = data, cfg.data.seq_len, cfg.data.packing
        self.micro_batch, self.pad_id, self.seed = cfg.batch.micro_batch, tokenizer.pad_token_id, cfg.seed
        self.pin_memory, self.rank, self.world = pin_memory, rank, world
        self.epoch, self.position = 0, 0
        self.problems = ProblemLog(data.skip_bad_records, seq_len=self.seq_len)  # the last complete pass
        self._pass: ProblemLog | None = None  # the pass in progress
        self._passes_done = 0
        self._micro_batch_note: str | None = None
        self._items: Iterator[dict] | None = None

    def _examples(self, problems: ProblemLog) -> Iterator[dict]:
        dataset = EncodedChunks(self.data.path, self.data.split, self.data.limit, self.spec, self.rank, self.world,
                                max_record_bytes=self.data.max_record_bytes)
        workers = self.data.num_workers
        if workers:
            os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are the parallelism
        loader = torch.utils.data.DataLoader(dataset, batch_size=None, collate_fn=_identity, num_workers=workers,
                                             prefetch_factor=self.data.prefetch_factor if workers else None)
        for result in loader:
            problems.add_chunk(result)  # raises on a malformed record unless skipping
            yield from result.examples

    def epoch_items(self, epoch: int) -> Iterator[dict]:
        """The examples (or packed rows) of one epoch, in training order."""
        first = self._passes_done == 0  # this process's first pass: warn as problems appear
        problems = self._pass = ProblemLog(self.data.skip_bad_records, seq_len=self.seq_len, live=first)
        rng = random.Random(self.seed * 1_000_003 + epoch)
        items = shuffled(self._examples(problems), self.data.shuffle_buffer, rng)
        if self.packing:
            items = pack_examples(items, self.seq_len)
        count = 0
        for item in items:
            count += 1
            yield item
        if count == 0:
            raise DataError(f"{self.data.path}: no usable examples" + "".join(f"\n  {s}" for s in problems.summary()))
        if first:
            problems.report()
        self.problems, self._passes_done = problems, self._passes_done + 1

    @property
    def notes(self) -> DataNotes:
        done = self._passes_done or self._pass is None
        scope = ("streamed" if done else "streamed, so far") + (", this process's share" if self.world > 1 else "")
        notes = DataNotes.from_log(self.problems if done else self._pass, self.seq_len, scope)
        notes.micro_batch_note = self._micro_batch_note
        return notes

    def _start_epoch(self) -> None:
        items = self.epoch_items(self.epoch)
        for _ in range(self.position):  # resume: replay and drop what this epoch already served
            next(items)
        self._items = items

    def next_batch(self) -> dict[str, torch.Tensor]:
        if self._items is None:
            self._start_epoch()
        rows = [row for _, row in zip(range(self.micro_batch), self._items)]
        if not rows:  # epoch done (the last batch of an epoch may be short)
            self.epoch, self.position = self.epoch + 1, 0
            self._start_epoch()
            rows = [row for _, row in zip(range(self.micro_batch), self._items)]
        if self.position == 0 and len(rows) < self.micro_batch and self._micro_batch_note is None:
            self._shrunk(len(rows))  # a whole epoch fits in one micro-batch
        self.position += len(rows)
        batch = collate(rows, self.pad_id)
        return {k: v.pin_memory() for k, v in batch.items()} if self.pin_memory else batch

    def _shrunk(self, rows: int) -> None:
        notes = DataNotes(self.seq_len)  # `notes` is made anew from each pass; the note outlives them
        notes.shrink_micro_batch(self.micro_batch, rows, self.packing, self.world)
        self._micro_batch_note = notes.micro_batch_note

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.position = state["epoch"], state["position"]
        self._items = None
