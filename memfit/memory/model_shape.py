"""What the memory formulas need to know about an architecture, and which of its parameters train.

`model_shape(config)` counts parameters by kind once from a `meta` build (no bytes) and caches
the answer, because the planner asks hundreds of times per config; `trainable_params` and
`lora_params` say how many of them a method (full, LoRA, QLoRA) trains.
"""

from __future__ import annotations

import weakref
from dataclasses import dataclass, field
from functools import lru_cache

from memfit.config import RunConfig
from memfit.strategies.adapters import targets_module
from memfit.strategies.precision import precision_entry


@dataclass(frozen=True)
class ModelShape:
    """What the formulas need to know about an architecture (counted once from a meta build)."""

    family: str                 # "llama" (gated MLP, RMSNorm) or "gpt" (plain MLP, LayerNorm)
    layers: int
    hidden: int
    q_dim: int                  # attention heads x head_dim
    kv_dim: int                 # key/value heads x head_dim
    heads: int
    head_dim: int
    intermediate: int           # per-expert MLP width
    vocab: int
    experts_per_token: int      # 1 for dense models
    norms_per_layer: int
    total_params: int
    embedding_params: int       # input embeddings (+ positions)
    lm_head_params: int         # 0 when tied to the embeddings
    linear: tuple = field(default=())  # (module name, in_features, out_features) of every block linear

    @property
    def block_linear_params(self) -> int:
        return sum(i * o for _, i, o in self.linear)


_SHAPE_BY_ID: dict[int, tuple] = {}  # id(config) -> (weak reference, shape); ids are checked on use


@lru_cache(maxsize=64)
def _shape_cached(config_json: str) -> ModelShape:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM
    import json

    raw = json.loads(config_json)
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    embedding_params = embed.weight.numel() + sum(
        m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding) and m is not embed)
    linear = []
    for name, module in model.named_modules():
        if module is head:
            continue
        if isinstance(module, torch.nn.Linear):
            linear.append((name, module.in_features, module.out_features))
        elif type(module).__name__ == "Conv1D":  # GPT-2's transposed linear
            linear.append((name, module.weight.shape[0], module.weight.shape[1]))
    total = sum(p.numel() for p in model.parameters())
    text = getattr(config, "get_text_config", lambda: config)()
    hidden = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        kv_heads = 1  # falcon-7b
    gated = text.model_type not in ("gpt2", "phi", "falcon", "gpt_neox", "gpt_bigcode", "opt")
    intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    if text.model_type == "falcon":
        intermediate = getattr(text, "ffn_hidden_size", None) or 4 * hidden
    layers = text.num_hidden_layers
    norms = 4 if text.model_type in ("gemma2", "gemma3_text") else 2
    if text.model_type in ("phi", "falcon") and not getattr(text, "new_decoder_architecture", False):
        norms = 1  # parallel attention + MLP share one input norm
    return ModelShape(
        family="llama" if gated else "gpt", layers=layers, hidden=hidden, q_dim=heads * head_dim,
        kv_dim=kv_heads * head_dim, heads=heads, head_dim=head_dim, intermediate=intermediate,
        vocab=text.vocab_size, experts_per_token=getattr(text, "num_experts_per_tok", None) or 1,
        norms_per_layer=norms, total_params=total, embedding_params=embedding_params,
        lm_head_params=0 if (tied or head is None) else head.weight.numel(), linear=tuple(linear))


def model_shape(model_config) -> ModelShape:
    """The architecture numbers of a transformers config (cached: a meta build takes ~0.05-1 s)."""
    import json

    entry = _SHAPE_BY_ID.get(id(model_config))  # the planner asks hundreds of times per config object
    if entry is not None and entry[0]() is model_config:
        return entry[1]

    raw = {k: v for k, v in model_config.to_dict().items()
           if k not in ("_name_or_path", "transformers_version", "auto_map")}
    shape = _shape_cached(json.dumps(raw, sort_keys=True, default=str))
    _SHAPE_BY_ID[id(model_config)] = (weakref.ref(model_config), shape)
    return shape


# --- which parameters train ------------------------------------------------------------------------
def _is_target(name: str, targets) -> bool:
    if targets == "all-linear":
        return True
    return any(targets_module(name, t) for t in targets)


def adapted_linears(shape: ModelShape, cfg: RunConfig) -> tuple[tuple[str, int, int], ...]:
    """The block linears that get LoRA adapters (peft matches on the module name's suffix)."""
    if cfg.method == "full":
        return ()
    targets = cfg.lora.targets
    return _adapted(shape, targets if isinstance(targets, str) else tuple(targets))


@lru_cache(maxsize=256)  # the planner's search asks this for every candidate of the same model
def _adapted(shape: ModelShape, targets) -> tuple[tuple[str, int, int], ...]:
    return tuple(m for m in shape.linear if _is_target(m[0], targets))


@lru_cache(maxsize=256)
def linear_leaf_names(shape: ModelShape) -> frozenset[str]:
    """The distinct last name parts of the block linears (q_proj, gate_proj, ...)."""
    return frozenset(name.rsplit(".", 1)[-1] for name, _, _ in shape.linear)


def lora_params(shape: ModelShape, cfg: RunConfig) -> int:
    r = cfg.lora.rank
    return sum(r * (i + o) for _, i, o in adapted_linears(shape, cfg))


def trainable_params(shape: ModelShape, cfg: RunConfig) -> int:
    if cfg.method == "full":
        return shape.total_params
    extra = 0
    if getattr(cfg.lora, "train_embeddings", False):
        extra += shape.embedding_params
    if getattr(cfg.lora, "train_lm_head", False):
        extra += shape.lm_head_params or shape.embedding_params
    return lora_params(shape, cfg) + extra


def trainable_value_bytes(cfg: RunConfig) -> int:
    """Bytes of each trainable value and of its gradient: LoRA adapters are fp32 (peft's
    autocast_adapter_dtype); full fine-tuning trains the weights in the precision's master dtype."""
    return 4 if cfg.method != "full" else precision_entry(cfg.precision).master_bytes
