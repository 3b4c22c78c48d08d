"""One run per output folder: an exclusive lock held for the whole life of a run.

`memfit train` takes an exclusive `flock` on the output folder itself (on its directory file
descriptor, so no lock file is needed) BEFORE the folder is judged ("already holds a run", the
resume checks): checking the folder and claiming it are one atomic step, so two processes started
together can never both pass the checks. The OS drops the lock when the process ends, however it
ends, so a crashed or killed run never blocks the next one.

While it holds the lock, a run keeps RUN_INFO (pid, host, command, start time) in the folder so
that a second process can say which run is there. It is removed when the run ends; one left
behind by kill -9 is simply overwritten by the next run (the lock, not the file, decides).
If the run fails before it wrote anything, the folders it created are removed again.

Under torchrun only rank 0 takes the lock: the other ranks write nothing of their own there.
"""

from __future__ import annotations

import json
import os
import shlex
import socket
import sys
import time
from contextlib import contextmanager
from pathlib import Path

from memfit.train.output_dir import RUN_INFO, OutputDirError, check_location

try:
    import fcntl
except ImportError:  # Windows: no flock; runs are not protected from each other there
    fcntl = None


class OutputDirBusyError(OutputDirError):
    """Another memfit process holds the output folder."""


@contextmanager
def hold_output_dir(cfg):
    """Hold the output folder of `cfg` exclusively until the block ends (rank 0 only)."""
    if fcntl is None or os.environ.get("RANK", "0") != "0":
        yield
        return
    check_location(cfg)  # an output_dir that cannot be a folder is refused before one is made
    out = Path(cfg.output_dir).expanduser()
    created = _make_folders(out)
    fd = _lock(out)
    info = out / RUN_INFO
    try:
        _write_info(info)
        yield
    except BaseException:
        info.unlink(missing_ok=True)
        for folder in reversed(created):  # refused before writing anything: leave no empty folder behind
            try:
                folder.rmdir()
            except OSError:
                break
        raise
    else:
        info.unlink(missing_ok=True)
    finally:
        os.close(fd)  # releases the lock


def _make_folders(out: Path) -> list[Path]:
    """Make `out` and any missing parents; the ones this call created, outermost first."""
    missing = [p for p in [out, *out.parents] if not p.exists()][::-1]
    created = []
    for folder in missing:
        try:
            folder.mkdir()
            created.append(folder)
        except FileExistsError:  # another process made it in between
            pass
    return created


def _lock(out: Path, tries: int = 3) -> int:
    """An open descriptor of `out` holding its exclusive lock. Retried when the folder was replaced
    between opening and locking it (a run that just failed removed the folder it had made)."""
    for _ in range(tries):
        fd = os.open(out, os.O_RDONLY | os.O_DIRECTORY)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OutputDirBusyError(busy_message(out)) from None
        except BaseException:
            os.close(fd)
            raise
        try:
            if os.stat(out).st_ino == os.fstat(fd).st_ino:
                return fd
        except FileNotFoundError:
            _make_folders(out)
        os.close(fd)
    raise OutputDirError(f"output_dir {out} keeps being removed and made again by another process; "
                         "choose another output_dir")


def _write_info(path: Path) -> None:
    info = {"pid": os.getpid(), "host": socket.gethostname(), "command": _command(),
            "started": time.strftime("%Y-%m-%d %H:%M:%S %Z")}
    path.write_text(json.dumps(info) + "\n")  # read only while the lock is held, so no rename is needed


def _command() -> str:
    program = "python -m memfit" if sys.argv and sys.argv[0].endswith(f"memfit{os.sep}__main__.py") \
        else Path(sys.argv[0]).name if sys.argv else "python"
    text = shlex.join([program, *sys.argv[1:]])
    return text if len(text) <= 300 else text[:297] + "..."


def busy_message(out: Path, wait_s: float = 2.0) -> str:
    """The refusal a second process gets, naming the run that holds `out`. The holder writes RUN_INFO
    just after taking the lock, so a process refused at that very moment waits for it briefly."""
    deadline = time.monotonic() + wait_s
    while True:
        try:
            info = json.loads((out / RUN_INFO).read_text())
            who = f"pid {info['pid']} on host {info['host']}, started {info['started']}: {info['command']}"
            break
        except (OSError, ValueError, KeyError, TypeError):  # not written yet, or half written
            if time.monotonic() > deadline:
                who = "it has not said which"
                break
            time.sleep(0.05)
    return (f"output_dir {out} is in use by another memfit run ({who}); wait for it to end or stop it, "
            "or choose another output_dir")
