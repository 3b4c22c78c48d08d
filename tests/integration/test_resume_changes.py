"""Resume after a change, end to end on the tiny model: a lower lr after a non-finite stop takes effect,
a finished run is left alone until max_steps is raised, and changed data is refused (or, when asked,
continued with a warning)."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest

from memfit.cli import main
from memfit.config import load_config
from memfit.errors import MemfitError
from memfit.step import training_step
from memfit.train import loop
from memfit.train.output_dir import DATA_IDENTITY_FILE, RunAlreadyFinished
from memfit.train.resolve import resolve_run

REAL_STEP = training_step  # the loop runs it through memfit.step.tracked_steps


def _data(path: Path, word: str = "record", n: int = 12) -> Path:
    path.write_text("".join(json.dumps({"text": f"{word} {i} of the resume test"}) + "\n" for i in range(n)))
    return path


def _overrides(tmp: Path, *extra: str) -> list[str]:
    data = tmp / "texts.jsonl"
    if not data.exists():
        _data(data)
    return [f"output_dir={tmp / 'run'}", "model.init=random", f"data.path={data}", "data.format=text",
            "data.seq_len=32", "batch.micro_batch=2", "optim.lr=0.001", "optim.warmup_steps=0",
            "optim.schedule=constant", "max_steps=4", "checkpoints.every=2", "logging.every=1",
            "logging.track_memory=false", "logging.report_to=[]", "device=cpu", *extra]


def _train(tmp: Path, *extra: str):
    return loop.train(resolve_run(load_config(None, _overrides(tmp, *extra))), progress=False)


def _metrics(tmp: Path) -> list[dict]:
    return [json.loads(line) for line in (tmp / "run" / "metrics.jsonl").read_text().splitlines()]


def _snapshot(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _nan_at(monkeypatch, steps: set[int]) -> None:
    """Training steps whose loss and gradients are NaN (out of the final norm), counted from 1."""
    calls = []

    def step(model, *args, **kwargs):
        calls.append(1)
        hook = model.model.norm.register_forward_hook(lambda m, a, out: out * float("nan")) \
            if len(calls) in steps else None
        try:
            return REAL_STEP(model, *args, **kwargs)
        finally:
            if hook:
                hook.remove()

    monkeypatch.setattr("memfit.step.training_step", step)


@pytest.mark.slow  # three short runs: about 30 s on the loaded 2-core machine
def test_after_a_nonfinite_stop_a_lower_lr_resumes_and_takes_effect(tmp_path, monkeypatch, caplog):
    _nan_at(monkeypatch, {3, 4})
    with pytest.raises(MemfitError, match=r"Last good checkpoint: .*step-00000002\. Lower lr"):
        _train(tmp_path, "optim.max_nonfinite_steps=2")
    monkeypatch.setattr("memfit.step.training_step", REAL_STEP)
    with caplog.at_level(logging.WARNING):
        result = _train(tmp_path, "resume=true", "optim.lr=0.0003", "optim.max_nonfinite_steps=2")
    assert "resume: optim.lr 0.001 -> 0.0003" in caplog.text
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert [r["lr"] for r in rows] == [0.001, 0.001, 0.0003, 0.0003]  # step 4: the scheduler's base lr is new too
    assert all(loss == loss for loss in result.losses)
    # The run's record now holds the lr it trained with: resuming with the old one is a change again.
    assert load_config(tmp_path / "run" / "run_config.yaml").optim.lr == 0.0003


@pytest.mark.slow
def test_a_finished_run_is_left_alone_until_max_steps_is_raised(tmp_path, capsys):
    _train(tmp_path)
    before = _snapshot(tmp_path)
    with pytest.raises(RunAlreadyFinished):
        _train(tmp_path, "resume=true")
    capsys.readouterr()
    (tmp_path / "run.yaml").write_text("{}\n")
    status = main(["train", str(tmp_path / "run.yaml"), *_overrides(tmp_path, "resume=true"), "--no-progress"])
    assert status == 0
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        f"memfit: the run in {tmp_path / 'run'} already finished at step 4 (max_steps 4); nothing to do: "
        "raise max_steps to train further")
    assert _snapshot(tmp_path) == {**before, tmp_path / "run.yaml": b"{}\n"}  # the report was not replaced

    result = _train(tmp_path, "resume=true", "max_steps=6")
    assert len(result.losses) == 6 and [r["step"] for r in _metrics(tmp_path)] == list(range(1, 7))


@pytest.mark.slow
def test_a_run_stopped_before_its_final_outputs_writes_them_on_resume(tmp_path, monkeypatch):
    def killed(*args, **kwargs):
        raise KeyboardInterrupt  # as if the process died after the last checkpoint

    monkeypatch.setattr(loop, "finish", killed)
    with pytest.raises(KeyboardInterrupt):
        _train(tmp_path)
    monkeypatch.undo()
    assert not (tmp_path / "run" / "memory_report.txt").exists()
    _train(tmp_path, "resume=true")  # not finished: the final outputs are written now
    assert (tmp_path / "run" / "memory_report.txt").exists() and (tmp_path / "run" / "model.safetensors").exists()
    with pytest.raises(RunAlreadyFinished):
        _train(tmp_path, "resume=true")


@pytest.mark.slow
def test_changed_data_is_refused_unless_continue_is_asked_for(tmp_path, caplog):
    _train(tmp_path, "max_steps=2")
    data = _data(tmp_path / "texts.jsonl", word="replacement", n=12)
    before = _snapshot(tmp_path)
    with pytest.raises(MemfitError, match=f"the training data changed since the run in {tmp_path / 'run'} last "
                                          f"trained on it \\({data} has [0-9,]+ bytes, had [0-9,]+\\)"):
        _train(tmp_path, "resume=true", "max_steps=4")
    assert _snapshot(tmp_path) == before

    with caplog.at_level(logging.WARNING):
        result = _train(tmp_path, "resume=true", "max_steps=4", "resume_data_changed=continue")
    assert "resume_data_changed=continue: going on at the saved position" in caplog.text
    assert len(result.losses) == 4
    recorded = json.loads((tmp_path / "run" / DATA_IDENTITY_FILE).read_text())
    assert recorded["files"][str(data)]["bytes"] == data.stat().st_size  # the next resume compares with this data
    # The permission was for that resume only: the recorded config does not carry it to the next change.
    assert load_config(tmp_path / "run" / "run_config.yaml").resume_data_changed == "error"
    _train(tmp_path, "resume=true", "max_steps=5")
