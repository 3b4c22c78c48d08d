"""The run folder: checked before anything heavy, and only memfit's own files in it ever deleted.

`check_output_dir` runs first in `memfit train`, before the planner, the data or the model: an
output_dir that is unusable (a file, under a file, not writable, too little free disk), that
overlaps the model's or the data's folder, or that holds someone else's files fails at once
with the path and the reason.

`memfit_outputs.json` in the run folder lists the entries memfit wrote there. overwrite=true
deletes exactly those (and, inside `checkpoints/`, only memfit's checkpoint folders), so files a
user keeps beside a run survive every overwrite. A folder without that list is not a memfit run:
memfit writes into it only with overwrite=true, and only when none of its files has a name
memfit would write over.

Only one process at a time works in a run folder (memfit/train/run_lock.py holds it for the
run's life), so the checks here and the files written after them cannot interleave with another
run's. A resumed run must be the same run (`check_same_run`: settings outside RESUMABLE_CHANGES,
and the training data, `DATA_IDENTITY_FILE`), and a run that already finished is left alone.
"""

from __future__ import annotations

import fnmatch
import glob
import json
import logging
import shutil
import tempfile
from pathlib import Path

import yaml

from memfit.checkpoint import CHECKPOINTS_DIR, aside_path, discard_checkpoints, newest_checkpoint_step
from memfit.config import RunConfig, move_flat_keys
from memfit.data.identity import data_identity, identity_changes
from memfit.errors import MemfitError
from memfit.memory.model_shape import model_shape, trainable_params
from memfit.memory.model_states import optimizer_state_bytes
from memfit.models.loading import has_weights, load_model_config
from memfit.units import format_bytes

log = logging.getLogger(__name__)

OUTPUTS_FILE = "memfit_outputs.json"
DATA_IDENTITY_FILE = "data_identity.json"  # the training data's identity (memfit/data/identity.py)
RUN_INFO = ".memfit-running.json"  # who holds the folder now (run_lock.py); never a run's output
# Files memfit writes aside (memfit.checkpoint.aside_path) and renames over these names.
ASIDE_WRITTEN = (OUTPUTS_FILE, "run_config.yaml", DATA_IDENTITY_FILE, "metrics.jsonl")
# Names memfit may write at the top of a run folder (model and tokenizer files come from transformers
# and peft). A foreign file with one of these names would be overwritten, so its folder is refused.
WRITTEN_NAMES = ("run_config.yaml", "metrics.jsonl", "tensorboard", "wandb", "mlruns", "best", "memory_report.*",
                 "memory_timeline.*", "distributed_memory.json", "config.json", "generation_config.json",
                 "model*.safetensors*", "pytorch_model*", "tokenizer*", "special_tokens_map.json",
                 "added_tokens.json", "chat_template.*", "vocab.*", "merges.txt", "adapter_*", "README.md",
                 "base_model", "merged", "errors.log", DATA_IDENTITY_FILE)
# Settings a resumed run may change (config paths, or whole sections): none of them changes the model's
# shape, the optimizer state's shape or which records train in which order. Any other difference means the
# checkpoint belongs to another run. The optimizer's settings here take effect from the first resumed step
# (the checkpoint's copies of them are replaced: memfit.checkpoint.keep_configured_hyperparameters).
RESUMABLE_CHANGES = ("resume", "overwrite", "max_steps", "checkpoints", "logging", "output_dir", "device",
                     "resume_data_changed", "optim.lr", "optim.weight_decay", "optim.schedule", "optim.warmup_steps",
                     "optim.max_grad_norm", "optim.max_nonfinite_steps",
                     # evaluation on its own file, never on records held out of the training data (eval.fraction)
                     "eval.data", "eval.every", "eval.micro_batch", "eval.max_batches", "eval.save_best",
                     # how many processes read the data, not which records or their order
                     "data.num_workers", "data.prefetch_factor")
NOT_NOTED = ("resume", "overwrite", "resume_data_changed")  # about this resume, not about the training


class RunAlreadyFinished(MemfitError):
    """resume=true on a run that reached max_steps and wrote its final outputs: nothing to do, which
    is not a failure (a job scheduler re-running a finished job must see success)."""
    exit_status = 0


class OutputDirError(MemfitError):
    """The output folder cannot take this run; the message names the path and the reason."""


# ---------------------------------------------------------------- before anything heavy


def check_output_dir(cfg: RunConfig, needed_bytes: int = 0) -> None:
    """Every reason this run cannot write its output_dir, raised before any heavy work."""
    out = Path(cfg.output_dir).expanduser()
    check_location(cfg)
    if out.is_dir():
        _check_contents(out, cfg)
    _check_free_disk(out, needed_bytes)


def check_location(cfg: RunConfig) -> None:
    """What can be judged without looking inside output_dir: whether it can be a folder of this run."""
    out = Path(cfg.output_dir).expanduser()
    if cfg.resume and cfg.overwrite:
        raise OutputDirError("resume=true continues the run in output_dir and overwrite=true replaces it; "
                             "set only one")
    _check_usable(out)
    _check_no_overlap(out, cfg)


def _check_usable(out: Path) -> None:
    if out.exists() and not out.is_dir():
        raise OutputDirError(f"output_dir {out} is an existing file, not a folder; choose another output_dir")
    existing = next(p for p in [out, *out.parents] if p.exists())
    if not existing.is_dir():
        raise OutputDirError(f"output_dir {out}: {existing} is a file, so no folder can be made under it")
    try:  # a real write: permission bits say nothing for root, read-only mounts or quotas
        with tempfile.TemporaryFile(dir=existing, prefix=".memfit-write-test-"):
            pass
    except OSError as exc:
        raise OutputDirError(f"output_dir {out}: cannot write in {existing} ({exc.strerror or exc}); "
                             "choose a folder you can write to") from None


def _input_paths(cfg: RunConfig) -> list[tuple[str, Path]]:
    """The local folders and files this run reads: (config field, path)."""
    found = [("model.name", cfg.model.name), ("data.path", cfg.data.path), ("data.prepared_dir", cfg.data.prepared_dir),
             ("eval.data", cfg.eval.data)]
    paths = []
    for field, value in found:
        if not value or value.startswith("builtin:"):
            continue
        fixed = Path(value.split("*")[0].split("?")[0].split("[")[0]).expanduser() if glob.has_magic(value) \
            else Path(value).expanduser()  # a glob: the folder its matches live in
        if fixed.exists():
            paths.append((field, fixed.resolve()))
    return paths


def _check_no_overlap(out: Path, cfg: RunConfig) -> None:
    target = out.resolve()
    for field, path in _input_paths(cfg):
        if target == path:
            how = "is"
        elif path in target.parents:
            how = "is inside"
        elif target in path.parents:
            how = "contains"
        else:
            continue
        raise OutputDirError(f"output_dir {out} {how} the {field} {path}: the run would write over its own "
                             "input; choose an output_dir outside it")


def _check_contents(out: Path, cfg: RunConfig) -> None:
    entries = sorted(p.name for p in out.iterdir() if not _internal(p.name))
    if not entries:
        return
    if is_run(out):
        if not (cfg.overwrite or cfg.resume):
            raise OutputDirError(f"output_dir {out} already holds a run; choose another output_dir, set "
                                 "resume=true to continue it, or overwrite=true to replace it")
        if cfg.resume:
            check_same_run(out, cfg)
            check_not_finished(out, cfg)
            check_same_data(out, cfg)
        return
    if cfg.resume:
        raise OutputDirError(f"resume=true: output_dir {out} holds no memfit run to continue "
                             f"(no {OUTPUTS_FILE} or run_config.yaml)")
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    if not cfg.overwrite:
        raise OutputDirError(f"output_dir {out} is not empty and is not a memfit run (it holds {shown}); choose "
                             "a new or empty folder, or set overwrite=true to write beside those files "
                             "(memfit never deletes files it did not write)")
    clashes = [name for name in entries if name != CHECKPOINTS_DIR and _memfit_name(name)]
    if clashes:
        raise OutputDirError(f"output_dir {out} holds files memfit did not write but would write over: "
                             f"{', '.join(clashes)}; move them or choose another output_dir")


def _memfit_name(name: str) -> bool:
    return any(fnmatch.fnmatch(name, pattern) for pattern in WRITTEN_NAMES)


def _internal(name: str) -> bool:
    """memfit's bookkeeping while a run writes (the holder's info, files being written aside): never
    a run's output, and never a reason to call a folder non-empty (one may be left by kill -9)."""
    return name == RUN_INFO or _temporary(name)


def _temporary(name: str) -> bool:
    return any(fnmatch.fnmatch(name, f".{base}*.tmp") for base in ASIDE_WRITTEN)


def _check_free_disk(out: Path, needed_bytes: int) -> None:
    if needed_bytes <= 0:
        return
    existing = next(p for p in [out, *out.parents] if p.exists())
    free = shutil.disk_usage(existing).free
    if free < needed_bytes:
        raise OutputDirError(f"output_dir {out}: {format_bytes(free)} free on its disk, but the run writes about "
                             f"{format_bytes(needed_bytes)} (checkpoints.keep checkpoints, one being written, and "
                             "the final model); free space, lower checkpoints.keep, or choose another disk")


def planned_disk_bytes(cfg: RunConfig) -> int:
    """An upper bound of what the run writes: checkpoints.keep checkpoints plus the one being written
    (trainable weights in fp32 and the optimizer states), and the final model in fp32."""
    shape = model_shape(load_model_config(cfg.model)[0])
    trainable = trainable_params(shape, cfg)
    checkpoint = trainable * 4 + optimizer_state_bytes(shape, cfg)
    final = trainable * 4 + (shape.total_params * 4 if cfg.method != "full" and not has_weights(cfg.model) else 0)
    return (cfg.checkpoints.keep + 1) * checkpoint + final


# ---------------------------------------------------------------- the run's own files


def is_run(out: Path) -> bool:
    """A folder memfit ran in: it keeps the list of its outputs, or at least its run_config.yaml."""
    return (out / OUTPUTS_FILE).is_file() or (out / "run_config.yaml").is_file()


def _recorded(out: Path) -> dict:
    """The list of outputs; `finished_step`: the step of the final outputs, once a run wrote them."""
    try:
        data = json.loads((out / OUTPUTS_FILE).read_text())
        record = {"outputs": list(data["outputs"]), "not_ours": list(data["not_ours"])}
        if isinstance(data.get("finished_step"), int):
            record["finished_step"] = data["finished_step"]
        return record
    except (OSError, ValueError, KeyError, TypeError):
        return {"outputs": [], "not_ours": []}


def _write_record(out: Path, record: dict) -> None:
    tmp = aside_path(out / OUTPUTS_FILE)  # written aside and renamed: a kill never leaves half a list
    tmp.write_text(json.dumps({**record, "outputs": sorted(set(record["outputs"])),
                               "not_ours": sorted(set(record["not_ours"]))}, indent=1) + "\n")
    tmp.replace(out / OUTPUTS_FILE)


def record_outputs(out: Path) -> None:
    """Add what appeared in the run folder since the run began to memfit's list of its outputs
    (a run resumed from before memfit kept that list keeps none: what it wrote is unknown)."""
    if not (out / OUTPUTS_FILE).is_file():
        return
    record = _recorded(out)
    present = {p.name for p in out.iterdir() if not _internal(p.name)} - {OUTPUTS_FILE}
    record["outputs"] = sorted(set(record["outputs"]) | (present - set(record["not_ours"])))
    _write_record(out, record)


def record_finished(out: Path, step: int) -> None:
    """The final outputs of `step` are written: a later resume=true up to that step has nothing to do."""
    if (out / OUTPUTS_FILE).is_file():
        _write_record(out, {**_recorded(out), "finished_step": step})


def _remove_outputs(out: Path) -> None:
    """overwrite=true: delete the previous run's outputs (only those memfit listed) so nothing of it
    can be mistaken for this run's; inside checkpoints/, only memfit's checkpoint folders."""
    discard_checkpoints(out)  # checkpoints/ may predate the run; its memfit checkpoint folders are ours
    for name in _recorded(out)["outputs"]:
        path = out / name
        if name == CHECKPOINTS_DIR:
            continue
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink(missing_ok=True)


def prepare_output_dir(cfg: RunConfig) -> Path:
    """Make the folder (already checked by `check_output_dir`), clear the replaced run's outputs,
    write run_config.yaml and the data's identity, and start the list of memfit's outputs. A resumed
    run writes nothing new until its checkpoint has loaded (`record_resumed_run`)."""
    out = Path(cfg.output_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    if is_run(out):  # files a killed run was writing aside: this run holds the folder, so no one else is
        for stale in (p for p in out.iterdir() if _temporary(p.name)):
            stale.unlink(missing_ok=True)
    if not cfg.resume:
        if (out / OUTPUTS_FILE).is_file():
            _remove_outputs(out)
        elif is_run(out):  # a run from before memfit listed its outputs: its checkpoints must not be resumed
            discard_checkpoints(out)
        not_ours = sorted(p.name for p in out.iterdir() if p.name != OUTPUTS_FILE and not _internal(p.name))
        _write_record(out, {"outputs": [], "not_ours": not_ours})
        _record_run(out, cfg)
    elif not (out / "run_config.yaml").exists():
        _write_aside(out / "run_config.yaml", cfg.to_yaml())
    record_outputs(out)
    return out


def record_resumed_run(out: Path, cfg: RunConfig) -> None:
    """A resumed run whose checkpoint loaded: its settings and data become the run's record, so the
    next resume compares with what ran last. It passed `check_same_run`, so only resumable settings
    (and, with resume_data_changed=continue, the data) differ from what was recorded."""
    _record_run(out, cfg)
    record_outputs(out)


def _record_run(out: Path, cfg: RunConfig) -> None:
    _write_aside(out / DATA_IDENTITY_FILE, json.dumps(data_identity(cfg), indent=1) + "\n")
    # resume_data_changed=continue accepts the data of this resume only: a later resume of the recorded
    # config must not accept the next change silently.
    _write_aside(out / "run_config.yaml", cfg.model_copy(update={"resume_data_changed": "error"}).to_yaml())


def _write_aside(path: Path, text: str) -> None:
    tmp = aside_path(path)  # written aside and renamed: a kill never leaves half a file
    tmp.write_text(text)
    tmp.replace(path)


# ---------------------------------------------------------------- resuming


def check_same_run(out: Path, cfg: RunConfig) -> None:
    """resume=true: the saved run_config.yaml must describe the same run (up to RESUMABLE_CHANGES,
    each of which is logged as a note)."""
    path = out / "run_config.yaml"
    if not path.exists():
        return
    try:
        before = _flatten(move_flat_keys(yaml.safe_load(path.read_text()) or {}, str(path)))
    except yaml.YAMLError:
        raise OutputDirError(f"resume=true: {path} is not valid YAML; it cannot tell which run this is") from None
    now = _flatten(cfg.model_dump(mode="json"))
    differ = [key for key in sorted(set(before) & set(now)) if before[key] != now[key]]
    changed = [f"{key}: {before[key]!r} there, {now[key]!r} now" for key in differ if not resumable(key)]
    if changed:
        raise OutputDirError(f"resume=true: {path} describes a different run ({'; '.join(changed)}); "
                             "resume with the same settings, or use another output_dir")
    for key in differ:
        if not resumable(key, NOT_NOTED):
            log.warning("resume: %s %s -> %s", key, _shown(before[key]), _shown(now[key]))


def _shown(value) -> str:
    return value if isinstance(value, str) else json.dumps(value)


def check_not_finished(out: Path, cfg: RunConfig) -> None:
    """resume=true on a run whose final outputs are of max_steps or later (and that has trained no
    further since) changes nothing: its report would be replaced by a measurement of no steps."""
    finished = _recorded(out).get("finished_step")
    if finished is None or finished < cfg.max_steps:
        return
    newest = newest_checkpoint_step(out)
    if newest is not None and newest > finished:  # a later resume trained past it (then was stopped)
        return
    raise RunAlreadyFinished(f"the run in {out} already finished at step {finished} (max_steps {cfg.max_steps}); "
                             "nothing to do: raise max_steps to train further")


def check_same_data(out: Path, cfg: RunConfig) -> None:
    """resume=true: the checkpoint's data position counts records of the data the run trained on; on
    other data it would point at other records. Refused unless resume_data_changed=continue."""
    path = out / DATA_IDENTITY_FILE
    if not path.is_file() or newest_checkpoint_step(out) is None:  # a run from before memfit kept it; step 0
        return
    try:
        before = json.loads(path.read_text())
        if not isinstance(before, dict):
            raise ValueError("not a mapping")
    except (OSError, ValueError):
        raise OutputDirError(f"resume=true: {path} is not valid JSON; it cannot tell whether the training data "
                             "changed. Delete it to resume without that check") from None
    changes = identity_changes(before, data_identity(cfg))
    if not changes:
        return
    what = "; ".join(changes[:5]) + (f"; and {len(changes) - 5} more" if len(changes) > 5 else "")
    if cfg.resume_data_changed == "continue":
        log.warning("resume: the training data changed since the run last trained on it (%s); "
                    "resume_data_changed=continue: going on at the saved position in the changed data", what)
        return
    raise OutputDirError(f"resume=true: the training data changed since the run in {out} last trained on it "
                         f"({what}), so its checkpoint's data position would point at other records; restore the "
                         "data, start a new run in another output_dir, or set resume_data_changed=continue to go on "
                         "at the saved position anyway")


def resumable(path: str, allowed_paths: tuple[str, ...] = RESUMABLE_CHANGES) -> bool:
    return any(path == allowed or path.startswith(allowed + ".") for allowed in allowed_paths)


def _flatten(tree: dict, prefix: str = "") -> dict:
    flat = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            flat.update(_flatten(value, f"{prefix}{key}."))
        else:
            flat[f"{prefix}{key}"] = value
    return flat
