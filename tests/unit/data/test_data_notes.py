"""What the data path cuts and drops is counted and said: examples truncated to data.seq_len (and the
tokens cut), records dropped by kind, a micro-batch the data cannot fill. Every batch stream keeps
the counts in `stream.notes` (in memory, prepared, streamed: so far), each is warned about when first
known, and `memfit train` prints them in its summary."""

import json
import logging

import pytest
import torch

from memfit.cli import main
from memfit.config import load_config
from memfit.data.examples import EncodeSpec, encode_chunk
from memfit.data.loader import build_batch_stream
from memfit.data.prepare import prepare_dataset
from memfit.models.tokenizer import byte_tokenizer

SEQ_LEN = 32
LONG = "x" * 100  # BOS + 100 bytes + EOS = 102 tokens: 70 cut at seq_len 32
RECORDS = [{"text": "short one"}, {"text": LONG}, {"text": "  "}, {"text": None}, {"text": "another short one"}]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def cfg_for(tmp_path, *overrides):
    path = write_jsonl(tmp_path / "data.jsonl", RECORDS)
    return load_config(None, ["model=memfit/tiny-llama", "model.init=random", f"data.path={path}", "data.format=text",
                              f"data.seq_len={SEQ_LEN}", "batch.micro_batch=2", "data.skip_bad_records=true",
                              f"output_dir={tmp_path / 'run'}", *overrides])


def test_encode_chunk_counts_truncated_examples_and_the_tokens_cut(tok):
    items = [("f:1", {"text": "short"}), ("f:2", {"text": LONG}), ("f:3", {"text": LONG})]
    result = encode_chunk(items, EncodeSpec(tok, SEQ_LEN, "text"))
    assert len(result.examples) == 3 and all(len(e["input_ids"]) <= SEQ_LEN for e in result.examples)
    assert (result.truncated, result.truncated_tokens, result.first_truncated) == (2, 2 * 70, "f:2")
    exact = encode_chunk([("f:1", {"text": "y" * (SEQ_LEN - 2)})], EncodeSpec(tok, SEQ_LEN, "text"))
    assert exact.truncated == 0  # BOS + 30 + EOS fills seq_len exactly: nothing is cut


def test_in_memory_notes_count_truncated_and_dropped_and_warn_before_training(tmp_path, tok, caplog):
    with caplog.at_level(logging.WARNING):
        stream = build_batch_stream(cfg_for(tmp_path), tok, torch.device("cpu"))
    notes = stream.notes
    assert (notes.records, notes.examples, notes.truncated, notes.truncated_tokens) == (5, 3, 1, 70)
    assert notes.dropped == {"empty": 1, "malformed": 1}
    assert notes.micro_batch_note is None
    assert notes.lines() == [f"data: 5 record(s) read, 3 example(s); 1 truncated to data.seq_len={SEQ_LEN} tokens "
                             "(70 tokens cut); 2 dropped (1 empty, 1 malformed)"]
    assert f"1 of 3 example(s) were longer than data.seq_len={SEQ_LEN} tokens and truncated (70 tokens cut; " \
           f"e.g. {tmp_path / 'data.jsonl'}:2)" in caplog.text
    assert "1 empty example(s) skipped" in caplog.text and "1 malformed record(s) skipped" in caplog.text


def test_a_micro_batch_larger_than_the_data_is_said_and_noted(tmp_path, tok, caplog):
    with caplog.at_level(logging.WARNING):
        stream = build_batch_stream(cfg_for(tmp_path, "batch.micro_batch=8"), tok, torch.device("cpu"))
    assert stream.next_batch()["input_ids"].shape[0] == 3  # what the note says
    message = ("micro-batches hold 3 row(s), not batch.micro_batch=8: the data holds only 3 example(s); "
               "lower batch.micro_batch (raise batch.grad_accum to keep the batch size) or add data")
    assert message in caplog.text and stream.notes.lines()[1] == message


def test_a_micro_batch_the_data_fills_has_no_note(tmp_path, tok, caplog):
    with caplog.at_level(logging.WARNING):
        stream = build_batch_stream(cfg_for(tmp_path, "batch.micro_batch=3"), tok, torch.device("cpu"))
    assert len(stream.notes.lines()) == 1 and "micro-batches hold" not in caplog.text


def test_streaming_notes_count_so_far_then_the_whole_pass(tmp_path, tok, caplog):
    cfg = cfg_for(tmp_path, "data.streaming=true", "batch.micro_batch=1", "data.shuffle_buffer=1")
    stream = build_batch_stream(cfg, tok, torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        stream.next_batch()  # the whole (small) file is read into the first chunk
    notes = stream.notes
    assert notes.scope == "streamed, so far" and (notes.records, notes.truncated) == (5, 1)
    # warned as first met, without waiting for the end of the epoch
    assert f"{tmp_path / 'data.jsonl'}:2: the example is longer than data.seq_len={SEQ_LEN} tokens" in caplog.text
    assert f"{tmp_path / 'data.jsonl'}:4: field 'text' is null" in caplog.text
    for _ in range(3):  # through the end of the epoch
        stream.next_batch()
    notes = stream.notes
    assert notes.scope == "streamed" and notes.dropped == {"empty": 1, "malformed": 1} and notes.truncated_tokens == 70


def test_streaming_says_when_an_epoch_is_smaller_than_a_micro_batch(tmp_path, tok, caplog):
    stream = build_batch_stream(cfg_for(tmp_path, "data.streaming=true", "batch.micro_batch=8"), tok,
                                torch.device("cpu"))
    with caplog.at_level(logging.WARNING):
        assert stream.next_batch()["input_ids"].shape[0] == 3
    assert "micro-batches hold 3 row(s), not batch.micro_batch=8" in caplog.text
    assert stream.notes.lines()[1].startswith("micro-batches hold 3 row(s)")


def test_prepared_data_keeps_its_counts_for_the_run(tmp_path, tok, caplog):
    cfg = cfg_for(tmp_path, f"data.prepared_dir={tmp_path / 'prepared'}")
    report = prepare_dataset(cfg, tok, tmp_path / "prepared", progress=False)
    assert (report.truncated, report.truncated_tokens) == (1, 70)
    assert "truncated to data.seq_len: 1 example(s) (70 tokens cut)" in report.to_text()
    with caplog.at_level(logging.WARNING):
        stream = build_batch_stream(cfg, tok, torch.device("cpu"))
    line = stream.notes.lines()[0]
    assert line == (f"data (prepared): 5 record(s) read, 3 example(s); 1 truncated to data.seq_len={SEQ_LEN} tokens "
                    "(70 tokens cut); 2 dropped (1 empty, 1 malformed)")
    assert line in caplog.text  # said again before training: the prepare run may have been long ago


def test_the_train_summary_prints_the_counts(tmp_path, capsys):
    cfg = cfg_for(tmp_path, "batch.micro_batch=4")
    (tmp_path / "config.yaml").write_text(cfg.to_yaml())
    status = main(["train", str(tmp_path / "config.yaml"), "max_steps=1", "device=cpu", "logging.report_to=[]",
                   "logging.track_memory=false", "--no-progress"])
    out = capsys.readouterr().out
    assert status == 0
    assert (f"data: 5 record(s) read, 3 example(s); 1 truncated to data.seq_len={SEQ_LEN} tokens (70 tokens cut); "
            "2 dropped (1 empty, 1 malformed)") in out
    assert "micro-batches hold 3 row(s), not batch.micro_batch=4" in out
