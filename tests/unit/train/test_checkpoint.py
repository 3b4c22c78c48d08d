"""Checkpoints: exact round trip, atomic writes, damage detection with fallback, pruning, disk full."""

from __future__ import annotations

import errno
import json
import logging
import random

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.data.loader import BatchStream
from memfit import checkpoint as ckpt
from memfit.checkpoint import (CheckpointError, TrainerState, find_good_checkpoint, load_checkpoint,
                                     save_checkpoint, truncate_metrics, verify)


def _model(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64)
    return LlamaForCausalLM(config)


def _trained(seed: int = 0, steps: int = 2):
    """A model, AdamW and a LambdaLR after a few real steps (so optimizer state is non-trivial)."""
    model = _model(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    for _ in range(steps):
        ids = torch.randint(0, 64, (2, 16))
        model(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return model, optimizer, scheduler


def _save(out, step, model, optimizer, scheduler=None, keep=3, **state):
    return save_checkpoint(out, TrainerState(step=step, **state), model, optimizer, scheduler, keep=keep)


def test_round_trip_restores_weights_optimizer_scheduler_scaler_rng_and_counters(tmp_path):
    model, optimizer, scheduler = _trained()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    state = TrainerState(step=7, data={"epoch": 1, "position": 24}, losses=[3.5, 3.25, float("nan")],
                         nonfinite_total=1)
    random.seed(5)
    torch.manual_seed(5)
    path = save_checkpoint(tmp_path, state, model, optimizer, scheduler, scaler)
    expected_python, expected_torch = random.random(), torch.rand(3)  # what the run draws next

    fresh, fresh_opt, fresh_sched = _trained(seed=1, steps=1)  # different weights, state and step count
    fresh_scaler = torch.amp.GradScaler("cpu")
    random.seed(99)
    torch.manual_seed(99)
    loaded = load_checkpoint(path, fresh, fresh_opt, fresh_sched, fresh_scaler)

    assert random.random() == expected_python and torch.equal(torch.rand(3), expected_torch)
    for (name, a), (_, b) in zip(model.named_parameters(), fresh.named_parameters()):
        assert torch.equal(a, b), name
    for a, b in zip(optimizer.state.values(), fresh_opt.state.values()):
        assert all(torch.equal(a[k], b[k]) for k in ("step", "exp_avg", "exp_avg_sq"))
    assert fresh_opt.param_groups[0]["lr"] == optimizer.param_groups[0]["lr"]
    assert fresh_sched.state_dict()["last_epoch"] == scheduler.state_dict()["last_epoch"] == 2
    assert fresh_scaler.get_scale() == 1024.0
    assert (loaded.step, loaded.data, loaded.nonfinite_total) == (7, {"epoch": 1, "position": 24}, 1)
    assert loaded.losses[:2] == [3.5, 3.25] and loaded.losses[2] != loaded.losses[2]  # NaN survives


def test_only_trainable_weights_are_saved(tmp_path):
    model, optimizer, _ = _trained()
    for name, p in model.named_parameters():
        p.requires_grad_("layers.1" in name)  # as with adapters: most weights frozen
    path = _save(tmp_path, 1, model, optimizer)
    from safetensors.torch import load_file

    names = set(load_file(path / "model.safetensors"))
    assert names and all("layers.1" in n for n in names)


def test_manifest_records_size_and_hash_and_no_temporary_is_left(tmp_path):
    model, optimizer, _ = _trained()
    path = _save(tmp_path, 3, model, optimizer)
    manifest = json.loads((path / "manifest.json").read_text())
    assert set(manifest["files"]) == {"model.safetensors", "training_state.pt", "rng.safetensors",
                                      "trainer_state.json"}
    assert all(manifest["files"][f]["bytes"] == (path / f).stat().st_size for f in manifest["files"])
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000003"]
    assert verify(path) is None


def test_keeps_only_the_newest_k(tmp_path):
    model, optimizer, _ = _trained()
    for step in (2, 4, 6, 8, 10):
        _save(tmp_path, step, model, optimizer, keep=2)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000008", "step-00000010"]


@pytest.mark.parametrize("damage, problem", [
    (lambda p: (p / "model.safetensors").write_bytes((p / "model.safetensors").read_bytes()[:-10]), "torn write"),
    (lambda p: (p / "training_state.pt").write_bytes(b"X" + (p / "training_state.pt").read_bytes()[1:]), "corrupt"),
    (lambda p: (p / "rng.safetensors").unlink(), "rng.safetensors is missing"),
    (lambda p: (p / "manifest.json").unlink(), "manifest.json is missing"),
])
def test_damaged_newest_checkpoint_falls_back_to_previous_with_a_message(tmp_path, caplog, damage, problem):
    model, optimizer, _ = _trained()
    _save(tmp_path, 2, model, optimizer)
    newest = _save(tmp_path, 4, model, optimizer)
    damage(newest)
    with caplog.at_level(logging.WARNING, logger="memfit.checkpoint"):
        found = find_good_checkpoint(tmp_path)
    assert found.name == "step-00000002"
    assert "step-00000004 is damaged" in caplog.text and problem in caplog.text
    assert (tmp_path / "checkpoints" / "step-00000004.damaged").is_dir()  # kept for inspection, out of the way


def test_a_resumed_run_never_prunes_its_new_checkpoint_for_a_damaged_newer_one(tmp_path):
    """Resumed from step 2 past a damaged step 6, the run's next save (step 4, keep=1) must survive."""
    model, optimizer, _ = _trained()
    _save(tmp_path, 2, model, optimizer, keep=3)
    damaged = _save(tmp_path, 6, model, optimizer, keep=3)
    (damaged / "model.safetensors").write_bytes(b"torn")
    assert find_good_checkpoint(tmp_path).name == "step-00000002"
    _save(tmp_path, 4, model, optimizer, keep=1)
    assert find_good_checkpoint(tmp_path).name == "step-00000004"
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step-00000004", "step-00000006.damaged"]


@pytest.mark.parametrize("files", [{"model.safetensors": 7}, {"model.safetensors": {"bytes": "many"}}, ["x"]])
def test_a_malformed_manifest_marks_the_checkpoint_damaged(tmp_path, files):
    model, optimizer, _ = _trained()
    folder = _save(tmp_path, 2, model, optimizer)
    manifest = json.loads((folder / "manifest.json").read_text())
    (folder / "manifest.json").write_text(json.dumps({**manifest, "files": files}))
    assert verify(folder) == "manifest.json is not valid"


def test_leftover_temporary_folder_is_ignored_and_removed(tmp_path):
    model, optimizer, _ = _trained()
    _save(tmp_path, 2, model, optimizer)
    torn = tmp_path / "checkpoints" / ".tmp-step-00000004-123"
    torn.mkdir()
    (torn / "model.safetensors").write_bytes(b"half")
    assert find_good_checkpoint(tmp_path).name == "step-00000002"
    assert not torn.exists()


def test_disk_full_mid_write_keeps_previous_checkpoint_intact(tmp_path, monkeypatch):
    model, optimizer, _ = _trained()
    previous = _save(tmp_path, 2, model, optimizer)
    before = {p.name: p.read_bytes() for p in previous.iterdir()}
    real_write, calls = ckpt._write_bytes, []

    def write_then_fill_disk(path, data):
        calls.append(path.name)
        if len(calls) == 2:  # the first file went through; the disk fills on the second
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        real_write(path, data)

    monkeypatch.setattr(ckpt, "_write_bytes", write_then_fill_disk)
    with pytest.raises(CheckpointError, match="No space left on device; the previous checkpoint step-00000002 is intact"):
        _save(tmp_path, 4, model, optimizer)
    assert [p.name for p in (tmp_path / "checkpoints").iterdir()] == ["step-00000002"]  # no temporary left
    assert {p.name: p.read_bytes() for p in previous.iterdir()} == before and verify(previous) is None


def test_pickled_code_in_a_checkpoint_is_refused(tmp_path):
    """weights_only=True: a training_state.pt carrying an arbitrary object is not unpickled."""
    import hashlib
    import io

    model, optimizer, _ = _trained()
    path = _save(tmp_path, 2, model, optimizer)
    buffer = io.BytesIO()
    torch.save({"optimizer": optimizer.state_dict(), "scheduler": None, "scaler": None,
                "payload": BatchStream}, buffer)  # a class reference: needs full unpickling
    data = buffer.getvalue()
    (path / "training_state.pt").write_bytes(data)
    manifest = json.loads((path / "manifest.json").read_text())
    manifest["files"]["training_state.pt"] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (path / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError, match="weights_only"):
        load_checkpoint(path, *_trained()[:2])


def test_checkpoint_from_another_model_is_refused(tmp_path):
    model, optimizer, _ = _trained()
    path = _save(tmp_path, 2, model, optimizer)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=4))
    with pytest.raises(CheckpointError, match="does not fit this model"):
        load_checkpoint(path, other, torch.optim.AdamW(other.parameters()))


def test_truncate_metrics_drops_later_and_torn_lines(tmp_path):
    lines = [json.dumps({"step": s, "loss": 1.0}) for s in range(1, 7)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + '\n{"step": 7, "lo')
    truncate_metrics(tmp_path, 4)
    assert [json.loads(l)["step"] for l in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1, 2, 3, 4]


def test_batch_stream_resumes_at_the_exact_example():
    examples = [{"input_ids": [i, i], "labels": [i, i]} for i in range(10)]
    whole = BatchStream(examples, 3, 0, seed=4)
    first = [whole.next_batch()["input_ids"][:, 0].tolist() for _ in range(9)]
    part = BatchStream(examples, 3, 0, seed=4)
    for _ in range(5):
        part.next_batch()
    resumed = BatchStream(examples, 3, 0, seed=4)
    resumed.load_state_dict(json.loads(json.dumps(part.state_dict())))  # through JSON, as on disk
    assert [resumed.next_batch()["input_ids"][:, 0].tolist() for _ in range(4)] == first[5:]


def test_first_signal_requests_a_stop_and_the_second_gets_the_previous_handler():
    import signal

    from memfit.train.signals import StopOnSignal

    # raise_signal delivers to this thread, so the handler has run when it returns; os.kill may land
    # on another of the process's threads and be handled a few bytecodes later.
    with StopOnSignal() as stop:
        assert not stop.requested
        signal.raise_signal(signal.SIGINT)
        assert stop.requested and stop.name == "SIGINT"
        with pytest.raises(KeyboardInterrupt):  # Ctrl-C twice: Python's own handler is back
            signal.raise_signal(signal.SIGINT)
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler
