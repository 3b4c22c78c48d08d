"""Find a model's config, build it (real weights, random init, or on `meta`), and its tokenizer.

A model name resolves, first match wins, to:
  1. a local directory with a config.json (weights loaded when present, else random init),
  2. a preset shipped with memfit (config only: random init, useful for planning and demos),
  3. a Hugging Face hub id (loaded with `from_pretrained`; needs network access).
"""

from __future__ import annotations

import logging
import pickle
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from memfit.config import ModelConfig
from memfit.errors import MemfitError
from memfit.models.presets import load_preset_config, preset_path
from memfit.models.tokenizer import byte_tokenizer
from memfit.strategies.attention import attention_implementation

log = logging.getLogger(__name__)

class ModelLoadError(MemfitError):
    pass


def _has_weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))


def load_model_config(spec: ModelConfig) -> tuple[PretrainedConfig, str]:
    """Return (config, source) where source is 'local', 'preset' or 'hub'."""
    path = Path(spec.name).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelLoadError(f"model path {path} exists but holds no config.json; "
                                 "point model.name at a folder saved with save_pretrained()")
        config = _read_config(path, spec, f"model.name: {path / 'config.json'}")
        return _require_causal_lm(config, spec.name), "local"
    if preset_path(spec.name) is not None:
        return load_preset_config(spec.name), "preset"
    if spec.name.startswith(("/", "./", "../", "~")):  # clearly a path, not a hub id: don't ask the hub
        raise ModelLoadError(f"model.name: {path} is not a local folder: it does not exist")
    try:
        config = AutoConfig.from_pretrained(spec.name, revision=spec.revision, trust_remote_code=spec.trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(
            f"model '{spec.name}' is not a local folder, not a memfit preset (`memfit presets` lists them), "
            f"and could not be fetched from the hub: {str(exc).splitlines()[0]}") from None
    except ValueError as exc:
        raise _config_error(f"model.name: '{spec.name}'", exc) from None
    return _require_causal_lm(config, spec.name), "hub"


def _read_config(path: Path, spec: ModelConfig, where: str) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=spec.trust_remote_code)
    except OSError as exc:  # unreadable file or invalid JSON
        raise ModelLoadError(f"{where} could not be read: {str(exc).splitlines()[0]}") from None
    except ValueError as exc:
        raise _config_error(where, exc) from None


def _config_error(where: str, exc: ValueError) -> ModelLoadError:
    """transformers' ValueErrors about a config, said in one line (trust_remote_code gets its own)."""
    text = str(exc)
    if "trust_remote_code" in text:
        # Running a model's own Python code is the user's explicit decision, never a default.
        return ModelLoadError(f"{where}: the model ships its own Python code (auto_map), which memfit runs only "
                              "with model.trust_remote_code=true; set that only if you trust its author")
    return ModelLoadError(f"{where}: {text.splitlines()[0]}")


def _require_causal_lm(config: PretrainedConfig, name: str) -> PretrainedConfig:
    """Refuse configs that are not decoder language models, before anything is built or written."""
    import inspect

    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    model_class = MODEL_FOR_CAUSAL_LM_MAPPING.get(type(config), None)
    if model_class is None:
        raise ModelLoadError(f"model.name: '{name}' is a {config.model_type} model, which is not a causal "
                             "language model (transformers has no AutoModelForCausalLM class for it); memfit "
                             "fine-tunes decoder models such as llama, mistral, qwen2, gemma, gpt2")
    # BERT-like encoders have a causal LM head class, but it attends both ways unless is_decoder is set.
    try:
        encoder = "as a standalone" in inspect.getsource(model_class.__init__)
    except (OSError, TypeError):
        encoder = False
    if encoder and not getattr(config, "is_decoder", False):
        raise ModelLoadError(f"model.name: '{name}' is a {config.model_type} encoder (bidirectional attention), "
                             "not a causal language model; use a decoder model, or set is_decoder: true in its "
                             "config.json if it really is one")
    return config


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
    except pickle.UnpicklingError:  # transformers loads .bin files with torch.load(weights_only=True)
        raise ModelLoadError(f"model.name: the weights in '{spec.name}' hold pickled objects besides tensors; "
                             "memfit does not run pickled code: convert them to safetensors") from None
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
        elif spec.name.startswith(("/", "./", "../", "~")):  # clearly a path, not a hub id: don't ask the hub
            raise ModelLoadError(f"model.name: {path} is not a local folder: it does not exist")
        else:
            tokenizer = AutoTokenizer.from_pretrained(spec.name, revision=spec.revision,
                                                      trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError) as exc:  # ValueError: transformers' check of the repo id's form
        raise ModelLoadError(f"tokenizer for '{spec.name}' could not be loaded: {str(exc).splitlines()[0]}") from None
    if tokenizer is None:
        log.info("no tokenizer shipped with '%s': using memfit's byte-level tokenizer", spec.name)
        return byte_tokenizer()
    if tokenizer.pad_token is None:  # many causal LMs ship without one; padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def _is_preset(name: str) -> bool:
    return preset_path(name) is not None
