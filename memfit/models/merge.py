"""Adapter outputs: a base that can be found again, and the merged full model.

A LoRA/QLoRA run writes its adapter in PEFT's own format (adapter_config.json +
adapter_model.safetensors; `peft.PeftModel.from_pretrained(base, run_dir)` loads it).

Which base? An adapter is only meaningful with the exact base it was trained on:
  - base with weights of its own (a local folder with safetensors, or a hub id): that is the base;
    `memfit merge` loads it again and, for a quantized run, quantizes and dequantizes it the same
    (deterministic) way training did, so it merges into the weights training actually saw.
  - base without weights (a preset or config-only folder: random initialisation): the run saves
    the base it trained on to `RUN_DIR/base_model/` (safetensors, base dtype; for a quantized run
    the dequantized weights training saw) and points adapter_config.json's base_model_name_or_path
    at it, so `AutoPeftModelForCausalLM.from_pretrained(RUN_DIR)` and `memfit merge` find it.

`memfit merge RUN_DIR` (or `merge: true`) writes `RUN_DIR/merged/`: base + adapters merged into
plain weights, the base dtype, safetensors, loadable with `AutoModelForCausalLM.from_pretrained`.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
from pathlib import Path

import torch
from safetensors import SafetensorError
from torch import nn

from memfit.config import ModelConfig, RunConfig, load_config
from memfit.errors import MemfitError, require
from memfit.models.loading import build_model, drop_tied_copies, has_weights, load_saved_model
from memfit.strategies.precision import precision_entry
from memfit.strategies.quantization import compute_dtype, dequantize_model, quantize_model

log = logging.getLogger(__name__)
BASE_DIR = "base_model"
MERGED_DIR = "merged"
_TRAINED_COPY = re.compile(r"\.modules_to_save\.[^.]+\.")
_QUANT_STATE = re.compile(r"\.(absmax|quant_map|quant_state|nested_absmax|nested_quant_map|SCB|weight_format)\b")


def base_dtype(cfg: RunConfig) -> torch.dtype:
    return precision_entry(cfg.precision).weight_dtype


def save_adapter_outputs(model: nn.Module, cfg: RunConfig, out: Path,
                         gathered: dict[str, torch.Tensor] | None = None) -> None:
    """After the adapter is saved: keep a random-init base next to it, and merge if asked.
    Called at the end of training; it unloads the adapters from `model` (no further use).
    `gathered`: the PeftModel's full state when the run sharded its parameters (FSDP2), else None."""
    if cfg.method == "full":
        return
    if not has_weights(cfg.model):
        save_trained_base(model, cfg, out, gathered)
    if cfg.lora.merge:
        merge_run(out, overwrite=True)


def save_trained_base(model: nn.Module, cfg: RunConfig, out: Path,
                      gathered: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the (dequantized) frozen base of a PeftModel to out/base_model in the base dtype; from
    `gathered` (the PeftModel's full state) when the model's own parameters are shards."""
    dtype = base_dtype(cfg)
    base = model.unload()  # the original modules back, adapters dropped (they are saved already)
    target = out / BASE_DIR
    if gathered is None:
        dequantize_model(base, dtype).to(dtype)
        base.save_pretrained(target, safe_serialization=True)
    else:
        base.save_pretrained(target, state_dict=drop_tied_copies(base, base_state(gathered, dtype)),
                             safe_serialization=True)
    adapter_config = out / "adapter_config.json"
    if adapter_config.is_file():
        data = json.loads(adapter_config.read_text())
        data["base_model_name_or_path"] = str(target.resolve())
        adapter_config.write_text(json.dumps(data, indent=2) + "\n")
    log.info("base model (random initialisation) saved to %s so the adapter can be reloaded and merged", target)
    return target


def base_state(peft_state: dict[str, torch.Tensor], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The base model's weights, under its own names, from a PeftModel's state dict, as PEFT's
    `unload()` leaves them: PEFT nests the base under `base_model.model.` and each adapted layer
    under `.base_layer`; a fully trained module (modules_to_save) keeps its trained copy under
    `.modules_to_save.<adapter>.` and the untouched one under `.original_module.`, and unload keeps
    the trained copy. Adapters are dropped. Only for unquantized bases: packed 4-/8-bit weights
    must be dequantized through their modules, which the gathered state no longer has."""
    quantized = [name for name, tensor in peft_state.items()
                 if _QUANT_STATE.search(name) or tensor.dtype in (torch.uint8, torch.int8)]
    if quantized:
        raise MemfitError(f"the gathered model state holds quantized weights ({', '.join(quantized[:3])}"
                          f"{', ...' if len(quantized) > 3 else ''}): the base must be dequantized "
                          "through its own modules, not written from a gathered state")
    state = {}
    for name, tensor in peft_state.items():
        if ".lora_" in name or ".original_module." in name:
            continue
        plain = _TRAINED_COPY.sub(".", name.removeprefix("base_model.model.").replace(".base_layer.", "."))
        state[plain] = tensor.to(dtype) if tensor.is_floating_point() else tensor
    return state


def require_run_dir(run_dir: Path, command: str) -> None:
    """Stop unless `run_dir` is the output_dir of a memfit run, saying which it is not."""
    if not run_dir.exists():
        raise MemfitError(f"{run_dir}: no such folder; {command} needs the output_dir of a memfit run")
    if not run_dir.is_dir():
        raise MemfitError(f"{run_dir}: is a file, not a folder; {command} needs the output_dir of a memfit run")
    if not (run_dir / "run_config.yaml").is_file():
        raise MemfitError(f"{run_dir}: no run_config.yaml here, so it is not a memfit run; {command} needs the "
                          "output_dir of a memfit run")


def load_adapter(peft, base: nn.Module, run_dir: Path) -> nn.Module:
    """The run's adapter on its base; a damaged adapter file is one line naming it."""
    try:
        return peft.PeftModel.from_pretrained(base, run_dir)
    except SafetensorError as exc:
        raise MemfitError(f"{run_dir / 'adapter_model.safetensors'}: damaged or not safetensors ({exc}); restore "
                          "the run folder, or train again") from None


def load_base(run_dir: Path, cfg: RunConfig) -> nn.Module:
    """The base exactly as training saw it (dequantized when the run quantized it)."""
    dtype = base_dtype(cfg)
    if (run_dir / BASE_DIR).is_dir():
        return load_saved_model(run_dir / BASE_DIR, dtype)
    base = build_model(ModelConfig(**cfg.model.model_dump()), cfg.memory.attention, dtype=dtype)
    if cfg.quant.scheme != "none":
        quantize_model(base, cfg.quant.scheme, cfg.quant_backend, compute_dtype(cfg.quant.compute_dtype, cfg.precision))
        dequantize_model(base, dtype)
    return base


def merge_run(run_dir: str | Path, output: str | Path | None = None, overwrite: bool = False) -> Path:
    """Merge the run's adapter into its base; write a full safetensors model. Returns the folder."""
    peft = require("peft", "memfit merge")
    run_dir = Path(run_dir)
    require_run_dir(run_dir, "memfit merge")
    if not (run_dir / "adapter_config.json").is_file():
        raise MemfitError(f"{run_dir} holds no adapter (adapter_config.json): memfit merge needs the output_dir "
                          "of a method: lora or qlora run")
    cfg = load_config(run_dir / "run_config.yaml")
    output = Path(output) if output else run_dir / MERGED_DIR
    if (output / "config.json").exists() and not overwrite:
        raise MemfitError(f"{output} already holds a model; choose another --output or pass --overwrite")
    base = load_base(run_dir, cfg)
    merged = load_adapter(peft, base, run_dir).merge_and_unload()
    merged = merged.to(base_dtype(cfg))
    output.mkdir(parents=True, exist_ok=True)
    merged.save_pretrained(output, safe_serialization=True)
    _copy_tokenizer(run_dir, output)
    log.info("merged model written to %s", output)
    return output


def _copy_tokenizer(run_dir: Path, output: Path) -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "chat_template.jinja",
                 "vocab.json", "merges.txt", "tokenizer.model"):
        if (run_dir / name).is_file():
            shutil.copy2(run_dir / name, output / name)
