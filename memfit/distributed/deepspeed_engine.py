"""DeepSpeed from the user's own JSON config (`deepspeed: ds_config.json`).

For people who already run DeepSpeed: their JSON goes to `deepspeed.initialize` as written, and
memfit's one training loop drives the engine it returns. Nothing here talks between ranks
itself; DeepSpeed (ZeRO 1/2/3, offload, its loss scaler) does all of that.

Values memfit owns (micro-batch, accumulation, clipping, precision, lr) are filled into the
JSON from the RunConfig, or checked against it: memfit/config/deepspeed.py.

How the loop drives the engine (see `EnginePrecision`): memfit's step already divides every
micro-batch's loss by the step's target tokens, so `engine.backward(loss, scale_wrt_gas=False)`;
DeepSpeed counts gradient accumulation itself, so `engine.step()` runs after every micro-batch
and updates the weights at the last one (its accumulation boundary).

Loading under ZeRO-3 on several ranks (`partition_from_rank0`): rank 0 builds or loads the model
exactly as one process would (same seed, same random init, same files); the other ranks build
it on `meta` (no bytes). Then, one module at a time, every rank gives that module's parameters
storage, DeepSpeed's ZeRO conversion broadcasts rank 0's values and keeps 1/N of each, and the
full tensors are freed. So no rank but 0 ever holds the full model, and rank 0 only while
loading. (`deepspeed.zero.Init` around transformers' own build was tried first: its random init
differs from a single process's for the same seed, so runs would not be comparable.)

Checkpoints: `<output_dir>/checkpoints/deepspeed-step-00000042/` holds DeepSpeed's own
`save_checkpoint` folder (`state/`, every rank writes its ZeRO shards), trainer.json (step,
data position, losses), scheduler.pt and rng-rank<r>.pt. Written under a `.tmp-` name and
renamed once every rank is done. Final model: rank 0 writes ordinary safetensors; ZeRO-3
gathers one layer at a time onto rank 0 first. The weights are the engine's module weights
(bf16 when bf16 is enabled, like DeepSpeed's own save_16bit_model).
"""

from __future__ import annotations

import atexit
import json
import logging
import os
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist

from memfit.checkpoint import TrainerState
from memfit.distributed.checkpoint import TRAINER, newest_good_checkpoint, restore_rank_rng, write_checkpoint_folder
from memfit.distributed.safe_load import deepspeed_loads_weights_only
from memfit.config.deepspeed import json_path, read_json, resolved_config
from memfit.errors import MemfitError, require
from memfit.models.loading import drop_tied_copies

log = logging.getLogger(__name__)
PREFIX = "deepspeed-step-"


# ------------------------------------------------------------------ the engine

def initialize(model: torch.nn.Module, optimizer_factory, cfg, ctx, device: torch.device):
    """`engine, optimizer = initialize(...)`: the same signature as sharding.shard.

    `ctx` is memfit's DistContext (DeepSpeed reads the process group itself; memfit only asks it
    whether ZeRO-3 ranks receive their partitions from rank 0)."""
    if cfg.precision == "fp16-mixed" and device.type != "cuda":  # DeepSpeed: "Type fp16 is not supported"
        raise MemfitError("precision: fp16-mixed with deepspeed needs CUDA (DeepSpeed's CPU accelerator has no "
                          "fp16): use precision: bf16-mixed or fp32 on the CPU")
    deepspeed = require("deepspeed", "distributed.deepspeed: (training from a DeepSpeed JSON config)")
    if not dist.is_initialized():  # one process without torchrun: DeepSpeed still wants a process group
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"),
                           ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)
        deepspeed.init_distributed(dist_backend="nccl" if device.type == "cuda" else "gloo")
        atexit.register(lambda: dist.is_initialized() and dist.destroy_process_group())
    config = resolved_config(cfg, dist.get_world_size(), getattr(getattr(model, "config", None), "hidden_size", None))
    if loads_from_rank0(cfg, ctx):
        partition_from_rank0(model, config, device)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None if "optimizer" in config else optimizer_factory(params)
    engine, ds_optimizer, _, _ = deepspeed.initialize(model=model, model_parameters=params, optimizer=optimizer,
                                                      config=config)
    return engine, ds_optimizer


def zero_stage(cfg) -> int | None:
    """zero_optimization.stage in the run's DeepSpeed JSON (None: no deepspeed, unreadable or not set)."""
    if not cfg.distributed.deepspeed:
        return None
    ds, _ = read_json(cfg.distributed.deepspeed)
    stage = json_path(ds, ("zero_optimization", "stage")) if ds is not None else None
    return stage if isinstance(stage, int) else None


def loads_from_rank0(cfg, ctx) -> bool:
    """ZeRO-3 on several ranks: only rank 0 builds the real model; the others build it on `meta`
    and get their partitions from rank 0 in `partition_from_rank0` (see the module docstring)."""
    return bool(cfg.distributed.deepspeed) and ctx.enabled and ctx.world_size > 1 and zero_stage(cfg) == 3


def _engine_dtype(config: dict) -> torch.dtype | None:
    """The dtype DeepSpeed expects ZeRO-3 parameters to have already (None: keep the model's)."""
    if json_path(config, ("bf16", "enabled")) is True:
        return torch.bfloat16
    if json_path(config, ("fp16", "enabled")) is True:
        return torch.float16
    return None


def partition_from_rank0(model: torch.nn.Module, config: dict, device: torch.device) -> None:
    """Collective: turn every parameter into a ZeRO-3 partition holding rank 0's values.

    Rank 0's parameters hold the weights; the other ranks' are on `meta`. Module by module, a
    meta parameter gets empty storage, and DeepSpeed's own conversion (the one
    `deepspeed.initialize` runs on an unpartitioned model, `Init._zero_init_param`) broadcasts
    rank 0's bytes into it and keeps this rank's 1/N slice. deepspeed.initialize then finds only
    ZeRO parameters, converts nothing more, and uses them as built here (dtype, offload device:
    the same settings it would have used). Buffers are not partitioned: broadcast whole."""
    import deepspeed
    from deepspeed.runtime.zero.partition_parameters import is_zero_param

    deepspeed.init_distributed(dist_backend=dist.get_backend())  # joins the existing group: ZeRO counts its ranks
    dtype = _engine_dtype(config)
    offload = json_path(config, ("zero_optimization", "offload_param")) or {}
    remote = offload.get("device") if offload.get("device") not in (None, "none") else None
    # One receive buffer, the size of the largest module's parameters, reused for every module:
    # allocating and freeing each module's full tensors instead fragmented the heap (rank 1 peaked
    # at 0.76x the model's fp32 bytes on 2 ranks, not ~0.5x; docs/distributed.md).
    def aligned_bytes(param) -> int:
        return -(-param.numel() * (dtype or param.dtype).itemsize // 64) * 64

    needed = [sum(aligned_bytes(p) for p in m.parameters(recurse=False) if p.is_meta) for m in model.modules()]
    scratch = torch.empty(max(needed, default=0), dtype=torch.uint8, device=device)
    first, real = None, {}  # id(meta parameter) -> (it, its replacement): tied parameters stay one object
    for module in model.modules():
        offset = 0
        for name, param in list(module._parameters.items()):
            if param is not None and param.is_meta:  # a meta tensor's .data cannot be swapped: replace it
                if id(param) not in real:  # filled by the broadcast; only its partition outlives this module
                    size = aligned_bytes(param)
                    storage = scratch[offset:offset + param.numel() * (dtype or param.dtype).itemsize]
                    storage = storage.view(dtype or param.dtype).view(param.shape)
                    offset += size
                    real[id(param)] = (param, torch.nn.Parameter(storage, requires_grad=param.requires_grad))
                module._parameters[name] = real[id(param)][1]
        own = [p for p in module.parameters(recurse=False) if not is_zero_param(p)]  # tied: converted once
        if not own:
            continue
        for param in own:
            if dtype is not None and param.dtype != dtype:
                param.data = param.data.to(dtype)
        if first is None:  # the first conversion carries the settings every later one reuses
            holder = torch.nn.Module()
            for i, param in enumerate(own):
                holder.register_parameter(f"p{i}", param)
            deepspeed.zero.Init(module=holder, config_dict_or_path=config, remote_device=remote,
                                pin_memory=bool(offload.get("pin_memory", False)))
            first = own[0]
        else:
            first.convert_to_zero_parameters(param_list=own)
    with torch.no_grad():
        for module in model.modules():
            for key, buffer in module._buffers.items():
                if buffer is not None:
                    local = torch.empty_like(buffer, device=device) if buffer.is_meta else buffer.to(device)
                    dist.broadcast(local, src=0)
                    module._buffers[key] = local


class EngineChecksItself:
    """Stands where memfit's GradScaler would, telling training_step not to judge the gradients itself:
    under DeepSpeed they are mostly in its own partitions, not in `.grad` (DeepSpeed skips fp16
    overflow steps on its own). A non-finite loss stops the run in `EnginePrecision.backward`."""


class EnginePrecision:
    """Stands in for memfit's PrecisionPlan (strategies/precision.py) when DeepSpeed runs the step:
    DeepSpeed casts the model and scales fp16 losses itself, so no autocast and no GradScaler here."""

    scaler = EngineChecksItself()

    def __init__(self, engine, plan):
        self.engine, self.name, self.device_type = engine, plan.name, plan.device_type
        self.weight_dtype, self.autocast_dtype = plan.weight_dtype, None

    def autocast(self):
        return nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        # memfit drops a step with a NaN/inf loss by not stepping; DeepSpeed has no way to drop the
        # gradients it has accumulated and keep its micro-step count, so stop cleanly instead.
        if not bool(torch.isfinite(loss.detach()).all()):
            raise MemfitError(f"loss is {float(loss)} under DeepSpeed, which cannot drop a step's gradients: "
                              "stopped. Lower lr or check the data, then resume=true from the last checkpoint")
        # memfit's loss is already divided by the step's target tokens: no second 1/grad_accum.
        self.engine.backward(loss, scale_wrt_gas=False)
        if not self.engine.is_gradient_accumulation_boundary():
            self.engine.step()  # between micro-batches DeepSpeed only counts it

    def step(self, optimizer, params, max_grad_norm, norm=None) -> tuple[float, bool]:
        """The boundary step: DeepSpeed reduces, clips (gradient_clipping) and updates."""
        skipped_before = self.engine.skipped_steps
        self.engine.step()
        norm = self.engine.get_global_grad_norm()
        norm = float(norm) if norm is not None else float("nan")
        return norm, self.engine.skipped_steps > skipped_before  # fp16: DeepSpeed skipped an overflow


TRACKER_NOTE = ("DeepSpeed run: the tracker's categories are not this rank's memory. It sees the module's "
                "parameters and the storages created during the steps, not DeepSpeed's fp32 master partition "
                "(made at initialize) nor ZeRO-3's partitioned weights; DeepSpeed's gradient partitions and "
                "communication buckets (reduce_bucket_size elements) count as temporaries. Use the process "
                "peak RSS (CPU) or CUDA max allocated (GPU) for this rank's total.")


def torch_optimizer(optimizer):
    """The torch optimizer whose param_groups' lr DeepSpeed reads (what an LR scheduler drives);
    any optimizer that is not one of DeepSpeed's wrappers is returned unchanged."""
    if isinstance(optimizer, torch.optim.Optimizer) or not type(optimizer).__module__.startswith("deepspeed"):
        return optimizer
    inner = getattr(optimizer, "optimizer", None)
    return inner if isinstance(inner, torch.optim.Optimizer) else optimizer


# ------------------------------------------------------------------ checkpoints and the final model

def save_deepspeed(out: Path, state, engine, scheduler, keep: int = 2) -> Path:
    """Collective: every rank calls this with the same step. Returns the checkpoint folder."""
    def write(folder: Path, rank: int) -> None:
        engine.save_checkpoint(str(folder), tag="state", client_state={}, save_latest=False)
        if rank == 0:
            torch.save(scheduler.state_dict() if scheduler is not None else {}, folder / "scheduler.pt")
            trainer = {"step": state.step, "data": state.data, "losses": list(state.losses),
                       "nonfinite_total": state.nonfinite_total, "world_size": dist.get_world_size()}
            (folder / TRAINER).write_text(json.dumps(trainer))  # written last: it marks the folder complete

    return write_checkpoint_folder(Path(out) / "checkpoints", PREFIX, state.step, keep, write)


def load_deepspeed(path: Path, engine, scheduler) -> dict:
    """Collective: DeepSpeed restores weights, optimizer shards and its counters; returns trainer.json."""
    path = Path(path)
    trainer = json.loads((path / TRAINER).read_text())
    with deepspeed_loads_weights_only(engine):  # DeepSpeed itself would unpickle anything
        loaded, _ = engine.load_checkpoint(str(path), tag="state", load_optimizer_states=True,
                                           load_lr_scheduler_states=False)
    if loaded is None:
        raise MemfitError(f"resume=true: DeepSpeed could not load the checkpoint in {path / 'state'}")
    if scheduler is not None and (path / "scheduler.pt").exists():
        scheduler.load_state_dict(torch.load(path / "scheduler.pt", weights_only=True))
    restore_rank_rng(path, dist.get_rank())
    return trainer


def full_state_dict(engine) -> dict[str, torch.Tensor] | None:
    """Collective: the whole model's weights on rank 0's CPU; None on other ranks."""
    if engine.zero_optimization_partition_weights():  # ZeRO-3: gathered one layer at a time onto rank 0
        # Private, but it is what Hugging Face Accelerate calls for the same job.
        return engine._zero3_consolidated_16bit_state_dict()
    if dist.get_rank() != 0:  # ZeRO 0-2: every rank holds the full module weights
        return None
    return {k: v.detach().cpu() for k, v in engine.module.state_dict().items()}


def save_final(engine, tokenizer, out: Path) -> None:
    """Every rank calls this; rank 0 writes safetensors and the tokenizer."""
    state = full_state_dict(engine)
    if state is None:
        return
    hf_model = engine.module
    hf_model.save_pretrained(out, state_dict=drop_tied_copies(hf_model, state), safe_serialization=True)
    tokenizer.save_pretrained(out)


def resume(resume: bool, out: Path, engine, scheduler, stream) -> TrainerState:
    """Collective: the trainer state of the newest complete DeepSpeed checkpoint (a fresh one if none)."""
    found = newest_good_checkpoint(Path(out) / "checkpoints", PREFIX) if resume else None
    if found is None:
        if resume:
            log.warning("resume=true: no intact DeepSpeed checkpoint in %s; starting from step 0",
                        Path(out) / "checkpoints")
        return TrainerState(data=stream.state_dict())
    trainer = load_deepspeed(found, engine, scheduler)
    if trainer.get("world_size", dist.get_world_size()) != dist.get_world_size():
        log.warning("resuming a %d-rank DeepSpeed checkpoint on %d ranks (DeepSpeed re-partitions what it can)",
                    trainer["world_size"], dist.get_world_size())
    stream.load_state_dict(trainer["data"])
    return TrainerState(trainer["step"], trainer["data"], trainer["losses"], trainer["nonfinite_total"])
