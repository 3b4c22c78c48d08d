"""A null or a non-string value where text belongs is a malformed record, reported with its file and
line (or row), or skipped and counted with data.skip_bad_records, on every reader and data path; it
is never trained on as the text "None" or "42". An absent or null alpaca `input` is fine."""

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memfit.config import load_config
from memfit.data.examples import BAD, EncodeSpec, encode_chunk
from memfit.data.loader import load_examples
from memfit.data.prepare import prepare_dataset
from memfit.data.sources import DataError
from memfit.data.streaming import StreamingBatches
from memfit.models.tokenizer import byte_tokenizer

OK_TEXT = {"text": "a good record"}


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def encode(record, tok, fmt="auto"):
    return encode_chunk([("f.jsonl:7", record)], EncodeSpec(tok, 256, fmt))


@pytest.mark.parametrize("record, field, got", [
    ({"text": None}, "text", "null"),
    ({"text": 42}, "text", "a number (42)"),
    ({"text": ["a", "b"]}, "text", "a list (['a', 'b'])"),
    ({"instruction": None, "output": "b"}, "instruction", "null"),
    ({"instruction": "a", "output": None}, "output", "null"),
    ({"instruction": "a", "output": 3.5}, "output", "a number (3.5)"),
    ({"instruction": "a", "input": 7, "output": "b"}, "input", "a number (7)"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None}]},
     "messages[1].content", "null"),
    ({"messages": [{"role": None, "content": "hi"}, {"role": "assistant", "content": "yo"}]},
     "messages[0].role", "null"),
    ({"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": None}]},
     "conversations[1].value", "null"),
    ({"conversations": [{"from": "human", "value": 12}, {"from": "gpt", "value": "ok"}]},
     "conversations[0].value", "a number (12)"),
])
def test_a_value_that_is_not_text_is_a_malformed_record(tok, record, field, got):
    result = encode(record, tok)
    assert result.examples == []
    assert result.problems == [(BAD, f"f.jsonl:7: field '{field}' is {got}, expected text (a string)")]


@pytest.mark.parametrize("record", [{"instruction": "a", "output": "b"}, {"instruction": "a", "input": None, "output": "b"},
                                    {"instruction": "a", "input": "", "output": "b"}])
def test_an_absent_or_null_alpaca_input_is_no_input(tok, record):
    result = encode(record, tok)
    assert result.problems == [] and len(result.examples) == 1
    assert result.examples[0] == encode({"instruction": "a", "output": "b"}, tok).examples[0]


def write(path, records):
    """One file of `records` in the format its suffix names."""
    if path.suffix == ".jsonl":
        path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif path.suffix == ".json":
        path.write_text(json.dumps(records))
    elif path.suffix == ".parquet":
        pq.write_table(pa.Table.from_pylist(records), path)
    else:
        table = pa.Table.from_pylist(records)
        with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
            writer.write_table(table)
    return path


WHERE = {"data.jsonl": ":2", "data.json": ": record 1", "data.parquet": ": row 1", "data.arrow": ": row 1"}


def cfg_for(path, *overrides):
    return load_config(None, [f"data.path={path}", "data.seq_len=64", "batch.micro_batch=2", *overrides])


@pytest.mark.parametrize("name", list(WHERE))
def test_every_reader_reports_a_null_with_its_file_and_line_or_row(tmp_path, tok, name):
    path = write(tmp_path / name, [OK_TEXT, {"text": None}, OK_TEXT])
    with pytest.raises(DataError, match=f"{path}{WHERE[name]}: field 'text' is null"):
        load_examples(cfg_for(path).data, tok, 64)
    examples = load_examples(cfg_for(path, "data.skip_bad_records=true").data, tok, 64)
    assert len(examples) == 2


def test_a_parquet_column_of_nulls_is_refused_not_trained_as_none(tmp_path, tok):
    path = tmp_path / "nulls.parquet"
    pq.write_table(pa.table({"text": pa.array([None, None], pa.string())}), path)
    with pytest.raises(DataError, match=f"{path}: row 0: field 'text' is null"):
        load_examples(cfg_for(path).data, tok, 64)


def test_a_null_output_column_in_parquet_names_its_row(tmp_path, tok):
    path = tmp_path / "alpaca.parquet"
    pq.write_table(pa.table({"instruction": ["a", "b"], "output": pa.array(["ok", None], pa.string())}), path)
    with pytest.raises(DataError, match=f"{path}: row 1: field 'output' is null"):
        load_examples(cfg_for(path, "data.format=alpaca").data, tok, 64)


@pytest.mark.parametrize("workers", [0, 1])
def test_streaming_reports_and_counts_nulls(tmp_path, tok, workers):
    path = write(tmp_path / "data.jsonl", [OK_TEXT, {"text": None}, OK_TEXT, {"text": 5}])
    stream = StreamingBatches(cfg_for(path, "data.streaming=true", f"data.num_workers={workers}"), tok)
    with pytest.raises(DataError, match=f"{path}:2: field 'text' is null"):
        stream.next_batch()
    stream = StreamingBatches(cfg_for(path, "data.streaming=true", "data.skip_bad_records=true",
                                      f"data.num_workers={workers}"), tok)
    assert len(list(stream.epoch_items(0))) == 2
    assert stream.problems.counts == {"malformed": 2}


def test_prepare_with_worker_processes_reports_and_counts_nulls(tmp_path, tok):
    path = write(tmp_path / "data.jsonl", [OK_TEXT, OK_TEXT, {"text": None}])
    out = tmp_path / "prepared"
    with pytest.raises(DataError, match=f"{path}:3: field 'text' is null"):
        prepare_dataset(cfg_for(path, "data.num_workers=1"), tok, out, progress=False)
    assert not out.exists()
    report = prepare_dataset(cfg_for(path, "data.num_workers=1", "data.skip_bad_records=true"), tok, out, progress=False)
    assert report.examples == 2 and report.skipped == {"malformed": 1}


def test_a_hub_dataset_row_with_a_null_names_the_row(tok, monkeypatch):
    datasets = pytest.importorskip("datasets")
    monkeypatch.setattr(datasets, "load_dataset", lambda name, split, streaming: iter([OK_TEXT, {"text": None}]))
    with pytest.raises(DataError, match=r"hf:org/set\[train\] row 1: field 'text' is null"):
        load_examples(cfg_for("hf:org/set").data, tok, 64)
