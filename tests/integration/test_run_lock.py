"""One run per output folder, with real processes: two `python -m memfit train` started together into
one folder (fresh, or both resume=true), and a run killed with SIGKILL that must not block the next."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from memfit.config import load_config
from memfit.train import loop
from memfit.train.output_dir import RUN_INFO
from memfit.train.resolve import resolve_run

REPO = Path(__file__).resolve().parents[2]
SETTINGS = {"model": {"name": "memfit/tiny-llama", "init": "random"}, "precision": "fp32",
            "optim": {"lr": 1e-3, "warmup_steps": 0}, "batch": {"micro_batch": 2}, "max_steps": 4,
            "checkpoints": {"every": 2}, "logging": {"every": 1, "track_memory": False, "report_to": []},
            "device": "cpu", "seed": 3}


def _config(tmp: Path) -> Path:
    data = tmp / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i} of the lock test"}) + "\n" for i in range(12)))
    path = tmp / "run.yaml"
    path.write_text(yaml.safe_dump({**SETTINGS, "data": {"path": str(data), "format": "text", "seq_len": 32}}))
    return path


def _launch(config: Path, out: Path, *overrides: str, pause_s: str = "2") -> subprocess.Popen:
    """`python -m memfit train`; each checkpoint save pauses `pause_s` (memfit.checkpoint's test hook), so
    the winner of a race still holds the folder when the other process asks for it."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "MEMFIT_CHECKPOINT_PAUSE_S": pause_s}
    return subprocess.Popen([sys.executable, "-m", "memfit", "train", str(config), f"output_dir={out}", *overrides,
                             "--no-progress"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)


def _race(config: Path, out: Path, *overrides: str) -> None:
    """Start two identical runs at once: exactly one trains, the other is refused naming the first."""
    procs = [_launch(config, out, *overrides) for _ in range(2)]
    outputs = [proc.communicate(timeout=600)[0] for proc in procs]
    assert sorted(proc.returncode for proc in procs) == [0, 2], outputs
    winner, loser = (0, 1) if procs[0].returncode == 0 else (1, 0)
    refusal = [line for line in outputs[loser].splitlines() if line.startswith("memfit: error: ")]
    assert len(refusal) == 1 and "Traceback" not in outputs[loser], outputs[loser]
    assert refusal[0].startswith(f"memfit: error: output_dir {out} is in use by another memfit run "
                                 f"(pid {procs[winner].pid} on host "), refusal[0]
    assert "wait for it to end or stop it, or choose another output_dir" in refusal[0]
    assert not (out / RUN_INFO).exists()  # the winner removed it when it ended


def _steps(out: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.slow  # two processes at once: about 40 s on the loaded 2-core machine
def test_two_fresh_runs_into_one_folder_one_trains_the_other_is_refused(tmp_path):
    config, out = _config(tmp_path), tmp_path / "run"
    _race(config, out)
    assert _steps(out) == [1, 2, 3, 4]  # every step once: nothing of the refused run got in
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step-00000002", "step-00000004"]


@pytest.mark.slow
def test_two_resumes_of_one_run_one_trains_the_other_is_refused(tmp_path):
    config, out = _config(tmp_path), tmp_path / "run"
    loop.train(resolve_run(load_config(config, [f"output_dir={out}", "max_steps=2"])), progress=False)
    _race(config, out, "resume=true")
    assert _steps(out) == [1, 2, 3, 4]


@pytest.mark.slow
def test_a_run_killed_with_sigkill_does_not_block_the_next(tmp_path):
    config, out = _config(tmp_path), tmp_path / "run"
    proc = _launch(config, out, pause_s="60")  # holds still inside its first checkpoint save
    deadline = time.monotonic() + 300
    while not list(out.glob("checkpoints/.tmp-step-*/manifest.json")):
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[0]
        time.sleep(0.05)
    assert json.loads((out / RUN_INFO).read_text())["pid"] == proc.pid
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / RUN_INFO).exists()  # left behind: the OS released the lock, the file stays
    result = loop.train(resolve_run(load_config(config, [f"output_dir={out}", "resume=true"])), progress=False)
    assert len(result.losses) == 4 and _steps(out) == [1, 2, 3, 4]
    assert not (out / RUN_INFO).exists()
