"""Every input kind yields the same examples; bad records are named by file and line (or row)."""

import json
import logging

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from memfit.config import DataConfig
from memfit.data.loader import load_examples
from memfit.data.sources import DataError, is_hub_name, iter_raw
from memfit.models.tokenizer import byte_tokenizer

RECORDS = [{"instruction": f"task {i}", "input": "", "output": f"answer {i}"} for i in range(7)]


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def load(path, tok, **kw):
    return load_examples(DataConfig(path=str(path), **kw), tok, 256)


def write_all_kinds(folder):
    folder.mkdir()
    (folder / "a.jsonl").write_text("".join(json.dumps(r) + "\n" for r in RECORDS[:2]))
    (folder / "b.json").write_text(json.dumps(RECORDS[2:3]))
    table = pa.Table.from_pylist(RECORDS[3:5])
    pq.write_table(pa.Table.from_pylist(RECORDS[3:4]), folder / "c.parquet")
    with pa.OSFile(str(folder / "d.arrow"), "wb") as sink, pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(pa.Table.from_pylist(RECORDS[4:5]))  # stream format, as `datasets` writes it
    (folder / "e.csv").write_text("instruction,input,output\n" + "".join(
        f"{r['instruction']},{r['input']},{r['output']}\n" for r in RECORDS[5:7]))
    (folder / "notes.txt").write_text("ignored: not a data file")


def test_every_file_kind_folder_and_glob_give_the_same_examples(tmp_path, tok):
    reference = load(_jsonl(tmp_path / "all.jsonl", RECORDS), tok)
    write_all_kinds(tmp_path / "mixed")
    assert load(tmp_path / "mixed", tok) == reference
    assert load(str(tmp_path / "mixed" / "*.*"), tok) == reference
    assert len(load(tmp_path / "mixed" / "c.parquet", tok)) == 1


def test_arrow_file_format_and_json_lines_named_json(tmp_path, tok):
    table = pa.Table.from_pylist(RECORDS)
    with pa.OSFile(str(tmp_path / "x.arrow"), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    reference = load(_jsonl(tmp_path / "all.jsonl", RECORDS), tok)
    assert load(tmp_path / "x.arrow", tok) == reference
    (tmp_path / "lines.json").write_text((tmp_path / "all.jsonl").read_text())
    assert load(tmp_path / "lines.json", tok) == reference


def _jsonl(path, records, extra_lines=()):
    lines = [json.dumps(r) for r in records]
    for index, line in extra_lines:
        lines.insert(index, line)
    path.write_text("\n".join(lines) + "\n")
    return path


def test_malformed_line_names_file_and_line(tmp_path, tok):
    path = _jsonl(tmp_path / "bad.jsonl", RECORDS, extra_lines=[(2, '{"instruction": "x", "output": ')])
    with pytest.raises(DataError, match=rf"{path}:3: not valid JSON"):
        load(path, tok)
    path = _jsonl(tmp_path / "missing.jsonl", RECORDS, extra_lines=[(4, '{"instruction": "no output"}')])
    with pytest.raises(DataError, match=rf"{path}:5: missing field 'output'"):
        load(path, tok, format="alpaca")
    path = _jsonl(tmp_path / "array.jsonl", RECORDS, extra_lines=[(0, "[1, 2]")])
    with pytest.raises(DataError, match=rf"{path}:1: expected a JSON object, got list"):
        load(path, tok)


def test_malformed_csv_row_names_line(tmp_path, tok):
    path = tmp_path / "bad.csv"
    path.write_text("instruction,input,output\na,,b\nonly-one-cell\n")
    with pytest.raises(DataError, match=rf"{path}:3: the row has a different number of cells"):
        load(path, tok)


def test_skip_bad_records_counts_and_reports(tmp_path, tok, caplog):
    path = _jsonl(tmp_path / "bad.jsonl", RECORDS, extra_lines=[(2, "{oops"), (5, '{"instruction": "x"}')])
    with caplog.at_level(logging.WARNING):
        examples = load(path, tok, format="alpaca", skip_bad_records=True)
    assert len(examples) == len(RECORDS)
    assert "2 malformed record(s) skipped" in caplog.text and f"{path}:3" in caplog.text


def test_limit_and_missing_paths(tmp_path, tok):
    path = _jsonl(tmp_path / "all.jsonl", RECORDS)
    assert len(list(iter_raw(str(path), limit=3))) == 3
    with pytest.raises(DataError, match="does not exist"):
        load(tmp_path / "nope.jsonl", tok)
    with pytest.raises(DataError, match="matches no"):
        load(str(tmp_path / "*.parquet"), tok)
    with pytest.raises(DataError, match="no usable examples"):
        load(_jsonl(tmp_path / "empty.jsonl", [{"text": ""}]), tok)


def test_hub_names_are_told_apart_from_local_paths(tmp_path):
    assert is_hub_name("tatsu-lab/alpaca") and is_hub_name("hf:squad")
    assert not is_hub_name(str(tmp_path)) and not is_hub_name("data/train.jsonl") and not is_hub_name("builtin:demo")
