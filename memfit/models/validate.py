"""Checks of a run against its model's config.json, shared by `memfit plan` and `memfit train`.

RunConfig validates what a config says on its own; these need the model: it must be a decoder
transformer memfit can train (attention heads and layers, which the planner and the strategies
count), its sizes must be positive and its heads must split the hidden size, the sequence must fit
its position table, and tensor/pipeline parallel degrees must divide its heads, MLP width and
layers. Every problem is listed at once.
"""

from __future__ import annotations

import logging
from pathlib import Path

from memfit.errors import MemfitError
from memfit.config.distributed import model_parallel_family_problems
from memfit.strategies.engines import mesh_2d_degree

log = logging.getLogger(__name__)

# Sizes every decoder config has under one of these names; each must be a positive integer.
SIZES = (("hidden_size", "n_embd"), ("num_hidden_layers", "n_layer"), ("num_attention_heads", "n_head"),
         ("vocab_size",), ("intermediate_size", "n_inner"), ("num_key_value_heads",))
POSITIONS = ("max_position_embeddings", "n_positions")
# What memfit needs from an architecture: the planner, the tracer and the parallel strategies count
# attention heads and layers. State-space and recurrent models (mamba, rwkv, xlstm) have no heads.
REQUIRED = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
TRAINS = ("decoder transformers (attention + MLP layers: llama, mistral, mixtral, qwen2/3, gemma, phi, gpt2, "
          "falcon, ...)")


class ModelConfigError(MemfitError):
    """The run does not fit the model's config.json (or that config is not a usable model)."""


def _get(config, name: str):
    """An attribute of a config, None when it has none (some configs raise for attributes that vary per layer)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 - transformers raises its own error types here
        return None


def _first(config, names: tuple[str, ...]):
    for name in names:
        value = _get(config, name)
        if value is not None:
            return name, value
    return names[0], None


def _text_config(model_config):
    """The language model's part of a config (itself, for a plain decoder); None when that is ambiguous."""
    try:
        return model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    except ValueError:  # several text models (an encoder-decoder pair, music models)
        return None


def model_problems(cfg, model_config, gpus: int = 1) -> list[str]:
    """Everything wrong with running `cfg` on `model_config` (world size `gpus` for tp/pp)."""
    text = _text_config(model_config)
    absent = [name for name in REQUIRED if text is None or _get(text, name) is None]
    model_type = getattr(model_config, "model_type", "?")
    if absent:  # nothing below means anything for an architecture memfit cannot train
        return [f"a '{model_type}' model has no {', '.join(absent)}: memfit trains {TRAINS}, not this architecture"]
    problems = []
    for names in SIZES:
        name, value = _first(text, names)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            problems.append(f"{name} must be a positive integer (got {value!r})")
    if problems:  # nothing below means anything for a config with impossible sizes
        return problems
    problems += _head_problems(text)
    problems += _position_problems(cfg, model_config)
    tp, pp = cfg.distributed.tensor_parallel, cfg.distributed.pipeline_parallel
    problems += model_parallel_family_problems(cfg, getattr(model_config, "model_type", "?"))
    mesh_2d = mesh_2d_degree(cfg.distributed.model_dump(), cfg.distributed.sharding)  # FSDP2 over groups of tp GPUs
    if mesh_2d and gpus % tp:
        problems.append(f"distributed.tensor_parallel: {tp} with distributed.sharding: {cfg.distributed.sharding} "
                        f"needs a multiple of {tp} GPUs (got {gpus})")
    for degree, flag in ((0 if mesh_2d else tp, "tensor_parallel"), (pp, "pipeline_parallel")):
        if degree > 1 and gpus != degree:
            problems.append(f"distributed.{flag}: {degree} needs {degree} GPUs (got {gpus})")
    if tp > 1:
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = _get(text, name)
            if value is not None and value % tp:
                problems.append(f"distributed.tensor_parallel: {tp} must divide the model's {name} ({value})")
    layers = _first(text, SIZES[1])[1]
    if pp > 1 and layers is not None and layers < pp:
        problems.append(f"distributed.pipeline_parallel: {pp} needs at least {pp} layers; the model has {layers}")
    return problems


def _head_problems(text) -> list[str]:
    """Heads split the hidden size (unless the config sets head_dim on purpose), and key/value heads are
    shared by equal groups of query heads; otherwise the model fails in its first layer or forward pass."""
    hidden, heads = _get(text, "hidden_size"), _get(text, "num_attention_heads")
    head_dim, kv_heads = _get(text, "head_dim"), _get(text, "num_key_value_heads")
    problems = []
    if hidden % heads and head_dim in (None, hidden // heads):
        problems.append(f"hidden_size ({hidden}) must be a multiple of num_attention_heads ({heads}); change one "
                        "of them in config.json")
    if isinstance(kv_heads, int) and kv_heads >= 1 and heads % kv_heads:
        problems.append(f"num_key_value_heads ({kv_heads}) must divide num_attention_heads ({heads}); change one "
                        "of them in config.json")
    return problems


def _position_problems(cfg, model_config) -> list[str]:
    name, limit = _first(model_config, POSITIONS)
    seq_len = cfg.data.seq_len
    if not isinstance(limit, int) or seq_len <= limit:
        return []
    scaling = getattr(model_config, "rope_scaling", None) or {}
    if scaling.get("rope_type", scaling.get("type", "default")) != "default":  # positions extended on purpose
        log.warning("data.seq_len %d is beyond the model's %s (%d); its rope_scaling (%s) is expected to cover it",
                    seq_len, name, limit, model_config.rope_scaling)
        return []
    return [f"data.seq_len: {seq_len} is beyond the model's {name} ({limit}); lower it, or extend the positions "
            "with rope_scaling in the model's config.json"]


def check_model(cfg, model_config, where: str, gpus: int = 1) -> None:
    """Raise one ModelConfigError listing every problem; `where` names the model (its config.json)."""
    problems = model_problems(cfg, model_config, gpus)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise ModelConfigError(f"model.name: {where}: {len(problems)} problem(s) with this model:\n{lines}")


def model_where(spec) -> str:
    """How a message names the model's config: its config.json path, or the preset / hub id."""
    path = Path(spec.name).expanduser()
    return str(path / "config.json") if path.is_dir() else f"'{spec.name}'"
