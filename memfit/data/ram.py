"""The data side of a run's CPU RAM, for the planner: `estimate_data_ram_bytes(cfg)`.

What the data path holds in host memory, by term (see `data_ram_breakdown`):
- `dataset`: in-memory path only: the tokenized examples as Python lists, about
  IN_MEMORY_BYTES_PER_FILE_BYTE times the size of the raw files (Python ints and list slots,
  two lists per example). Prepared (memory-mapped Arrow) and streaming paths: 0, the data
  stays in the page cache, which the kernel reclaims under pressure.
- `shuffle_buffer`: streaming only: `shuffle_buffer` examples of at most seq_len tokens.
- `chunks_in_flight`: streaming only: record chunks tokenized ahead by the workers.
- `batches_in_flight`: collated int64 batches the DataLoader keeps ready (x2 when pinned on CUDA:
  the pinned copy).
- `worker_processes`: memory each extra worker process adds (WORKER_PROCESS_BYTES each).
The constants were measured on this project's CPU machine with bench/data_ram.py (docs/data.md);
they are approximations for planning, and the breakdown says which term dominates.
"""

from __future__ import annotations

from pathlib import Path

from memfit.data.batching import CHUNK_RECORDS
from memfit.data.sources import is_hub_name, resolve_files


PY_BYTES_PER_TOKEN = 48  # input_ids + labels list slots (8 B each) + one int object (32 B) shared by both
IN_MEMORY_BYTES_PER_FILE_BYTE = 12  # PY_BYTES_PER_TOKEN at ~4 raw bytes per BPE token
# Unique memory (USS) of one forked streaming DataLoader worker, 200 batches in: 15 MB measured
# (docs/data.md). Copy-on-write growth over a long run was not measured.
WORKER_PROCESS_BYTES = 16 * 2**20
BATCH_TENSORS = 3  # input_ids, labels, attention_mask or position_ids (int64 each)


def _source_bytes(path: str) -> int:
    """Size of the raw files behind data.path (0 for a hub dataset: unknown until downloaded)."""
    if is_hub_name(path):
        return 0
    return sum(Path(f).stat().st_size for f in resolve_files(path))


def data_ram_breakdown(cfg, cuda: bool = False) -> dict[str, int]:
    """Bytes of host RAM the data path of `cfg` (a RunConfig) needs, by term."""
    data = cfg.data
    token_bytes = PY_BYTES_PER_TOKEN
    streaming = data.streaming and not data.prepared_dir
    in_memory = not data.streaming and not data.prepared_dir
    batch_bytes = cfg.batch.micro_batch * cfg.data.seq_len * BATCH_TENSORS * 8
    batches = (data.num_workers * data.prefetch_factor if data.num_workers else 0) + 1
    chunk_bytes = CHUNK_RECORDS * cfg.data.seq_len * token_bytes
    return {
        "dataset": _source_bytes(data.path) * IN_MEMORY_BYTES_PER_FILE_BYTE if in_memory else 0,
        "shuffle_buffer": data.shuffle_buffer * cfg.data.seq_len * token_bytes if streaming else 0,
        "chunks_in_flight": (max(data.num_workers, 1) * data.prefetch_factor * chunk_bytes) if streaming else 0,
        "batches_in_flight": batches * batch_bytes * (2 if cuda else 1),
        "worker_processes": data.num_workers * WORKER_PROCESS_BYTES,
    }


def estimate_data_ram_bytes(cfg, cuda: bool = False) -> int:
    """Host RAM the data path needs on top of the training process itself (bytes)."""
    return sum(data_ram_breakdown(cfg, cuda).values())
