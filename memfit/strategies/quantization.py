"""Quantized base weights for LoRA/QLoRA: 4-bit (NF4, FP4, optional double quantization) or int8.

Backends, first that works wins (`quant_backend: auto`):
  bitsandbytes  `Linear4bit` (nf4, nf4-dq, fp4) and `Linear8bitLt` (int8). Runs on CUDA and, with
                bitsandbytes 0.50, on CPU (both 4-bit and int8 were trained here on a 2-core CPU).
  torchao       `NF4Tensor` weights in ordinary `nn.Linear` layers: the portable path. It always
                double-quantizes its block scales, so `nf4` and `nf4-dq` both give its NF4 layout;
                it has no fp4 or int8 base weights.

Byte layout per quantized weight of N values (what the tracker and the planner count):
  bitsandbytes nf4/fp4  N/2 B packed codes (uint8) + N/64 * 4 B absmax (fp32) + 64 B code table
  bitsandbytes nf4-dq   N/2 B + N/64 * 1 B absmax (uint8) + N/16384 * 4 B second-level absmax (fp32)
                        + 1 KiB second-level code table + 64 B code table + 4 B offset
  torchao NF4           N/2 B + N/64 * 1 B scalers (int8) + N/(64*256) * 4 B factors (fp32)
                        + 64 B NF4 table + 4 B scaler mean
  bitsandbytes int8     N * 1 B (int8) + rows * 4 B scale (fp32)
(small tables are per layer; "64 B code table" is 16 fp32 values).

Shapes (bitsandbytes 0.50.2, measured on a CPU with AVX512-BF16; nf4, nf4-dq, fp4 alike, fp32 or bf16):
the training kernel (dequantize, then matmul) runs every shape, in training and in evaluation; int8 and
torchao's NF4 run every shape too, except that torchao needs each weight's size to be a multiple of
TORCHAO_BLOCK (`torchao_shape_problem`). What fails is bitsandbytes' CPU inference fast path: in eval mode
under no_grad, on a CPU with AVX512-BF16, `Linear4bit` repacks its weight in place for a fused kernel
that needs out_features % 32 == 0 and in_features % blocksize == 0 (the demo's down_proj, 352 -> 128,
fails with "shape '[128, 5]' is invalid"), and the repacked layer then keeps using that kernel in
training, which passes no gradient to its input (every adapter below it would stop learning). memfit
keeps the training kernel (`keep_training_kernels`). CUDA has neither limit: its 4-bit matmul falls
back to dequantize + matmul when in_features is not a multiple of the blocksize, and int8 to an fp32
matmul when it is not a multiple of 4.

Real models keep bitsandbytes' block scales in a `quant_state` object the module system does not
see; `track_quant_state` registers them as non-persistent buffers so that `module.buffers()` (and
with it the memory tracker and `.to()`) include them. Quantize on the target device: a later
`.to(other_device)` would copy those buffers apart from the quant_state.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily

from memfit.errors import MemfitError, MissingPackageError, require
from memfit.strategies.entries import entry_lookup
from memfit.strategies.precision import precision_entry
from memfit.tensors import storages

log = logging.getLogger(__name__)

QUANT_BACKENDS = ("bitsandbytes", "torchao")
_SUPPORTED = {"bitsandbytes": ("nf4", "nf4-dq", "fp4", "int8"), "torchao": ("nf4", "nf4-dq")}
_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}
BNB_BLOCK = 64           # values per absmax (bitsandbytes' QLoRA default)
BNB_NESTED_BLOCK = 256   # absmax values per fp32 second-level scale (double quantization)
TORCHAO_BLOCK = 64       # values per scaler
TORCHAO_SCALER_BLOCK = 256  # scalers per fp32 quantization factor (reduced for small layers, see below)
INT8_THRESHOLD = 6.0     # LLM.int8() outlier threshold, transformers' BitsAndBytesConfig default


@dataclass(frozen=True)
class QuantEntry:
    """One way to store the frozen base weights, with what the planner needs to know of it."""

    name: str                # the value of quant.scheme
    bits: int                # bits per stored value (0: not quantized)
    bytes_per_param: float   # one stored value with its share of the block scales (the layout above)
    dequant_bytes: float     # what one dequantization pass moves per value: read the packed value and
                             # its first-level scale, write the 16-bit copy
    gives_up: str = ""       # for the plan's table


_CODES_4BIT = 4 / 8
QUANT_ENTRIES = (
    QuantEntry("none", 0, 0.0, 0.0),
    QuantEntry("nf4", 4, _CODES_4BIT + 4 / BNB_BLOCK, _CODES_4BIT + 4 / BNB_BLOCK + 2, "4-bit NF4 base weights"),
    QuantEntry("nf4-dq", 4, _CODES_4BIT + 1 / BNB_BLOCK + 4 / (BNB_BLOCK * BNB_NESTED_BLOCK),
               _CODES_4BIT + 1 / BNB_BLOCK + 2, "4-bit NF4 base weights"),
    QuantEntry("fp4", 4, _CODES_4BIT + 4 / BNB_BLOCK, _CODES_4BIT + 4 / BNB_BLOCK + 2, "4-bit FP4 base weights"),
    QuantEntry("int8", 8, 1.0, 1.0 + 2, "8-bit base weights"),  # + one fp32 scale per row: negligible
)
QUANT_SCHEMES, quant_entry = entry_lookup(QUANT_ENTRIES, "quant.scheme")
FOUR_BIT = tuple(entry.name for entry in QUANT_ENTRIES if entry.bits == 4)


class QuantizationError(MemfitError):
    pass


def quantization_problems(*, method: str, scheme: str, backend: str, merge: bool) -> list[str]:
    """Combinations of the method (`method`, `lora.merge`) and the quantization (`quant.scheme`,
    `quant.backend`) that cannot work, one message each, for the config's list of problems."""
    problems = []
    if method == "full" and scheme != "none":
        problems.append(f"quant: {scheme} freezes the base weights, so it needs method: lora or qlora "
                        "(got method: full)")
    if method == "qlora" and scheme not in FOUR_BIT:
        problems.append(f"quant: method: qlora needs 4-bit base weights ({', '.join(FOUR_BIT)}); got "
                        f"{scheme} "
                        "(for 8-bit base weights use method: lora with quant: int8)")
    if backend == "torchao" and scheme not in ("none", *_SUPPORTED["torchao"]):
        problems.append(f"quant.backend: torchao provides only nf4 / nf4-dq base weights, not {scheme}; "
                        "use quant.backend: bitsandbytes or auto")
    if scheme == "none" and backend != "auto":
        problems.append(f"quant.backend: {backend} is set but quant is none; set quant or drop quant_backend")
    if merge and method == "full":
        problems.append("lora.merge: true merges LoRA adapters into the base; method: full has none to merge")
    return problems


def sharded_quantization_problems(scheme: str, backend: str, sharding: str) -> list[str]:
    """Why FSDP2 (`sharding`: zero2/zero3) cannot shard a base quantized to `scheme` with `backend`. FSDP2
    shards torchao's NF4 tensor, which carries its block scales inside and splits by rows; bitsandbytes
    keeps its scales in a quant_state beside the weight, where FSDP2 cannot shard them."""
    if scheme not in _SUPPORTED["torchao"]:
        return [f"quant: {scheme} with distributed.sharding: {sharding} (FSDP2) is not supported: FSDP2 shards "
                f"torchao's NF4 base only ({', '.join(_SUPPORTED['torchao'])}), and bitsandbytes' {scheme} layers keep "
                "their scales outside the weight, where FSDP2 cannot shard them; use quant: nf4-dq (method: qlora), "
                "or distributed.sharding: ddp / zero1"]
    if backend == "bitsandbytes":
        return [f"quant.backend: bitsandbytes with distributed.sharding: {sharding} (FSDP2) is not supported: its "
                "4-bit layers keep their scales outside the weight, where FSDP2 cannot shard them; use "
                "quant.backend: torchao (or auto, which picks it under FSDP2), or distributed.sharding: ddp / zero1"]
    return []


def compute_dtype(setting: str, precision: str) -> torch.dtype:
    """dtype the dequantized weights are multiplied in: `setting` (quant.compute_dtype) unless it is auto,
    which follows `precision` (a precision entry's name)."""
    if setting != "auto":
        return _DTYPES[setting]
    return precision_entry(precision).compute_dtype


def choose_backend(quant: str, backend: str = "auto") -> str:
    """The first backend that is installed and supports `quant`; a clear error listing them otherwise."""
    candidates = QUANT_BACKENDS if backend == "auto" else (backend,)
    tried = []
    for name in candidates:
        if quant not in _SUPPORTED[name]:
            tried.append(f"{name}: has no {quant} base weights")
            continue
        try:
            require("bitsandbytes" if name == "bitsandbytes" else "torchao.quantization", f"quant: {quant}",
                    install=name)
        except MissingPackageError as exc:
            tried.append(f"{name}: not installed ({str(exc).split(' (')[0]})")
            continue
        return name
    raise QuantizationError(f"quant: {quant}: no backend can provide it here; tried " + "; ".join(tried) +
                            f". Supported backends: bitsandbytes ({', '.join(_SUPPORTED['bitsandbytes'])}), "
                            f"torchao ({', '.join(_SUPPORTED['torchao'])})")


def bitsandbytes_config(scheme: str, dtype: torch.dtype):
    """transformers' BitsAndBytesConfig for loading real weights straight into quantized layers of
    `scheme`, computing in `dtype` (`compute_dtype`)."""
    # Imported here: memfit.config (so `memfit --help`) imports this module, and transformers takes
    # 0.7 s to import.
    from transformers import BitsAndBytesConfig

    if scheme == "int8":
        return BitsAndBytesConfig(load_in_8bit=True, llm_int8_threshold=INT8_THRESHOLD,
                                  llm_int8_skip_modules=["lm_head"])
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="fp4" if scheme == "fp4" else "nf4",
                              bnb_4bit_use_double_quant=scheme == "nf4-dq",
                              bnb_4bit_compute_dtype=dtype, llm_int8_skip_modules=["lm_head"])


# The peak while one weight of N values is dequantized for its matmul, per value, by backend (measured with
# memfit's tracker on the CPU, torchao 0.18 / bitsandbytes 0.50.2, 4096 x 1024 and 4096 x 4096 weights):
#   bitsandbytes 4-bit  the dequantized copy (+ 1/16 B while double quantization's absmax is restored)
#   torchao NF4         8 + 3 x the compute dtype's bytes: 20 B in fp32, 14 B in bf16 (get_original_weight
#                       unpacks the codes, looks them up in the NF4 table and scales them, all whole-tensor)
#   int8                2 B (bitsandbytes' 8-bit matmul)
def dequantize_peak_per_value(scheme: str, backend: str, compute_bytes: int) -> float:
    """Bytes per value alive while one base weight quantized to `scheme` by `backend` is dequantized."""
    if scheme == "int8":
        return 2
    if backend == "torchao":
        return 8 + 3 * compute_bytes
    return compute_bytes + (1 / 16 if scheme == "nf4-dq" else 0)


def torchao_quantize_peak_per_value(compute_bytes: int) -> float:
    """Bytes per value alive while torchao's `to_nf4` quantizes one weight held in a dtype of `compute_bytes`
    (its block absmax, normalised copies and code search, whole-tensor): measured with memfit's tracker on
    a 3840 x 1408 weight, 17.5 B in bf16, 33.9 B in fp32."""
    return 1 + 8.2 * compute_bytes


def quantizes_while_loading(*, method: str, scheme: str, backend: str) -> bool:
    """A quantized base that bitsandbytes quantizes tensor by tensor as the weights load."""
    return method != "full" and scheme != "none" and choose_backend(scheme, backend) == "bitsandbytes"


def quantizes_after_loading(*, method: str, scheme: str, backend: str) -> bool:
    """A quantized base that torchao quantizes once it is loaded."""
    return method != "full" and scheme != "none" and choose_backend(scheme, backend) == "torchao"


def quantized_loading(*, method: str, scheme: str, backend: str, dtype: torch.dtype,
                      device: torch.device | None = None) -> dict:
    """from_pretrained kwargs that load real weights straight into bitsandbytes layers ({} when the
    base is not quantized or the backend is torchao, which quantizes after loading)."""
    if not quantizes_while_loading(method=method, scheme=scheme, backend=backend):
        return {}
    return {"quantization_config": bitsandbytes_config(scheme, dtype), "device_map": {"": str(device or "cpu")}}


# --- what is quantized ---------------------------------------------------------------------------

def is_quantized_linear(module: nn.Module) -> bool:
    weight = getattr(module, "weight", None)
    if weight is None or not isinstance(module, nn.Linear):
        return False
    return (type(weight).__name__ in ("Params4bit", "Int8Params") or is_nf4(weight)
            or getattr(weight, "quant_state", None) is not None or weight.dtype == torch.int8)


def is_nf4(tensor) -> bool:
    """A torchao NF4 tensor (by name: torchao is imported only where it quantizes)."""
    return type(tensor).__name__ == "NF4Tensor"


def is_quantized(model: nn.Module) -> bool:
    return any(is_quantized_linear(m) for m in model.modules())


def _is_fake(tensor: torch.Tensor) -> bool:
    return isinstance(tensor, FakeTensor)


def _linears_to_quantize(model: nn.Module) -> list[tuple[nn.Module, str, nn.Linear, str]]:
    """(parent, attribute name, layer, full module name) of every nn.Linear except the output head
    (kept in high precision, as QLoRA does)."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    found = []
    for prefix, parent in model.named_modules():
        for name, child in parent.named_children():
            if type(child) is nn.Linear and child is not head:
                found.append((parent, name, child, f"{prefix}.{name}" if prefix else name))
    return found


# --- shapes a backend cannot quantize ----------------------------------------------------------

def torchao_shape_problem(quant: str, linears, shards: int = 1) -> str | None:
    """Why torchao cannot quantize these (name, in_features, out_features) layers, or None: its NF4
    splits each weight into blocks of TORCHAO_BLOCK values and has no partial block, and FSDP2 cuts an
    NF4 weight into `shards` equal row shards of whole blocks (no padding)."""
    for name, in_f, out_f in linears:
        if (in_f * out_f) % TORCHAO_BLOCK:
            return (f"quant: {quant} with torchao needs every quantized weight to hold a multiple of {TORCHAO_BLOCK} "
                    f"values; {name} is {out_f} x {in_f} ({in_f * out_f:,} values). Use quant.backend: bitsandbytes "
                    "(it quantizes any shape), or method: lora without quant")
        if shards > 1 and (out_f % shards or (in_f * out_f) % (TORCHAO_BLOCK * shards)):
            return (f"quant: {quant} sharded by FSDP2 over {shards} ranks needs every quantized weight's rows to split "
                    f"into {shards} equal shards of whole {TORCHAO_BLOCK}-value blocks; {name} is {out_f} x {in_f}. "
                    f"Use a data-parallel size that divides {out_f}, or distributed.sharding: ddp")
    return None


def quantized_base_shape_problem(*, method: str, scheme: str, backend: str, linears, shards: int = 1) -> str | None:
    """Why a base quantized to `scheme` cannot be built for these (name, in_features, out_features) block
    layers with the backend `backend` (quant.backend) gives here, cut into `shards` FSDP2 row shards, or
    None (the planner's search skips such plans)."""
    if method == "full" or scheme == "none":
        return None
    try:
        chosen = choose_backend(scheme, backend)
    except QuantizationError:
        return None  # no backend at all: the build says so, naming what to install
    return torchao_shape_problem(scheme, linears, shards) if chosen == "torchao" else None


def keep_training_kernels(model: nn.Module) -> None:
    """Make bitsandbytes' 4-bit layers compute in evaluation as they do in training (see the module
    docstring): their CPU inference fast path fails for common shapes and, once taken, leaves the
    layer without an input gradient for the rest of the run."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):  # bitsandbytes' Linear4bit
            module.support_avx512bf16_for_cpu = False


# --- quantize --------------------------------------------------------------------------------------

def quantize_model(model: nn.Module, quant: str, backend: str = "auto",
                   dtype: torch.dtype = torch.float32, shards: int = 1) -> nn.Module:
    """Replace the base Linear layers by quantized ones, in place. No-op for quant none or a model
    already quantized (e.g. loaded with a BitsAndBytesConfig). `dtype` is the compute dtype; `shards`:
    how many row shards FSDP2 cuts each weight into (torchao only)."""
    if quant == "none":
        return model
    if not is_quantized(model):
        chosen = choose_backend(quant, backend)
        make = {"bitsandbytes": _bnb_linear, "torchao": _torchao_linear}[chosen]
        if any(p.device.type == "meta" for p in model.parameters()):
            make = {"bitsandbytes": _bnb_meta_linear, "torchao": _torchao_meta_linear}[chosen]
        layers = _linears_to_quantize(model)
        shapes = [(full, linear.in_features, linear.out_features) for _, _, linear, full in layers]
        problem = torchao_shape_problem(quant, shapes, shards) if chosen == "torchao" else None
        if problem:  # before any layer changes
            raise QuantizationError(problem)
        extra = {"shards": shards} if chosen == "torchao" else {}
        for parent, name, linear, _ in layers:
            setattr(parent, name, make(linear, quant, dtype, **extra))
        log.info("quantized the base Linear layers to %s with %s", quant, chosen)
    keep_training_kernels(model)  # also for a model loaded already quantized
    if quant == "int8":
        model.is_loaded_in_8bit = True  # tells peft to wrap with its bitsandbytes 8-bit LoRA layer
    elif any(type(m).__name__ == "Linear4bit" for m in model.modules()):
        model.is_loaded_in_4bit = True  # tells peft to wrap with its bitsandbytes 4-bit LoRA layer
    track_quant_state(model)
    return model


def _bnb_linear(linear: nn.Linear, quant: str, dtype: torch.dtype) -> nn.Module:
    bnb = require("bitsandbytes", f"quant: {quant}")
    weight, device = linear.weight.detach(), linear.weight.device
    fake = _is_fake(weight)
    with unset_fake_temporarily():  # bitsandbytes' modules cannot be constructed inside FakeTensorMode
        if quant == "int8":
            new = bnb.nn.Linear8bitLt(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                      has_fp16_weights=False, threshold=INT8_THRESHOLD, device="meta")
        else:
            new = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=linear.bias is not None,
                                    compute_dtype=dtype, compress_statistics=quant == "nf4-dq",
                                    quant_type="fp4" if quant == "fp4" else "nf4", device="meta")
    if linear.bias is not None:
        new.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    if fake:
        # bitsandbytes' Params4bit / Int8Params cannot wrap a FakeTensor; the planner's trace gets a
        # plain Parameter holding the same quantized tensors (bitsandbytes' ops have fake kernels).
        _bnb_fake_weight(new, weight, quant)
        return new
    if quant == "int8":
        new.weight = bnb.nn.Int8Params(weight.clone(), requires_grad=False, has_fp16_weights=False)
    else:
        new.weight = bnb.nn.Params4bit(weight.clone(), requires_grad=False, blocksize=BNB_BLOCK,
                                       compress_statistics=quant == "nf4-dq", quant_type=new.weight.quant_type,
                                       quant_storage=torch.uint8, module=new)
    return new.to(device)  # bitsandbytes quantizes when the weight moves to its device


def _bnb_fake_weight(new: nn.Module, weight: torch.Tensor, quant: str) -> None:
    bnb = require("bitsandbytes", f"quant: {quant}")
    if quant == "int8":
        scale = weight.abs().amax(dim=1).float()  # row-wise absmax, as Int8Params keeps in SCB
        new.weight = nn.Parameter(weight.to(torch.int8), requires_grad=False)
        new.register_buffer("quant_scb", scale, persistent=False)
        _relink_int8_state(new, ())
        return
    packed, state = bnb.functional.quantize_4bit(weight, blocksize=BNB_BLOCK, compress_statistics=quant == "nf4-dq",
                                                 quant_type="fp4" if quant == "fp4" else "nf4",
                                                 quant_storage=torch.uint8)
    new.weight = nn.Parameter(packed, requires_grad=False)
    new.weight.quant_state = new.quant_state = state
    new.weight.compress_statistics, new.weight.quant_type = quant == "nf4-dq", state.quant_type
    new.weight.bnb_quantized, new.weight.blocksize = True, BNB_BLOCK


def torchao_scaler_block(values: int, shards: int = 1) -> int:
    """Scalers per fp32 quantization factor for a weight of `values` values split into `shards` row shards.
    torchao groups scalers in blocks of 256 and needs the block count to divide evenly, and FSDP2's split
    of an NF4 weight needs every shard to hold whole blocks: small layers (tests) use the largest power of
    two that does, which changes only the tiny fp32 part."""
    blocks = values // TORCHAO_BLOCK
    scaler_block = TORCHAO_SCALER_BLOCK
    while scaler_block > 1 and blocks % (scaler_block * shards):
        scaler_block //= 2
    return scaler_block


def _torchao_linear(linear: nn.Linear, quant: str, dtype: torch.dtype, shards: int = 1) -> nn.Linear:
    from torchao.quantization import to_nf4

    weight = linear.weight.detach()
    # torchao dequantizes to the weight's dtype; keep the weight in the compute dtype.
    nf4 = to_nf4(weight.to(dtype), TORCHAO_BLOCK, torchao_scaler_block(weight.numel(), shards))
    for name in nf4.__tensor_flatten__()[0]:
        inner = getattr(nf4, name)
        if inner.device.type != "meta" and inner.untyped_storage().nbytes() > inner.numel() * inner.element_size():
            setattr(nf4, name, inner.clone())  # a view that would keep its whole intermediate alive
    linear.weight = nn.Parameter(nf4, requires_grad=False)
    return linear


# --- on meta (the planner builds there, then materialises fake tensors with `to_empty`) ------------

def _bnb_meta_linear(linear: nn.Linear, quant: str, dtype: torch.dtype) -> nn.Module:
    """A bitsandbytes layer with the quantized tensors' shapes and dtypes but no data. `to_empty`
    turns its parameter and buffers into fake tensors; a forward pre-hook then rebuilds the
    quant_state object (plain Python, which `to_empty` does not see) from those buffers."""
    bnb = require("bitsandbytes", f"quant: {quant}")
    from bitsandbytes.functional import get_4bit_type

    out_f, in_f, n = linear.out_features, linear.in_features, linear.weight.numel()
    if quant == "int8":
        new = bnb.nn.Linear8bitLt(in_f, out_f, bias=linear.bias is not None, has_fp16_weights=False,
                                  threshold=INT8_THRESHOLD, device="meta")
        new.weight = nn.Parameter(torch.empty(out_f, in_f, dtype=torch.int8, device="meta"), requires_grad=False)
        new.register_buffer("quant_scb", torch.empty(out_f, device="meta"), persistent=False)
        new.register_forward_pre_hook(_relink_int8_state)
    else:
        qtype = "fp4" if quant == "fp4" else "nf4"
        new = bnb.nn.Linear4bit(in_f, out_f, bias=linear.bias is not None, compute_dtype=dtype,
                                compress_statistics=quant == "nf4-dq", quant_type=qtype, device="meta")
        blocks = -(-n // BNB_BLOCK)
        new.weight = nn.Parameter(torch.empty((n + 1) // 2, 1, dtype=torch.uint8, device="meta"), requires_grad=False)
        buffers = {"absmax": torch.empty(blocks, dtype=torch.uint8 if quant == "nf4-dq" else torch.float32),
                   "code": torch.empty(len(get_4bit_type(qtype, device="cpu")))}
        if quant == "nf4-dq":
            buffers.update(absmax2=torch.empty(-(-blocks // 256)), code2=torch.empty(256), offset=torch.empty(()))
        for name, tensor in buffers.items():
            new.register_buffer(f"quant_{name}", tensor.to("meta"), persistent=False)
        new._memfit_quant = (qtype, quant == "nf4-dq", linear.weight.dtype)
        new.register_forward_pre_hook(_relink_4bit_state)
        _relink_4bit_state(new, ())  # peft reads compress_statistics / quant_type when it wraps the layer
    if linear.bias is not None:
        new.bias = nn.Parameter(linear.bias.detach(), requires_grad=False)
    return new


def _relink_4bit_state(module: nn.Module, args) -> None:
    from bitsandbytes.functional import QuantState

    weight = module.weight
    state = getattr(weight, "quant_state", None)
    if state is not None and state.absmax is module.quant_absmax:
        return
    qtype, nested, orig_dtype = module._memfit_quant
    state2 = QuantState(absmax=module.quant_absmax2, code=module.quant_code2, blocksize=256,
                        dtype=torch.float32) if nested else None
    weight.quant_state = module.quant_state = QuantState(
        absmax=module.quant_absmax, shape=torch.Size([module.out_features, module.in_features]),
        code=module.quant_code, blocksize=BNB_BLOCK, quant_type=qtype, dtype=orig_dtype,
        offset=module.quant_offset if nested else None, state2=state2)
    weight.compress_statistics, weight.quant_type, weight.bnb_quantized, weight.blocksize = (
        nested, qtype, True, BNB_BLOCK)


def _relink_int8_state(module: nn.Module, args) -> None:
    # As Linear8bitLt.init_8bit_state leaves a real layer: the matmul state holds the int8 weight
    # (the same storage) and its row scales; with state.CB unset bitsandbytes would re-quantize.
    module.state.SCB, module.state.CB = module.quant_scb, module.weight.data
    module.weight.SCB = module.weight.CB = None
    module.weight.has_fp16_weights = False


def _torchao_meta_linear(linear: nn.Linear, quant: str, dtype: torch.dtype, shards: int = 1) -> nn.Linear:
    """torchao quantizes meta tensors fine, but its `empty_like` (used by `to_empty`) leaves two
    small inner tensors (the 16-value table and the scaler mean) on meta; a pre-hook moves them."""
    linear = _torchao_linear(linear, quant, dtype, shards)
    linear.register_forward_pre_hook(_nf4_off_meta)
    return linear


def _nf4_off_meta(module: nn.Module, args) -> None:
    weight = module.weight
    device = weight.quantized_data.device
    for name in ("nf4", "scaler_mean"):
        inner = getattr(weight, name)
        if inner.device != device:
            setattr(weight, name, torch.empty_like(inner, device=device))


def quantize_nf4_rows(local, whole: torch.Tensor, rows: slice) -> None:
    """Fill the NF4 tensor `local` (one FSDP2 row shard of a weight) with rows `rows` of `whole` quantized
    as a whole: the second-level scale is the mean over the whole weight, which every shard must share
    (torchao's FSDP2 all-gather keeps the local shard's)."""
    from torchao.quantization import to_nf4

    device = local.quantized_data.device
    quantized = to_nf4(whole.to(device=device, dtype=local.dtype), local.block_size, local.scaler_block_size)
    size = rows.stop - rows.start
    part = torch.chunk(quantized, whole.shape[0] // size)[rows.start // size]
    local.nf4, local.scaler_mean = quantized.nf4, quantized.scaler_mean
    for name in ("quantized_scalers", "quantization_factor", "quantized_data"):
        getattr(local, name).copy_(getattr(part, name))


def track_quant_state(model: nn.Module) -> None:
    """Register bitsandbytes' quant_state tensors (absmax, code tables, nested absmax) as
    non-persistent buffers, so the memory tracker (which tags parameters and buffers) counts them."""
    for module in model.modules():
        weight = getattr(module, "weight", None)
        state = getattr(weight, "quant_state", None)
        if state is not None and not isinstance(state, torch.Tensor):
            tensors = {"absmax": state.absmax, "code": state.code}
            if getattr(state, "nested", False):
                tensors.update(absmax2=state.state2.absmax, code2=state.state2.code, offset=state.offset)
        elif getattr(weight, "SCB", None) is not None:
            tensors = {"scb": weight.SCB}
        else:
            continue
        for name, tensor in tensors.items():
            if isinstance(tensor, torch.Tensor) and getattr(module, f"quant_{name}", None) is not tensor:
                module.register_buffer(f"quant_{name}", tensor, persistent=False)


# --- dequantize (merge) ----------------------------------------------------------------------------

def dequantized_weight(module: nn.Module) -> torch.Tensor:
    """The weight a quantized Linear computes with, as a plain tensor (fp32)."""
    weight = module.weight
    if is_nf4(weight):
        return weight.get_original_weight().float()
    if getattr(weight, "quant_state", None) is not None:
        bnb = require("bitsandbytes", "dequantizing 4-bit weights")
        return bnb.functional.dequantize_4bit(weight.data, weight.quant_state).float()
    scale = _int8_scale(module)
    if scale is not None:  # int8 rows: value * row absmax / 127
        return weight.data.float() * scale.float().unsqueeze(1) / 127
    raise QuantizationError(f"{type(module).__name__} holds no quantized weight to dequantize")


def _int8_scale(module: nn.Module) -> torch.Tensor | None:
    """Row scales of a bitsandbytes int8 layer: on the weight until the first forward, which
    moves them into the layer's matmul state."""
    scale = getattr(module.weight, "SCB", None)
    if scale is None:
        scale = getattr(getattr(module, "state", None), "SCB", None)
    return scale


def dequantize_model(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Replace quantized Linear layers by plain ones holding the dequantized weights, in `dtype`."""
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if is_quantized_linear(child):
                plain = nn.Linear(child.in_features, child.out_features, bias=child.bias is not None,
                                  device=child.weight.device, dtype=dtype)
                with torch.no_grad():
                    plain.weight.copy_(dequantized_weight(child).reshape(plain.weight.shape))
                    if child.bias is not None:
                        plain.bias.copy_(child.bias.float())
                setattr(parent, name, plain)
    for flag in ("is_loaded_in_4bit", "is_loaded_in_8bit"):
        if flag in vars(model):
            delattr(model, flag)
    return model


def quantized_bytes(model: nn.Module) -> dict[str, int]:
    """Bytes of quantized weights (packed codes) and of their scales/tables, for reports and docs."""
    totals = {"codes": 0, "scales": 0}
    seen = set()
    for module in model.modules():
        if not is_quantized_linear(module):
            continue
        weight = module.weight
        if is_nf4(weight):
            for name in weight.__tensor_flatten__()[0]:
                part = getattr(weight, name)
                totals["codes" if name == "quantized_data" else "scales"] += part.numel() * part.element_size()
            continue
        totals["codes"] += weight.numel() * weight.element_size()
        for name, buf in module.named_buffers(recurse=False):
            if name.startswith("quant_") and id(buf) not in seen:
                seen.add(id(buf))
                totals["scales"] += sum(s.nbytes() for s in storages(buf))
    return totals
