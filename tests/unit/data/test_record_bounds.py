"""data.max_record_bytes: an oversize record is an error naming file and line (or row), or is
skipped and counted, in every format and data path, and is never read whole; invalid UTF-8 is
replaced and reported once per file."""

import io
import json
import logging
import re
import subprocess
import sys
import textwrap

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from pydantic import ValidationError

from memfit.config import DataConfig, load_config
from memfit.data.loader import load_examples
from memfit.data.prepare import prepare_dataset
from memfit.data.sources import DataError, OversizeRecord, _read_line, iter_raw
from memfit.data.streaming import StreamingBatches
from memfit.models.tokenizer import byte_tokenizer

LIMIT = 300  # data.max_record_bytes in these tests
RECORDS = [{"instruction": f"task {i}", "input": "", "output": f"answer {i}"} for i in range(6)]
HUGE = {"instruction": "big", "input": "", "output": "y" * 1000}  # record 2 (0-based) of every file below


@pytest.fixture(scope="module")
def tok():
    return byte_tokenizer()


def with_huge(records=RECORDS):
    return records[:2] + [HUGE] + records[2:]


def write_jsonl(path, records):
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return path


def write_csv(path, records):
    path.write_text("instruction,input,output\n" + "".join(
        f"{r['instruction']},{r['input']},{r['output']}\n" for r in records))
    return path


def write_json(path, records):
    path.write_text(json.dumps(records))
    return path


def write_parquet(path, records):
    pq.write_table(pa.Table.from_pylist(records), path)
    return path


def write_arrow(path, records):
    table = pa.Table.from_pylist(records)
    with pa.OSFile(str(path), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table)
    return path


WRITERS = {  # format -> (write the file, where record 2 is)
    "jsonl": (write_jsonl, ":3"),
    "json": (write_json, ": record 2"),
    "csv": (write_csv, ":4"),  # after the header line
    "parquet": (write_parquet, ": row 2"),
    "arrow": (write_arrow, ": row 2"),
}


def oversize_error(path, where):
    return re.escape(f"{path}{where}: record is ") + r"[\d.,]+ (B|KiB)" + re.escape(
        f", above data.max_record_bytes={LIMIT} (raise it or set data.skip_bad_records=true)")


def load(path, tok, **kw):
    settings = {"path": str(path), "max_record_bytes": LIMIT, "format": "alpaca", **kw}
    return load_examples(DataConfig(**settings), tok, 64)


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_oversize_record_names_file_and_line(tmp_path, tok, kind):
    write, where = WRITERS[kind]
    path = write(tmp_path / f"data.{kind}", with_huge())
    with pytest.raises(DataError, match=oversize_error(path, where)):
        load(path, tok)


@pytest.mark.parametrize("kind", sorted(WRITERS))
def test_skip_bad_records_skips_and_counts_oversize(tmp_path, tok, kind, caplog):
    write, where = WRITERS[kind]
    reference = load(write(tmp_path / f"ref.{kind}", RECORDS), tok)
    path = write(tmp_path / f"data.{kind}", with_huge())
    with caplog.at_level(logging.WARNING):
        assert load(path, tok, skip_bad_records=True) == reference
    assert f"1 oversize record(s) skipped (data.skip_bad_records); e.g. {path}{where}: record is" in caplog.text


def test_a_record_of_exactly_the_limit_is_read(tmp_path, tok):
    line = json.dumps({"text": ""})
    record = {"text": "z" * (LIMIT - len(line))}
    path = write_jsonl(tmp_path / "exact.jsonl", [record])
    assert len(json.dumps(record)) == LIMIT
    assert len(load(path, tok, format="text")) == 1
    (tmp_path / "crlf.jsonl").write_text(json.dumps(record) + "\r\n", newline="")  # the line end does not count
    assert len(load(tmp_path / "crlf.jsonl", tok, format="text")) == 1


def test_oversize_line_is_read_in_bounded_pieces():
    class Handle(io.BytesIO):
        largest = 0

        def readline(self, size=-1):
            line = super().readline(size)
            Handle.largest = max(Handle.largest, len(line))
            return line

    handle = Handle(b"a" * 5_000_000 + b"\nnext\n")
    assert _read_line(handle, 1000)[:2] == (None, 5_000_000)
    assert _read_line(handle, 1000)[:2] == (b"next\n", 4)
    assert _read_line(handle, 1000)[0] == b""
    assert Handle.largest <= 1 << 16  # never more than one drain chunk at a time


def test_csv_multiline_quoted_oversize_row_keeps_the_rows_after_it(tmp_path, tok):
    big = "x" * 400
    path = tmp_path / "multi.csv"
    path.write_text('instruction,input,output\na,,b\n"multi\nline ' + big + '\nend",,c\n'
                    '"he said ""hi""",,"two\nlines"\n')
    items = list(iter_raw(str(path), max_record_bytes=LIMIT))
    assert [where for where, _ in items] == [f"{path}:2", f"{path}:5", f"{path}:7"]
    assert isinstance(items[1][1], OversizeRecord) and items[1][1].size > 400
    assert items[2][1] == {"instruction": 'he said "hi"', "input": "", "output": "two\nlines"}


def test_csv_header_over_the_limit_is_an_error(tmp_path):
    path = tmp_path / "wide.csv"
    path.write_text(",".join(f"column_{i}" for i in range(100)) + "\n")
    with pytest.raises(DataError, match=re.escape(f"{path}:1: the header row is")):
        list(iter_raw(str(path), max_record_bytes=LIMIT))


def test_chat_column_of_parquet_is_measured_through_lists_and_structs(tmp_path, tok):
    chats = [{"messages": [{"role": "user", "content": f"hi {i}"}, {"role": "assistant", "content": "hello"}]}
             for i in range(4)]
    chats[1]["messages"][1]["content"] = "long " * 100
    path = tmp_path / "chat.parquet"
    pq.write_table(pa.Table.from_pylist(chats), path)
    items = list(iter_raw(str(path), max_record_bytes=LIMIT))
    assert [isinstance(item, OversizeRecord) for _, item in items] == [False, True, False, False]
    assert items[2][1] == chats[2]


def test_hub_records_are_measured(monkeypatch):
    class FakeDatasets:
        @staticmethod
        def load_dataset(name, split, streaming):
            return iter(with_huge())

    monkeypatch.setattr("memfit.data.sources.require", lambda *args: FakeDatasets)
    items = list(iter_raw("org/name", max_record_bytes=LIMIT))
    assert items[2][0] == "hf:org/name[train] row 2" and isinstance(items[2][1], OversizeRecord)
    assert [item for _, item in items[:2] + items[3:]] == RECORDS


def cfg_for(path, *overrides):
    return load_config(None, [f"data.path={path}", "data.seq_len=64", "batch.micro_batch=2", "data.format=alpaca",
                              f"data.max_record_bytes={LIMIT}", *overrides])


@pytest.mark.parametrize("workers", [0, 2])
def test_streaming_oversize_error_and_skip(tmp_path, tok, workers):
    path = write_jsonl(tmp_path / "data.jsonl", with_huge())
    stream = StreamingBatches(cfg_for(path, "data.streaming=true", f"data.num_workers={workers}"), tok)
    with pytest.raises(DataError, match=oversize_error(path, ":3")):
        stream.next_batch()
    stream = StreamingBatches(cfg_for(path, "data.streaming=true", "data.skip_bad_records=true",
                                      f"data.num_workers={workers}"), tok)
    assert len(list(stream.epoch_items(0))) == len(RECORDS)
    assert stream.problems.counts == {"oversize": 1}


def test_prepare_oversize_error_and_skip(tmp_path, tok):
    path = write_jsonl(tmp_path / "data.jsonl", with_huge())
    out = tmp_path / "prepared"
    with pytest.raises(DataError, match=oversize_error(path, ":3")):
        prepare_dataset(cfg_for(path), tok, out, progress=False)
    assert not out.exists()
    report = prepare_dataset(cfg_for(path, "data.skip_bad_records=true"), tok, out, progress=False)
    assert report.examples == len(RECORDS) and report.skipped == {"oversize": 1}


def test_max_record_bytes_default_and_bounds():
    assert DataConfig().max_record_bytes == 1 << 20
    with pytest.raises(ValidationError):
        DataConfig(max_record_bytes=0)


INVALID = [b'{"text": "valid \xef\xbf\xbd is not counted"}\n', b'{"text": "fine"}\n',
           b'{"text": "two \xff\xfe bad bytes"}\n', b'{"text": "ok"}\n', b'{"text": "cut \xc3( short"}\n']


def test_invalid_utf8_is_replaced_and_reported_once_per_file(tmp_path, tok, caplog):
    path = tmp_path / "latin.jsonl"
    path.write_bytes(b"".join(INVALID))
    with caplog.at_level(logging.WARNING):
        examples = load(path, tok, format="text")
        load(path, tok, format="text")  # read again: no second warning
    assert len(examples) == 5
    message = f"{path}: 3 invalid UTF-8 byte sequence(s) replaced with U+FFFD (first at line 3)"
    assert caplog.text.count(message) == 1
    assert "\ufffd" in tok.decode(examples[2]["input_ids"])


def test_invalid_utf8_in_csv_and_json_is_counted(tmp_path, caplog):
    csv_path = tmp_path / "latin.csv"
    csv_path.write_bytes(b"text\nfine\nna\xefve\n")
    json_path = tmp_path / "latin.json"
    json_path.write_bytes(b'[\n{"text": "a"},\n{"text": "\xff"}\n]\n')
    with caplog.at_level(logging.WARNING):
        assert list(iter_raw(str(csv_path)))[1][1] == {"text": "na\ufffdve"}
        assert list(iter_raw(str(json_path)))[1][1] == {"text": "\ufffd"}
    assert f"{csv_path}: 1 invalid UTF-8 byte sequence(s) replaced with U+FFFD (first at line 3)" in caplog.text
    assert f"{json_path}: 1 invalid UTF-8 byte sequence(s) replaced with U+FFFD (first at line 3)" in caplog.text


# Peak RSS of the trainer's data path (build_batch_stream, in memory, byte tokenizer) in a fresh process.
# The peak is VmHWM, not ru_maxrss: Linux carries ru_maxrss over fork + exec, so a child's ru_maxrss
# starts at the RSS of the pytest process that spawned it and would hide the growth measured here.
RSS_SCRIPT = textwrap.dedent("""
    import json, sys
    import torch
    from memfit.config import load_config
    from memfit.data.loader import build_batch_stream
    from memfit.models.tokenizer import byte_tokenizer

    def peak_rss():
        with open("/proc/self/status") as status:
            return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))  # kB

    path, max_record_bytes = sys.argv[1], sys.argv[2]
    cfg = load_config(None, [f"data.path={path}", "data.skip_bad_records=true", "data.seq_len=256",
                             f"data.max_record_bytes={max_record_bytes}"])
    tokenizer = byte_tokenizer()
    before = peak_rss()
    stream = build_batch_stream(cfg, tokenizer, torch.device("cpu"))
    stream.next_batch()
    print(json.dumps({"examples": len(stream.examples), "before": before, "peak": peak_rss()}))
""")
HOSTILE_BYTES = 50_000_000


def measure_rss(path, max_record_bytes=1 << 20) -> dict:
    done = subprocess.run([sys.executable, "-c", RSS_SCRIPT, str(path), str(max_record_bytes)],
                          capture_output=True, text=True, check=True, timeout=600)
    return json.loads(done.stdout.strip().splitlines()[-1])


def write_rss_corpus(path, hostile: bool):
    lines = [json.dumps({"text": f"record {i}: " + "some ordinary training text " * 8}) for i in range(2000)]
    if hostile:
        lines.insert(1000, json.dumps({"text": "x" * HOSTILE_BYTES}))
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.mark.slow
def test_a_50_mb_line_does_not_grow_peak_rss(tmp_path):
    normal = measure_rss(write_rss_corpus(tmp_path / "normal.jsonl", hostile=False))
    hostile = measure_rss(write_rss_corpus(tmp_path / "hostile.jsonl", hostile=True))
    growth = {name: run["peak"] - run["before"] for name, run in (("normal", normal), ("hostile", hostile))}
    print(f"\npeak RSS (MB = 10^6 B): 2,000 records: {normal['peak'] / 1e6:,.0f} MB "
          f"(data path +{growth['normal'] / 1e6:,.1f} MB); with one 50 MB line skipped: "
          f"{hostile['peak'] / 1e6:,.0f} MB (data path +{growth['hostile'] / 1e6:,.1f} MB)")
    assert normal["examples"] == hostile["examples"] == 2000
    assert growth["hostile"] - growth["normal"] < 100e6
