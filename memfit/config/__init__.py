"""RunConfig: the single, validated, frozen description of a fine-tuning run.

Filled from YAML plus dotted command-line overrides (`lora.rank=16`). `memfit plan` writes
one of these and `memfit train` reads it unchanged. An invalid config raises `ConfigError`
listing every problem at once, each with its field path and what is allowed.

  schema.py       the sections (ModelConfig, DataConfig, ...), their fields and single-field rules,
                  and the choices of every enumerated setting (Precision, Optimizer, Quant, ...)
  run_config.py   RunConfig: the sections together, and the rules between fields
  distributed.py, deepspeed.py   the engines' rules between fields; the DeepSpeed JSON
  step_rules.py   each switched-on step strategy's rules, given the run's settings as values
  validation.py   ConfigError, and pydantic's errors turned into its one-line problems
  loading.py      load_config: YAML files, dotted overrides, the deprecated flat keys
"""

from memfit.config.loading import RENAMED, build_config, load_config, move_flat_keys
from memfit.config.run_config import RunConfig
from memfit.config.schema import (Attention, BatchConfig, CheckpointConfig, DataConfig, DistributedConfig,
                                  EvalConfig, LoggingConfig, LoraConfig, MemoryConfig, Method, ModelConfig,
                                  Offload, OptimConfig, Optimizer, Precision, Quant, QuantConfig, Sharding)
from memfit.config.validation import ConfigError

__all__ = [
    # choices
    "Attention", "Method", "Offload", "Optimizer", "Precision", "Quant", "Sharding",
    # sections and the run
    "BatchConfig", "CheckpointConfig", "DataConfig", "DistributedConfig", "EvalConfig", "LoggingConfig",
    "LoraConfig", "MemoryConfig", "ModelConfig", "OptimConfig", "QuantConfig", "RunConfig",
    # errors and loading
    "ConfigError", "RENAMED", "build_config", "load_config", "move_flat_keys",
]
