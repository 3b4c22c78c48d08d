"""Resumable checkpoints that survive kill -9, power loss and full disks.

A checkpoint is a folder `<output_dir>/checkpoints/step-00000042/` holding:

  model.safetensors   the trainable weights (all of them in a full fine-tune, the adapters with LoRA)
  training_state.pt   optimizer, LR scheduler and gradient-scaler state (loaded with weights_only=True)
  rng.safetensors     torch CPU (and CUDA) generator states
  trainer_state.json  step, data position, loss history, non-finite counters, python/numpy RNG states
  manifest.json       size and sha256 of every file above; written last

Atomic: everything is written into `.tmp-step-...`, each file fsynced, then the folder is renamed to
its final name and the parent folder fsynced. A folder named `step-*` therefore only ever appears
complete; a crash mid-write leaves a `.tmp-*` folder that the next save or resume removes. A
checkpoint damaged later (truncated, bit-flipped, file missing) fails the manifest check and the
previous good one is used, with a warning naming what is wrong.

Test hook: when the environment variable MEMFIT_CHECKPOINT_PAUSE_S is set, `save_checkpoint` sleeps
that many seconds after the temporary folder is complete and before the rename, so a test can kill
the process at exactly the worst moment (tests/integration/test_resume.py does).
"""

from __future__ import annotations

import hashlib
import io
import json
import logging
import os
import random
import re
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import numpy
import torch
from safetensors.torch import load_file, save as safetensors_save

from memfit.errors import MemfitError

log = logging.getLogger(__name__)

CHECKPOINTS_DIR = "checkpoints"
MANIFEST = "manifest.json"
PAUSE_ENV = "MEMFIT_CHECKPOINT_PAUSE_S"
_NAME = re.compile(r"^step-(\d{8,})$")
_ANY_ENGINE_NAME = re.compile(r"^(?:sharded-|deepspeed-)?step-(\d{8,})$")  # what every engine names its checkpoints
# Folder names of every kind of checkpoint memfit writes (single process, sharded, DeepSpeed, unfinished).
CHECKPOINT_PREFIXES = ("step-", "sharded-step-", "deepspeed-step-", ".tmp-")
FORMAT_VERSION = 1


class CheckpointError(MemfitError):
    """A checkpoint could not be written or none could be read; the message says which and why."""


@dataclass
class TrainerState:
    """The loop's own counters, saved next to the tensors."""

    step: int = 0
    data: dict = field(default_factory=dict)  # BatchStream.state_dict()
    losses: list[float] = field(default_factory=list)
    nonfinite_total: int = 0


# ---------------------------------------------------------------- writing


def _write_bytes(path: Path, data: bytes) -> None:
    """Write and fsync one file. The single place bytes hit the disk (tests make it fail with ENOSPC)."""
    with open(path, "wb") as handle:
        handle.write(data)
        handle.flush()
        os.fsync(handle.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def trainable_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Trainable parameters by name: every weight in a full fine-tune, only the adapters with LoRA.

    Frozen weights are rebuilt from the model source on resume, so they need no copy here.
    """
    return {name: p.detach().to("cpu").contiguous() for name, p in model.named_parameters() if p.requires_grad}


def rng_state() -> tuple[dict[str, torch.Tensor], dict]:
    """(tensor states, JSON states) of every random generator a step may draw from."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        for index, state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = state
    version, internal, gauss = random.getstate()
    plain = {"python": [version, list(internal), gauss]}
    try:
        name, keys, pos, has_gauss, cached = numpy.random.get_state()
        plain["numpy"] = [name, keys.tolist(), pos, has_gauss, cached]
    except Exception:  # pragma: no cover - exotic numpy builds
        pass
    return tensors, plain


def set_rng_state(tensors: dict[str, torch.Tensor], plain: dict) -> None:
    torch.set_rng_state(tensors["torch_cpu"])
    cuda = [tensors[k] for k in sorted((k for k in tensors if k.startswith("torch_cuda_")), key=lambda k: int(k[11:]))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda[:torch.cuda.device_count()])
    version, internal, gauss = plain["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in plain:
        name, keys, pos, has_gauss, cached = plain["numpy"]
        numpy.random.set_state((name, numpy.array(keys, dtype=numpy.uint32), pos, has_gauss, cached))


def _serialize(obj) -> bytes:
    buffer = io.BytesIO()
    torch.save(obj, buffer)
    return buffer.getvalue()


def _safetensors_bytes(tensors: dict[str, torch.Tensor]) -> bytes:
    return safetensors_save(tensors)


def save_checkpoint(out: Path, state: TrainerState, model: torch.nn.Module, optimizer, scheduler=None,
                    scaler=None, keep: int = 2) -> Path:
    """Write a checkpoint of `state.step` atomically, then keep only the newest `keep`. Returns its folder.

    On any OSError (disk full, permissions) the temporary folder is removed, earlier checkpoints are
    left untouched, and a CheckpointError says what failed.
    """
    root = Path(out) / CHECKPOINTS_DIR
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-step-{state.step:08d}-{os.getpid()}"
    try:
        root.mkdir(parents=True, exist_ok=True)
        remove_partial(root)
        tmp.mkdir()
        rng_tensors, rng_plain = rng_state()
        payload = {
            "model.safetensors": _safetensors_bytes(trainable_state(model)),
            "training_state.pt": _serialize({
                "optimizer": optimizer.state_dict(),
                "scheduler": scheduler.state_dict() if scheduler is not None else None,
                "scaler": scaler.state_dict() if scaler is not None else None}),
            "rng.safetensors": _safetensors_bytes(rng_tensors),
            "trainer_state.json": json.dumps({"format": FORMAT_VERSION, "step": state.step, "data": state.data,
                                              "losses": state.losses, "nonfinite_total": state.nonfinite_total,
                                              "rng": rng_plain}).encode(),
        }
        files = {}
        for name, data in payload.items():
            _write_bytes(tmp / name, data)
            files[name] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        # The manifest goes last: a folder whose manifest is missing was never finished.
        _write_bytes(tmp / MANIFEST, json.dumps({"format": FORMAT_VERSION, "step": state.step,
                                                 "files": files}, indent=1).encode())
        _fsync_dir(tmp)
        pause = float(os.environ.get(PAUSE_ENV, "0") or 0)
        if pause:
            log.warning("%s=%s: pausing %.1f s before publishing %s (test hook)", PAUSE_ENV, pause, pause, final.name)
            time.sleep(pause)
        if final.exists():  # a save of the same step by an earlier, interrupted attempt
            _discard(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except OSError as exc:
        shutil.rmtree(tmp, ignore_errors=True)
        previous = latest_step_name(root)
        kept = f"the previous checkpoint {previous} is intact" if previous else "no earlier checkpoint exists"
        raise CheckpointError(f"saving checkpoint {final} failed: {exc.strerror or exc}; {kept}. "
                              "Free space (or fix permissions) and continue with resume=true") from None
    prune(root, keep)
    return final


def _discard(path: Path) -> None:
    """Remove a folder so that a crash half-way leaves nothing that looks like a checkpoint."""
    doomed = path.with_name(f".tmp-delete-{path.name}-{os.getpid()}")
    os.replace(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def remove_partial(root: Path) -> None:
    """Delete `.tmp-*` folders left by a save or prune that was killed half-way."""
    for path in root.glob(".tmp-*"):
        shutil.rmtree(path, ignore_errors=True)


def checkpoint_dirs(root: Path) -> list[Path]:
    """`step-*` folders, newest first."""
    found = [(int(m.group(1)), p) for p in root.glob("step-*") if (m := _NAME.match(p.name)) and p.is_dir()]
    return [p for _, p in sorted(found, reverse=True)]


def latest_step_name(root: Path) -> str | None:
    dirs = checkpoint_dirs(root) if root.is_dir() else []
    return dirs[0].name if dirs else None


def newest_checkpoint_step(out: Path) -> int | None:
    """The step of the newest checkpoint folder in a run folder, whichever engine wrote it (not verified)."""
    root = Path(out) / CHECKPOINTS_DIR
    steps = [int(m.group(1)) for p in root.iterdir() if (m := _ANY_ENGINE_NAME.match(p.name))] if root.is_dir() else []
    return max(steps, default=None)


def prune(root: Path, keep: int) -> None:
    for old in checkpoint_dirs(root)[keep:]:
        _discard(old)


# ---------------------------------------------------------------- reading


def file_sha256(path: Path) -> str:
    """sha256 of a file, read in 8 MiB pieces: a multi-GB shard never has to fit in RAM."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        while piece := handle.read(8 << 20):
            digest.update(piece)
    return digest.hexdigest()


def write_manifest(folder: Path, step: int) -> None:
    """Size and sha256 of every file under `folder` (names relative to it), as `verify` reads them.
    For checkpoints whose files other writers (DCP, DeepSpeed) have already put on disk."""
    files = {str(file.relative_to(folder)): {"bytes": file.stat().st_size, "sha256": file_sha256(file)}
             for file in sorted(folder.rglob("*")) if file.is_file() and file.name != MANIFEST}
    _write_bytes(folder / MANIFEST, json.dumps({"format": FORMAT_VERSION, "step": step, "files": files},
                                               indent=1).encode())
    _fsync_dir(folder)


def verify(path: Path) -> str | None:
    """None when the checkpoint folder matches its manifest; otherwise what is wrong with it."""
    try:
        manifest = json.loads((path / MANIFEST).read_text())
        files = manifest["files"]
    except FileNotFoundError:
        return f"{MANIFEST} is missing"
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is not valid"
    try:
        entries = [(str(name), int(expected["bytes"]), str(expected["sha256"])) for name, expected in files.items()]
    except (AttributeError, KeyError, TypeError, ValueError):
        return f"{MANIFEST} is not valid"
    for name, expected_bytes, expected_sha256 in entries:
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        size = file.stat().st_size
        if size != expected_bytes:
            return f"{name} has {size} bytes, the manifest says {expected_bytes} (torn write)"
        if file_sha256(file) != expected_sha256:
            return f"{name} does not match its sha256 in the manifest (corrupt)"
    return None


def find_good_checkpoint(out: Path) -> Path | None:
    """The newest checkpoint that passes `verify` (see `newest_intact`); None when there is none."""
    root = Path(out) / CHECKPOINTS_DIR
    if not root.is_dir():
        return None
    remove_partial(root)
    return newest_intact(checkpoint_dirs(root))


def newest_intact(newest_first: list[Path]) -> Path | None:
    """The first folder of `newest_first` that passes `verify`, warning about every one before it.
    Those damaged newer folders are renamed to `<name>.damaged`: kept for inspection, but out of the
    way of the resumed run, whose keep-newest pruning would otherwise count them and delete its own
    new checkpoints. Raises CheckpointError when there are folders and none is intact: starting over
    would silently throw the run away."""
    for index, path in enumerate(newest_first):
        problem = verify(path)
        if problem is None:
            for damaged in newest_first[:index]:
                log.warning("moved the damaged checkpoint %s to %s", damaged, _set_aside(damaged))
            return path
        log.warning("checkpoint %s is damaged (%s); falling back to the previous one", path, problem)
    if newest_first:
        raise CheckpointError(f"resume=true: every checkpoint in {newest_first[0].parent} is damaged "
                              f"({', '.join(p.name for p in newest_first)}: see the warnings above); move them "
                              "away and resume to start from step 0, or set overwrite=true")
    return None


def _set_aside(path: Path) -> Path:
    target, n = path.with_name(f"{path.name}.damaged"), 1
    while target.exists():
        n += 1
        target = path.with_name(f"{path.name}.damaged-{n}")
    os.replace(path, target)
    return target


def load_checkpoint(path: Path, model: torch.nn.Module, optimizer, scheduler=None, scaler=None) -> TrainerState:
    """Restore weights, optimizer, scheduler, scaler and RNG from a verified checkpoint folder."""
    weights = load_file(path / "model.safetensors")
    params = dict(model.named_parameters())
    expected = {name for name, p in params.items() if p.requires_grad}
    if set(weights) != expected:
        missing, extra = sorted(expected - set(weights)), sorted(set(weights) - expected)
        raise CheckpointError(f"checkpoint {path} does not fit this model: missing {missing[:3]}, "
                              f"unexpected {extra[:3]}; was it written with another model or method?")
    with torch.no_grad():
        for name, tensor in weights.items():
            if params[name].shape != tensor.shape:
                raise CheckpointError(f"checkpoint {path}: {name} has shape {tuple(tensor.shape)}, "
                                      f"the model has {tuple(params[name].shape)}")
            params[name].copy_(tensor)
    # weights_only=True: a checkpoint is data; never run pickled code from a file on disk.
    try:
        training = torch.load(path / "training_state.pt", map_location="cpu", weights_only=True)
    except Exception as exc:  # pickle.UnpicklingError and friends: something beyond plain tensors and numbers
        raise CheckpointError(f"checkpoint {path / 'training_state.pt'} holds more than tensors and numbers; "
                              f"refusing to unpickle it (weights_only=True): {str(exc).splitlines()[0]}") from None
    optimizer.load_state_dict(training["optimizer"])  # restores per-group lr before the scheduler
    if scheduler is not None and training["scheduler"] is not None:
        scheduler.load_state_dict(training["scheduler"])
    if scaler is not None and training["scaler"] is not None:
        scaler.load_state_dict(training["scaler"])
    trainer = json.loads((path / "trainer_state.json").read_text())
    set_rng_state(load_file(path / "rng.safetensors"), trainer["rng"])
    return TrainerState(step=trainer["step"], data=trainer["data"], losses=trainer["losses"],
                        nonfinite_total=trainer["nonfinite_total"])


# ---------------------------------------------------------------- resuming a run


def aside_path(path: Path) -> Path:
    """Where `path` is written before it is renamed into place: named per process, so two writers never
    share it (`.<name>.<pid>.tmp`)."""
    return path.with_name(f".{path.name}.{os.getpid()}.tmp")


def truncate_metrics(out: Path, last_step: int) -> None:
    """Drop metrics lines after `last_step` (written after the checkpoint a resume starts from),
    so the resumed run appends each step exactly once. Rewritten atomically."""
    path = Path(out) / "metrics.jsonl"
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line + "\n")
        except (ValueError, KeyError, TypeError):
            pass  # a line torn by a kill mid-write
    tmp = aside_path(path)
    _write_bytes(tmp, "".join(kept).encode())
    os.replace(tmp, path)


def resume_state(resume: bool, out: Path, model, optimizer, scheduler, scaler, stream) -> TrainerState:
    """Where the loop starts: step 0 for a new run; with resume, everything restored from the last
    good checkpoint (the data stream too, so each example is seen exactly once per epoch)."""
    if not resume:
        return TrainerState(data=stream.state_dict())
    found = find_good_checkpoint(out)
    if found is None:
        log.warning("resume=true: no usable checkpoint in %s; starting from step 0", Path(out) / CHECKPOINTS_DIR)
        truncate_metrics(out, 0)
        return TrainerState(data=stream.state_dict())
    state = load_checkpoint(found, model, optimizer, scheduler, scaler)
    stream.load_state_dict(state.data)
    truncate_metrics(out, state.step)
    log.warning("resuming from %s (step %d)", found, state.step)
    return state


# Optimizer settings a resumed run takes from its config, not from the checkpoint (output_dir.RESUMABLE_CHANGES):
# loading the optimizer's state restores every group's hyperparameters, and the LR scheduler's its base_lrs.
CONFIGURED_GROUP_KEYS = ("weight_decay",)


@contextmanager
def keep_configured_hyperparameters(optimizer, scheduler):
    """Around loading a checkpoint (any engine's): afterwards the optimizer's groups keep the weight decay
    and the LR scheduler keeps the peak lrs the config built them with, and the current lr is the config's
    schedule at the restored step. Without a checkpoint this changes nothing."""
    configured = [{k: group[k] for k in CONFIGURED_GROUP_KEYS if k in group} for group in optimizer.param_groups]
    base_lrs = list(scheduler.base_lrs) if scheduler is not None else None
    yield
    for group, values in zip(optimizer.param_groups, configured):
        group.update(values)
    if scheduler is None:
        return
    scheduler.base_lrs = base_lrs
    lrs = [base * factor(scheduler.last_epoch) for base, factor in zip(base_lrs, scheduler.lr_lambdas)]
    for group, base, lr in zip(optimizer.param_groups, base_lrs, lrs):
        group["initial_lr"] = base
        if isinstance(group["lr"], torch.Tensor):  # torchao keeps lr as a tensor (compile must not retrace)
            group["lr"].fill_(lr)
        else:
            group["lr"] = lr
    # What get_last_lr() reports for the first resumed step: copies, as the scheduler keeps them.
    scheduler._last_lr = [lr.clone() if isinstance(lr, torch.Tensor) else lr
                          for lr in (group["lr"] for group in optimizer.param_groups)]


def discard_checkpoints(out: Path) -> None:
    """overwrite=true: the old run's checkpoints must not be resumed into the new one. Only memfit's
    own checkpoint folders go; anything else a user keeps in checkpoints/ stays."""
    root = Path(out) / CHECKPOINTS_DIR
    if not root.is_dir():
        return
    for path in root.iterdir():
        if path.is_dir() and any(path.name.startswith(prefix) for prefix in CHECKPOINT_PREFIXES):
            _discard(path)
    if not any(root.iterdir()):
        root.rmdir()
