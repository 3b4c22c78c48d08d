"""What the memory formulas need to know about an architecture, and which of its parameters train.

`model_shape(config)` counts parameters by kind once from a `meta` build (no bytes) and caches
the answer, because the planner asks hundreds of times per config; `trainable_params` and
`lora_params` say how many of them a method (full, LoRA, QLoRA) trains.

Everything is read off the built model, not off names: the decoder blocks are the ModuleList with one
entry per layer; in the first block, the attention is the child whose class says so and the MLP the
other child holding weights; a linear reading the hidden size is an input of its part and the one
writing it back the output (of several, the last built); an MLP with three weight matrices per
width (gate, up, down) is gated, with two (in, out) plain; the norms are the block's children whose
class is a norm. The gated/plain split picks the model family (memory/families/).
"""

from __future__ import annotations

import json
import weakref
from dataclasses import dataclass, field
from functools import lru_cache

import torch
from transformers import AutoConfig, AutoModelForCausalLM

from memfit.config import RunConfig
from memfit.memory.families import gated_dense, plain_dense
from memfit.strategies.adapters import targets_module
from memfit.strategies.precision import precision_entry


@dataclass(frozen=True)
class ModelShape:
    """What the formulas need to know about an architecture (counted once from a meta build)."""

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
    gated_mlp: bool = True      # gate, up and down matrices (else one in and one out matrix)
    block_prefix: str = ""      # the first block's module name ("model.layers.0")
    roles: tuple = field(default=())  # (path in a block, role, in_features, out_features) of each block linear
    head: bool = True           # computes the final norm, lm_head and loss (False: a pipeline stage before the last)
    checkpoint_bytes: int = 2   # bytes per parameter of its released weights (config.json's dtype)

    @property
    def family(self) -> str:
        """The NAME of the memory/families module that describes this model's blocks."""
        return (gated_dense if self.gated_mlp else plain_dense).NAME

    @property
    def head_params(self) -> int:
        """The lm_head's parameters (the embeddings', when tied); 0 on a part of the model without the head."""
        return (self.lm_head_params or self.embedding_params) if self.head else 0

    @property
    def block_linear_params(self) -> int:
        return sum(i * o for _, i, o in self.linear)

    @property
    def largest_linear_params(self) -> int:
        """The biggest block weight matrix: the one a quantized base dequantizes at once."""
        return max(i * o for _, i, o in self.linear)

    @property
    def largest_tensor_params(self) -> int:
        """The biggest single weight: a block matrix, the embeddings or the lm_head."""
        return max(self.largest_linear_params, self.embedding_params, self.lm_head_params)


_SHAPE_BY_ID: dict[int, tuple] = {}  # id(config) -> (weak reference, shape); ids are checked on use


# what a block linear does: reads the attention's or the MLP's input, or writes its output
ATTENTION_INPUT, ATTENTION_OUTPUT = "attention_input", "attention_output"
MLP_INPUT, MLP_OUTPUT = "mlp_input", "mlp_output"


def _linears(module: torch.nn.Module, skip=None) -> list[tuple[str, int, int]]:
    """(name, in_features, out_features) of every linear under `module`, in build order."""
    found = []
    for name, child in module.named_modules():
        if child is skip:
            continue
        if isinstance(child, torch.nn.Linear):
            found.append((name, child.in_features, child.out_features))
        elif type(child).__name__ == "Conv1D":  # GPT-2's transposed linear
            found.append((name, child.weight.shape[0], child.weight.shape[1]))
    return found


def _first_block(model: torch.nn.Module, layers: int) -> tuple[str, torch.nn.Module | None]:
    """The first decoder block: entry 0 of the ModuleList that holds one module per layer."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and len(module) == layers:
            return f"{name}.0", module[0]
    return "", None


def _is_attention(name: str, module: torch.nn.Module) -> bool:
    kind = type(module).__name__.lower()
    return "attention" in kind or "attn" in kind or "attn" in name or "attention" in name


def _roles(block: torch.nn.Module, hidden: int) -> tuple[tuple[str, str, int, int], ...]:
    """Each linear of a block with its role: what reads the hidden size is an input of its part (the
    attention or the MLP), what writes it back is the part's output (when several could, the last built)."""
    roles = []
    for part_name, part in block.named_children():
        linears = _linears(part)
        if not linears:
            continue
        attention = _is_attention(part_name, part)
        writers = [name for name, _, out in linears if out == hidden]
        output = writers[-1] if writers else None
        for name, i, o in linears:
            if name == output:
                role = ATTENTION_OUTPUT if attention else MLP_OUTPUT
            elif i == hidden:
                role = ATTENTION_INPUT if attention else MLP_INPUT
            else:
                continue
            roles.append((f"{part_name}.{name}", role, i, o))
    return tuple(roles)


def _gated_mlp(block: torch.nn.Module, hidden: int, intermediate: int, experts: int) -> bool:
    """Whether the block's MLP holds three weight matrices per unit of width (gate, up, down) rather than
    two (in, out): its weights divided by hidden x width x experts, rounded (biases and a router are small)."""
    for part_name, part in block.named_children():
        if _is_attention(part_name, part) or "norm" in type(part).__name__.lower():
            continue
        weights = sum(p.numel() for p in part.parameters())
        if weights >= hidden * intermediate:
            return round(weights / (hidden * intermediate * experts)) == 3
    return True


def _norms(block: torch.nn.Module) -> int:
    """The block's own norms (a norm inside the attention, such as Qwen3's q/k norm, is the attention's)."""
    return sum(1 for _, child in block.named_children() if "norm" in type(child).__name__.lower())


@lru_cache(maxsize=64)
def _shape_cached(config_json: str) -> ModelShape:
    raw = json.loads(config_json)
    config = AutoConfig.for_model(**raw)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    embed = model.get_input_embeddings()
    head = model.get_output_embeddings()
    tied = head is not None and head.weight is embed.weight
    embedding_params = embed.weight.numel() + sum(
        m.weight.numel() for n, m in model.named_modules() if isinstance(m, torch.nn.Embedding) and m is not embed)
    linear = _linears(model, skip=head)
    total = sum(p.numel() for p in model.parameters())
    text = getattr(config, "get_text_config", lambda: config)()
    hidden = text.hidden_size
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or hidden // heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    if getattr(text, "multi_query", False) and not getattr(text, "new_decoder_architecture", False):
        kv_heads = 1  # falcon-7b
    intermediate = getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden
    if text.model_type == "falcon":
        intermediate = getattr(text, "ffn_hidden_size", None) or 4 * hidden
    layers = text.num_hidden_layers
    experts = getattr(text, "num_local_experts", None) or getattr(text, "num_experts", None) or 1
    prefix, block = _first_block(model, layers)
    gated = block is None or _gated_mlp(block, hidden, intermediate, experts)
    return ModelShape(
        layers=layers, hidden=hidden, q_dim=heads * head_dim,
        kv_dim=kv_heads * head_dim, heads=heads, head_dim=head_dim, intermediate=intermediate,
        vocab=text.vocab_size, experts_per_token=getattr(text, "num_experts_per_tok", None) or 1,
        norms_per_layer=_norms(block) if block is not None else 2, total_params=total,
        embedding_params=embedding_params, lm_head_params=0 if (tied or head is None) else head.weight.numel(),
        linear=tuple(linear), gated_mlp=gated, block_prefix=prefix,
        roles=_roles(block, hidden) if block is not None else (), checkpoint_bytes=_checkpoint_bytes(config))


def _checkpoint_bytes(config) -> int:
    """Bytes per parameter of the released weights: config.json's dtype; a config that names none (GPT-2's)
    was saved in fp32, which is also what transformers assumes for it."""
    dtype = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(dtype, str):
        dtype = getattr(torch, dtype, None)
    return dtype.itemsize if isinstance(dtype, torch.dtype) else 4


def model_shape(model_config) -> ModelShape:
    """The architecture numbers of a transformers config (cached: a meta build takes ~0.05-1 s)."""
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
    return _adapted(shape, _targets(cfg))


@lru_cache(maxsize=256)  # the planner's search asks this for every candidate of the same model
def _adapted(shape: ModelShape, targets) -> tuple[tuple[str, int, int], ...]:
    return tuple(m for m in shape.linear if _is_target(m[0], targets))


@lru_cache(maxsize=256)
def linear_leaf_names(shape: ModelShape) -> frozenset[str]:
    """The distinct last name parts of the block linears (q_proj, gate_proj, ...)."""
    return frozenset(name.rsplit(".", 1)[-1] for name, _, _ in shape.linear)


def block_linears(shape: ModelShape, cfg: RunConfig, role: str) -> list[tuple[str, int, int]]:
    """(path in a block, in_features, out_features) of one block's linears with this role that train:
    all under full fine-tuning, the adapted ones under LoRA."""
    adapted = _adapted_in_block(shape, None if cfg.method == "full" else _targets(cfg))
    return [(path, i, o) for path, r, i, o in shape.roles if r == role and (adapted is None or path in adapted)]


def _targets(cfg: RunConfig):
    targets = cfg.lora.targets
    return targets if isinstance(targets, str) else tuple(targets)


@lru_cache(maxsize=256)
def _adapted_in_block(shape: ModelShape, targets) -> frozenset[str] | None:
    """Paths (in a block) of the first block's adapted linears; None when every linear trains."""
    if targets is None:
        return None
    start = shape.block_prefix + "."
    return frozenset(name[len(start):] for name, _, _ in _adapted(shape, targets) if name.startswith(start))


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
        extra += shape.head_params
    return lora_params(shape, cfg) + extra


def trainable_value_bytes(cfg: RunConfig) -> int:
    """Bytes of each trainable value and of its gradient: LoRA adapters are fp32 (peft's
    autocast_adapter_dtype); full fine-tuning trains the weights in the precision's master dtype."""
    return 4 if cfg.method != "full" else precision_entry(cfg.precision).master_bytes
