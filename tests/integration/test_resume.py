"""Resume, signals, non-finite steps, and kill -9 at random points.

All runs are fp32 on CPU with the same seed, so "the same" means bitwise: losses compared with ==,
weights with torch.equal.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import memfit.train.loop as loop
from memfit.config import load_config
from memfit.errors import MemfitError
from memfit.checkpoint import PAUSE_ENV, checkpoint_dirs, verify
from memfit.step import training_step
from memfit.train.signals import TrainingStopped
from memfit.train.resolve import resolve_run

REPO = Path(__file__).resolve().parents[2]
REAL_STEP = training_step  # the loop runs it through memfit.step.tracked_steps


def write_texts(path: Path, n: int = 24, seed: int = 3) -> Path:
    """Short distinct text records: cheap steps on a loaded 2-core machine."""
    rng = random.Random(seed)
    words = "apple river tensor window zebra memory planet silver kernel lemon".split()
    path.write_text("".join(json.dumps({"text": f"{i}: " + " ".join(rng.choices(words, k=3))}) + "\n"
                            for i in range(n)))
    return path


def run_settings(tmp_path: Path, **extra) -> dict:
    settings = {"model": {"name": "memfit/tiny-llama", "init": "random"}, "data": {"path": str(write_texts(tmp_path / "texts.jsonl")),
                                                       "format": "text"},
                "precision": "fp32", "optimizer": "adamw", "micro_batch": 4, "seq_len": 48, "lr": 3e-3,
                "warmup_steps": 2, "max_steps": 12, "save_every": 2, "keep_checkpoints": 2, "log_every": 1,
                "device": "cpu", "track_memory": False, "seed": 7}
    settings.update(extra)
    return settings


def config(settings: dict, output_dir: Path, *overrides: str):
    import yaml

    path = output_dir.parent / f"{output_dir.name}.yaml"
    path.write_text(yaml.safe_dump(settings))
    return load_config(path, [f"output_dir={output_dir}", *overrides]), path


def metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]


def weights(run: Path) -> dict[str, torch.Tensor]:
    return load_file(run / "model.safetensors")


def assert_same_weights(a: Path, b: Path) -> None:
    wa, wb = weights(a), weights(b)
    assert wa.keys() == wb.keys()
    assert all(torch.equal(wa[k], wb[k]) for k in wa), "final weights differ"


class Recorder:
    """Wraps training_step: records each step's sequences; can signal or poison chosen steps."""

    def __init__(self, monkeypatch, signal_at: int | None = None, nan_steps=()):
        self.real, self.signal_at, self.nan_steps = REAL_STEP, signal_at, set(nan_steps)
        self.sequences: list[list[tuple]] = []
        self.weights_before: list[torch.Tensor] = []
        monkeypatch.setattr("memfit.step.training_step", self)

    def __call__(self, model, optimizer, micro_batches, *args, **kwargs):
        step = len(self.sequences) + 1
        self.sequences.append([tuple(ids[mask.bool()].tolist()) for mb in micro_batches
                               for ids, mask in zip(mb["input_ids"], mb["attention_mask"])])
        self.weights_before.append(next(model.parameters()).detach().clone())
        if step == self.signal_at:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-step, like a scheduler's preemption
        hook = None
        if step in self.nan_steps:  # NaN out of the final norm: the loss and every gradient become NaN
            hook = model.model.norm.register_forward_hook(lambda module, args, out: out * float("nan"))
        try:
            return self.real(model, optimizer, micro_batches, *args, **kwargs)
        finally:
            if hook:
                hook.remove()


@pytest.mark.slow  # three 12-step runs: 80 s on the loaded 2-core machine
def test_sigterm_then_resume_matches_uninterrupted_run(tmp_path, monkeypatch):
    settings = run_settings(tmp_path)
    straight = Recorder(monkeypatch)
    reference = loop.train(resolve_run(config(settings, tmp_path / "reference")[0]), progress=False)

    interrupted = Recorder(monkeypatch, signal_at=7)
    cfg, _ = config(settings, tmp_path / "run")
    with pytest.raises(TrainingStopped, match="SIGTERM received; checkpoint of step 7 saved") as stopped:
        loop.train(resolve_run(cfg), progress=False)
    assert stopped.value.exit_status == 128 + signal.SIGTERM
    assert [p.name for p in checkpoint_dirs(tmp_path / "run" / "checkpoints")] == ["step-00000007", "step-00000006"]
    assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL  # handler restored after the run

    with pytest.raises(MemfitError, match="already holds a run"):  # without resume the folder is refused
        loop.train(resolve_run(cfg), progress=False)
    resumed_steps = Recorder(monkeypatch)
    resumed = loop.train(resolve_run(config(settings, tmp_path / "run", "resume=true")[0]), progress=False)

    assert resumed.losses == reference.losses  # bitwise, the 7 steps before the stop included
    assert [m["step"] for m in metrics(tmp_path / "run")] == list(range(1, 13))  # appended, no duplicates
    assert [m["loss"] for m in metrics(tmp_path / "run")] == reference.losses
    assert_same_weights(tmp_path / "reference", tmp_path / "run")
    # Same batches in the same order, and each epoch (24 examples / 4 = 6 steps) sees every example once.
    assert interrupted.sequences + resumed_steps.sequences == straight.sequences
    assert len(resumed_steps.sequences) == 5
    every_example = Counter(seq for step in straight.sequences[:6] for seq in step)
    for epoch in range(2):
        seen = Counter(seq for step in straight.sequences[6 * epoch:6 * epoch + 6] for seq in step)
        assert seen == every_example and len(seen) == 24


def test_resume_refuses_a_different_run_and_a_contradiction(tmp_path):
    settings = run_settings(tmp_path, max_steps=2)
    cfg, _ = config(settings, tmp_path / "run")
    loop.train(resolve_run(cfg), progress=False)
    before = {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()}
    with pytest.raises(MemfitError, match=r"describes a different run \(data.seq_len: 48 there, 64 now\)"):
        loop.train(resolve_run(config(settings, tmp_path / "run", "resume=true", "data.seq_len=64")[0]), progress=False)
    with pytest.raises(MemfitError, match="set only one"):
        loop.train(resolve_run(config(settings, tmp_path / "run", "resume=true", "overwrite=true")[0]), progress=False)
    assert {p: p.read_bytes() for p in (tmp_path / "run").rglob("*") if p.is_file()} == before


def test_nonfinite_step_is_skipped_and_counted(tmp_path, monkeypatch):
    recorder = Recorder(monkeypatch, nan_steps={3})
    result = loop.train(resolve_run(config(run_settings(tmp_path, max_steps=5), tmp_path / "run")[0]), progress=False)
    rows = metrics(tmp_path / "run")
    assert [r["nonfinite"] for r in rows] == [False, False, True, False, False]
    assert rows[2]["skipped"] and result.losses[2] != result.losses[2]  # NaN recorded, update skipped
    assert torch.equal(recorder.weights_before[2], recorder.weights_before[3])  # step 3 changed nothing
    assert not torch.equal(recorder.weights_before[3], recorder.weights_before[4])  # step 4 trained again
    assert all(torch.isfinite(w).all() for w in weights(tmp_path / "run").values())


def test_nonfinite_streak_stops_the_run_and_keeps_the_last_good_checkpoint(tmp_path, monkeypatch):
    Recorder(monkeypatch, nan_steps=range(5, 13))
    cfg, _ = config(run_settings(tmp_path, max_nonfinite_steps=3), tmp_path / "run")
    with pytest.raises(MemfitError, match=r"step 7: loss or gradients were NaN/inf for 3 steps in a row "
                                          r"\(steps 5-7, optim.max_nonfinite_steps=3\); stopped. Last good checkpoint: "
                                          r".*step-00000004"):
        loop.train(resolve_run(cfg), progress=False)
    good = checkpoint_dirs(tmp_path / "run" / "checkpoints")
    assert [p.name for p in good] == ["step-00000004", "step-00000002"] and verify(good[0]) is None
    assert all(torch.isfinite(w).all() for w in load_file(good[0] / "model.safetensors").values())


def _launch(config_path: Path, out: Path, env_extra: dict | None = None) -> subprocess.Popen:
    env = {**os.environ, "PYTHONPATH": str(REPO), **(env_extra or {})}
    return subprocess.Popen([sys.executable, "-m", "memfit", "train", str(config_path), f"output_dir={out}",
                             "resume=true", "--no-progress"], cwd=REPO, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _newest_good(out: Path) -> str | None:
    root = out / "checkpoints"
    good = [p.name for p in checkpoint_dirs(root) if verify(p) is None] if root.is_dir() else []
    return good[0] if good else None


def _steps_logged(path: Path) -> int:
    return path.read_text().count("\n") if path.exists() else 0


def _wait_for(condition, proc: subprocess.Popen, timeout_s: float = 120.0) -> bool:
    """Poll until condition() holds (True) or the process ends (False)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        if proc.poll() is not None:
            return False
        time.sleep(0.02)
    raise AssertionError("timed out waiting for the training subprocess")


@pytest.mark.slow
def test_kill_9_at_random_points_then_resume_gives_the_uninterrupted_weights(tmp_path):
    """Start `memfit train ... resume=true`, SIGKILL it, repeat; the first kill lands inside a checkpoint
    write (MEMFIT_CHECKPOINT_PAUSE_S holds the process between the temporary folder and the rename),
    one round damages the newest checkpoint by hand, the others land at seeded random times."""
    settings = run_settings(tmp_path, max_steps=24)
    reference = loop.train(resolve_run(config(settings, tmp_path / "reference")[0]), progress=False)
    _, config_path = config(settings, tmp_path / "run")
    out, rng, kills = tmp_path / "run", random.Random(2026), 0
    metrics_file = out / "metrics.jsonl"

    # 1. Killed inside a checkpoint write: the temporary folder is complete, the rename has not happened.
    proc = _launch(config_path, out, {PAUSE_ENV: "60"})
    assert _wait_for(lambda: any((out / "checkpoints").glob(".tmp-step-*/manifest.json")), proc)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    kills += 1
    assert not (out / "checkpoints" / "step-00000002").exists()  # never published

    # 2. Random kills: some while importing/building, most while training; one round damages a checkpoint.
    outputs, damaged = [], False  # (newest good checkpoint at launch, process output)
    for round_ in range(5):
        expected = _newest_good(out)
        if not damaged and len(checkpoint_dirs(out / "checkpoints")) == 2:
            newest = checkpoint_dirs(out / "checkpoints")[0]
            (newest / "model.safetensors").write_bytes(b"torn")  # as if the disk lost the end of the file
            expected, damaged = _newest_good(out), newest.name
            print(f"damaged {newest.name} by hand")
        proc = _launch(config_path, out)
        when = "during start-up" if rng.random() < 0.2 else "during training"
        if when == "during start-up":
            time.sleep(rng.uniform(0.5, 4.0))  # before or after the resume
        else:  # during training, a random number of steps in: counted, not timed (the machine may be busy)
            done = int(expected.split("-")[1]) if expected else 0  # metrics are cut back to it on resume
            target = done + rng.randint(1, 6)
            if _wait_for(lambda: _steps_logged(metrics_file) >= target, proc):
                time.sleep(rng.uniform(0.0, 0.3))
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGKILL)
            kills += 1
        outputs.append((expected, proc.communicate()[0]))
        print(f"round {round_}: killed {when}; newest good checkpoint at launch {expected}, exit {proc.returncode}, "
              f"{_steps_logged(metrics_file)} metrics lines")
        print("".join(f"    {line}\n" for line in outputs[-1][1].splitlines() if "damaged" in line or "resuming" in line))

    # 3. Run to the end.
    proc = _launch(config_path, out)
    outputs.append((_newest_good(out), proc.communicate(timeout=300)[0]))
    assert proc.returncode == 0, outputs[-1][1]
    for expected, output in outputs:  # every resume that got that far started from the newest good one
        if expected and "resuming from" in output:
            assert f"resuming from {out / 'checkpoints' / expected} " in output, output
    assert "resuming from" in outputs[-1][1] or outputs[-1][0] is None
    assert not damaged or any("is damaged" in output for _, output in outputs)
    assert kills >= 4
    assert [m["step"] for m in metrics(out)] == list(range(1, 25))
    assert [m["loss"] for m in metrics(out)] == reference.losses
    assert_same_weights(tmp_path / "reference", out)
