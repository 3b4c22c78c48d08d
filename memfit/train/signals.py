"""SIGTERM / SIGINT: finish the current step, write a checkpoint, exit cleanly.

Schedulers (Slurm, Kubernetes, spot-instance reclaim) send SIGTERM and wait a grace period before
SIGKILL; a user presses Ctrl-C. Stopping mid-step would lose the step and could tear a checkpoint
write, so the handler only sets a flag that the loop reads at the next step boundary. A second
signal of the same kind gets the default behaviour (Ctrl-C twice aborts at once).
"""

from __future__ import annotations

import logging
import signal
import threading

from memfit.errors import MemfitError

log = logging.getLogger(__name__)
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class TrainingStopped(MemfitError):
    """The run stopped on request after saving a checkpoint; `exit_status` follows the shell's 128 + signal."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_status = 128 + signum


class StopOnSignal:
    """Context manager: while active, SIGTERM/SIGINT set `self.signum` instead of killing the process.

    A no-op outside the main thread (Python only delivers signals there).
    """

    def __init__(self):
        self.signum: int | None = None
        self._previous: dict[int, object] = {}

    @property
    def requested(self) -> bool:
        return self.signum is not None

    @property
    def name(self) -> str:
        return signal.Signals(self.signum).name if self.signum else ""

    def _handle(self, signum, frame) -> None:
        self.signum = signum
        # Restore the previous handler so a second signal is not swallowed (Ctrl-C twice = abort now).
        signal.signal(signum, self._previous.get(signum, signal.SIG_DFL))
        log.warning("%s received: saving a checkpoint after the current step, then stopping "
                    "(send it again to abort without saving)", signal.Signals(signum).name)

    def __enter__(self) -> "StopOnSignal":
        if threading.current_thread() is threading.main_thread():
            for signum in SIGNALS:
                self._previous[signum] = signal.signal(signum, self._handle)
        return self

    def __exit__(self, *exc) -> None:
        for signum, handler in self._previous.items():
            signal.signal(signum, handler)
        self._previous.clear()
