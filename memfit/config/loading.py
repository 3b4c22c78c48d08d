"""Loading a RunConfig: YAML files and dotted command-line overrides (`lora.rank=16`), the deprecated flat
keys (`lr: 1e-4`) moved to their sections, and every problem reported at once as a ConfigError."""

from __future__ import annotations

import copy
import logging
from pathlib import Path
from typing import Any

import yaml

from memfit.config.run_config import RunConfig
from memfit.config.validation import ConfigError, validated
from memfit.errors import MemfitError

log = logging.getLogger(__name__)

# Flat keys (`lr: 1e-4`, `micro_batch=2`): a setting's bare name and the sectioned path it stands for. They
# load, with a warning naming the sectioned key, so that configs, command lines and saved run_config.yaml
# files (read again by resume=true) that use them keep working; many of the test suite's configs use them.
# They are deprecated (CHANGELOG.md) and go in the release named here.
FLAT_KEYS_REMOVED_IN = "memfit 0.2.0"
RENAMED = {
    "seq_len": "data.seq_len", "packing": "data.packing", "merge": "lora.merge",
    "quant_backend": "quant.backend", "compute_dtype": "quant.compute_dtype",
    "checkpointing": "memory.checkpointing", "attention": "memory.attention", "chunked_loss": "memory.chunked_loss",
    "optimizer_in_backward": "memory.optimizer_in_backward", "activation_offload": "memory.activation_offload",
    "memory_budget": "memory.limit",
    "optimizer": "optim.name", "optimizer_backend": "optim.backend", "lr": "optim.lr",
    "weight_decay": "optim.weight_decay", "lr_schedule": "optim.schedule", "warmup_steps": "optim.warmup_steps",
    "max_grad_norm": "optim.max_grad_norm", "max_nonfinite_steps": "optim.max_nonfinite_steps",
    "micro_batch": "batch.micro_batch", "grad_accum": "batch.grad_accum",
    "save_every": "checkpoints.every", "keep_checkpoints": "checkpoints.keep",
    "sharding": "distributed.sharding", "offload": "distributed.offload",
    "tensor_parallel": "distributed.tensor_parallel", "pipeline_parallel": "distributed.pipeline_parallel",
    "deepspeed": "distributed.deepspeed",
    "log_every": "logging.every", "report_to": "logging.report_to", "track_memory": "logging.track_memory",
}
SHORTHANDS = {"model": "name", "quant": "scheme"}  # sections that may be given as their one main value


def move_flat_keys(raw: dict, source: str = "config") -> dict:
    """Old flat keys (`lr: 1e-4`) moved to their sections (`optim: {lr: 1e-4}`), with one warning naming
    each new key; a key given both ways is a problem."""
    moved, problems, result = [], [], dict(raw)
    for old, new in RENAMED.items():
        if old not in result:
            continue
        section, leaf = new.split(".")
        value = result.pop(old)
        target = result.get(section)
        target = {"scheme": target} if section == "quant" and isinstance(target, str) else target
        target = dict(target) if isinstance(target, dict) else {}
        if leaf in target:
            problems.append(f"{old}: also given as {new}; set only {new}")
            continue
        target[leaf] = value
        result[section] = target
        moved.append(f"{old} -> {new}")
    if problems:
        raise ConfigError(problems, source)
    if moved:
        log.warning("%s: flat keys are deprecated and stop working in %s; use the sectioned keys: %s",
                    source, FLAT_KEYS_REMOVED_IN, ", ".join(moved))
    return result


def parse_value(text: str) -> Any:
    """A command-line value parsed as YAML, so `true`, `3`, `1e-4`, `[a, b]` and `null` work."""
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides to a nested dict (a copy); errors name the bad override."""
    result = copy.deepcopy(raw)
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r}: expected key=value, e.g. batch.micro_batch=2")
            continue
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            if isinstance(node.get(part), str) and node is result and part in SHORTHANDS:
                node[part] = {SHORTHANDS[part]: node[part]}  # model: NAME, quant: SCHEME
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                problems.append(f"override {item!r}: '{part}' is not a section")
                break
        else:
            node[leaf] = parse_value(value)
    if problems:
        raise ConfigError(problems, "command line")
    return result


def build_config(raw: dict, source: str = "config") -> RunConfig:
    """Validate a nested dict; raise ConfigError listing every problem at once."""
    if not isinstance(raw, dict):
        raise ConfigError([f"top level must be a mapping of keys to values, got {type(raw).__name__}"], source)
    return validated(RunConfig, move_flat_keys(raw, source), source, RENAMED)


class ConfigFileError(ConfigError):
    """The config file itself is unusable (missing, a folder, unreadable, not a mapping): one line naming it."""

    def __init__(self, path: Path, problem: str):
        self.problems = [problem]
        MemfitError.__init__(self, f"{path}: {problem}")


def _folder_problem(path: Path) -> str:
    """What to say about a folder given as the config: a run folder's own run_config.yaml, or its YAML files."""
    if (path / "run_config.yaml").is_file():
        return (f"is a folder, not a config file; it holds a memfit run: to continue that run use resume=true with "
                f"its run_config.yaml ({path / 'run_config.yaml'} resume=true)")
    found = sorted(p.name for p in path.glob("*.y*ml") if p.is_file())[:3]
    return "is a folder, not a config file; give a RunConfig YAML file" + (
        f" (this folder holds {', '.join(found)})" if found else "")


_YAML_KINDS = {str: "a string", int: "a number", float: "a number", bool: "a boolean"}


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if path.is_dir():
        raise ConfigFileError(path, _folder_problem(path))
    if not path.is_file():
        raise ConfigFileError(path, "file not found; give the path of a RunConfig YAML file")
    try:
        raw = yaml.safe_load(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"invalid YAML{where}: {getattr(exc, 'problem', exc)}"], str(path)) from None
    except UnicodeDecodeError:
        raise ConfigFileError(path, "is not a text file (UTF-8); give a RunConfig YAML file") from None
    except OSError as exc:
        raise ConfigFileError(path, f"cannot be read ({exc.strerror})") from None
    if raw is None:  # an empty file (or only comments): every default
        return {}
    if not isinstance(raw, dict):
        kind = "a list" if isinstance(raw, list) else f"{_YAML_KINDS.get(type(raw), 'a value')} ({repr(raw)[:40]})"
        raise ConfigFileError(path, f"the top level must be a mapping of keys to values (e.g. `max_steps: 100`), "
                                    f"got {kind}")
    return raw


def _renamed_override(item: str) -> str:
    key, sep, value = item.partition("=")
    return f"{RENAMED.get(key, key)}{sep}{value}"


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (optional) + dotted overrides -> validated RunConfig."""
    source = str(path) if path else "config"
    raw = move_flat_keys(read_yaml(path), source) if path else {}
    moved = [item for item in overrides if item.partition("=")[0] in RENAMED]
    if moved:  # a flat override replaces the sectioned value of the YAML, as its new key would
        log.warning("command line: flat keys are deprecated and stop working in %s; use %s",
                    FLAT_KEYS_REMOVED_IN, ", ".join(RENAMED[item.partition("=")[0]] for item in moved))
        overrides = [_renamed_override(item) for item in overrides]
    return build_config(apply_overrides(raw, list(overrides)), source)
