"""RunConfig: the single, validated, frozen description of a fine-tuning run.

Filled from YAML plus dotted command-line overrides (`lora.rank=16`). `memfit plan` writes
one of these and `memfit train` reads it unchanged. An invalid config raises `ConfigError`
listing every problem at once, each with its field path and what is allowed.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from memfit.errors import MemfitError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

Precision = Literal["fp32", "bf16-mixed", "fp16-mixed", "bf16-pure"]
Optimizer = Literal["adamw", "adamw-8bit", "paged-adamw-8bit", "adafactor", "lion", "lion-8bit", "sgd"]
Attention = Literal["eager", "sdpa", "flash"]
Method = Literal["full", "lora", "qlora"]

_CHECKPOINTING = re.compile(r"^(none|full|every-[1-9][0-9]*)$")


class ConfigError(MemfitError, ValueError):
    """Every problem in a config, one per line, each with its field path."""

    def __init__(self, problems: list[str], source: str = "config"):
        self.problems = problems
        lines = "\n".join(f"  - {p}" for p in problems)
        super().__init__(f"{source} has {len(problems)} problem(s):\n{lines}")


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelConfig(_Section):
    name: str = Field("memfit/tiny-llama", description="Local directory, hub id, or preset name (see `memfit presets`).")
    trust_remote_code: bool = Field(False, description="Run Python code shipped with the model. Only for models you trust.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) when loading by hub id.")


class DataConfig(_Section):
    path: str = Field("builtin:demo", description="Dataset file, folder, glob, or `builtin:demo` (shipped with memfit).")
    format: Literal["auto", "text", "alpaca", "chat"] = Field("auto", description="How records become prompt/response text.")
    train_on_prompt: bool = Field(False, description="Also compute loss on prompt tokens (default: response only).")
    limit: int | None = Field(None, ge=1, description="Use only the first N records (quick experiments).")


class LoraConfig(_Section):
    rank: int = Field(8, ge=1, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    targets: Union[list[str], Literal["all-linear"]] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], description="Module names to adapt, or `all-linear`.")


class RunConfig(_Section):
    model: ModelConfig = Field(default_factory=ModelConfig)
    data: DataConfig = Field(default_factory=DataConfig)
    output_dir: str = Field("runs/latest", description="Where weights, config, metrics and memory report go.")
    overwrite: bool = Field(False, description="Allow writing into an output_dir that already holds a run.")

    method: Method = Field("full", description="full fine-tune, or LoRA / QLoRA adapters.")
    precision: Precision = Field("fp32", description="fp32; bf16/fp16-mixed (autocast, fp32 master weights); bf16-pure.")
    checkpointing: str = Field("none", description="Gradient checkpointing: none, full (every layer), or every-N.")
    optimizer: Optimizer = Field("adamw", description="Optimizer; 8-bit ones keep states in 1 byte per value.")
    optimizer_backend: Literal["auto", "bitsandbytes", "torchao"] = Field(
        "auto", description="Backend for 8-bit optimizers; auto = bitsandbytes, else torchao.")
    attention: Attention = Field("sdpa", description="Attention kernel: eager, sdpa, or flash (flash-attn package).")
    lora: LoraConfig = Field(default_factory=LoraConfig)

    micro_batch: int = Field(4, ge=1, description="Sequences per forward/backward pass.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    seq_len: int = Field(256, ge=8, description="Maximum tokens per sequence (longer examples are truncated).")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps before the schedule.")
    lr_schedule: Literal["cosine", "linear", "constant"] = Field("cosine")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip gradients to this global norm; null disables.")
    max_steps: int = Field(100, ge=1, description="Optimizer steps to run.")
    seed: int = Field(0)
    log_every: int = Field(10, ge=1, description="Write metrics every N steps.")
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu.")
    track_memory: bool = Field(True, description="Measure memory by category with memfit's tracker.")

    @field_validator("checkpointing")
    @classmethod
    def _checkpointing_form(cls, value: str) -> str:
        if not _CHECKPOINTING.match(value):
            raise ValueError("must be 'none', 'full' or 'every-N' with N >= 1 (e.g. 'every-2')")
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _model_shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @property
    def checkpoint_every(self) -> int:
        """0 = no checkpointing, 1 = every layer, N = every N-th layer."""
        if self.checkpointing == "none":
            return 0
        return 1 if self.checkpointing == "full" else int(self.checkpointing.split("-")[1])

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def _describe(error: dict) -> str:
    where = ".".join(str(p) for p in error["loc"]) or "(top level)"
    if error["type"] == "extra_forbidden":
        return f"{where}: unknown field"
    if error["type"] == "literal_error":
        return f"{where}: got {error['input']!r}; allowed: {error['ctx']['expected']}"
    message = error["msg"].removeprefix("Value error, ")
    return f"{where}: {message} (got {error['input']!r})"


def _unknown_field_hint(path: tuple, model: type[BaseModel]) -> str:
    """Suggest the closest known field for a typo like `micro_bach`."""
    import difflib

    for part in path[:-1]:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None) if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return ""
        model = annotation
    close = difflib.get_close_matches(str(path[-1]), list(model.model_fields), n=1)
    return f" (did you mean '{close[0]}'?)" if close else ""


def parse_value(text: str) -> Any:
    """A command-line value parsed as YAML, so `true`, `3`, `1e-4`, `[a, b]` and `null` work."""
    return yaml.safe_load(text) if text != "" else ""


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Apply `a.b=value` overrides to a nested dict (a copy); errors name the bad override."""
    import copy

    result = copy.deepcopy(raw)
    problems = []
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep or not key:
            problems.append(f"override {item!r}: expected key=value, e.g. micro_batch=2")
            continue
        node = result
        *parents, leaf = key.split(".")
        for part in parents:
            if isinstance(node.get(part), str) and part == "model":
                node[part] = {"name": node[part]}
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
    try:
        return RunConfig.model_validate(raw)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            text = _describe(err)
            if err["type"] == "extra_forbidden":
                text += _unknown_field_hint(err["loc"], RunConfig)
            problems.append(text)
        raise ConfigError(problems, source) from None


def read_yaml(path: str | Path) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError([f"file not found: {path}"], str(path))
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise ConfigError([f"invalid YAML{where}: {getattr(exc, 'problem', exc)}"], str(path)) from None
    return raw


def load_config(path: str | Path | None = None, overrides: list[str] = ()) -> RunConfig:
    """YAML file (optional) + dotted overrides -> validated RunConfig."""
    raw = read_yaml(path) if path else {}
    return build_config(apply_overrides(raw, list(overrides)), str(path) if path else "config")
