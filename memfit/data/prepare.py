"""`memfit data prepare`: tokenize a dataset once, with worker processes, into memory-mapped Arrow.

The output folder holds `data.arrow` (Arrow IPC file: `input_ids`, `labels`, and `doc_lengths`
when packed; int32 lists) and `meta.json` (what it was built from, and the statistics printed at
the end). `memfit train` with `data.prepared_dir` memory-maps it: rows are read from the page
cache on demand, so the training process holds only the rows of the batches in flight, however
large the dataset. RAM while preparing stays bounded too: records are read one chunk at a time
and at most 2 chunks per worker are in flight; the file is written as it goes.
The folder is written as `<dir>.partial` and renamed when complete, so a failed run never leaves
a half-written dataset that looks finished.
"""

from __future__ import annotations

import bisect
import json
import logging
import multiprocessing
import os
import resource
import shutil
import time
from array import array
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
from tqdm.auto import tqdm

from memfit.data.batching import CHUNK_RECORDS, chunked
from memfit.data.examples import EncodeSpec, ProblemLog, encode_chunk
from memfit.data.packing import pack_examples
from memfit.data.sources import DataError, iter_raw
from memfit.units import format_bytes

log = logging.getLogger(__name__)
DATA_FILE, META_FILE = "data.arrow", "meta.json"
WRITE_TOKENS = 1 << 20  # tokens per Arrow record batch: bounds the rows held as Python lists
FORMAT_VERSION = 1
# Meta entries that must match the training config for a prepared dataset to be reused as is.
MUST_MATCH = ("seq_len", "packing", "tokenizer", "format", "train_on_prompt", "fields")


@dataclass
class PrepareReport:
    path: str
    records: int = 0
    examples: int = 0
    rows: int = 0
    tokens: int = 0
    trainable_tokens: int = 0
    truncated: int = 0         # examples cut to seq_len
    truncated_tokens: int = 0  # tokens cut off them
    example_length: dict = field(default_factory=dict)  # min/median/p95/max tokens per example
    skipped: dict = field(default_factory=dict)
    seconds: float = 0.0
    workers: int = 0
    main_peak_rss_bytes: int = 0
    worker_peak_rss_bytes: int = 0  # largest single worker

    def to_text(self) -> str:
        lengths = self.example_length
        lines = [f"prepared dataset: {self.path}",
                 f"records read: {self.records:,}; examples: {self.examples:,}; rows stored: {self.rows:,}",
                 f"tokens: {self.tokens:,} ({self.trainable_tokens:,} carry loss)",
                 f"tokens per example: min {lengths.get('min')}, median {lengths.get('median')}, "
                 f"p95 {lengths.get('p95')}, max {lengths.get('max')}",
                 f"truncated to data.seq_len: {self.truncated:,} example(s) ({self.truncated_tokens:,} tokens cut)",
                 f"time: {self.seconds:.1f} s with {self.workers} worker process(es) "
                 f"({self.records / max(self.seconds, 1e-9):,.0f} records/s, "
                 f"{self.tokens / max(self.seconds, 1e-9):,.0f} tokens/s)",
                 f"peak RSS: main process {format_bytes(self.main_peak_rss_bytes)}"
                 + (f", largest worker {format_bytes(self.worker_peak_rss_bytes)}" if self.workers else "")]
        lines += [f"skipped: {n} {kind}" for kind, n in self.skipped.items()]
        return "\n".join(lines)


def _meta_expectations(cfg, tokenizer_name: str) -> dict:
    return {"seq_len": cfg.data.seq_len, "packing": cfg.data.packing, "tokenizer": tokenizer_name,
            "format": cfg.data.format, "train_on_prompt": cfg.data.train_on_prompt, "fields": dict(cfg.data.fields)}


# Worker side: the spec travels once per worker (initializer), chunks travel one by one.
_WORKER_SPEC: EncodeSpec | None = None


def _init_worker(spec: EncodeSpec) -> None:
    global _WORKER_SPEC
    _WORKER_SPEC = spec


def _encode_in_worker(chunk):
    return encode_chunk(chunk, _WORKER_SPEC)


def _encoded_chunks(chunks, spec: EncodeSpec, workers: int):
    """encode_chunk over chunks, in order; with workers, at most 2 chunks per worker in flight
    (Pool.imap would read the whole input ahead into its queue)."""
    if workers == 0:
        for chunk in chunks:
            yield encode_chunk(chunk, spec)
        return
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")  # the workers are the parallelism
    method = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
    with multiprocessing.get_context(method).Pool(workers, _init_worker, (spec,)) as pool:
        pending = deque()
        for chunk in chunks:
            pending.append(pool.apply_async(_encode_in_worker, (chunk,)))
            if len(pending) >= 2 * workers:
                yield pending.popleft().get()
        while pending:
            yield pending.popleft().get()
        pool.close()
        pool.join()


def _blocks(rows, tokens: int):
    block, held = [], 0
    for row in rows:
        block.append(row)
        held += len(row["input_ids"])
        if held >= tokens:
            yield block
            block, held = [], 0
    if block:
        yield block


def _length_stats(lengths: array) -> dict:
    if not len(lengths):
        return {}
    values = np.frombuffer(lengths, dtype=np.int32)
    return {"min": int(values.min()), "median": int(np.median(values)), "p95": int(np.percentile(values, 95)),
            "max": int(values.max())}


def prepare_dataset(cfg, tokenizer, out_dir: str | Path, overwrite: bool = False, progress: bool = True) -> PrepareReport:
    """Tokenize cfg.data into `out_dir` (memory-mapped Arrow + meta.json); returns the statistics."""
    import pyarrow as pa

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise DataError(f"{out} already exists; remove it, choose another data.prepared_dir, or pass --overwrite")
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    partial.mkdir(parents=True)
    started = time.perf_counter()
    spec = EncodeSpec.from_config(cfg.data, tokenizer, cfg.data.seq_len)
    report = PrepareReport(str(out), workers=cfg.data.num_workers)
    problems = ProblemLog(cfg.data.skip_bad_records, seq_len=cfg.data.seq_len)
    example_lengths = array("i")
    packed = cfg.data.packing
    list_type = pa.list_(pa.int32())
    names = ["input_ids", "labels"] + (["doc_lengths"] if packed else [])
    schema = pa.schema([(name, list_type) for name in names])
    bar = tqdm(desc="tokenizing", unit=" records", disable=not progress)

    def examples():
        records = iter_raw(cfg.data.path, cfg.data.split, cfg.data.limit, cfg.data.max_record_bytes)
        for result in _encoded_chunks(chunked(records, CHUNK_RECORDS), spec, cfg.data.num_workers):
            problems.add_chunk(result)
            report.records += result.records
            bar.update(result.records)
            for example in result.examples:
                report.examples += 1
                report.tokens += len(example["input_ids"])
                report.trainable_tokens += sum(1 for label in example["labels"][1:] if label != -100)
                example_lengths.append(len(example["input_ids"]))
                yield example

    try:
        rows = pack_examples(examples(), cfg.data.seq_len) if packed else examples()
        with pa.OSFile(str(partial / DATA_FILE), "wb") as sink, pa.ipc.new_file(sink, schema) as writer:
            for block in _blocks(rows, WRITE_TOKENS):
                writer.write_batch(pa.record_batch([pa.array([r[n] for r in block], list_type) for n in names],
                                                   schema=schema))
                report.rows += len(block)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    finally:
        bar.close()
    if report.rows == 0:
        shutil.rmtree(partial, ignore_errors=True)
        raise DataError(f"{cfg.data.path}: no usable examples" + "".join(f"\n  {s}" for s in problems.summary()))
    problems.report()
    report.example_length = _length_stats(example_lengths)
    report.skipped = dict(problems.counts)
    report.truncated, report.truncated_tokens = problems.truncated, problems.truncated_tokens
    report.seconds = time.perf_counter() - started
    report.main_peak_rss_bytes = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux
    if report.workers:
        report.worker_peak_rss_bytes = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    meta = {"format_version": FORMAT_VERSION, **_meta_expectations(cfg, cfg.model.name),
            "source": cfg.data.path, "split": cfg.data.split, "limit": cfg.data.limit, "report": asdict(report)}
    (partial / META_FILE).write_text(json.dumps(meta, indent=2) + "\n")
    if out.exists():
        shutil.rmtree(out)
    partial.rename(out)
    return report


class PreparedDataset:
    """Rows of a prepared folder, memory-mapped: `ds[i]` -> {"input_ids": [...], "labels": [...], ...}.

    Only offsets and the mapping live in the process; the token data stays in the page cache.
    Pickles as its path (DataLoader workers reopen the mapping).
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.meta = json.loads((self.path / META_FILE).read_text())
        self._open()

    def _open(self) -> None:
        import pyarrow as pa

        reader = pa.ipc.open_file(pa.memory_map(str(self.path / DATA_FILE)))
        self.names = reader.schema.names
        self._starts, self._columns, total = [], [], 0
        for i in range(reader.num_record_batches):
            batch = reader.get_batch(i)
            self._starts.append(total)
            total += batch.num_rows
            # zero-copy numpy views of the mapped offsets and values
            self._columns.append({n: (batch.column(n).offsets.to_numpy(), batch.column(n).values.to_numpy())
                                  for n in self.names})
        self._len = total

    def __getstate__(self) -> dict:
        return {"path": self.path, "meta": self.meta}

    def __setstate__(self, state: dict) -> None:
        self.path, self.meta = state["path"], state["meta"]
        self._open()

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index: int) -> dict:
        if not 0 <= index < self._len:
            raise IndexError(index)
        b = bisect.bisect_right(self._starts, index) - 1
        row = index - self._starts[b]
        out = {}
        for name, (offsets, values) in self._columns[b].items():
            out[name] = values[offsets[row]:offsets[row + 1]].tolist()
        return out

    def lengths(self) -> list[int]:
        return np.concatenate([np.diff(c["input_ids"][0]) for c in self._columns]).tolist()

    @classmethod
    def open(cls, path: str | Path, expect=None) -> "PreparedDataset":
        """Open a prepared folder; with `expect` (a RunConfig), check it was built for that config."""
        path = Path(path)
        if not (path / META_FILE).is_file() or not (path / DATA_FILE).is_file():
            raise DataError(f"data.prepared_dir: {path} is not a prepared dataset (no {META_FILE}/{DATA_FILE}); "
                            "create it with `memfit data prepare CONFIG`")
        dataset = cls(path)
        if expect is not None:
            wanted = _meta_expectations(expect, expect.model.name)
            wrong = [f"{k}: prepared with {dataset.meta.get(k)!r}, config has {wanted[k]!r}"
                     for k in MUST_MATCH if dataset.meta.get(k) != wanted[k]]
            if wrong:
                raise DataError(f"data.prepared_dir: {path} does not match this config ({'; '.join(wrong)}); "
                                "re-run `memfit data prepare` with this config")
        return dataset
