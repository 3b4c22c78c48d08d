"""The data side of CPU RAM the planner adds: which terms appear on which path."""

from memfit.config import load_config
from memfit.data.ram import (IN_MEMORY_BYTES_PER_FILE_BYTE, WORKER_PROCESS_BYTES, data_ram_breakdown,
                             estimate_data_ram_bytes)


def cfg(path, *overrides):
    return load_config(None, [f"data.path={path}", "data.seq_len=128", "batch.micro_batch=4", *overrides])


def test_in_memory_grows_with_the_files_streaming_and_prepared_do_not(tmp_path):
    small, large = tmp_path / "small.jsonl", tmp_path / "large.jsonl"
    small.write_text('{"text": "x"}\n' * 100)
    large.write_text('{"text": "x"}\n' * 10_000)
    assert data_ram_breakdown(cfg(small))["dataset"] == small.stat().st_size * IN_MEMORY_BYTES_PER_FILE_BYTE
    assert estimate_data_ram_bytes(cfg(large)) > estimate_data_ram_bytes(cfg(small))
    for path_kind in (["data.streaming=true"], [f"data.prepared_dir={tmp_path}"]):
        assert estimate_data_ram_bytes(cfg(large, *path_kind)) == estimate_data_ram_bytes(cfg(small, *path_kind))
        assert data_ram_breakdown(cfg(large, *path_kind))["dataset"] == 0


def test_workers_buffers_and_pinning_add_up(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "x"}\n')
    base = data_ram_breakdown(cfg(path, "data.streaming=true"))
    two = data_ram_breakdown(cfg(path, "data.streaming=true", "data.num_workers=2"))
    assert two["worker_processes"] - base["worker_processes"] == 2 * WORKER_PROCESS_BYTES
    assert two["batches_in_flight"] == 5 * base["batches_in_flight"]  # 2 workers x prefetch 2 + the one in use
    assert data_ram_breakdown(cfg(path, "data.streaming=true", "data.shuffle_buffer=0"))["shuffle_buffer"] == 0
    cuda = data_ram_breakdown(cfg(path, "data.streaming=true"), cuda=True)
    assert cuda["batches_in_flight"] == 2 * base["batches_in_flight"]  # the pinned copy
