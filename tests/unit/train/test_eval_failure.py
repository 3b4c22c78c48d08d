"""An evaluation that fails never costs the trained weights: the checkpoint of the finished step (at
the end, the final model too) is saved first, then the run stops with one line saying what was
saved and how to continue; the traceback goes to RUN_DIR/errors.log."""

from __future__ import annotations

import json
from pathlib import Path

import torch
import yaml

from memfit.checkpoint import checkpoint_dirs, verify
from memfit.cli import main
from memfit.errors import MemfitError
from memfit.train import evaluate as evaluate_module

BASE = {"model": {"name": "memfit/tiny-llama", "init": "random"},
        "data": {"format": "text", "seq_len": 32}, "precision": "fp32", "optim": {"name": "adamw", "warmup_steps": 0},
        "batch": {"micro_batch": 2}, "max_steps": 3, "eval": {"fraction": 0.5},
        "logging": {"every": 1, "track_memory": False, "report_to": []}, "device": "cpu"}


def _config(tmp: Path, records: int = 16) -> Path:
    data = tmp / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i} of the test data"}) + "\n" for i in range(records)))
    path = tmp / "config.yaml"
    path.write_text(yaml.safe_dump({**BASE, "data": {**BASE["data"], "path": str(data)}}))
    return path


def _train(tmp: Path, capsys, *overrides: str) -> tuple[int, str]:
    capsys.readouterr()
    status = main(["train", str(_config(tmp)), f"output_dir={tmp / 'run'}", *overrides, "--no-progress"])
    return status, capsys.readouterr().err


def _fail_at(monkeypatch, failing_step: int, error: Exception) -> None:
    real, calls = evaluate_module.evaluate, []

    def evaluate(*args, **kwargs):
        calls.append(None)
        if len(calls) == failing_step:  # eval.every=1: the n-th evaluation is step n's
            raise error
        return real(*args, **kwargs)

    monkeypatch.setattr(evaluate_module, "evaluate", evaluate)


def test_a_failed_mid_run_evaluation_saves_the_step_and_the_run_resumes(tmp_path, capsys, monkeypatch):
    _fail_at(monkeypatch, 2, RuntimeError("shape '[128, 5]' is invalid for input of size 704\nmore detail"))
    status, stderr = _train(tmp_path, capsys, "eval.every=1")
    run = tmp_path / "run"
    assert status == 2 and "Traceback" not in stderr
    assert stderr.rstrip("\n").splitlines()[-1] == (
        f"memfit: error: evaluation at step 2 failed (RuntimeError: shape '[128, 5]' is invalid for input of size "
        f"704; traceback in {run / 'errors.log'}); checkpoint of the finished step saved in "
        f"{run / 'checkpoints' / 'step-00000002'}; fix the cause, then continue with resume=true")
    kept = checkpoint_dirs(run / "checkpoints")
    assert [p.name for p in kept] == ["step-00000002"] and verify(kept[0]) is None
    assert "Traceback" in (run / "errors.log").read_text() and "more detail" in (run / "errors.log").read_text()
    assert not (run / "model.safetensors").exists()

    monkeypatch.undo()
    status, stderr = _train(tmp_path, capsys, "eval.every=1", "resume=true")
    assert status == 0, stderr
    steps = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in steps if "eval_loss" in r] == [1, 3]  # step 2's evaluation is the one that failed
    assert (run / "model.safetensors").is_file()


def test_a_failed_final_evaluation_still_writes_the_final_model(tmp_path, capsys, monkeypatch):
    _fail_at(monkeypatch, 1, torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"))
    status, stderr = _train(tmp_path, capsys)  # eval.every 0: one evaluation, after the last step
    run = tmp_path / "run"
    assert status == 2 and "Traceback" not in stderr
    message = stderr.rstrip("\n").splitlines()[-1]
    assert message.startswith("memfit: error: evaluation at step 3 failed (OutOfMemoryError: CUDA out of memory.")
    assert message.endswith(f"training finished: the final model is saved in {run} and its checkpoint in "
                            f"{run / 'checkpoints' / 'step-00000003'}; only this evaluation is missing")
    assert (run / "model.safetensors").is_file() and (run / "memory_report.txt").is_file()
    assert [p.name for p in checkpoint_dirs(run / "checkpoints")] == ["step-00000003"]


def test_running_out_of_memory_in_evaluation_says_to_lower_its_micro_batch(tmp_path, capsys, monkeypatch):
    _fail_at(monkeypatch, 1, torch.OutOfMemoryError("out of memory"))
    status, stderr = _train(tmp_path, capsys, "eval.every=1")
    assert status == 2 and "lower eval.micro_batch, then continue with resume=true" in stderr


def test_a_memfit_error_in_evaluation_is_shown_as_it_is_without_a_traceback_file(tmp_path, capsys, monkeypatch):
    _fail_at(monkeypatch, 1, MemfitError("eval.jsonl:3: not valid JSON"))
    status, stderr = _train(tmp_path, capsys, "eval.every=1")
    assert status == 2 and "evaluation at step 1 failed (eval.jsonl:3: not valid JSON); checkpoint" in stderr
    assert not (tmp_path / "run" / "errors.log").exists()


def test_a_real_evaluation_over_memory_limit_keeps_the_checkpoint(tmp_path, capsys):
    longer = tmp_path / "eval.jsonl"
    longer.write_text("".join(json.dumps({"text": f"held-out record {i}, long enough to fill its row " * 3}) + "\n"
                              for i in range(64)))
    status, stderr = _train(tmp_path, capsys, "eval.fraction=0", f"eval.data={longer}", "eval.every=1",
                            "eval.micro_batch=64", "memory.limit=14MiB", "max_steps=2")
    assert status == 2 and "evaluation at step 1 failed (OutOfMemoryError: memory.limit" in stderr, stderr
    assert [p.name for p in checkpoint_dirs(tmp_path / "run" / "checkpoints")] == ["step-00000001"]
