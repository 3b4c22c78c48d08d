"""The run folder is checked before anything heavy, and memfit deletes only what it wrote."""

from __future__ import annotations

import errno
import hashlib
import json
import shutil
import tempfile
from collections import namedtuple

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.config import load_config
from memfit.train import loop
from memfit.train.loop import train
from memfit.train.metrics import MetricsLog, OutputWriteError
from memfit.train.output_dir import OUTPUTS_FILE, OutputDirError, check_output_dir
from memfit.train.resolve import resolve_run
from tests.conftest import tiny_overrides


def _cfg(out, **extra):
    return load_config(None, tiny_overrides(out, **extra))


def _sha(path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _no_model_build(monkeypatch):
    """Fail the test if train() gets as far as building the model."""
    def refuse(*args, **kwargs):
        raise AssertionError("the model was built before the output folder was checked")

    monkeypatch.setattr(loop, "build_run", refuse)


def test_an_existing_file_is_refused_before_the_model_is_built(tmp_path, monkeypatch):
    _no_model_build(monkeypatch)
    (tmp_path / "out").write_text("mine")
    with pytest.raises(OutputDirError, match="is an existing file"):
        train(resolve_run(_cfg(tmp_path / "out")), progress=False)
    with pytest.raises(OutputDirError, match=r"out is a file, so no folder can be made under it"):
        train(resolve_run(_cfg(tmp_path / "out" / "run")), progress=False)
    assert (tmp_path / "out").read_text() == "mine"


def test_a_folder_that_cannot_be_written_is_refused(tmp_path, monkeypatch):
    # Permission bits do not stop root (CI runs as root), so the write probe itself fails here.
    def no_write(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(tempfile, "TemporaryFile", no_write)
    with pytest.raises(OutputDirError, match=r"cannot write in .* \(Permission denied\)"):
        check_output_dir(_cfg(tmp_path / "run"))


def test_too_little_free_disk_is_refused(tmp_path, monkeypatch):
    usage = namedtuple("usage", "total used free")
    monkeypatch.setattr(shutil, "disk_usage", lambda path: usage(10 * 2**20, 9 * 2**20, 2**20))
    with pytest.raises(OutputDirError, match=r"1\.00 MiB free on its disk, but the run writes about"):
        check_output_dir(_cfg(tmp_path / "run"), needed_bytes=5 * 2**20)
    check_output_dir(_cfg(tmp_path / "run"), needed_bytes=2**19)  # fits


@pytest.fixture
def model_folder(tmp_path):
    folder = tmp_path / "models" / "mymodel"
    config = LlamaConfig(vocab_size=260, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=256)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    return folder


@pytest.mark.parametrize("layout, how", [("same", "is"), ("parent", "contains"), ("child", "is inside")])
def test_the_model_folder_is_never_written(monkeypatch, model_folder, layout, how):
    _no_model_build(monkeypatch)
    before = _sha(model_folder / "model.safetensors")
    out = {"same": model_folder, "parent": model_folder.parent, "child": model_folder / "run"}[layout]
    cfg = _cfg(out, **{"model.name": str(model_folder), "model.init": "pretrained"})
    with pytest.raises(OutputDirError, match=f"{how} the model.name"):
        train(resolve_run(cfg), progress=False)
    assert _sha(model_folder / "model.safetensors") == before


def test_the_data_file_is_never_written(tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    (data / "train.jsonl").write_text(json.dumps({"text": "hello"}) + "\n")
    with pytest.raises(OutputDirError, match="is inside the data.path"):
        check_output_dir(_cfg(data / "run", **{"data.path": str(data)}))


def test_a_foreign_folder_needs_overwrite_and_keeps_its_files(tmp_path):
    out = tmp_path / "run"
    (out / "checkpoints").mkdir(parents=True)
    (out / "checkpoints" / "epoch10.pt").write_bytes(b"someone's weights")
    (out / "notes.txt").write_text("my notes")
    with pytest.raises(OutputDirError, match=r"not empty and is not a memfit run \(it holds checkpoints, notes.txt\)"):
        check_output_dir(_cfg(out))

    first = train(resolve_run(_cfg(out, max_steps=4, overwrite="true", **{"checkpoints.every": 2})), progress=False)
    assert len(first.losses) == 4
    recorded = json.loads((out / OUTPUTS_FILE).read_text())
    assert recorded["not_ours"] == ["checkpoints", "notes.txt"]
    assert "model.safetensors" in recorded["outputs"] and "notes.txt" not in recorded["outputs"]
    assert sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step"))

    # Replacing the run deletes memfit's outputs (its checkpoints included), nothing else.
    train(resolve_run(_cfg(out, max_steps=2, overwrite="true")), progress=False)
    assert (out / "notes.txt").read_text() == "my notes"
    assert (out / "checkpoints" / "epoch10.pt").read_bytes() == b"someone's weights"
    assert not (out / "checkpoints" / "step-00000004").exists()


def test_overwrite_refuses_a_foreign_file_memfit_would_write_over(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / "config.json").write_text("{}")
    with pytest.raises(OutputDirError, match="would write over: config.json"):
        check_output_dir(_cfg(out, overwrite="true"))


def test_resume_and_overwrite_together_are_refused(tmp_path):
    with pytest.raises(OutputDirError, match="set only one"):
        check_output_dir(_cfg(tmp_path / "run", resume="true", overwrite="true"))


def test_a_failed_metrics_write_keeps_a_checkpoint_and_the_run_resumes(tmp_path, monkeypatch, caplog):
    out = tmp_path / "run"
    real_write = MetricsLog.write

    def disk_full_at_step_3(self, record, prefix="train"):
        if record.get("step") == 3 and prefix == "train":
            self.file.write = _raise_enospc
        real_write(self, record, prefix)

    monkeypatch.setattr(MetricsLog, "write", disk_full_at_step_3)
    with pytest.raises(OutputWriteError) as caught:
        train(resolve_run(_cfg(out, max_steps=6)), progress=False)
    message = str(caught.value)
    assert "metrics.jsonl failed: No space left on device" in message
    assert "training stopped at step 3: checkpoint of step 3 saved in" in message
    assert "resume=true" in message

    monkeypatch.setattr(MetricsLog, "write", real_write)
    with caplog.at_level("WARNING", logger="memfit.checkpoint"):
        resumed = train(resolve_run(_cfg(out, max_steps=6, resume="true")), progress=False)
    assert "step-00000003 (step 3)" in caplog.text  # nothing before the failure was lost
    assert len(resumed.losses) == 6


def _raise_enospc(*args):
    raise OSError(errno.ENOSPC, "No space left on device")
