"""Find a model's config, build it (real weights, random init, or on `meta`), and its tokenizer.

A model name resolves, first match wins, to:
  1. a local directory with a config.json (and, to train its real weights, the weights),
  2. a preset shipped with memfit: its config.json, so planning needs no network. Training a preset
     named by a hub id (`meta-llama/Llama-3.1-8B`, or its short name) loads that hub model's weights
     and tokenizer; memfit's own presets (`memfit/...`) are shapes without weights,
  3. a Hugging Face hub id (loaded with `from_pretrained`).

`model.init` says which weights train: `pretrained` (the default) loads real ones and stops with an
error where there are none, so a typo never trains a random model by accident; `random` builds
the architecture with fresh weights. When the hub cannot be reached (HF_HUB_OFFLINE, no network),
hub loads use the local cache only and fail at once instead of retrying for a minute.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import pickle
import socket
import threading
from pathlib import Path
from urllib.parse import urlparse

import torch
from huggingface_hub import constants as hf_constants
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel

from memfit.config import ModelConfig
from memfit.errors import MemfitError
from memfit.models.presets import load_preset_config, preset_hub_id, preset_path
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
        config = from_hub(AutoConfig.from_pretrained, spec.name, "config", revision=spec.revision,
                          trust_remote_code=spec.trust_remote_code)
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


def missing_weights(spec: ModelConfig) -> str | None:
    """Why model.init=pretrained cannot have real weights (a config-only folder, one of memfit's own
    presets), or None; decided without the network."""
    if spec.init == "random":
        return None
    path = Path(spec.name).expanduser()
    if path.is_dir() and (path / "config.json").is_file() and not _has_weights(path):
        return f"{path} holds a config.json but no weights (*.safetensors or pytorch_model*.bin)"
    if not path.exists() and _is_preset(spec.name) and preset_hub_id(spec.name) is None:
        return f"'{spec.name}' is one of memfit's own presets, a model shape with no pretrained weights"
    return None


def check_weights(spec: ModelConfig) -> None:
    """Stop before anything heavy when model.init=pretrained cannot have real weights."""
    reason = missing_weights(spec)
    if reason:
        raise ModelLoadError(f"model.name: {reason}; add the weights, or set model.init=random to train "
                             "the architecture from random weights")


def _weights_id(spec: ModelConfig) -> str | None:
    """What from_pretrained loads real weights from (a local folder or a hub id); None: random init."""
    if spec.init == "random":
        return None
    path = Path(spec.name).expanduser()
    if path.exists():
        return spec.name if _has_weights(path) else None
    return preset_hub_id(spec.name) or (None if _is_preset(spec.name) else spec.name)


def _is_local(name: str) -> bool:
    return Path(name).expanduser().exists()


def build_model(spec: ModelConfig, attention: str = "sdpa", dtype: torch.dtype = torch.float32,
                on_meta: bool = False, load_kwargs: dict | None = None) -> PreTrainedModel:
    """The model with its real weights (model.init=pretrained), random ones (model.init=random), or on
    `meta` (no memory: planning, or a sharded rank that receives its weights).

    `load_kwargs` go to `from_pretrained` only (e.g. a BitsAndBytesConfig from
    memfit.strategies.quantization.quantized_loading: real weights load straight into 4/8-bit
    layers; a random-init model is quantized after it is built instead)."""
    config, _ = load_model_config(spec)
    config._attn_implementation = attention_implementation(attention)
    kwargs = dict(dtype=dtype, trust_remote_code=spec.trust_remote_code)
    if not on_meta:
        check_weights(spec)
    weights = None if on_meta else _weights_id(spec)
    try:
        if on_meta:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, **kwargs)
        if weights is not None and _is_local(weights):
            return AutoModelForCausalLM.from_pretrained(weights, config=config, **kwargs, **(load_kwargs or {}))
        if weights is not None:  # the hub: its own config.json, which a preset's copy may abbreviate
            return from_hub(AutoModelForCausalLM.from_pretrained, weights, "weights", revision=spec.revision,
                            attn_implementation=config._attn_implementation, **kwargs, **(load_kwargs or {}))
        if _weights_id(spec.model_copy(update={"init": "pretrained"})) is not None:
            log.warning("model.init=random: '%s' trains from random weights, not its pretrained ones", spec.name)
        return AutoModelForCausalLM.from_config(config, **kwargs)
    except OSError as exc:
        raise ModelLoadError(f"model.name: the weights of '{weights}' could not be loaded: "
                             f"{str(exc).splitlines()[0]}") from None
    except ValueError as exc:  # transformers' message for "not a causal LM"
        raise ModelLoadError(f"model '{spec.name}' ({config.model_type}) cannot be loaded as a causal LM: "
                             f"{str(exc).splitlines()[0]}") from None
    except pickle.UnpicklingError:  # transformers loads .bin files with torch.load(weights_only=True)
        raise ModelLoadError(f"model.name: the weights in '{spec.name}' hold pickled objects besides tensors; "
                             "memfit does not run pickled code: convert them to safetensors") from None


def has_weights(spec: ModelConfig) -> bool:
    """Whether the trained base can be loaded again from where it came from (local weights or the hub);
    a random-init base cannot, so a LoRA run saves it next to its adapter."""
    return _weights_id(spec) is not None


def load_tokenizer(spec: ModelConfig):
    """The model's own tokenizer when it has one, else memfit's byte-level tokenizer."""
    path = Path(spec.name).expanduser()
    hub_id = None if path.exists() else (preset_hub_id(spec.name) if _is_preset(spec.name) else spec.name)
    if _is_preset(spec.name) and spec.init == "random":
        hub_id = None  # a preset's shape from scratch: nothing on the hub matches it
    try:
        if path.is_dir():
            if (path / "tokenizer_config.json").is_file() or (path / "tokenizer.json").is_file():
                tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=spec.trust_remote_code)
            else:
                tokenizer = None
        elif spec.name.startswith(("/", "./", "../", "~")):  # clearly a path, not a hub id: don't ask the hub
            raise ModelLoadError(f"model.name: {path} is not a local folder: it does not exist")
        elif hub_id is None:
            tokenizer = None
        else:
            tokenizer = from_hub(AutoTokenizer.from_pretrained, hub_id, "tokenizer", revision=spec.revision,
                                 trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError) as exc:  # ValueError: transformers' check of the repo id's form
        raise ModelLoadError(f"tokenizer for '{spec.name}' could not be loaded: {str(exc).splitlines()[0]}") from None
    if tokenizer is None:
        log.info("no tokenizer shipped with '%s': using memfit's byte-level tokenizer", spec.name)
        return byte_tokenizer()
    if tokenizer.pad_token is None:  # many causal LMs ship without one; padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def from_hub(load, name: str, what: str, **kwargs):
    """`load(name, **kwargs)` from the hub, or from the local cache alone when the hub is unreachable:
    huggingface_hub would otherwise retry for about a minute before giving up."""
    reason = hub_unreachable()
    if reason is None:
        return load(name, **kwargs)
    try:
        with _hub_offline():
            return load(name, local_files_only=True, **kwargs)
    except OSError:
        raise ModelLoadError(f"model '{name}': not a local folder, and the hub cannot be reached ({reason}) while "
                             f"the local Hugging Face cache lacks its {what}; download it where the hub is "
                             f"reachable (`huggingface-cli download {name}`), point model.name at a local folder, "
                             "or use a memfit preset (`memfit presets` lists them)") from None


@contextlib.contextmanager
def _hub_offline():
    """huggingface_hub's offline mode, as HF_HUB_OFFLINE=1 sets it at import: local_files_only alone does
    not reach every lookup transformers makes (the adapter-config probe retries for ~25 s)."""
    previous = hf_constants.HF_HUB_OFFLINE
    hf_constants.HF_HUB_OFFLINE = True
    try:
        yield
    finally:
        hf_constants.HF_HUB_OFFLINE = previous


HUB_PROBE_TIMEOUT_S = 3.0


@functools.lru_cache(maxsize=None)
def _probe(host: str, port: int) -> str | None:
    """Why a TCP connection to the hub fails (None: it connects). DNS lookups ignore socket timeouts,
    so the probe runs in a thread that is abandoned after HUB_PROBE_TIMEOUT_S."""
    outcome: list[str | None] = []

    def connect() -> None:
        try:
            socket.create_connection((host, port), timeout=HUB_PROBE_TIMEOUT_S).close()
            outcome.append(None)
        except OSError as exc:
            outcome.append(f"{host}:{port}: {exc.strerror or exc}")

    thread = threading.Thread(target=connect, daemon=True)
    thread.start()
    thread.join(HUB_PROBE_TIMEOUT_S + 0.5)
    return outcome[0] if outcome else f"{host}:{port}: no answer within {HUB_PROBE_TIMEOUT_S:.0f} s"


def hub_unreachable() -> str | None:
    """None when the Hugging Face hub answers; otherwise why not (HF_HUB_OFFLINE set, or no connection)."""
    if os.environ.get("HF_HUB_OFFLINE", "").strip().upper() in ("1", "ON", "YES", "TRUE"):
        return "HF_HUB_OFFLINE is set"
    endpoint = urlparse(os.environ.get("HF_ENDPOINT") or "https://huggingface.co")
    return _probe(endpoint.hostname or "huggingface.co", endpoint.port or (443 if endpoint.scheme == "https" else 80))


def _is_preset(name: str) -> bool:
    return preset_path(name) is not None


def drop_tied_copies(hf_model, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Gathered copies hide a weight tie from transformers: drop the duplicates as a one-process save does."""
    if getattr(hf_model.config, "tie_word_embeddings", False):
        tied = getattr(hf_model, "_tied_weights_keys", None) or {}
        for key in (tied if isinstance(tied, dict) else []):
            if tied[key] in state:
                state.pop(key, None)
    return state
