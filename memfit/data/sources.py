"""Where records come from: files (jsonl, json, csv, parquet, Arrow), folders, globs, hub datasets.

Every reader yields `(where, item)` one record at a time, so nothing here holds a whole corpus in
memory (the one exception is a `.json` file holding a single JSON array, which must be parsed
whole; JSON Lines, CSV, Parquet and Arrow all stream). `where` names the record precisely
("file:line" for text formats, "file:row N" for columnar ones) so a bad one can be reported.

`item` is a dict, except for JSON Lines where it is the raw line: parsing happens later, in the
tokenizing worker processes, so the reading process stays cheap.

No record bigger than `data.max_record_bytes` goes on to parsing or tokenizing (where one hostile
50 MB line once took RSS from 0.4 to 9.2 GiB): the readers measure each record while reading it and
yield an `OversizeRecord` (its size only) in its place. JSON Lines and CSV are read with bounded
reads, so such a line is never held whole; Parquet and Arrow are measured per record batch with
Arrow's own string lengths; a `.json` array and hub records are measured once parsed.

Text files are decoded as UTF-8 with invalid bytes replaced by U+FFFD; each file with any gets one
warning saying how many and from which line.
"""

from __future__ import annotations

import csv
import glob
import json
import logging
from pathlib import Path
from typing import Iterator

import numpy as np

from memfit.data.demo import DEMO_PATH
from memfit.errors import MemfitError, require
from memfit.units import format_bytes

log = logging.getLogger(__name__)

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet",
            ".arrow": "arrow", ".feather": "arrow"}
MAX_RECORD_BYTES = 1 << 20  # the default of data.max_record_bytes
_DRAIN_CHUNK = 1 << 16  # bytes read at a time while skipping through an oversize line
_FFFD = "\ufffd".encode()  # U+FFFD as it appears, valid, in UTF-8 input


class DataError(MemfitError):
    """A record or file that cannot be used; the message names file and line (or row)."""


def _builtin(path: str) -> Path | None:
    if path == "builtin:demo":
        return DEMO_PATH
    return None


def resolve_files(path: str) -> list[Path]:
    """A file, a folder (every supported file in it, recursively, sorted) or a glob -> files."""
    builtin = _builtin(path)
    if builtin is not None:
        return [builtin]
    if any(ch in path for ch in "*?["):
        matches = sorted(Path(p) for p in glob.glob(str(Path(path).expanduser()), recursive=True))
        files = [p for p in matches if p.is_file() and p.suffix in SUFFIXES]
        if not files:
            raise DataError(f"data.path: the glob {path} matches no {'/'.join(sorted(SUFFIXES))} files")
        return files
    resolved = Path(path).expanduser()
    if resolved.is_dir():
        files = sorted(p for p in resolved.rglob("*") if p.is_file() and p.suffix in SUFFIXES
                       and not p.name.startswith("."))
        if not files:
            raise DataError(f"data.path: the folder {path} holds no {'/'.join(sorted(SUFFIXES))} files")
        return files
    if resolved.is_file():
        if resolved.suffix not in SUFFIXES:
            raise DataError(f"data.path: {path}: unsupported file type '{resolved.suffix}'; "
                            f"supported: {', '.join(sorted(SUFFIXES))}")
        return [resolved]
    raise DataError(f"data.path: {path} does not exist")


def is_hub_name(path: str) -> bool:
    """`org/name` that is not a local path: a Hugging Face dataset id (`hf:` prefix forces it)."""
    if path.startswith("hf:"):
        return True
    return (not path.startswith(("builtin:", ".", "/", "~")) and path.count("/") == 1
            and not Path(path).expanduser().exists() and not any(ch in path for ch in "*?[")
            and Path(path).suffix not in SUFFIXES)


def iter_raw(path: str, split: str = "train", limit: int | None = None, max_record_bytes: int = MAX_RECORD_BYTES,
             warn: bool = True) -> Iterator[tuple[str, object]]:
    """Every record of a data source, in a fixed order, as (where, dict-or-raw-jsonl-line); a record
    over `max_record_bytes` comes as an OversizeRecord. `warn`: log invalid UTF-8 (once per file)."""
    if is_hub_name(path):
        items = _iter_hub(path.removeprefix("hf:"), split, max_record_bytes)
    else:
        items = _iter_files(resolve_files(path), max_record_bytes, warn)
    for count, item in enumerate(items, start=1):
        yield item
        if limit and count >= limit:
            return


def _iter_files(files: list[Path], max_bytes: int, warn: bool) -> Iterator[tuple[str, object]]:
    for file in files:
        utf8 = _Utf8Tally()
        try:
            yield from READERS[SUFFIXES[file.suffix]](file, max_bytes, utf8)
        finally:  # also when reading stops early (data.limit, an error): report what was seen
            if warn:
                utf8.warn(file)


class _Utf8Tally:
    """Decodes one file's text, replacing invalid UTF-8 with U+FFFD, and counts the replacements."""

    def __init__(self):
        self.reset()

    def reset(self) -> None:
        self.count, self.first_line = 0, None

    def decode(self, raw: bytes, line: int) -> str:
        """`raw` starts at line number `line` of the file."""
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError as exc:
            text = raw.decode("utf-8", errors="replace")
            self.count += text.count("\ufffd") - raw.count(_FFFD)  # less the U+FFFD that were already there
            if self.first_line is None:
                self.first_line = line + raw.count(b"\n", 0, exc.start)
            return text

    def warn(self, path: Path) -> None:
        key = (str(path), self.count, self.first_line)
        if self.count and key not in _WARNED:  # once per file, however often it is re-read
            _WARNED.add(key)
            log.warning("%s: %d invalid UTF-8 byte sequence(s) replaced with U+FFFD (first at line %d)",
                        path, self.count, self.first_line)


_WARNED: set[tuple] = set()


def _read_line(handle, limit: int) -> tuple[bytes | None, int, int]:
    """(line, size, quotes): the next line of a binary file (b"" at the end) and its size in bytes,
    the line end not counted. A line over `limit` bytes is read through in bounded chunks and never
    held whole: it comes back as None, with the number of '"' in it (CSV's quoting needs it)."""
    line = handle.readline(limit + 2)  # + 2: room for a "\r\n", which does not count
    size = len(line.rstrip(b"\r\n"))
    if size <= limit:
        return line, size, 0
    quotes = line.count(b'"')
    while not line.endswith(b"\n"):
        line = handle.readline(_DRAIN_CHUNK)
        if not line:
            break
        size += len(line.rstrip(b"\r\n"))
        quotes += line.count(b'"')
    return None, size, quotes


def _read_jsonl(path: Path, max_bytes: int, utf8: _Utf8Tally) -> Iterator[tuple[str, object]]:
    with path.open("rb") as handle:
        number = 0
        while True:
            line, size, _ = _read_line(handle, max_bytes)
            if line == b"":
                return
            number += 1
            if line is None:
                yield f"{path}:{number}", OversizeRecord(size, max_bytes)
                continue
            text = utf8.decode(line, number)
            if text.strip():
                yield f"{path}:{number}", text


def _read_json(path: Path, max_bytes: int, utf8: _Utf8Tally) -> Iterator[tuple[str, object]]:
    """A JSON array of objects (or an object holding one list); a .json that is really JSON Lines
    is read as such. The array is parsed whole (RAM: a few times the file's size; JSON Lines is the
    format for big data); each record is measured before it goes on to tokenizing."""
    text = utf8.decode(path.read_bytes(), 1)
    try:
        data, json_lines = json.loads(text), False
    except json.JSONDecodeError as exc:
        if exc.msg != "Extra data":
            raise DataError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        data, json_lines = None, True  # several top-level values: JSON Lines under a .json name
    del text  # only the records are needed from here on
    if json_lines:
        utf8.reset()  # the same bytes are decoded again, line by line
        yield from _read_jsonl(path, max_bytes, utf8)
        return
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a JSON array of records (or an object with one list of them)")
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of records, got {type(data).__name__}")
    for index, record in enumerate(data):
        yield f"{path}: record {index}", _bounded(record, max_bytes)


class _CsvLines:
    """The decoded lines of a CSV file, as csv.reader reads them, with each row's size bounded.

    A row (one or more lines: quoted fields may hold newlines) that passes `max_bytes` is read
    through without being kept: each line of it that does not fit is replaced by a stand-in with the
    same quoting parity, so csv.reader still ends the row where the file does. `end_row()`, called
    after each row, returns that row's size if it was too big (else 0).
    """

    def __init__(self, handle, max_bytes: int, utf8: _Utf8Tally):
        self.handle, self.max_bytes, self.utf8 = handle, max_bytes, utf8
        self.number = 0  # lines read
        self.row_bytes, self.oversize = 0, False

    def __iter__(self):
        return self

    def __next__(self) -> str:
        line, size, quotes = _read_line(self.handle, max(self.max_bytes - self.row_bytes, 0))
        if line == b"":
            raise StopIteration
        self.number += 1
        self.row_bytes += size
        if line is None:
            self.oversize = True
            return '"' * (quotes % 2) + "\n"  # a '"' opens or closes a quoted field as the line did
        return self.utf8.decode(line, self.number)

    def end_row(self) -> int:
        size = self.row_bytes if self.oversize else 0
        self.row_bytes, self.oversize = 0, False
        return size


def _read_csv(path: Path, max_bytes: int, utf8: _Utf8Tally) -> Iterator[tuple[str, object]]:
    # _CsvLines bounds whole rows; csv's own per-field limit (128 KiB by default) must not stop a
    # field that fits in one.
    csv.field_size_limit(max(csv.field_size_limit(), max_bytes))
    with path.open("rb") as handle:
        lines = _CsvLines(handle, max_bytes, utf8)
        rows, header = csv.reader(lines), None
        while True:
            try:
                row = next(rows, None)
            except csv.Error as exc:
                raise DataError(f"{path}:{lines.number}: not valid CSV ({exc})") from None
            if row is None:
                return
            where, oversize = f"{path}:{lines.number}", lines.end_row()
            if oversize and header is None:
                raise DataError(f"{where}: the header row is {format_bytes(oversize)}, above "
                                f"data.max_record_bytes={max_bytes}")
            if header is None:
                header = row
            elif oversize:
                yield where, OversizeRecord(oversize, max_bytes)
            elif not row:  # a blank line
                continue
            elif len(row) != len(header):
                yield where, _BadRecord(f"the row has a different number of cells than the header's "
                                        f"{len(header)} columns {header}")
            else:
                yield where, dict(zip(header, row))


def _iter_table_batches(path: Path, batches, max_bytes: int) -> Iterator[tuple[str, object]]:
    """Rows of Arrow record batches as dicts; rows over max_bytes are measured in Arrow and never
    turned into Python objects."""
    import pyarrow as pa

    row = 0
    for batch in batches:
        sizes = _row_text_bytes(batch)
        fits = sizes <= max_bytes
        records = iter((batch if fits.all() else batch.filter(pa.array(fits))).to_pylist())
        for size, ok in zip(sizes.tolist(), fits.tolist()):
            yield f"{path}: row {row}", next(records) if ok else OversizeRecord(size, max_bytes)
            row += 1


def _row_text_bytes(batch):
    """Bytes of string and binary data in each row of an Arrow record batch (numpy int64)."""
    total = np.zeros(batch.num_rows, dtype=np.int64)
    for column in batch.columns:
        total += _array_text_bytes(column)
    return total


def _array_text_bytes(array):
    """Per row of an Arrow array: bytes of its strings, summed through lists and structs
    (a chat `messages` column is a list of structs of strings)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if pa.types.is_dictionary(kind):
        return _array_text_bytes(array.dictionary_decode())
    if pa.types.is_string_view(kind) or pa.types.is_binary_view(kind):  # binary_length has no kernel for views
        return _array_text_bytes(array.cast(pa.large_binary()))
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or pa.types.is_binary(kind) \
            or pa.types.is_large_binary(kind):
        return pc.binary_length(array).fill_null(0).to_numpy(zero_copy_only=False).astype(np.int64)
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind):
        inner = _array_text_bytes(array.flatten())
        parents = pc.list_parent_indices(array).to_numpy(zero_copy_only=False)
        return np.bincount(parents, weights=inner, minlength=len(array)).astype(np.int64)
    if pa.types.is_struct(kind):
        return sum((_array_text_bytes(child) for child in array.flatten()), np.zeros(len(array), dtype=np.int64))
    return np.zeros(len(array), dtype=np.int64)  # numbers and the like: a few bytes each


def _read_parquet(path: Path, max_bytes: int, utf8: _Utf8Tally) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    yield from _iter_table_batches(path, file.iter_batches(batch_size=1024), max_bytes)


def _read_arrow(path: Path, max_bytes: int, utf8: _Utf8Tally) -> Iterator[tuple[str, object]]:
    """Arrow IPC, file or stream format (`datasets` writes the stream format), memory-mapped."""
    import pyarrow as pa

    source = pa.memory_map(str(path))
    try:
        reader = pa.ipc.open_file(source)
        batches = (reader.get_batch(i) for i in range(reader.num_record_batches))
    except pa.ArrowInvalid:
        source.seek(0)
        try:
            batches = pa.ipc.open_stream(source)
        except pa.ArrowInvalid as exc:
            raise DataError(f"{path}: not an Arrow IPC file or stream ({exc})") from None
    yield from _iter_table_batches(path, batches, max_bytes)


def _iter_hub(name: str, split: str, max_bytes: int) -> Iterator[tuple[str, object]]:
    """A Hugging Face dataset by id, streamed (nothing is downloaded whole); `datasets` parses each
    record, so it is measured after that, before tokenizing."""
    datasets = require("datasets", "reading a Hugging Face dataset by name")
    try:
        stream = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as exc:  # network, missing dataset or split: say which
        raise DataError(f"data.path: cannot open the Hugging Face dataset '{name}' (split '{split}'): {exc}") from None
    for row, record in enumerate(stream):
        yield f"hf:{name}[{split}] row {row}", _bounded(record, max_bytes)


def _bounded(record: object, max_bytes: int) -> object:
    size = _text_bytes(record)
    return record if size <= max_bytes else OversizeRecord(size, max_bytes)


def _text_bytes(value: object) -> int:
    """Bytes of UTF-8 text in a parsed record: its strings (keys too) and bytes, nested ones included."""
    if isinstance(value, str):
        return len(value.encode("utf-8", errors="surrogatepass"))  # json.loads lets lone surrogates through
    if isinstance(value, bytes):
        return len(value)
    if isinstance(value, dict):
        return sum(_text_bytes(k) + _text_bytes(v) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return sum(_text_bytes(v) for v in value)
    return 0


class _BadRecord:
    """A record the reader already knows is malformed (kept in the stream so it can be counted)."""

    def __init__(self, problem: str):
        self.problem = problem


class OversizeRecord(_BadRecord):
    """Stands in for a record over data.max_record_bytes: only its size is kept."""

    def __init__(self, size: int, limit: int):
        super().__init__(f"record is {format_bytes(size)}, above data.max_record_bytes={limit}")
        self.size = size


def parse_item(where: str, item: object) -> dict:
    """A reader's item -> record dict, or DataError naming where and what is wrong."""
    if isinstance(item, _BadRecord):
        raise DataError(f"{where}: {item.problem}")
    if isinstance(item, str):
        try:
            item = json.loads(item)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(item, dict):
        raise DataError(f"{where}: expected a JSON object, got {type(item).__name__}")
    return item


READERS = {"jsonl": _read_jsonl, "json": _read_json, "csv": _read_csv, "parquet": _read_parquet,
           "arrow": _read_arrow}
