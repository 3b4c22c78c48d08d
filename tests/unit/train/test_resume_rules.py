"""What a resume may change, when it has nothing to do, when the data changed under it, and who
holds a run folder (in one process; tests/integration/test_run_lock.py uses real processes)."""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

import pytest
import torch

from memfit.checkpoint import keep_configured_hyperparameters, truncate_metrics
from memfit.config import load_config
from memfit.data.identity import BLOCK_BYTES, data_identity, identity_changes
from memfit.train.output_dir import (DATA_IDENTITY_FILE, OUTPUTS_FILE, RUN_INFO, OutputDirError, RunAlreadyFinished,
                                     check_output_dir, prepare_output_dir, record_finished, record_resumed_run)
from memfit.train.run_lock import OutputDirBusyError, hold_output_dir
from memfit.train.schedule import make_scheduler


def _texts(path: Path, n: int = 8, word: str = "record") -> Path:
    path.write_text("".join(json.dumps({"text": f"{word} {i}"}) + "\n" for i in range(n)))
    return path


def _cfg(tmp: Path, *overrides: str):
    data = tmp / "texts.jsonl"
    if not data.exists():
        _texts(data)
    return load_config(None, [f"output_dir={tmp / 'run'}", f"data.path={data}", "data.format=text", "device=cpu",
                              "model.init=random", "max_steps=4", "optim.lr=0.001", *overrides])


def _run_folder(tmp: Path, *overrides: str, checkpoint_step: int | None = 2) -> Path:
    """A run folder as prepare_output_dir leaves it, with an (empty) checkpoint folder of a step."""
    out = prepare_output_dir(_cfg(tmp, *overrides))
    if checkpoint_step is not None:
        (out / "checkpoints" / f"step-{checkpoint_step:08d}").mkdir(parents=True)
    return out


# ---------------------------------------------------------------- settings a resume may change


def test_a_resume_may_change_lr_and_says_so(tmp_path, caplog):
    _run_folder(tmp_path)
    with caplog.at_level(logging.WARNING, logger="memfit.train.output_dir"):
        check_output_dir(_cfg(tmp_path, "resume=true", "optim.lr=0.0003", "optim.max_grad_norm=0.5",
                              "optim.warmup_steps=3", "eval.every=0", "data.num_workers=1"))
    notes = [r.getMessage() for r in caplog.records]
    assert "resume: optim.lr 0.001 -> 0.0003" in notes
    assert "resume: optim.max_grad_norm 1.0 -> 0.5" in notes
    assert "resume: optim.warmup_steps 10 -> 3" in notes
    assert "resume: data.num_workers 0 -> 1" in notes
    assert not any("resume: resume" in note for note in notes)  # resume itself is not a change worth a note


@pytest.mark.parametrize("change", ["seed=1", "data.seq_len=64", "optim.name=sgd", "eval.fraction=0.2",
                                    "batch.micro_batch=2", "data.limit=4"])
def test_a_resume_refuses_what_changes_the_model_or_the_data_order(tmp_path, change):
    _run_folder(tmp_path)
    with pytest.raises(OutputDirError, match=f"describes a different run \\({change.split('=')[0]}: "):
        check_output_dir(_cfg(tmp_path, "resume=true", change))


def _optimizer_and_scheduler(lr: float, weight_decay: float, max_steps: int = 10):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay)
    settings = load_config(None, [f"optim.lr={lr}", f"optim.weight_decay={weight_decay}", "optim.warmup_steps=2"]).optim
    return model, optimizer, make_scheduler(optimizer, settings, max_steps)


def _trained_state(steps: int = 4) -> dict:
    model, optimizer, scheduler = _optimizer_and_scheduler(lr=1e-2, weight_decay=0.0)
    for _ in range(steps):
        model(torch.ones(3, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        scheduler.step()
    return {"optimizer": optimizer.state_dict(), "scheduler": scheduler.state_dict(),
            "lr": optimizer.param_groups[0]["lr"]}


def test_the_resumed_run_trains_with_the_new_lr_and_weight_decay():
    saved = _trained_state()
    model, optimizer, scheduler = _optimizer_and_scheduler(lr=1e-4, weight_decay=0.1)
    factor = scheduler.lr_lambdas[0]
    with keep_configured_hyperparameters(optimizer, scheduler):
        optimizer.load_state_dict(saved["optimizer"])  # as every engine's resume does
        scheduler.load_state_dict(saved["scheduler"])
    group = optimizer.param_groups[0]
    assert scheduler.last_epoch == 4 and optimizer.state[group["params"][0]]  # the checkpoint's state is kept
    assert saved["lr"] == pytest.approx(1e-2 * factor(4))  # what the checkpoint would have trained with
    assert group["lr"] == pytest.approx(1e-4 * factor(4)) and scheduler.get_last_lr() == [group["lr"]]
    assert group["weight_decay"] == 0.1 and scheduler.base_lrs == [1e-4]
    scheduler.step()
    assert group["lr"] == pytest.approx(1e-4 * factor(5))


def test_unchanged_settings_resume_exactly_as_saved():
    saved = _trained_state()
    _, optimizer, scheduler = _optimizer_and_scheduler(lr=1e-2, weight_decay=0.0)
    with keep_configured_hyperparameters(optimizer, scheduler):
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
    assert optimizer.param_groups[0]["lr"] == saved["lr"]  # bitwise: an uninterrupted run's lr


# ---------------------------------------------------------------- a finished run


def test_resuming_a_finished_run_has_nothing_to_do(tmp_path):
    out = _run_folder(tmp_path, checkpoint_step=4)
    record_finished(out, 4)
    with pytest.raises(RunAlreadyFinished, match=r"already finished at step 4 \(max_steps 4\); nothing to do: "
                                                 r"raise max_steps") as caught:
        check_output_dir(_cfg(tmp_path, "resume=true"))
    assert caught.value.exit_status == 0
    check_output_dir(_cfg(tmp_path, "resume=true", "max_steps=6"))  # raising max_steps continues it


def test_a_run_that_trained_past_its_final_outputs_or_never_wrote_them_resumes(tmp_path):
    out = _run_folder(tmp_path, checkpoint_step=4)
    check_output_dir(_cfg(tmp_path, "resume=true"))  # killed after its last checkpoint, before the final outputs
    record_finished(out, 4)
    (out / "checkpoints" / "step-00000005").mkdir()  # a resume with max_steps=6 saved step 5, then was stopped
    check_output_dir(_cfg(tmp_path, "resume=true"))  # its final outputs are of step 4, not 5: not finished
    assert json.loads((out / OUTPUTS_FILE).read_text())["finished_step"] == 4


def test_overwrite_forgets_that_the_old_run_finished(tmp_path):
    out = _run_folder(tmp_path, checkpoint_step=4)
    record_finished(out, 4)
    prepare_output_dir(_cfg(tmp_path, "overwrite=true"))
    assert "finished_step" not in json.loads((out / OUTPUTS_FILE).read_text())


# ---------------------------------------------------------------- the data under a resume


def test_a_resume_on_changed_data_is_refused_naming_the_file(tmp_path):
    _run_folder(tmp_path)
    data = _texts(tmp_path / "texts.jsonl", n=9)
    with pytest.raises(OutputDirError, match=f"the training data changed since the run in .* last trained on it \\("
                                             f"{data} has [0-9,]+ bytes, had [0-9,]+\\).*resume_data_changed=continue"):
        check_output_dir(_cfg(tmp_path, "resume=true"))


def test_continue_goes_on_with_a_warning_and_then_compares_with_the_new_data(tmp_path, caplog):
    _run_folder(tmp_path)
    _texts(tmp_path / "texts.jsonl", word="RECORD")  # same size, other content
    cfg = _cfg(tmp_path, "resume=true", "resume_data_changed=continue")
    with caplog.at_level(logging.WARNING, logger="memfit.train.output_dir"):
        check_output_dir(cfg)
    assert "has other content (same size)" in caplog.text and "going on at the saved position" in caplog.text
    record_resumed_run(tmp_path / "run", cfg)  # once its checkpoint loaded, the resumed run records its data
    check_output_dir(_cfg(tmp_path, "resume=true"))


def test_touching_the_data_does_not_block_a_resume(tmp_path):
    out = _run_folder(tmp_path)
    os.utime(tmp_path / "texts.jsonl", (1, 1))  # recorded, but a new time alone is no change
    assert json.loads((out / DATA_IDENTITY_FILE).read_text())["files"][str(tmp_path / "texts.jsonl")]["mtime"] != 1
    check_output_dir(_cfg(tmp_path, "resume=true"))


def test_without_a_checkpoint_the_data_may_change(tmp_path):
    _run_folder(tmp_path, checkpoint_step=None)  # a resume starts at step 0: no position to misapply
    _texts(tmp_path / "texts.jsonl", n=3)
    check_output_dir(_cfg(tmp_path, "resume=true"))


def test_a_folder_identity_names_added_removed_and_changed_files(tmp_path):
    folder = tmp_path / "data"
    folder.mkdir()
    for name in ("a", "b", "c"):
        _texts(folder / f"{name}.jsonl", word=name)
    cfg = load_config(None, [f"data.path={folder}"])
    before = data_identity(cfg)
    (folder / "a.jsonl").unlink()
    _texts(folder / "b.jsonl", word="B")
    _texts(folder / "d.jsonl")
    gone, new, changed = (folder / f"{name}.jsonl" for name in "adb")
    assert identity_changes(before, data_identity(cfg)) == [f"{gone} is gone", f"{new} is new",
                                                           f"{changed} has other content (same size)"]


def test_a_large_file_is_hashed_at_both_ends(tmp_path):
    data = tmp_path / "big.jsonl"
    data.write_bytes(b"x" * (3 * BLOCK_BYTES))
    cfg = load_config(None, [f"data.path={data}"])
    before = data_identity(cfg)
    with open(data, "r+b") as handle:  # the middle MiB: not read (documented), so not seen
        handle.seek(BLOCK_BYTES + 10)
        handle.write(b"y")
    assert identity_changes(before, data_identity(cfg)) == []
    with open(data, "r+b") as handle:
        handle.seek(3 * BLOCK_BYTES - 1)
        handle.write(b"y")
    assert identity_changes(before, data_identity(cfg)) == [f"{data} has other content (same size)"]


def test_a_prepared_dataset_is_identified_by_its_token_file(tmp_path):
    tokens = tmp_path / "prepared" / "data.arrow"
    tokens.parent.mkdir()
    tokens.write_bytes(b"rows")
    cfg = load_config(None, [f"data.prepared_dir={tokens.parent}"])
    before = data_identity(cfg)
    tokens.write_bytes(b"other rows")
    assert identity_changes(before, data_identity(cfg)) == [f"{tokens} has 10 bytes, had 4"]


def test_the_builtin_data_is_named_not_located():
    identity = data_identity(load_config(None, []))
    assert list(identity["files"]) == ["builtin:demo"] and identity["files"]["builtin:demo"]["bytes"] > 0


# ---------------------------------------------------------------- who holds the folder


def test_a_second_holder_is_refused_with_the_first_ones_pid(tmp_path):
    cfg = _cfg(tmp_path)
    with hold_output_dir(cfg):
        info = json.loads((tmp_path / "run" / RUN_INFO).read_text())
        assert info["pid"] == os.getpid()
        with pytest.raises(OutputDirBusyError, match=f"is in use by another memfit run \\(pid {os.getpid()} on host "):
            with hold_output_dir(cfg):
                pass
        assert (tmp_path / "run" / RUN_INFO).exists()  # the refused one removed nothing of the holder's
    assert not (tmp_path / "run" / RUN_INFO).exists()
    with hold_output_dir(cfg):  # released at the end
        pass


def test_a_refused_run_leaves_no_file_and_no_folder_it_made(tmp_path):
    cfg = load_config(None, [f"output_dir={tmp_path / 'new' / 'run'}"])
    with pytest.raises(RuntimeError):
        with hold_output_dir(cfg):
            assert (tmp_path / "new" / "run").is_dir()
            raise RuntimeError("refused")
    assert list(tmp_path.iterdir()) == []


def test_a_stale_info_file_and_temporary_files_do_not_make_a_folder_foreign(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / RUN_INFO).write_text('{"pid": 1}')  # left by kill -9
    (out / f".{OUTPUTS_FILE}.12345.tmp").write_text("{")
    check_output_dir(_cfg(tmp_path))  # counts as empty
    prepare_output_dir(_cfg(tmp_path))
    recorded = json.loads((out / OUTPUTS_FILE).read_text())
    assert not {RUN_INFO, f".{OUTPUTS_FILE}.12345.tmp"} & set(recorded["outputs"] + recorded["not_ours"])
    (out / ".run_config.yaml.12346.tmp").write_text("half a config")  # a killed run's, in a run folder now
    prepare_output_dir(_cfg(tmp_path, "resume=true"))
    assert not list(out.glob(".*.tmp"))  # whoever holds the folder clears what killed runs left


def test_files_written_aside_are_named_per_process(tmp_path, monkeypatch):
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\n{"step": 2}\n')
    renamed = []
    real = os.replace
    monkeypatch.setattr(os, "replace", lambda src, dst: (renamed.append(Path(src).name), real(src, dst)))
    truncate_metrics(tmp_path, 1)
    prepare_output_dir(_cfg(tmp_path))
    assert renamed and all(f".{os.getpid()}.tmp" in name for name in renamed)
    assert (tmp_path / "metrics.jsonl").read_text() == '{"step": 1}\n'
