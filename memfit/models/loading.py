"""Find a model's config, build it (real weights, random init, or on `meta`), and its tokenizer.

A model name resolves, first match wins, to:
  1. a local directory with a config.json (weights loaded when present, else random init),
  2. a preset shipped with memfit (config only: random init, useful for planning and demos),
  3. a Hugging Face hub id (loaded with `from_pretrained`; needs network access).
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from memfit.config import ModelConfig
from memfit.errors import MemfitError
from memfit.models.tokenizer import byte_tokenizer
from memfit.strategies.attention import attention_implementation

log = logging.getLogger(__name__)

class ModelLoadError(MemfitError):
    pass


def _has_weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))


def load_model_config(spec: ModelConfig) -> tuple[PretrainedConfig, str]:
    """Return (config, source) where source is 'local', 'preset' or 'hub'."""
    from memfit.models.presets import load_preset_config, preset_path

    path = Path(spec.name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model path {path} exists but holds no config.json; "
                                 "point model.name at a folder saved with save_pretrained()")
        return AutoConfig.from_pretrained(path, trust_remote_code=spec.trust_remote_code), "local"
    if preset_path(spec.name) is not None:
        return load_preset_config(spec.name), "preset"
    try:
        config = AutoConfig.from_pretrained(spec.name, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(
            f"model '{spec.name}' is not a local folder, not a memfit preset (`memfit presets` lists them), "
            f"and could not be fetched from the hub: {str(exc).splitlines()[0]}") from None
    return config, "hub"


def build_model(spec: ModelConfig, attention: str = "sdpa", dtype: torch.dtype = torch.float32,
                on_meta: bool = False, load_kwargs: dict | None = None) -> PreTrainedModel:
    """The model, with weights when the source has them; random init otherwise; on `meta` if asked.

    `load_kwargs` go to `from_pretrained` only (e.g. a BitsAndBytesConfig from
    memfit.strategies.quantization.quantized_loading: real weights load straight into 4/8-bit
    layers; a random-init model is quantized after it is built instead)."""
    config, source = load_model_config(spec)
    config._attn_implementation = attention_implementation(attention)
    kwargs = dict(dtype=dtype, trust_remote_code=spec.trust_remote_code)
    pretrained_kwargs = {**kwargs, **(load_kwargs or {})}
    try:
        if on_meta:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, **kwargs)
        if source == "local" and _has_weights(Path(spec.name).expanduser()):
            return AutoModelForCausalLM.from_pretrained(spec.name, config=config, **pretrained_kwargs)
        if source == "hub":
            return AutoModelForCausalLM.from_pretrained(spec.name, config=config, revision=spec.revision,
                                                        **pretrained_kwargs)
    except ValueError as exc:  # transformers' message for "not a causal LM"
        raise ModelLoadError(f"model '{spec.name}' ({config.model_type}) cannot be loaded as a causal LM: "
                             f"{str(exc).splitlines()[0]}") from None
    log.warning("model '%s' has no weights here (%s config): starting from random initialisation", spec.name, source)
    try:
        return AutoModelForCausalLM.from_config(config, **kwargs)
    except ValueError as exc:
        raise ModelLoadError(f"model '{spec.name}' ({config.model_type}) is not a causal LM: "
                             f"{str(exc).splitlines()[0]}") from None


def has_weights(spec: ModelConfig) -> bool:
    """Whether the model's weights can be loaded again (local folder with weights, or hub id);
    presets and config-only folders start from random weights."""
    path = Path(spec.name).expanduser()
    if path.exists():
        return _has_weights(path)
    return not _is_preset(spec.name)


def load_tokenizer(spec: ModelConfig):
    """The model's own tokenizer when it has one, else memfit's byte-level tokenizer."""
    path = Path(spec.name).expanduser()
    try:
        if path.is_dir():
            if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
                tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=spec.trust_remote_code)
            else:
                tokenizer = None
        elif _is_preset(spec.name):
            tokenizer = None
        else:
            tokenizer = AutoTokenizer.from_pretrained(spec.name, revision=spec.revision,
                                                      trust_remote_code=spec.trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(f"tokenizer for '{spec.name}' could not be loaded: {str(exc).splitlines()[0]}") from None
    if tokenizer is None:
        log.info("no tokenizer shipped with '%s': using memfit's byte-level tokenizer", spec.name)
        return byte_tokenizer()
    if tokenizer.pad_token is None:  # many causal LMs ship without one; padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _is_preset(name: str) -> bool:
    from memfit.models.presets import preset_path

    return preset_path(name) is not None
