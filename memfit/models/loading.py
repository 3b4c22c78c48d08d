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

Real weights must fill the model exactly (memfit/models/weights_check.py): a missing, unexpected or
misshapen tensor stops the run unless model.new_weights / model.dropped_weights name it. The tokenizer
is model.tokenizer, else the model's own; memfit's byte-level tokenizer serves only its own presets and
random-init models, and every tokenizer's ids must fit the model's embedding.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import logging
import os
import pickle
import socket
import threading
import zlib
from pathlib import Path
from urllib.parse import urlparse

import torch
from huggingface_hub import constants as hf_constants, snapshot_download
from huggingface_hub.errors import StrictDataclassError
from safetensors import SafetensorError, safe_open
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer, PretrainedConfig, PreTrainedModel
from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

from memfit.config import ModelConfig
from memfit.errors import MemfitError
from memfit.models.presets import load_preset_config, preset_hub_id, preset_path
from memfit.models.tokenizer import byte_tokenizer
from memfit.models.validate import model_where
from memfit.models.weights_check import check_loading_info
from memfit.strategies.attention import attention_implementation

log = logging.getLogger(__name__)

class ModelLoadError(MemfitError):
    pass


class TokenizerError(ModelLoadError):
    """No tokenizer for real weights, or one whose token ids do not fit the model's embedding."""


# Files any of which makes a folder hold a tokenizer AutoTokenizer can load.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json")


def _has_weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors")) or any(directory.glob("pytorch_model*.bin"))


def _has_tokenizer(directory: Path) -> bool:
    return any((directory / name).is_file() for name in TOKENIZER_FILES)


def _looks_like_path(name: str) -> bool:
    return name.startswith(("/", "./", "../", "~"))


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
    if _looks_like_path(spec.name):  # clearly a path, not a hub id: don't ask the hub
        raise ModelLoadError(f"model.name: {path} is not a local folder: it does not exist")
    try:
        config = from_hub(AutoConfig.from_pretrained, spec.name, "config", revision=spec.revision,
                          trust_remote_code=spec.trust_remote_code)
    except OSError as exc:
        raise ModelLoadError(
            f"model '{spec.name}' is not a local folder, not a memfit preset (`memfit presets` lists them), "
            f"and could not be fetched from the hub: {str(exc).splitlines()[0]}") from None
    except (ValueError, StrictDataclassError) as exc:
        raise _config_error(f"model.name: '{spec.name}'", exc) from None
    return _require_causal_lm(config, spec.name), "hub"


def _read_config(path: Path, spec: ModelConfig, where: str) -> PretrainedConfig:
    try:
        return AutoConfig.from_pretrained(path, trust_remote_code=spec.trust_remote_code)
    except OSError as exc:  # unreadable file or invalid JSON
        raise ModelLoadError(f"{where} could not be read: {str(exc).splitlines()[0]}") from None
    except (ValueError, StrictDataclassError) as exc:
        raise _config_error(where, exc) from None


def _config_error(where: str, exc: Exception) -> ModelLoadError:
    """transformers' errors about a config, said in one line (trust_remote_code gets its own). transformers
    5 validates a config's architecture as it loads (hidden size a multiple of the heads, ...) and wraps
    the reason in a StrictDataclassError whose own first line names only the validator."""
    text = str(exc.__cause__ if isinstance(exc, StrictDataclassError) and exc.__cause__ else exc)
    if "trust_remote_code" in text:
        # Running a model's own Python code is the user's explicit decision, never a default.
        return ModelLoadError(f"{where}: the model ships its own Python code (auto_map), which memfit runs only "
                              "with model.trust_remote_code=true; set that only if you trust its author")
    if isinstance(exc, StrictDataclassError):
        return ModelLoadError(f"{where}: {text.strip().splitlines()[0]} Fix config.json")
    return ModelLoadError(f"{where}: {text.splitlines()[0]}")


def _require_causal_lm(config: PretrainedConfig, name: str) -> PretrainedConfig:
    """Refuse configs that are not decoder language models, before anything is built or written."""
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


def weights_folder(spec: ModelConfig) -> Path | None:
    """The local folder holding the weights `spec` loads (None for random init): a local path as given, a hub
    model's snapshot in the local cache (fetched first when the hub is reachable)."""
    weights = _weights_id(spec)
    if weights is None:
        return None
    if _is_local(weights):
        return Path(weights).expanduser()
    return Path(from_hub(snapshot_download, weights, "weights", revision=spec.revision,
                         allow_patterns=["*.safetensors", "*.json"]))


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
    checked = dict(where=f"model.name: {weights}", new_weights=spec.new_weights,
                   dropped_weights=spec.dropped_weights)
    try:
        if on_meta:
            with torch.device("meta"):
                return AutoModelForCausalLM.from_config(config, **kwargs)
        if weights is not None and _is_local(weights):
            return from_pretrained_checked(AutoModelForCausalLM.from_pretrained, weights, **checked, config=config,
                                           **kwargs, **(load_kwargs or {}))
        if weights is not None:  # the hub: its own config.json, which a preset's copy may abbreviate
            return from_hub(functools.partial(from_pretrained_checked, AutoModelForCausalLM.from_pretrained, **checked),
                            weights, "weights", revision=spec.revision,
                            attn_implementation=config._attn_implementation, **kwargs, **(load_kwargs or {}))
        if _weights_id(spec.model_copy(update={"init": "pretrained"})) is not None:
            log.warning("model.init=random: '%s' trains from random weights, not its pretrained ones", spec.name)
        return random_model(config, kwargs)
    except OSError as exc:
        raise ModelLoadError(f"model.name: the weights of '{weights}' could not be loaded: "
                             f"{str(exc).splitlines()[0]}") from None
    except ValueError as exc:  # transformers' message for "not a causal LM"
        raise ModelLoadError(f"model '{spec.name}' ({config.model_type}) cannot be loaded as a causal LM: "
                             f"{str(exc).splitlines()[0]}") from None
    except pickle.UnpicklingError:  # transformers loads .bin files with torch.load(weights_only=True)
        raise ModelLoadError(f"model.name: the weights in '{spec.name}' hold pickled objects besides tensors; "
                             "memfit does not run pickled code: convert them to safetensors") from None


def random_model(config: PretrainedConfig, kwargs: dict) -> PreTrainedModel:
    """The model of `config` with random weights, each module's seeded by its name and the run's seed
    (`torch.initial_seed()`, set from cfg.seed), so that a process that builds only a part of the model
    (memfit/models/part_loading.py) makes the same values."""
    with parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, **kwargs)
    seed = torch.initial_seed()
    for name, module in model.named_modules():
        if module._parameters:
            initialise_module(model, name, seed)
    model.tie_weights()
    return model


@contextlib.contextmanager
def parameters_on_meta():
    """Build modules whose parameters are on `meta` (no bytes) and whose buffers are real: rotary tables and
    masks are small, computed at construction, and not always remade by a model's `_init_weights`."""
    original = torch.nn.Module.register_parameter

    def register(module, name, param):
        if param is not None and not param.is_meta:
            param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
        original(module, name, param)

    torch.nn.Module.register_parameter = register
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = original


def name_seed(seed: int, name: str) -> int:
    """A seed that depends only on the run's seed and `name` (never on a rank or the number of ranks)."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % 2**63


def initialise_module(model: PreTrainedModel, module_name: str, seed: int) -> None:
    """Give the module `module_name` of `model` host parameters (its own, not its children's) and fill them
    with the model's own init, seeded by the module's name."""
    module = model.get_submodule(module_name)
    for key, param in module._parameters.items():
        if param is not None:
            module._parameters[key] = torch.nn.Parameter(torch.empty_like(param, device="cpu"),
                                                         requires_grad=param.requires_grad)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(name_seed(seed, module_name))
        model._init_weights(module)


def from_pretrained_checked(load, source, where: str, new_weights=(), dropped_weights=(), fix: str | None = None,
                            fix_damaged: str = "copy or save the model again", **kwargs) -> PreTrainedModel:
    """`load(source, **kwargs)` (a `from_pretrained`) whose checkpoint must fill the model exactly
    (memfit/models/weights_check.py); a damaged weights file is one line naming it. `where` starts
    every message, e.g. "model.name: /path/to/model"; `fix` / `fix_damaged` end them."""
    try:
        with _quiet_load_report():
            model, info = load(source, output_loading_info=True, ignore_mismatched_sizes=True, **kwargs)
    except SafetensorError as exc:
        raise ModelLoadError(f"{where}: {_damaged_file(source) or 'a weights file'} is damaged or not safetensors "
                             f"({exc}); {fix_damaged}") from None
    except RuntimeError as exc:
        if isinstance(exc, torch.OutOfMemoryError) or not _is_unreadable_checkpoint(exc):
            raise
        reason = str(exc).splitlines()[0].split(". ")[0]  # torch adds paragraphs of advice after the reason
        raise ModelLoadError(f"{where}: the weights could not be read ({reason}); {fix_damaged}") from None
    check_loading_info(model, info, where, new_weights, dropped_weights, fix)
    return model


@contextlib.contextmanager
def _quiet_load_report():
    """memfit reports what a checkpoint lacks itself (one error, or one warning per allowed group);
    transformers' own table of it, logged as a warning, would repeat it at length. A filter, not a
    level: transformers runs extra checks (and warns) when this logger's level is raised."""
    logger = logging.getLogger("transformers.modeling_utils")
    logger.addFilter(_not_a_load_report)
    try:
        yield
    finally:
        logger.removeFilter(_not_a_load_report)


def _not_a_load_report(record: logging.LogRecord) -> bool:
    return "LOAD REPORT" not in record.getMessage()


def _is_unreadable_checkpoint(exc: RuntimeError) -> bool:
    """transformers' and torch's RuntimeErrors about a checkpoint file (not about the model or memory)."""
    text = str(exc)
    return any(sign in text for sign in ("PytorchStreamReader", "Error(s) in loading state_dict",
                                         "automatic conversion of the weights", "zip archive"))


def _damaged_file(source) -> str | None:
    """The first safetensors file of a local folder that does not open (a truncated copy, other bytes)."""
    folder = Path(str(source)).expanduser()
    for file in sorted(folder.glob("*.safetensors")) if folder.is_dir() else []:
        try:
            with safe_open(str(file), framework="pt"):
                pass
        except (SafetensorError, OSError):
            return str(file)
    return None


def load_saved_model(folder: Path, dtype: torch.dtype) -> PreTrainedModel:
    """A model memfit saved (a run's weights, a LoRA run's base_model/), checked like any checkpoint."""
    return from_pretrained_checked(AutoModelForCausalLM.from_pretrained, folder, str(folder), dtype=dtype,
                                   fix="the saved model is incomplete or does not match its config.json: restore "
                                       "the folder, or train again", fix_damaged="restore the folder, or train again")


def has_weights(spec: ModelConfig) -> bool:
    """Whether the trained base can be loaded again from where it came from (local weights or the hub);
    a random-init base cannot, so a LoRA run saves it next to its adapter."""
    return _weights_id(spec) is not None


def tokenizer_source(spec: ModelConfig) -> str | None:
    """Where the run's tokenizer comes from, decided without the network: a local folder or a hub id, or
    None for memfit's byte-level tokenizer, which only memfit's own presets and random-init models without
    a tokenizer get: real weights learned their own token ids, and byte ids would mean nothing to them."""
    if spec.tokenizer:
        path = Path(spec.tokenizer).expanduser()
        if not (path.exists() or _looks_like_path(spec.tokenizer)):
            return spec.tokenizer  # a hub id
        if not path.exists():
            raise TokenizerError(f"model.tokenizer: {path} does not exist; point it at a folder holding a tokenizer, "
                                 "or at a hub id")
        if not (path.is_dir() and _has_tokenizer(path)):
            raise TokenizerError(f"model.tokenizer: {path} is not a folder holding a tokenizer (none of "
                                 f"{', '.join(TOKENIZER_FILES)}); point it at one, or at a hub id")
        return str(path)
    path = Path(spec.name).expanduser()
    if path.is_dir():
        if _has_tokenizer(path):
            return str(path)
        if spec.init == "pretrained" and _has_weights(path):
            raise TokenizerError(
                f"model.name: {path} holds real weights but no tokenizer (none of {', '.join(TOKENIZER_FILES)} "
                "there), and memfit's byte-level tokenizer would feed them ids they never learned; set model.tokenizer "
                "to the folder or hub id of the tokenizer these weights were trained with")
        return None
    if _looks_like_path(spec.name):  # clearly a path, not a hub id: don't ask the hub
        raise ModelLoadError(f"model.name: {path} is not a local folder: it does not exist")
    if _is_preset(spec.name):  # memfit's own shapes, or a preset's shape from scratch: nothing on the hub fits
        return None if spec.init == "random" else preset_hub_id(spec.name)
    return spec.name


def load_tokenizer(spec: ModelConfig, model_config: PretrainedConfig | None = None):
    """The run's tokenizer (`tokenizer_source`), checked to fit the model's embedding."""
    source = tokenizer_source(spec)
    if source is None:
        log.info("no tokenizer shipped with '%s': using memfit's byte-level tokenizer", spec.name)
        tokenizer = byte_tokenizer()
    else:
        tokenizer = _load_tokenizer(source, spec)
    _check_fits(tokenizer, source, spec, model_config or load_model_config(spec)[0])
    if tokenizer.pad_token is None:  # many causal LMs ship without one; padding is masked anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def check_tokenizer(spec: ModelConfig) -> None:
    """Stop before anything heavy when the run has no usable tokenizer; a hub tokenizer is checked when
    the run loads it (no network here)."""
    source = tokenizer_source(spec)
    if source is None or Path(source).is_dir():
        load_tokenizer(spec)


def _load_tokenizer(source: str, spec: ModelConfig):
    field = "model.tokenizer" if spec.tokenizer else "model.name"
    try:
        if Path(source).is_dir():
            return AutoTokenizer.from_pretrained(source, trust_remote_code=spec.trust_remote_code)
        revision = None if spec.tokenizer else spec.revision  # model.revision names a commit of the model's repo
        return from_hub(AutoTokenizer.from_pretrained, source, "tokenizer", field=field, revision=revision,
                        trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError) as exc:  # ValueError: transformers' check of the repo id's form
        raise TokenizerError(f"{field}: the tokenizer of '{source}' could not be loaded: "
                             f"{str(exc).splitlines()[0]}") from None


def _check_fits(tokenizer, source: str | None, spec: ModelConfig, model_config: PretrainedConfig) -> None:
    """Every token id must have a row in the model's embedding, or the first batch fails with an index error
    deep inside the forward pass."""
    text = getattr(model_config, "get_text_config", lambda: model_config)()
    vocab = getattr(text, "vocab_size", None)
    ids = max(tokenizer.get_vocab().values(), default=-1) + 1
    if not isinstance(vocab, int) or ids <= vocab:
        return
    where = model_where(spec)
    if source is None:
        raise TokenizerError(
            f"model.name: {where}: vocab_size is {vocab}, but memfit's byte-level tokenizer, which a model without "
            f"a tokenizer of its own trains with, uses {ids} token ids; set vocab_size to at least {ids} in "
            "config.json, or point model.tokenizer at a tokenizer that fits")
    field = "model.tokenizer" if spec.tokenizer else "model.name"
    raise TokenizerError(f"{field}: the tokenizer of '{source}' uses {ids} token ids, but the model's embedding "
                         f"({where}: vocab_size) has {vocab} rows; use the tokenizer the model was trained with")


def from_hub(load, name: str, what: str, field: str = "model.name", **kwargs):
    """`load(name, **kwargs)` from the hub, or from the local cache alone when the hub is unreachable:
    huggingface_hub would otherwise retry for about a minute before giving up. `field`: the setting
    that named `name`."""
    reason = hub_unreachable()
    if reason is None:
        return load(name, **kwargs)
    try:
        with _hub_offline():
            return load(name, local_files_only=True, **kwargs)
    except OSError:
        if field != "model.name":
            raise ModelLoadError(f"{field}: '{name}' is not a local folder, and the hub cannot be reached ({reason}) "
                                 f"while the local Hugging Face cache lacks its {what}; download it where the hub is "
                                 f"reachable (`huggingface-cli download {name}`), or point {field} at a local "
                                 "folder") from None
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
