"""Micro-batches for the training loop, from whichever data path the config chooses.

- in memory (default, small data such as the demo): `load_examples` tokenizes everything up front;
- prepared (`data.prepared_dir`, written by `memfit data prepare`): memory-mapped Arrow on disk;
- streaming (`data.streaming: true`): raw files read and tokenized on the fly (see streaming.py).

`BatchStream` serves the first two: it walks a seeded permutation of the examples, epoch after
epoch, through a torch DataLoader (worker processes, pinned memory on CUDA), and its exact
position is `state_dict()`, so a resumed run sees every example exactly once per epoch.
Every stream keeps `notes` (data/notes.py): what was read, truncated and dropped, for the summary.
"""

from __future__ import annotations

import functools
import logging
from typing import Callable, Iterator, Sequence

import torch

from memfit.config import DataConfig
from memfit.data.batching import CHUNK_RECORDS, chunked, collate, is_held_out
from memfit.data.examples import EncodeSpec, ProblemLog, encode_chunk
from memfit.data.notes import DataNotes
from memfit.data.packing import pack_examples
from memfit.data.prepare import PreparedDataset
from memfit.data.sources import DataError, is_hub_name, iter_raw
from memfit.data.streaming import StreamingBatches

log = logging.getLogger(__name__)
LENGTH_GROUP_BATCHES = 64  # group_by_length sorts within windows of this many micro-batches


def load_examples(cfg: DataConfig, tokenizer, seq_len: int, packing: bool = False,
                  keep: Callable[[dict], bool] | None = None, problems: ProblemLog | None = None) -> list[dict]:
    """Tokenize the whole dataset into a list in RAM (fine for small data; see `memfit data prepare`).
    `keep`: which tokenized examples to use (before packing), e.g. all but the held-out ones.
    `problems`: where to count what was read, dropped and truncated (all records, `keep` or not)."""
    spec, examples = EncodeSpec.from_config(cfg, tokenizer, seq_len), []
    problems = ProblemLog(cfg.skip_bad_records, seq_len=seq_len) if problems is None else problems
    for chunk in chunked(iter_raw(cfg.path, cfg.split, cfg.limit, cfg.max_record_bytes), CHUNK_RECORDS):
        result = encode_chunk(chunk, spec)
        problems.add_chunk(result)
        kept = result.examples if keep is None else [e for e in result.examples if keep(e)]
        problems.held_out += len(result.examples) - len(kept)
        examples += kept
    problems.report()
    if not examples:
        raise DataError(f"{cfg.path}: no usable examples" + "".join(f"\n  {s}" for s in problems.summary()))
    return list(pack_examples(examples, seq_len)) if packing else examples


class BatchStream:
    """Endless micro-batches over seeded per-epoch permutations; resumable from `state_dict`.

    `examples` is any sequence of example dicts (a list, or a memory-mapped PreparedDataset).
    `num_workers` > 0 collates in that many DataLoader worker processes; `pin_memory` pins the
    batches (CUDA) so the host-to-device copy can overlap compute. `notes`: the load's counts
    (data/notes.py); a micro-batch the data cannot fill is added to them.
    """

    def __init__(self, examples: Sequence[dict], micro_batch: int, pad_id: int, seed: int, num_workers: int = 0,
                 pin_memory: bool = False, prefetch_factor: int = 2, group_by_length: bool = False,
                 rank: int = 0, world: int = 1, notes: DataNotes | None = None):
        per_rank = len(examples) // world  # an epoch's last len % world examples are dropped (_order)
        if per_rank == 0:
            raise DataError(f"no examples to train on: the data holds {len(examples)} example(s) (packed rows) for "
                            f"{world} data-parallel process(es)")
        self.examples, self.micro_batch, self.pad_id, self.seed = examples, micro_batch, pad_id, seed
        self.num_workers, self.pin_memory, self.prefetch_factor = num_workers, pin_memory, prefetch_factor
        self.group_by_length = group_by_length
        self.rank, self.world = rank, world
        self.epoch, self.position = 0, 0
        self._batches: Iterator[dict] | None = None
        self.notes = notes
        if notes is not None and per_rank < micro_batch:
            notes.shrink_micro_batch(micro_batch, per_rank, "doc_lengths" in examples[0], world)

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
        examples = PreparedDataset.open(data.prepared_dir, expect=cfg)
        notes = DataNotes.from_prepared(examples.meta)
        if notes.lossy():  # said when it was prepared, maybe in another session: say it again before training
            log.warning("%s: %s", data.prepared_dir, notes.lines()[0])
    elif data.streaming:
        return StreamingBatches(cfg, tokenizer, pin_memory=pin, rank=rank, world=world)
    else:
        fraction = cfg.eval.fraction
        keep = (lambda example: not is_held_out(example, fraction)) if fraction else None
        problems = ProblemLog(data.skip_bad_records, seq_len=data.seq_len)
        examples = load_examples(data, tokenizer, cfg.data.seq_len, cfg.data.packing, keep, problems)
        notes = DataNotes.from_log(problems, data.seq_len)
    return BatchStream(examples, cfg.batch.micro_batch, tokenizer.pad_token_id, cfg.seed, data.num_workers, pin,
                       data.prefetch_factor, data.group_by_length, rank, world, notes)


def eval_batches(cfg, tokenizer) -> list[dict[str, torch.Tensor]]:
    """The evaluation batches, unpacked and in file order: `eval.data`, or the share of the training
    records `eval.fraction` holds out (the training stream leaves exactly those out)."""
    spec = cfg.eval
    if spec.data is not None:
        examples = load_examples(cfg.data.model_copy(update={"path": spec.data, "limit": None, "split": "validation"
                                                             if is_hub_name(spec.data) else cfg.data.split}),
                                 tokenizer, cfg.data.seq_len)
    else:
        try:
            examples = load_examples(cfg.data, tokenizer, cfg.data.seq_len, keep=lambda e: is_held_out(e, spec.fraction))
        except DataError:
            raise DataError(f"eval.fraction {spec.fraction}: no example of {cfg.data.path} falls in the held-out "
                            "share; raise eval.fraction or set eval.data") from None
    rows = spec.micro_batch or cfg.batch.micro_batch
    batches = [collate(chunk, tokenizer.pad_token_id) for chunk in chunked(examples, rows)]
    return batches[: spec.max_batches] if spec.max_batches else batches
