"""End to end on CPU: `memfit train` on a locally saved model, `memfit demo`, and clear CLI errors."""

import json
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file

from memfit.cli import main
from memfit.config import ModelConfig
from memfit.models.loading import build_model
from memfit.models.tokenizer import byte_tokenizer
from memfit.memory.tracker import CATEGORIES


@pytest.fixture
def saved_model(tmp_path):
    """A tiny Llama saved with save_pretrained, as a user's local model folder would be."""
    torch.manual_seed(0)
    model = build_model(ModelConfig(name="memfit/tiny-llama", init="random"))
    folder = tmp_path / "my-model"
    model.save_pretrained(folder)
    byte_tokenizer().save_pretrained(folder)
    return folder, {k: v.clone() for k, v in model.state_dict().items()}


def test_train_on_a_local_model_folder_writes_every_output(tmp_path, saved_model, capsys):
    folder, initial = saved_model
    config = tmp_path / "run.yaml"
    config.write_text(f"model: {folder}\ndata:\n  path: builtin:demo\n  limit: 128\nseq_len: 128\n")
    out = tmp_path / "out"
    code = main(["train", str(config), f"output_dir={out}", "max_steps=6", "batch.micro_batch=4", "logging.every=2",
                 "precision=bf16-mixed", "memory.checkpointing=full", "--no-progress"])
    assert code == 0
    for name in ("model.safetensors", "run_config.yaml", "metrics.jsonl", "memory_report.txt", "memory_report.json",
                 "tokenizer.json"):
        assert (out / name).is_file(), name

    trained = load_file(out / "model.safetensors")
    changed = [k for k, v in initial.items() if k in trained and not torch.equal(trained[k], v)]
    assert changed, "training should have changed the saved weights"

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 4, 6]
    assert {"loss", "lr", "tokens_per_s", "peak_bytes", "peak_by_category_bytes"} <= set(rows[0])
    report = json.loads((out / "memory_report.json").read_text())
    assert set(report["measured_by_category"]) == set(CATEGORIES)
    assert report["measured_peak_bytes"] == sum(report["measured_by_category"].values())
    captured = capsys.readouterr()
    assert "MiB" in captured.out and "loss:" in captured.out
    # --no-progress: no bar from transformers either (loading the folder's weights, saving the model)
    assert "Loading weights" not in captured.err and "Writing model shards" not in captured.err


def test_weights_category_counts_every_parameter_once(tmp_path, saved_model):
    folder, _ = saved_model
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    code = main(["train", str(empty), f"model={folder}", f"output_dir={tmp_path / 'o'}", "max_steps=1",
                 "data.limit=8", "data.seq_len=128", "--no-progress"])
    assert code == 0
    report = json.loads((tmp_path / "o" / "memory_report.json").read_text())
    model = build_model(ModelConfig(name=str(folder)))
    expected = sum(t.untyped_storage().nbytes() for t in {id(t): t for t in [*model.parameters(), *model.buffers()]}.values())
    assert report["measured_by_category"]["weights"] == expected


def test_demo_runs_and_reports_by_category(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert main(["demo", "max_steps=8", "--no-progress"]) == 0
    text = capsys.readouterr().out
    for category in CATEGORIES:
        assert category in text
    assert "loss:" in text and (tmp_path / "runs" / "demo" / "model.safetensors").is_file()


def test_bad_config_exits_2_with_every_problem_and_no_traceback(tmp_path):
    config = tmp_path / "bad.yaml"
    config.write_text("precision: fp8\noptim:\n  name: adam\n")
    done = subprocess.run([sys.executable, "-m", "memfit", "train", str(config)], capture_output=True, text=True)
    assert done.returncode == 2
    assert "precision: got 'fp8'" in done.stderr and "optim.name: got 'adam'" in done.stderr
    assert "Traceback" not in done.stderr


def test_missing_model_path_is_a_clear_error(tmp_path, capsys):
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    code = main(["train", str(empty), f"model={tmp_path / 'nothing-here'}", "max_steps=1", "--no-progress",
                 f"output_dir={tmp_path / 'o'}"])
    assert code == 2
    err = capsys.readouterr().err
    assert "nothing-here" in err and "not a local folder" in err
