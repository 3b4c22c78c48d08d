"""RUN_DIR/errors.log: the tracebacks a run's one-line error messages leave out.

A background thread that dies (TensorBoard's event writer on a full disk, a data prefetcher) prints
its traceback in the middle of the terminal, and the main thread, which notices the failure and
says in one line what was kept, is no longer what the user reads last. While a run trains,
`ThreadErrorsToLog` sends those tracebacks to errors.log instead, with one log line naming the
thread; an evaluation that fails records its traceback there too (`write_traceback`).
"""

from __future__ import annotations

import logging
import threading
import time
import traceback
from pathlib import Path

log = logging.getLogger(__name__)

ERRORS_LOG = "errors.log"


def first_line(exc: BaseException) -> str:
    """`Type: message` of an exception, its first line only."""
    text = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__


def write_traceback(out: Path, title: str, exc: BaseException) -> Path | None:
    """Append `exc`'s traceback to out/errors.log under `title`; the file, or None when it cannot be
    written (a full disk: the caller's message still says what failed)."""
    path = Path(out) / ERRORS_LOG
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    text = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    try:
        with open(path, "a") as file:
            file.write(f"--- {stamp} {title}\n{text}\n")
    except OSError as write_exc:
        _drop_if_empty(path)  # created, then nothing fitted: an empty log would only puzzle
        log.warning("%s: %s (its traceback could not be written to %s: %s)", title, first_line(exc), path,
                    write_exc.strerror or write_exc)
        return None
    return path


def _drop_if_empty(path: Path) -> None:
    try:
        if path.stat().st_size == 0:
            path.unlink()
    except OSError:
        pass


class ThreadErrorsToLog:
    """A context manager: tracebacks of threads that die inside it go to out/errors.log, not stderr."""

    def __init__(self, out: Path):
        self.out = Path(out)
        self.previous = None

    def __enter__(self) -> "ThreadErrorsToLog":
        self.previous, threading.excepthook = threading.excepthook, self._record
        return self

    def __exit__(self, *exc) -> None:
        threading.excepthook = self.previous

    def _record(self, args: threading.ExceptHookArgs) -> None:
        if args.exc_type is SystemExit:  # as the default hook: a thread may end itself that way
            return
        exc = args.exc_value if args.exc_value is not None else args.exc_type()
        title = f"background thread {args.thread.name if args.thread else '?'} failed"
        if write_traceback(self.out, title, exc) is not None:
            log.warning("%s: %s (traceback in %s)", title, first_line(exc), self.out / ERRORS_LOG)
