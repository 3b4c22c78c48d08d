"""A metrics sink that cannot write (TensorBoard on a full disk) stops the run with memfit's one line,
last and alone: the writer thread's traceback goes to RUN_DIR/errors.log, not the terminal."""

from __future__ import annotations

import errno
import json
import logging
import os
import threading
import time
from pathlib import Path

import pytest
import yaml
from tensorboard.summary.writer.record_writer import RecordWriter

from memfit.checkpoint import checkpoint_dirs, verify
from memfit.cli import main
from memfit.train.error_log import ERRORS_LOG, ThreadErrorsToLog
from memfit.train.metrics import MetricsLog, OutputWriteError

RECORD = {"step": 3, "loss": 2.5, "lr": 1e-3}
ENOSPC = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


@pytest.fixture
def disk(monkeypatch):
    """TensorBoard's event files: their writes fail once `disk["full"]` is set, as on a full disk.
    Threads' tracebacks print to stderr as they do outside pytest (which would catch them itself)."""
    state = {"full": False}
    real = RecordWriter.write

    def write(self, data):
        if state["full"]:
            raise ENOSPC
        real(self, data)

    monkeypatch.setattr(RecordWriter, "write", write)
    monkeypatch.setattr(threading, "excepthook", threading.__excepthook__)
    return state


def _wait_for(path: Path, seconds: float = 5.0) -> str:
    """The file's text once it exists: the dying thread writes it while the main thread goes on."""
    deadline = time.monotonic() + seconds
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.01)
    return path.read_text()


def test_tensorboard_on_a_full_disk_is_one_error_naming_it(tmp_path, disk, capfd):
    with ThreadErrorsToLog(tmp_path):
        with pytest.raises(OutputWriteError) as raised:
            with MetricsLog(tmp_path, ["tensorboard"], {}) as log:
                log.write(RECORD)
                disk["full"] = True
                log.write({**RECORD, "step": 4})
    assert str(raised.value) == f"writing the metrics of step 4 to {tmp_path / 'tensorboard'} failed: " \
                                "No space left on device"
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [3, 4]
    logged = _wait_for(tmp_path / ERRORS_LOG)
    assert "background thread" in logged and "Traceback" in logged and "[Errno 28]" in logged
    stderr = capfd.readouterr().err
    assert "Exception in thread" not in stderr and "Traceback" not in stderr
    assert threading.excepthook is threading.__excepthook__  # put back


def test_a_thread_traceback_that_cannot_be_written_is_one_log_line(tmp_path, disk, capfd, caplog):
    folder = tmp_path / "gone"  # errors.log cannot be created here
    with ThreadErrorsToLog(folder):
        thread = threading.Thread(target=lambda: 1 / 0, name="prefetcher")
        thread.start()
        thread.join()
    assert "Traceback" not in capfd.readouterr().err
    assert [r.getMessage().split(" (")[0] for r in caplog.records] == [
        "background thread prefetcher failed: ZeroDivisionError: division by zero"]
    assert "could not be written" in caplog.records[0].getMessage()


def test_closing_after_a_clean_run_warns_instead_of_failing(tmp_path, caplog):
    class Full:
        def close(self):
            raise ENOSPC

    with caplog.at_level(logging.WARNING):
        with MetricsLog(tmp_path, [], {}) as log:
            log.write(RECORD)
            log.file.close()
            log.file = Full()
    assert "the last metrics may be missing" in caplog.text and "No space left on device" in caplog.text


def test_train_with_the_default_sink_on_a_full_disk_ends_with_the_one_line(tmp_path, disk, capsys, monkeypatch):
    real_write = MetricsLog.write

    def write(self, record, prefix="train"):
        disk["full"] = disk["full"] or (record["step"] == 2 and prefix == "train")
        real_write(self, record, prefix)

    monkeypatch.setattr(MetricsLog, "write", write)
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i} of the test data"}) + "\n" for i in range(8)))
    (tmp_path / "config.yaml").write_text(yaml.safe_dump({
        "model": {"name": "memfit/tiny-llama", "init": "random"},
        "data": {"path": str(data), "format": "text", "seq_len": 32}, "precision": "fp32",
        "optim": {"name": "adamw", "warmup_steps": 0}, "batch": {"micro_batch": 2}, "max_steps": 3,
        "logging": {"every": 1, "track_memory": False}, "device": "cpu"}))  # report_to: the default, TensorBoard
    capsys.readouterr()
    status = main(["train", str(tmp_path / "config.yaml"), f"output_dir={tmp_path / 'run'}", "--no-progress"])
    stderr = capsys.readouterr().err
    run = tmp_path / "run"
    assert status == 2
    assert "Traceback" not in stderr and "Exception in thread" not in stderr
    assert stderr.rstrip("\n").splitlines()[-1] == (
        f"memfit: error: writing the metrics of step 2 to {run / 'tensorboard'} failed: No space left on device; "
        f"training stopped at step 2: checkpoint of step 2 saved in {run / 'checkpoints' / 'step-00000002'}. Free "
        "space or fix the output folder, then continue with resume=true")
    kept = checkpoint_dirs(run / "checkpoints")
    assert [p.name for p in kept] == ["step-00000002"] and verify(kept[0]) is None
    assert "Traceback" in _wait_for(run / ERRORS_LOG)
