"""In-memory, prepared (memory-mapped Arrow) and streaming paths: same examples, each exactly once
per epoch, resumable mid-epoch from state_dict."""

import json

import pytest
import torch

from memfit.config import load_config
from memfit.data.loader import BatchStream, build_batch_stream, load_examples
from memfit.data.prepare import PreparedDataset, prepare_dataset
from memfit.data.sources import DataError
from memfit.data.streaming import StreamingBatches
from memfit.models.tokenizer import byte_tokenizer

N = 60
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("".join(json.dumps({"text": f"<{i:03d}> " + "word " * (i % 9)}) + "\n" for i in range(N)))
    return path


def cfg_for(corpus, *overrides):
    return load_config(None, [f"data.path={corpus}", "data.seq_len=64", "batch.micro_batch=4", "seed=3", *overrides])


def ids_of(batch) -> list[int]:
    """The record number each row starts with (rows start with BOS, '<', three digits)."""
    return [int(bytes(row[2:5].tolist()).decode()) for row in batch["input_ids"]]


def rows_of(batch) -> list[list[int]]:
    mask = batch.get("attention_mask", torch.ones_like(batch["input_ids"]))
    return [row[m.bool()].tolist() for row, m in zip(batch["input_ids"], mask)]


def epoch_ids(stream, batches: int) -> list[int]:
    return [i for _ in range(batches) for i in ids_of(stream.next_batch())]


@pytest.mark.parametrize("workers", [0, 2])
def test_batch_stream_resume_sees_every_example_once_per_epoch(tok, corpus, workers):
    examples = load_examples(cfg_for(corpus).data, tok, 64)
    full = BatchStream(examples, 4, tok.pad_token_id, seed=3, num_workers=workers)
    reference = epoch_ids(full, N // 4)
    assert sorted(reference) == list(range(N)) and reference != list(range(N))  # all, once, shuffled
    first = BatchStream(examples, 4, tok.pad_token_id, seed=3, num_workers=workers)
    seen = epoch_ids(first, 6)
    resumed = BatchStream(examples, 4, tok.pad_token_id, seed=3, num_workers=workers)
    resumed.load_state_dict(first.state_dict())
    assert seen + epoch_ids(resumed, N // 4 - 6) == reference
    assert resumed.epoch == 0 and sorted(epoch_ids(resumed, N // 4)) == list(range(N))  # next epoch: all again
    assert resumed.epoch == 1


def test_streaming_epoch_is_exactly_once_and_resume_is_exact(tok, corpus):
    cfg = cfg_for(corpus, "data.streaming=true", "data.shuffle_buffer=16")
    full = StreamingBatches(cfg, tok)
    reference = epoch_ids(full, N // 4)
    assert sorted(reference) == list(range(N)) and reference != list(range(N))
    first = StreamingBatches(cfg, tok)
    seen = epoch_ids(first, 5)
    resumed = StreamingBatches(cfg, tok)
    resumed.load_state_dict(first.state_dict())
    assert seen + epoch_ids(resumed, N // 4 - 5) == reference
    second_epoch = epoch_ids(resumed, N // 4)
    assert resumed.epoch == 1 and sorted(second_epoch) == list(range(N)) and second_epoch != reference


def test_streaming_order_does_not_depend_on_worker_count(tok, corpus):
    cfg = cfg_for(corpus, "data.streaming=true", "data.shuffle_buffer=0")
    in_process = epoch_ids(StreamingBatches(cfg, tok), N // 4)
    with_workers = epoch_ids(StreamingBatches(cfg_for(corpus, "data.streaming=true", "data.shuffle_buffer=0",
                                                      "data.num_workers=2"), tok), N // 4)
    assert in_process == with_workers == list(range(N))  # chunk order kept; no shuffle = file order


def test_streaming_data_parallel_ranks_split_the_epoch(tok, corpus):
    cfg = cfg_for(corpus, "data.streaming=true", "data.shuffle_buffer=0")
    shares = [[int(bytes(e["input_ids"][2:5]).decode()) for e in StreamingBatches(cfg, tok, rank=r, world=2)
               .epoch_items(0)] for r in range(2)]
    assert sorted(shares[0] + shares[1]) == list(range(N)) and not set(shares[0]) & set(shares[1])


@pytest.mark.parametrize("packing", [False, True])
def test_prepared_streaming_and_in_memory_yield_the_same_examples(tok, corpus, tmp_path, packing):
    cfg = cfg_for(corpus, f"data.packing={packing}", f"data.prepared_dir={tmp_path / 'prepared'}", "data.num_workers=2")
    report = prepare_dataset(cfg, tok, cfg.data.prepared_dir, progress=False)
    prepared = PreparedDataset.open(cfg.data.prepared_dir, expect=cfg)
    in_memory = load_examples(cfg.data, tok, 64, packing=packing)
    streamed = list(StreamingBatches(cfg_for(corpus, f"data.packing={packing}", "data.streaming=true",
                                             "data.shuffle_buffer=0"), tok).epoch_items(0))
    assert [prepared[i] for i in range(len(prepared))] == in_memory == streamed
    assert report.rows == len(prepared) and report.examples == N and report.records == N
    assert report.tokens == sum(len(e["input_ids"]) for e in in_memory)
    assert (report.rows < N) == packing
    lengths = report.example_length
    assert lengths["min"] <= lengths["median"] <= lengths["p95"] <= lengths["max"] <= 64


def test_training_reuses_a_prepared_dataset_and_checks_it_matches(tok, corpus, tmp_path):
    cfg = cfg_for(corpus, f"data.prepared_dir={tmp_path / 'prepared'}", "data.group_by_length=true")
    prepare_dataset(cfg, tok, cfg.data.prepared_dir, progress=False)
    stream = build_batch_stream(cfg, tok, CPU)
    assert isinstance(stream.examples, PreparedDataset)
    batch = stream.next_batch()
    lengths = batch["attention_mask"].sum(1).tolist()
    assert lengths == sorted(lengths, reverse=True)  # grouped by length within the window
    with pytest.raises(DataError, match="seq_len: prepared with 64, config has 128"):
        build_batch_stream(cfg_for(corpus, f"data.prepared_dir={tmp_path / 'prepared'}", "data.seq_len=128"), tok, CPU)
    with pytest.raises(DataError, match="already exists"):
        prepare_dataset(cfg, tok, cfg.data.prepared_dir, progress=False)
    with pytest.raises(DataError, match="memfit data prepare"):
        build_batch_stream(cfg_for(corpus, f"data.prepared_dir={tmp_path / 'missing'}"), tok, CPU)


def test_prepare_stops_at_a_bad_record_and_leaves_nothing_behind(tok, tmp_path):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"text": "fine"}\n{"text": "fine"}\n{"text": \n{"text": ""}\n')
    out = tmp_path / "prepared"
    with pytest.raises(DataError, match=rf"{path}:3: not valid JSON"):
        prepare_dataset(cfg_for(path, "data.num_workers=2"), tok, out, progress=False)
    assert not out.exists() and not (tmp_path / "prepared.partial").exists()
    report = prepare_dataset(cfg_for(path, "data.skip_bad_records=true"), tok, out, progress=False)
    assert report.rows == 2 and report.skipped == {"malformed": 1, "empty": 1}
