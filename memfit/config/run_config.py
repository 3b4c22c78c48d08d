"""RunConfig: the single, validated, frozen description of a fine-tuning run, made of the sections in
memfit/config/schema.py, and checked on every construction by every rule between its fields."""

from __future__ import annotations

from typing import Any, Literal

import yaml
from pydantic import BaseModel, Field, field_validator, model_validator

from memfit.config.deepspeed import deepspeed_problems
from memfit.config.distributed import config_problems
from memfit.config.schema import (BatchConfig, CheckpointConfig, DataConfig, DistributedConfig, EvalConfig,
                                  LoggingConfig, LoraConfig, MemoryConfig, Method, ModelConfig, OptimConfig,
                                  Precision, QuantConfig, _Section)
from memfit.config.step_rules import step_strategy_problems
from memfit.config.validation import PROBLEMS_SEPARATOR, ConfigError, validated
from memfit.strategies.engines import sharding_entry
from memfit.strategies.methods import METHODS, method_entry
from memfit.strategies.optimizers import optimizer_problems
from memfit.strategies.quantization import quantization_problems
from memfit.units import parse_bytes


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
        """A method without a quantization scheme stores its base as its entry says (QLoRA: its own choice,
        NF4 with double quantization)."""
        method = value.get("method") if isinstance(value, dict) else None
        if method in METHODS and method_entry(method).default_quant != "none":
            quant = value.get("quant", {})
            quant = {"scheme": quant} if isinstance(quant, str) else quant
            if isinstance(quant, dict) and "scheme" not in quant:
                value = {**value, "quant": {**quant, "scheme": method_entry(method).default_quant}}
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
        problems = (config_problems(self) + deepspeed_problems(self)
                    + quantization_problems(method=self.method, scheme=self.quant.scheme, backend=self.quant_backend,
                                            merge=self.lora.merge)
                    + optimizer_problems(self.optim.name, self.optim.backend, self.logging.track_memory)
                    + eval_problems(self) + step_strategy_problems(self))
        if problems:
            raise ValueError(PROBLEMS_SEPARATOR.join(problems))
        return self

    @property
    def quant_backend(self) -> str:
        """quant.backend as the run uses it: FSDP2 shards only torchao's NF4 tensor (bitsandbytes keeps its
        block scales beside the weight, where FSDP2 cannot shard them), so `auto` means torchao there."""
        fsdp2 = sharding_entry(self.distributed.sharding).fsdp2
        sharded_auto = fsdp2 and self.quant.backend == "auto" and self.quant.scheme != "none"
        return "torchao" if sharded_auto else self.quant.backend

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
        return validated(RunConfig, raw, source)

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
