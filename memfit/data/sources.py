"""Where records come from: files (jsonl, json, csv, parquet, Arrow), folders, globs, hub datasets.

Every reader yields `(where, item)` one record at a time, so nothing here holds a whole corpus in
memory (the one exception is a `.json` file holding a single JSON array, which must be parsed
whole; JSON Lines, CSV, Parquet and Arrow all stream). `where` names the record precisely
("file:line" for text formats, "file:row N" for columnar ones) so a bad one can be reported.

`item` is a dict, except for JSON Lines where it is the raw line: parsing happens later, in the
tokenizing worker processes, so the reading process stays cheap.
"""

from __future__ import annotations

import glob
import json
from pathlib import Path
from typing import Iterator

from memfit.data.demo import DEMO_PATH
from memfit.errors import MemfitError, require

SUFFIXES = {".jsonl": "jsonl", ".ndjson": "jsonl", ".json": "json", ".csv": "csv", ".parquet": "parquet",
            ".arrow": "arrow", ".feather": "arrow"}


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


def iter_raw(path: str, split: str = "train", limit: int | None = None) -> Iterator[tuple[str, object]]:
    """Every record of a data source, in a fixed order, as (where, dict-or-raw-jsonl-line)."""
    items = _iter_hub(path.removeprefix("hf:"), split) if is_hub_name(path) else _iter_files(resolve_files(path))
    for count, item in enumerate(items, start=1):
        yield item
        if limit and count >= limit:
            return


def _iter_files(files: list[Path]) -> Iterator[tuple[str, object]]:
    for file in files:
        yield from READERS[SUFFIXES[file.suffix]](file)


def _read_jsonl(path: Path) -> Iterator[tuple[str, object]]:
    with path.open(encoding="utf-8", errors="replace") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                yield f"{path}:{number}", line


def _read_json(path: Path) -> Iterator[tuple[str, object]]:
    """A JSON array of objects (or an object holding one list); a .json that is really JSON Lines
    is read as such."""
    text = path.read_text(encoding="utf-8", errors="replace")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        if exc.msg == "Extra data":  # several top-level values: JSON Lines under a .json name
            yield from _read_jsonl(path)
            return
        raise DataError(f"{path}:{exc.lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if isinstance(data, dict):
        lists = [v for v in data.values() if isinstance(v, list)]
        if len(lists) != 1:
            raise DataError(f"{path}: expected a JSON array of records (or an object with one list of them)")
        data = lists[0]
    if not isinstance(data, list):
        raise DataError(f"{path}: expected a JSON array of records, got {type(data).__name__}")
    for index, record in enumerate(data):
        yield f"{path}: record {index}", record


def _read_csv(path: Path) -> Iterator[tuple[str, object]]:
    import csv

    with path.open(encoding="utf-8", errors="replace", newline="") as handle:
        reader = csv.DictReader(handle)
        for row in reader:
            where = f"{path}:{reader.line_num}"
            if None in row or None in row.values():  # more / fewer cells than the header has
                yield where, _BadRecord(f"the row has a different number of cells than the header's "
                                        f"{len(reader.fieldnames)} columns {reader.fieldnames}")
            else:
                yield where, row


def _iter_table_batches(path: Path, batches) -> Iterator[tuple[str, object]]:
    row = 0
    for batch in batches:
        for record in batch.to_pylist():
            yield f"{path}: row {row}", record
            row += 1


def _read_parquet(path: Path) -> Iterator[tuple[str, object]]:
    import pyarrow.parquet as pq

    try:
        file = pq.ParquetFile(path)
    except Exception as exc:  # pyarrow raises several types for a damaged file
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    yield from _iter_table_batches(path, file.iter_batches(batch_size=1024))


def _read_arrow(path: Path) -> Iterator[tuple[str, object]]:
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
    yield from _iter_table_batches(path, batches)


def _iter_hub(name: str, split: str) -> Iterator[tuple[str, object]]:
    """A Hugging Face dataset by id, streamed (nothing is downloaded whole)."""
    datasets = require("datasets", "reading a Hugging Face dataset by name")
    try:
        stream = datasets.load_dataset(name, split=split, streaming=True)
    except Exception as exc:  # network, missing dataset or split: say which
        raise DataError(f"data.path: cannot open the Hugging Face dataset '{name}' (split '{split}'): {exc}") from None
    for row, record in enumerate(stream):
        yield f"hf:{name}[{split}] row {row}", record


class _BadRecord:
    """A record the reader already knows is malformed (kept in the stream so it can be counted)."""

    def __init__(self, problem: str):
        self.problem = problem


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
