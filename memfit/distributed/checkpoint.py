"""Checkpoints of sharded runs, and the final model as ordinary Hugging Face files.

Resumable checkpoint (every rank takes part): `<output_dir>/checkpoints/sharded-step-00000042/`
  state/              torch.distributed.checkpoint (DCP) folder: model and optimizer state as
                      each rank holds it (FSDP2/TP shards as DTensors, DDP replicas once).
                      zero1 (ZeroRedundancyOptimizer) partitions and pipeline stages hold the
                      optimizer states of their own parameters only: those are stored per
                      parameter name (`optim_by_name`), each rank its own. DCP re-shards on
                      load, so a zero1/zero2/zero3 run can resume on another number of ranks
                      (a 2-D dp x K mesh's DTensors too: stored as global tensors, they resume
                      on any number of dp groups of the same K).
  trainer.json        rank 0: step, data position, losses, non-finite count
  trainer.pt          rank 0: LR scheduler state and optimizer hyperparameters (loaded with
                      weights_only=True: a checkpoint never unpickles code)
  rng-rank<r>.pt      each rank's torch RNG state
  manifest.json       rank 0: size and sha256 of every file above, as single-process checkpoints
It is written under a `.tmp-` name and renamed by rank 0 once every rank has finished, so a
folder with the final name is complete. Resume takes the newest folder that matches its manifest
(rank 0 checks, every rank loads the same one) and reads it through memfit/distributed/safe_load.py:
no file in it can run code when loaded.

Final model: `get_model_state_dict(full_state_dict=True, cpu_offload=True)` gathers the full
weights onto rank 0's CPU (other ranks receive nothing), and rank 0 writes them with the
model's own `save_pretrained` (safetensors; PEFT adapter files for LoRA).
"""

from __future__ import annotations

import json
import logging
import pickle
import re
import shutil
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_model_state_dict, get_state_dict,
                                                     set_model_state_dict, set_state_dict)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from memfit.checkpoint import CheckpointError, newest_intact, write_manifest
from memfit.distributed.launch import DistContext, gather_to_main
from memfit.distributed.safe_load import dcp_load, dcp_metadata
from memfit.errors import MemfitError
from memfit.models.loading import drop_tied_copies
from memfit.strategies.quantization import is_nf4

log = logging.getLogger(__name__)
PREFIX = "sharded-step-"
TRAINER = "trainer.json"
TENSORS = "trainer.pt"  # scheduler state and optimizer hyperparameters


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The Hugging Face (or PEFT) model inside a DDP or pipeline wrapper."""
    return getattr(model, "module", model)


def _is_zero1(optimizer) -> bool:
    # Imported here: torch.distributed.optim takes 0.3-0.4 s to import, which runs without
    # a distributed engine should not pay.
    from torch.distributed.optim import ZeroRedundancyOptimizer

    return isinstance(optimizer, ZeroRedundancyOptimizer)


def _local_optimizer(optimizer):
    """ZeroRedundancyOptimizer's own partition (`.optim`): saving it per rank avoids gathering the
    whole optimizer state on rank 0 (`consolidate_state_dict`), which costs rank 0 a full copy."""
    return optimizer.optim if _is_zero1(optimizer) else optimizer


def _local_params_by_name(model, optimizer) -> dict[str, torch.nn.Parameter]:
    """This rank's optimizer parameters by their Hugging Face name (pipeline stages map theirs)."""
    names = getattr(model, "names", None)  # PipelineModel: stage parameter name -> Hugging Face name
    named = {}
    for name, param in unwrap(model).named_parameters():
        named[id(param)] = names[name.removeprefix("stage.")] if names is not None else name
    return {named[id(p)]: p for group in _local_optimizer(optimizer).param_groups for p in group["params"]}


def _named_optimizer_state(model, optimizer) -> dict[str, torch.Tensor]:
    """`{"<parameter name>::<state key>": tensor}` for the parameters this rank updates. The keys
    differ per rank; DCP stores each rank's own, so any partition can find its parameters' later."""
    state = _local_optimizer(optimizer).state
    return {f"{name}::{key}": value if isinstance(value, torch.Tensor) else torch.tensor(value)
            for name, param in _local_params_by_name(model, optimizer).items()
            for key, value in state.get(param, {}).items()}


# The frozen base of an adapter run is not saved: resuming reads it from where the run first did (its
# checkpoint, or its name-seeded random init), which gives the same values, quantized or not.
TRAINED_ONLY = StateDictOptions(ignore_frozen_params=True)
LOAD_TRAINED = StateDictOptions(ignore_frozen_params=True, strict=False)


def _state(model, optimizer) -> dict:
    if hasattr(model, "stage_state_dict"):  # pipeline stage: its own part of the model
        return {"model": model.stage_state_dict(), "optim_by_name": _named_optimizer_state(model, optimizer)}
    if _is_zero1(optimizer):
        return {"model": get_model_state_dict(model, options=TRAINED_ONLY),
                "optim_by_name": _named_optimizer_state(model, optimizer)}
    model_state, optim_state = get_state_dict(model, optimizer, options=TRAINED_ONLY)
    return {"model": model_state, "optim": optim_state}


def _load_named_optimizer_state(path: Path, model, optimizer) -> None:
    """Give each of this rank's parameters the optimizer state saved under its name, whichever
    rank (of however many) saved it; hyperparameters come from the saved param groups."""
    saved = dcp_metadata(path / "state").state_dict_metadata
    mine = _local_params_by_name(model, optimizer)
    wanted = {}
    for fqn, meta in saved.items():
        name, _, key = fqn.removeprefix("optim_by_name.").partition("::")
        if fqn.startswith("optim_by_name.") and name in mine:
            wanted[fqn.removeprefix("optim_by_name.")] = torch.empty(meta.size, dtype=meta.properties.dtype)
    if not wanted and mine and not any(fqn.startswith("optim_by_name.") for fqn in saved):
        raise MemfitError(f"{path}: holds no per-parameter optimizer state (it was written by another engine); "
                          "resume with the sharding it was saved with")
    loaded = {"optim_by_name": wanted}
    dcp_load(loaded, path / "state")
    local = _local_optimizer(optimizer)
    for fqn, value in loaded["optim_by_name"].items():
        name, _, key = fqn.partition("::")
        param = mine[name]
        local.state.setdefault(param, {})[key] = value.to(param.device) if value.dim() else value


def write_checkpoint_folder(root: Path, prefix: str, step: int, keep: int, write) -> Path:
    """Collective: every rank runs `write(folder, rank)` into `root/.tmp-<prefix><step>`, then saves
    its RNG state there; once all are done rank 0 renames the folder to its final name and keeps the
    newest `keep` complete ones. `write` writes TRAINER last on rank 0: it marks a folder complete;
    the manifest of every rank's files follows once all have written."""
    rank = dist.get_rank()
    final, tmp = root / f"{prefix}{step:08d}", root / f".tmp-{prefix}{step:08d}"
    if rank == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    dist.barrier()
    write(tmp, rank)
    torch.save({"torch_cpu": torch.get_rng_state()}, tmp / f"rng-rank{rank}.pt")
    dist.barrier()
    if rank == 0:
        write_manifest(tmp, step)
        shutil.rmtree(final, ignore_errors=True)
        tmp.rename(final)
        for old in complete_checkpoints(root, prefix)[:-keep]:
            shutil.rmtree(old, ignore_errors=True)
    dist.barrier()
    return final


def complete_checkpoints(root: Path, prefix: str = PREFIX) -> list[Path]:
    """`root/<prefix>NNNNNNNN` folders holding TRAINER (complete), oldest first."""
    pattern = re.compile(rf"^{re.escape(prefix)}(\d{{8,}})$")
    found = [p for p in Path(root).glob(f"{prefix}*") if pattern.match(p.name) and (p / TRAINER).exists()]
    return sorted(found, key=lambda p: int(pattern.match(p.name).group(1)))


def newest_good_checkpoint(root: Path, prefix: str = PREFIX) -> Path | None:
    """Collective: the newest complete checkpoint under `root` that matches its manifest, the same on
    every rank (rank 0 reads the files and sets damaged newer ones aside, see `newest_intact`; when
    every one is damaged each rank raises the same CheckpointError)."""
    shared = [None, None]  # chosen folder, or the refusal every rank raises
    if dist.get_rank() == 0:
        try:
            chosen = newest_intact(list(reversed(complete_checkpoints(root, prefix))))
            shared[0] = str(chosen) if chosen is not None else None
        except CheckpointError as exc:
            shared[1] = str(exc)
    dist.broadcast_object_list(shared, src=0)
    if shared[1] is not None:
        raise CheckpointError(shared[1])
    return Path(shared[0]) if shared[0] is not None else None


def restore_rank_rng(path: Path, rank: int) -> None:
    """This rank's torch RNG state as `write_checkpoint_folder` saved it (if it did)."""
    rng = path / f"rng-rank{rank}.pt"
    if rng.exists():
        torch.set_rng_state(torch.load(rng, weights_only=True)["torch_cpu"])


def save_sharded(out: Path, step: int, trainer: dict, model, optimizer, ctx: DistContext, keep: int = 2) -> Path:
    """Collective: every rank calls this with the same step. Returns the checkpoint folder."""
    def write(folder: Path, rank: int) -> None:
        dcp.save(_state(model, optimizer), checkpoint_id=str(folder / "state"))
        if rank == 0:
            plain = {key: value for key, value in trainer.items() if key != "scheduler"}
            groups = [{k: v for k, v in group.items() if k != "params"} for group in optimizer.param_groups]
            torch.save({"scheduler": trainer.get("scheduler"), "param_groups": groups}, folder / TENSORS)
            (folder / TRAINER).write_text(json.dumps(plain))  # written last: it marks the folder complete

    return write_checkpoint_folder(Path(out) / "checkpoints", PREFIX, step, keep, write)


def load_sharded(path: Path, model, optimizer, ctx: DistContext) -> dict:
    """Collective: restore model and optimizer (re-sharded to this run's ranks); returns trainer state."""
    path = Path(path)
    if not (path / TRAINER).exists():
        raise MemfitError(f"{path} is not a complete sharded checkpoint (no {TRAINER})")
    state = _state(model, optimizer)
    named = state.pop("optim_by_name", None) is not None
    dcp_load(state, path / "state")
    if named:
        if hasattr(model, "load_stage_state_dict"):
            model.load_stage_state_dict(state["model"])
        else:
            set_model_state_dict(model, state["model"], options=LOAD_TRAINED)
        _load_named_optimizer_state(path, model, optimizer)
    else:
        set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                       options=LOAD_TRAINED)
    restore_rank_rng(path, ctx.rank)
    trainer = load_trainer(path)
    for group, saved in zip(optimizer.param_groups, trainer.pop("param_groups")):
        group.update(saved)  # lr as of the saved step (the scheduler sets it again only after the next step)
    return trainer


def load_trainer(path: Path) -> dict:
    """Rank 0's trainer state of a sharded checkpoint: JSON, and the scheduler as plain tensors/numbers."""
    trainer = json.loads((path / TRAINER).read_text())
    try:  # a checkpoint is data: weights_only=True refuses pickled code
        trainer.update(torch.load(path / TENSORS, weights_only=True))
    except (pickle.UnpicklingError, RuntimeError) as exc:
        raise MemfitError(f"{path / TENSORS} holds more than plain data; refusing to unpickle it "
                          f"(weights_only=True): {str(exc).splitlines()[0]}") from None
    return trainer


def full_state_dict(model, ctx: DistContext) -> dict[str, torch.Tensor]:
    """Collective: the whole model's weights on rank 0's CPU, names as in the unwrapped model; {} elsewhere."""
    if hasattr(model, "full_state_dict"):  # pipeline: stages send their parts to rank 0
        return model.full_state_dict()
    if any(isinstance(p, DTensor) and is_nf4(p._local_tensor) for p in model.parameters()):
        return _unit_by_unit_state(model, ctx)
    state = get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
    return state if ctx.is_main else {}


def _unit_by_unit_state(model, ctx: DistContext) -> dict[str, torch.Tensor]:
    """`full_state_dict` of an FSDP2 model with a torchao NF4 base (whose shards DTensor cannot gather):
    each FSDP2 unit (the blocks, then the root) is all-gathered by FSDP2's own `unshard`, its parameters
    copied to rank 0's CPU, NF4 ones dequantized (as a one-process run saves a quantized base), and
    resharded before the next, so a rank holds one unit's whole weights at a time."""
    units = [(name, module) for name, module in unwrap(model).named_modules() if isinstance(module, FSDPModule)]
    state = {}
    for unit_name, unit in units:
        prefix = f"{unit_name}." if unit_name else ""
        nested = [f"{name}." for name, _ in units if name.startswith(prefix) and name != unit_name]
        unit.unshard()
        for name, param in unit.named_parameters(remove_duplicate=False):
            full = prefix + name
            if ctx.is_main and not any(full.startswith(inner) for inner in nested):
                state[full] = (param.get_original_weight() if is_nf4(param) else param).detach().cpu().clone()
        unit.reshard()
    return state


def save_final(model, tokenizer, out: Path, ctx: DistContext) -> dict[str, torch.Tensor] | None:
    """Every rank calls this; rank 0 writes safetensors (or PEFT adapter files) and the tokenizer.
    Returns the gathered full state on rank 0 when the parameters are shards (FSDP2: a LoRA run's
    frozen base exists whole only there); None elsewhere and for replicas (DDP/zero1), whose own
    modules still hold every weight, quantized ones included, for the caller to read directly."""
    sharded_params = any(isinstance(p, DTensor) for p in model.parameters())
    state = full_state_dict(model, ctx)
    if not ctx.is_main:
        return None
    hf_model = unwrap(model)
    if hasattr(hf_model, "hf_model"):  # pipeline wrapper keeps the meta skeleton of the full model
        hf_model = hf_model.hf_model
    hf_model.save_pretrained(out, state_dict=drop_tied_copies(hf_model, dict(state)), safe_serialization=True)
    tokenizer.save_pretrained(out)
    return state if sharded_params else None


def write_rank_memory(ctx: DistContext, out: Path, report, load_rss_bytes: int) -> list[dict]:
    """Collective: every rank's measured peak, gathered into `distributed_memory.json` by rank 0."""
    mine = {"rank": ctx.rank, "measured_peak_bytes": report.measured_peak_bytes,
            "measured_by_category_bytes": report.measured_by_category,
            "process_peak_rss_bytes": report.process_peak_rss_bytes, "load_peak_rss_bytes": load_rss_bytes,
            "cuda_max_allocated_bytes": getattr(report, "cuda_max_allocated_bytes", None)}
    ranks = gather_to_main(mine, ctx)
    if ctx.is_main:
        (Path(out) / "distributed_memory.json").write_text(json.dumps({"world_size": ctx.world_size,
                                                                      "ranks": ranks}, indent=1) + "\n")
    return ranks
