"""RunConfig: the single, validated, frozen description of a fine-tuning run.

Filled from YAML plus dotted command-line overrides (`lora.rank=16`). `memfit plan` writes
one of these and `memfit train` reads it unchanged. An invalid config raises `ConfigError`
listing every problem at once, each with its field path and what is allowed.
"""

from __future__ import annotations

import logging
import re
from pathlib import Path
from typing import Any, Literal, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from memfit.config.deepspeed import deepspeed_problems
from memfit.config.distributed import config_problems
from memfit.errors import MemfitError
from memfit.strategies.optimizers import OPTIMIZERS, optimizer_problems
from memfit.strategies.precision import PRECISIONS
from memfit.strategies.quantization import quant_problems
from memfit.strategies.table import STEP_STRATEGIES
from memfit.units import parse_bytes

# The choices of every enumerated setting, defined once: fields, the CLI and the planner read them here.
Precision = Literal[PRECISIONS]  # the precision table (memfit/strategies/precision.py)
Optimizer = Literal[OPTIMIZERS]  # the optimizer table (memfit/strategies/optimizers.py)
Attention = Literal["eager", "sdpa", "flash"]
Method = Literal["full", "lora", "qlora"]
Quant = Literal["none", "nf4", "nf4-dq", "fp4", "int8"]
Sharding = Literal["none", "ddp", "zero1", "zero2", "zero3"]
Offload = Literal["none", "params", "all"]

log = logging.getLogger(__name__)
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
    name: str = Field("memfit/tiny-llama", description="Local directory, hub id, or preset name (see `memfit "
                                                       "presets`).")
    trust_remote_code: bool = Field(False, description="Run Python code shipped with the model. Only for models you "
                                                       "trust.")
    revision: str | None = Field(None, description="Hub revision (branch, tag or commit) when loading by hub id.")
    init: Literal["pretrained", "random"] = Field("pretrained", description=(
        "`pretrained`: train the model's real weights (a folder's, or the hub's for a hub id or a preset named "
        "by one); stop if there are none. `random`: start from random weights (memfit's own presets, "
        "config-only folders, experiments)."))
    tokenizer: str | None = Field(None, description=(
        "Tokenizer to use instead of the model's own: a local folder or hub id (e.g. the hub model the weights came "
        "from, or a finished run's output_dir). Needed for a folder of real weights saved without tokenizer files; "
        "its token ids must fit the model's vocab_size."))
    new_weights: list[str] = Field(default_factory=list, description=(
        "Model tensors that may be missing from the checkpoint (or have another shape there) and start from random "
        "values, as glob patterns over tensor names, e.g. [\"lm_head.*\"] for a new output head; each is logged. "
        "Any other missing or misshapen tensor stops the run (model.init: pretrained)."))
    dropped_weights: list[str] = Field(default_factory=list, description=(
        "Checkpoint tensors the model has no place for that may be left out, as glob patterns, e.g. [\"v_head.*\"] "
        "for a value head the causal LM does not use; each is logged. Any other unexpected tensor stops the run."))

    @model_validator(mode="after")
    def _weight_lists_need_pretrained(self) -> "ModelConfig":
        # With random init nothing is loaded, so these lists would be silently ignored.
        if self.init == "random" and (self.new_weights or self.dropped_weights):
            raise ValueError("new_weights / dropped_weights only apply to init: pretrained (a random init loads "
                             "no checkpoint)")
        return self


class DataConfig(_Section):
    path: str = Field("builtin:demo", description="Dataset file, folder, glob, or `builtin:demo` (shipped with "
                                                  "memfit).")
    format: Literal["auto", "text", "alpaca", "chat"] = Field("auto", description="How records become prompt/response "
                                                                                  "text.")
    train_on_prompt: bool = Field(False, description="Also compute loss on prompt tokens (default: response only).")
    limit: int | None = Field(None, ge=1, description="Use only the first N records (quick experiments).")
    split: str = Field("train", description="Split to read when `path` is a Hugging Face dataset id (`org/name` or "
                                            "`hf:name`).")
    fields: dict[str, str] = Field(default_factory=dict, description=(
        "Rename your columns to memfit's: memfit name -> your name, e.g. {instruction: question, output: answer}; "
        "names: text, instruction, input, output, messages, conversations."))
    streaming: bool = Field(False, description="Read and tokenize the raw files on the fly while training (flat RAM, "
                                               "for corpora larger than RAM or disk cache) instead of loading them "
                                               "whole.")
    prepared_dir: str | None = Field(None, description="Folder of memory-mapped Arrow written by `memfit data "
                                                       "prepare`; "
                                                       "`memfit train` reads it instead of `path` when set.")
    num_workers: int = Field(0, ge=0, description="Worker processes that tokenize (prepare, streaming) or collate "
                                                  "batches (DataLoader); 0 = in the main process.")
    prefetch_factor: int = Field(2, ge=1, description="Batches (or record chunks when streaming) each worker keeps "
                                                      "ready.")
    skip_bad_records: bool = Field(False, description="Skip malformed records (counted and reported) instead of "
                                                      "stopping at the first with its file and line.")
    max_record_bytes: int = Field(1 << 20, ge=1, description="Largest raw record, in bytes of text, memfit reads "
                                                             "(1 MiB); bigger ones are errors naming file:line, or "
                                                             "skipped and counted with data.skip_bad_records.")
    shuffle_buffer: int = Field(10_000, ge=0, description="Streaming: examples held to shuffle within (0 = file "
                                                          "order).")
    group_by_length: bool = Field(False, description="Batch examples of similar length together (less padding; "
                                                     "sorted within windows of 64 micro-batches).")
    seq_len: int = Field(256, ge=8, description="Maximum tokens per sequence (longer examples are truncated).")
    packing: bool = Field(False, description="Pack several examples into each seq_len sequence (position ids restart "
                                             "per example, so attention and loss never cross one).")

    @field_validator("fields")
    @classmethod
    def _known_field_names(cls, value: dict[str, str]) -> dict[str, str]:
        known = ("text", "instruction", "input", "output", "messages", "conversations")
        unknown = sorted(set(value) - set(known))
        if unknown:
            raise ValueError(f"unknown memfit field name(s) {unknown}: keys are memfit's names ({', '.join(known)}), "
                             "values the names in your data")
        return value


class LoraConfig(_Section):
    rank: int = Field(8, ge=1, description="LoRA rank r.")
    alpha: float = Field(16.0, gt=0, description="LoRA scaling numerator (scale = alpha / r).")
    dropout: float = Field(0.0, ge=0, lt=1, description="Dropout on the LoRA input.")
    targets: Union[list[str], Literal["all-linear"]] = Field(
        default_factory=lambda: ["q_proj", "v_proj"], description="Module names to adapt, or `all-linear`.")
    use_dora: bool = Field(False, description="DoRA: also learn a per-output magnitude (weight-decomposed LoRA).")
    use_rslora: bool = Field(False, description="rsLoRA: scale adapters by alpha / sqrt(r) instead of alpha / r.")
    train_embeddings: bool = Field(False, description="Also train the input embeddings in full (peft modules_to_save).")
    train_lm_head: bool = Field(False, description="Also train the output head in full (peft modules_to_save).")
    merge: bool = Field(False, description="After training, also write the base with the adapters merged in "
                                           "(full safetensors model in the base dtype) to output_dir/merged.")


class EvalConfig(_Section):
    data: str | None = Field(None, description="Held-out data (same formats as data.path; a hub dataset's "
                                               "validation split); or use fraction.")
    fraction: float = Field(0.0, ge=0, lt=1, description="Hold out this share of the training records instead "
                                                         "(the same records every run: split by record hash).")
    every: int = Field(0, ge=0, description="Evaluate every N steps (0 = only after the last step).")
    micro_batch: int | None = Field(None, ge=1, description="Rows per eval batch (default: the training micro_batch).")
    max_batches: int | None = Field(None, ge=1, description="Evaluate on at most this many batches (default: all).")
    save_best: bool = Field(False, description="Keep the weights of the evaluation with the lowest loss in "
                                               "RUN_DIR/best.")

    @property
    def enabled(self) -> bool:
        return self.data is not None or self.fraction > 0

    @model_validator(mode="after")
    def _one_source(self) -> "EvalConfig":
        problems = []
        if self.data is not None and self.fraction > 0:
            problems.append("set eval.data or eval.fraction, not both")
        if (self.save_best or self.every) and not self.enabled:
            problems.append("eval.save_best / eval.every need held-out data: set eval.data or eval.fraction")
        if problems:
            raise ValueError("; ".join(problems))
        return self


class QuantConfig(_Section):
    """Quantized base weights under LoRA; combinations are checked in memfit/strategies/quantization.py."""

    scheme: Quant = Field("none", description="4-bit nf4 / fp4, nf4-dq (double-quantized scales), or int8. "
                                              "method: qlora defaults to nf4-dq.")
    backend: Literal["auto", "bitsandbytes", "torchao"] = Field(
        "auto", description="Who quantizes: auto = bitsandbytes, else torchao NF4 (the portable path).")
    compute_dtype: Literal["auto", "fp32", "bf16", "fp16"] = Field(
        "auto", description="dtype quantized weights are dequantized to for matmuls; auto follows precision.")


class _MemoryConfig(_Section):
    """Strategies that trade time for memory inside one process (memfit/strategies/). The step
    strategies' switches (chunked_loss, optimizer_in_backward, activation_offload, ...) are added to
    this class from their table entries (memfit/strategies/table.py) as `MemoryConfig`."""

    checkpointing: str = Field("none", description="Activation checkpointing: none, full (every layer), or every-N.")
    attention: Attention = Field("sdpa", description="Attention kernel: eager, sdpa, or flash (flash-attn package).")
    limit: str | None = Field(None, description="Tracked-memory ceiling, e.g. 512MiB or 20GB: a step that goes above "
                                                "it "
                                                "fails with out-of-memory as a full GPU would (tests OOM recovery on "
                                                "CPU), and batch.micro_batch: auto fits under it.")

    @field_validator("checkpointing")
    @classmethod
    def _checkpointing_form(cls, value: str) -> str:
        if not _CHECKPOINTING.match(value):
            raise ValueError("must be 'none', 'full' or 'every-N' with N >= 1 (e.g. 'every-2')")
        return value

    @field_validator("limit", mode="before")
    @classmethod
    def _limit_form(cls, value: Any) -> str | None:
        if value is not None:  # a bare number is refused like everywhere else (memfit/units.py)
            if parse_bytes(value) <= 0:  # parse_bytes' own ValueError says how to write a size
                raise ValueError("must be a positive size, e.g. 512MiB")
        return value

    @property
    def limit_bytes(self) -> int | None:
        return None if self.limit is None else parse_bytes(self.limit)

    @property
    def activation_checkpoint_every(self) -> int:
        """0 = no checkpointing, 1 = every layer, N = every N-th layer."""
        if self.checkpointing == "none":
            return 0
        return 1 if self.checkpointing == "full" else int(self.checkpointing.split("-")[1])


# Each step strategy's switch, and the settings it brings (memfit/strategies/table.py).
MemoryConfig = create_model("MemoryConfig", __base__=_MemoryConfig, **{
    strategy.name: (bool, Field(False, description=strategy.description)) for strategy in STEP_STRATEGIES}, **{
    name: (kind, Field(**settings)) for strategy in STEP_STRATEGIES
    for name, (kind, settings) in strategy.options.items()})


class OptimConfig(_Section):
    name: Optimizer = Field("adamw", description="Optimizer; 8-bit ones keep states in 1 byte per value.")
    backend: Literal["auto", "bitsandbytes", "torchao"] = Field(
        "auto", description="Backend for 8-bit optimizers; auto = bitsandbytes, else torchao.")
    lr: float = Field(3e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = Field("cosine", description="Learning-rate schedule after "
                                                                                    "warm-up.")
    warmup_steps: int = Field(10, ge=0, description="Linear warm-up steps before the schedule.")
    max_grad_norm: float | None = Field(1.0, gt=0, description="Clip gradients to this global norm; null disables.")
    max_nonfinite_steps: int = Field(10, ge=1, description="Stop after this many steps in a row with a non-finite "
                                                           "loss or gradient (each such step is skipped).")


class BatchConfig(_Section):
    micro_batch: Union[int, Literal["auto"]] = Field(
        4, description="Sequences per forward/backward pass, or `auto`: the largest that fits (planner; memory.limit "
                       "when set, else the device's memory). On a real out-of-memory error training halves it and "
                       "doubles grad_accum (same effective batch) and redoes the step.")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per optimizer step.")

    @field_validator("micro_batch", mode="before")
    @classmethod
    def _micro_batch_form(cls, value: Any) -> Any:
        if value == "auto" or (isinstance(value, int) and not isinstance(value, bool) and value >= 1):
            return value
        raise ValueError("must be an integer >= 1 or 'auto'")


class CheckpointConfig(_Section):
    """Resumable checkpoints (memfit/checkpoint.py; sharded runs: memfit/distributed/)."""

    every: int = Field(100, ge=0, description="Write a resumable checkpoint every N optimizer steps "
                                              "(0: only when stopped by SIGTERM/SIGINT).")
    keep: int = Field(2, ge=1, description="How many of the newest checkpoints to keep.")


class DistributedConfig(_Section):
    """Scale-out on PyTorch's own engines and DeepSpeed; combinations are checked in memfit/config/distributed.py."""

    sharding: Sharding = Field(
        "none", description="Data-parallel engine under torchrun: ddp; zero1 (ZeroRedundancyOptimizer: optimizer "
                            "states sharded); zero2 (FSDP2, + gradients); zero3 (FSDP2, + parameters).")
    offload: Offload = Field(
        "none", description="CPU offload with zero2/zero3 (FSDP2 CPUOffloadPolicy moves parameters, gradients and "
                            "the optimizer step together, so params and all are the same there).")
    tensor_parallel: int = Field(1, ge=1, description="Tensor-parallel degree K for Llama-family blocks (DTensor).")
    pipeline_parallel: int = Field(1, ge=1, description="Pipeline stages S (torch.distributed.pipelining, GPipe; "
                                                         "batch.grad_accum micro-batches per step).")
    deepspeed: str | None = Field(None, description="A DeepSpeed JSON config file (yours, as DeepSpeed reads it): "
                                                  "the DeepSpeed engine runs the step under torchrun; values memfit "
                                                  "owns may be \"auto\" (memfit/config/deepspeed.py).")


class LoggingConfig(_Section):
    every: int = Field(10, ge=1, description="Write metrics every N steps (and at the first and last).")
    report_to: list[Literal["tensorboard", "wandb", "mlflow"]] | None = Field(
        None, description="Where metrics go besides metrics.jsonl: null = tensorboard when installed; [] = nowhere "
                          "else.")
    track_memory: bool = Field(True, description="Measure memory by category with memfit's tracker.")

    @field_validator("report_to")
    @classmethod
    def _sinks_installed(cls, value: list[str] | None) -> list[str] | None:
        return _missing_sink_packages(value)


class RunConfig(_Section):
    # With no model named, memfit trains its built-in tiny shape, which has no pretrained weights.
    model: ModelConfig = Field(default_factory=lambda: ModelConfig(init="random"))
    method: Method = Field("full", description="full fine-tune, or LoRA / QLoRA adapters.")
    precision: Precision = Field("fp32", description="fp32; bf16/fp16-mixed (autocast, fp32 master weights); "
                                                     "bf16-pure.")
    data: DataConfig = Field(default_factory=DataConfig)
    lora: LoraConfig = Field(default_factory=LoraConfig)
    quant: QuantConfig = Field(default_factory=QuantConfig)
    memory: MemoryConfig = Field(default_factory=MemoryConfig)
    optim: OptimConfig = Field(default_factory=OptimConfig)
    batch: BatchConfig = Field(default_factory=BatchConfig)
    max_steps: int = Field(100, ge=1, description="Optimizer steps to run.")
    seed: int = Field(0)
    device: Literal["auto", "cpu", "cuda"] = Field("auto", description="auto = cuda when available, else cpu.")
    checkpoints: CheckpointConfig = Field(default_factory=CheckpointConfig)
    distributed: DistributedConfig = Field(default_factory=DistributedConfig)
    budget: str | None = Field(None, description="GPU memory budget for `memfit plan`'s choice before training: null "
                                                 "(train as configured), auto (the free memory of the device) or a "
                                                 "size "
                                                 "like 24GiB; the planner picks the fastest setup that fits.")
    eval: EvalConfig = Field(default_factory=EvalConfig, description="Evaluation on held-out data: loss and "
                                                                     "perplexity.")
    logging: LoggingConfig = Field(default_factory=LoggingConfig)
    output_dir: str = Field("runs/latest", description="Where weights, config, metrics and memory report go.")
    overwrite: bool = Field(False, description="Allow writing into an output_dir that already holds a run.")
    resume: bool = Field(False, description="Continue the run in output_dir from its last good checkpoint "
                                            "(reuses output_dir; starts from step 0 if it has none).")
    resume_data_changed: Literal["error", "continue"] = Field(
        "error", description="resume=true when the training data's files changed size or content since the run "
                             "began (RUN_DIR/data_identity.json): `error` refuses; `continue` goes on at the saved "
                             "data position in the changed data, with a warning.")

    @model_validator(mode="before")
    @classmethod
    def _qlora_default_quant(cls, value: Any) -> Any:
        """method: qlora without a quantization scheme means QLoRA's own choice, NF4 with double quantization."""
        if isinstance(value, dict) and value.get("method") == "qlora":
            quant = value.get("quant", {})
            quant = {"scheme": quant} if isinstance(quant, str) else quant
            if isinstance(quant, dict) and "scheme" not in quant:
                value = {**value, "quant": {**quant, "scheme": "nf4-dq"}}
        return value

    @field_validator("model", mode="before")
    @classmethod
    def _model_shorthand(cls, value: Any) -> Any:
        return {"name": value} if isinstance(value, str) else value

    @field_validator("quant", mode="before")
    @classmethod
    def _quant_shorthand(cls, value: Any) -> Any:
        return {"scheme": value} if isinstance(value, str) else value

    @field_validator("budget", mode="before")  # before: a YAML number gets the size rule's message
    @classmethod
    def _planner_budget_form(cls, value: Any) -> str | None:
        if value is not None and value != "auto":
            if parse_bytes(value) <= 0:  # parse_bytes' own ValueError says how to write a size
                raise ValueError("must be null, 'auto' or a positive size, e.g. 24GiB")
        return value

    @model_validator(mode="after")
    def _cross_field_rules(self) -> "RunConfig":
        """Every rule between fields, on every construction (YAML, command line, planner copies)."""
        problems = (config_problems(self) + deepspeed_problems(self) + quant_problems(self)
                    + optimizer_problems(self.optim.name, self.optim.backend, self.logging.track_memory)
                    + eval_problems(self))
        for strategy in STEP_STRATEGIES:
            if getattr(self.memory, strategy.name):
                problems += strategy.problems(self)
        if problems:
            raise ValueError(PROBLEMS_SEPARATOR.join(problems))
        return self

    def get(self, path: str) -> Any:
        """The value at a dotted path, e.g. `cfg.get("optim.lr")`."""
        node: Any = self
        for part in path.split("."):
            node = getattr(node, part)
        return node

    def updated(self, changes: dict[str, Any], source: str = "config") -> "RunConfig":
        """A copy with `changes` ({dotted path: value}) applied, validated like a YAML file: every rule
        runs again, and a bad combination raises ConfigError listing its problems."""
        raw = self.model_dump(mode="json")
        for path, value in changes.items():
            node = raw
            *parents, leaf = path.split(".")
            for part in parents:
                node = node[part]
            if leaf not in node:
                raise ConfigError([f"{path}: unknown field"], source)
            node[leaf] = value.model_dump(mode="json") if isinstance(value, BaseModel) else value
        return build_config(raw, source)

    def explicit_paths(self) -> set[str]:
        """Dotted paths of the values this config sets explicitly (in YAML or on the command line)."""
        def walk(node: BaseModel, prefix: str) -> set[str]:
            found = set()
            for name in node.model_fields_set:
                value = getattr(node, name)
                found |= walk(value, f"{prefix}{name}.") if isinstance(value, _Section) else {prefix + name}
            return found
        return walk(self, "")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


# Flat keys (`lr: 1e-4`, `micro_batch=2`): a setting's bare name and the sectioned path it stands for. They
# load, with a warning naming the sectioned key, so that configs, command lines and saved run_config.yaml
# files (read again by resume=true) that use them keep working; many of the test suite's configs use them.
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
PROBLEMS_SEPARATOR = "\n"
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
        log.warning("%s: flat keys are deprecated and stop working in memfit 0.2.0; use the sectioned "
                    "keys: %s", source, ", ".join(moved))
    return result


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
    known = list(model.model_fields) + (list(RENAMED) if model is RunConfig else [])
    close = difflib.get_close_matches(str(path[-1]), known, n=1)
    return f" (did you mean '{RENAMED.get(close[0], close[0]) if model is RunConfig else close[0]}'?)" if close else ""


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


def _missing_sink_packages(value: list[str] | None) -> list[str] | None:
    """An explicitly chosen metrics sink must be installed: say so at load, not after the model is built."""
    import importlib.util

    missing = [name for name in value or () if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError("; ".join(f"{name} needs the '{name}' package: pip install {name}" for name in missing))
    return value


def eval_problems(cfg: RunConfig) -> list[str]:
    """Evaluation settings the data path or engine cannot honour."""
    problems = []
    if cfg.eval.fraction and (cfg.data.streaming or cfg.data.prepared_dir):
        problems.append("eval.fraction holds records out of data loaded whole; with data.streaming or "
                        "data.prepared_dir set eval.data to a held-out file instead")
    if cfg.eval.enabled and cfg.distributed.pipeline_parallel > 1:
        problems.append("eval with pipeline_parallel > 1 is not supported: the pipeline schedule runs training "
                        "steps only; set distributed.pipeline_parallel: 1 or leave eval off")
    return problems


def build_config(raw: dict, source: str = "config") -> RunConfig:
    """Validate a nested dict; raise ConfigError listing every problem at once."""
    if not isinstance(raw, dict):
        raise ConfigError([f"top level must be a mapping of keys to values, got {type(raw).__name__}"], source)
    try:
        return RunConfig.model_validate(move_flat_keys(raw, source))
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            if not err["loc"] and err["type"] == "value_error":  # the cross-field rules, one per line
                problems += err["msg"].removeprefix("Value error, ").split(PROBLEMS_SEPARATOR)
                continue
            text = _describe(err)
            if err["type"] == "extra_forbidden":
                text += _unknown_field_hint(err["loc"], RunConfig)
            problems.append(text)
        raise ConfigError(problems, source) from None


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
        log.warning("command line: flat keys are deprecated and stop working in memfit 0.2.0; use %s",
                    ", ".join(RENAMED[item.partition("=")[0]] for item in moved))
        overrides = [_renamed_override(item) for item in overrides]
    return build_config(apply_overrides(raw, list(overrides)), source)
