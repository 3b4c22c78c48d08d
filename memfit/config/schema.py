"""The sections of a RunConfig (memfit/config/run_config.py): their fields with descriptions, the choices
of every enumerated setting, and the rules of single fields."""

from __future__ import annotations

import importlib.util
import re
from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, create_model, field_validator, model_validator

from memfit.strategies.engines import OFFLOADS, SHARDINGS
from memfit.strategies.methods import METHODS
from memfit.strategies.optimizers import OPTIMIZERS
from memfit.strategies.precision import PRECISIONS
from memfit.strategies.quantization import QUANT_SCHEMES
from memfit.strategies.table import STEP_STRATEGIES
from memfit.units import parse_bytes

# The choices of every enumerated setting, defined once: fields, the CLI and the planner read them here.
Precision = Literal[PRECISIONS]  # the precision table (memfit/strategies/precision.py)
Optimizer = Literal[OPTIMIZERS]  # the optimizer table (memfit/strategies/optimizers.py)
Attention = Literal["eager", "sdpa", "flash"]
Method = Literal[METHODS]  # the method table (memfit/strategies/methods.py)
Quant = Literal[QUANT_SCHEMES]  # the quantization table (memfit/strategies/quantization.py)
Sharding = Literal[SHARDINGS]  # the data-parallel engine table (memfit/strategies/engines.py)
Offload = Literal[OFFLOADS]  # the offload table (memfit/strategies/engines.py)

_CHECKPOINTING = re.compile(r"^(none|full|every-[1-9][0-9]*)$")


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


def _missing_sink_packages(value: list[str] | None) -> list[str] | None:
    """An explicitly chosen metrics sink must be installed: say so at load, not after the model is built."""
    missing = [name for name in value or () if importlib.util.find_spec(name) is None]
    if missing:
        raise ValueError("; ".join(f"{name} needs the '{name}' package: pip install {name}" for name in missing))
    return value


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
