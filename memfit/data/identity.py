"""What the training data is, so that a resumed run can tell whether it is still the same data.

A checkpoint keeps a position in the data (epoch, examples served), which means something only
for the records it was counted on. `data_identity(cfg)` describes those records:

- a file, a folder or a glob: for each file, its path (as `data.path` names it), size in bytes,
  modification time and a sha256 of its first and last 1 MiB (the whole file up to 2 MiB);
- `builtin:demo`: the same for the shipped file, named `builtin:demo` (not by where memfit is installed);
- `data.prepared_dir`: the same for its token file, the rows the position counts;
- a hub dataset: its name and split (memfit cannot see a hub dataset's content without reading it).

Two identities are the same data when the same files have the same sizes and hashes. The
modification time is recorded but not compared: `touch`, a copy or a checkout that keeps the
content must not block a resume. The price: an edit inside a file over 2 MiB that keeps its size
and its first and last MiB goes unnoticed.
"""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

from memfit.data.prepare import DATA_FILE
from memfit.data.sources import DataError, is_hub_name, resolve_files

BLOCK_BYTES = 1 << 20  # hashed at each end of a file


def data_identity(cfg) -> dict:
    """The identity of the data `cfg` trains on (a JSON-able dict)."""
    data = cfg.data
    if data.prepared_dir:
        tokens = Path(data.prepared_dir) / DATA_FILE
        return {"source": f"prepared_dir {data.prepared_dir}",
                "files": {str(tokens): file_identity(tokens.expanduser())}}
    if data.path.startswith("builtin:"):
        return {"source": data.path, "files": {data.path: file_identity(resolve_files(data.path)[0])}}
    if is_hub_name(data.path):
        return {"source": f"hub dataset {data.path.removeprefix('hf:')} split {data.split}", "files": {}}
    return {"source": data.path, "files": {str(path): file_identity(path) for path in resolve_files(data.path)}}


def file_identity(path: Path) -> dict:
    try:
        stat = os.stat(path)
        ends = _ends_sha256(str(path), stat.st_size, stat.st_mtime_ns, stat.st_ino)
    except OSError as exc:
        raise DataError(f"training data {path} cannot be read ({exc.strerror or exc})") from None
    return {"bytes": stat.st_size, "mtime": stat.st_mtime, "sha256_ends": ends}


@functools.lru_cache(maxsize=4096)
def _ends_sha256(path: str, size: int, mtime_ns: int, inode: int) -> str:
    """sha256 of the first and last BLOCK_BYTES (each byte once); cached per file version, since a
    resume computes it twice (the check, then the record of the resumed run)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        digest.update(handle.read(BLOCK_BYTES))
        if size > BLOCK_BYTES:
            handle.seek(max(BLOCK_BYTES, size - BLOCK_BYTES))
            digest.update(handle.read(BLOCK_BYTES))
    return digest.hexdigest()


def identity_changes(before: dict, now: dict) -> list[str]:
    """What differs between two identities, one phrase per file; empty when it is the same data.
    Modification times alone are not a change (see the module's docstring)."""
    if before.get("source") != now.get("source"):
        return [f"it was {before.get('source')}, it is {now.get('source')}"]
    old, new = before.get("files", {}), now.get("files", {})
    changes = [f"{name} is gone" for name in old if name not in new]
    changes += [f"{name} is new" for name in new if name not in old]
    for name in (name for name in new if name in old):
        if old[name].get("bytes") != new[name]["bytes"]:
            changes.append(f"{name} has {_count(new[name]['bytes'])} bytes, had {_count(old[name].get('bytes'))}")
        elif old[name].get("sha256_ends") != new[name]["sha256_ends"]:
            changes.append(f"{name} has other content (same size)")
    return changes


def _count(value) -> str:
    return f"{value:,}" if isinstance(value, int) else str(value)
