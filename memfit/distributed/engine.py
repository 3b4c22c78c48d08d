"""The engine that runs a training loop: one interface for one process, torch's engines and DeepSpeed.

The loop (memfit/train/loop.py) calls only these methods, so it never asks which engine runs it:

  wrap(model, make_optimizer)  the model and optimizer as the engine trains them (placed, sharded...)
  precision(model, plan)       the precision plan the step uses (DeepSpeed: its own backward/step)
  torch_optimizer(optimizer)   the torch optimizer an LR scheduler drives
  on_main_first(prepare)       rank 0 prepares the output folder while the others wait
  resume / save / save_final   checkpoints and the final model, in the engine's own format
  target_count, reduce_loss    what each rank divides its loss by; the loss one process would report
  note_memory(report, out)     what the memory report must add (every rank's peak, DeepSpeed's blind spots)
  teardown()                   leave the process group cleanly

  Engine            one process: memfit.checkpoint's atomic files, the model's own save_pretrained
  TorchDistributed  DDP, ZeRO-1, FSDP2 (zero2/zero3, CPU offload), tensor and pipeline parallel:
                    torch.distributed.checkpoint folders, full weights gathered to rank 0
  DeepSpeed         deepspeed.initialize with the user's JSON; DeepSpeed's checkpoints
"""

from __future__ import annotations

import logging
from pathlib import Path

import torch

from memfit.checkpoint import TrainerState, resume_state, save_checkpoint
from memfit.config import RunConfig
from memfit.distributed import checkpoint as sharded, deepspeed_engine, launch
from memfit.distributed.sharding import builds_on_meta, initial_device, shard
from memfit.errors import MemfitError
from memfit.models.loading import load_model_config
from memfit.step import count_targets
from memfit.strategies.engines import sharding_entry

log = logging.getLogger(__name__)


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise MemfitError("device: cuda was asked for, but torch sees no CUDA GPU; use device: cpu or auto")
    return torch.device(name)


def make_engine(cfg: RunConfig, device: torch.device) -> "Engine":
    """The engine for `cfg` on `device` (as resolving decided it, memfit/train/resolve.py); under torchrun
    it joins the process group first (every rank checks the launch the same way before any collective,
    memfit/config/distributed.py)."""
    ctx = launch.init_distributed(cfg, device, lambda: load_model_config(cfg.model)[0])
    device = launch.local_device(device, ctx)
    kind = DeepSpeed if cfg.distributed.deepspeed else TorchDistributed if ctx.enabled else Engine
    return kind(cfg, ctx, device)


class Engine:
    """One process, no process group: the model is placed on the device and trained as built."""

    traced = True  # the traced estimate describes this engine's memory (the report puts it beside the measurement)

    def __init__(self, cfg: RunConfig, ctx: launch.DistContext, device: torch.device):
        self.cfg, self.ctx, self.device = cfg, ctx, device
        self.load_rss_bytes = 0  # the process's peak RSS once the model is built and wrapped

    @property
    def is_main(self) -> bool:
        return self.ctx.is_main

    @property
    def builds_on_meta(self) -> bool:
        """This rank builds the model on `meta` (no bytes): it reads only its part, or receives it (DeepSpeed)."""
        return builds_on_meta(self.cfg, self.ctx)

    @property
    def quant_shards(self) -> int:
        """How many row shards FSDP2 cuts each quantized base weight into (its data-parallel size)."""
        return self.ctx.dp_size if self.ctx.enabled and sharding_entry(self.cfg.distributed.sharding).fsdp2 else 1

    @property
    def place_on(self) -> torch.device | None:
        """Where the built model goes before `wrap` (None: left where it was built)."""
        return initial_device(self.cfg, self.ctx, self.device)

    def wrap(self, model: torch.nn.Module, make_optimizer) -> tuple[torch.nn.Module, object]:
        wrapped = shard(model, make_optimizer, self.cfg, self.ctx, self.device)
        self.load_rss_bytes = launch.peak_rss_bytes()  # the model-loading high-water mark (docs/distributed.md)
        return wrapped

    def precision(self, model, plan):
        return plan

    def torch_optimizer(self, optimizer):
        return optimizer

    def on_main_first(self, prepare) -> Path:
        return launch.on_main_first(self.ctx, prepare, self.cfg)

    def resume(self, out: Path, model, optimizer, scheduler, scaler, stream) -> TrainerState:
        return resume_state(self.cfg.resume, out, model, optimizer, scheduler, scaler, stream)

    def save(self, out: Path, state: TrainerState, model, optimizer, scheduler, scaler) -> Path:
        return save_checkpoint(out, state, model, optimizer, scheduler, scaler, self.cfg.checkpoints.keep)

    def save_final(self, model, tokenizer, out: Path) -> dict[str, torch.Tensor] | None:
        """Weights as safetensors (adapters in PEFT's format), plus the tokenizer. Returns the full
        state when the engine had to gather it (the model's own parameters hold it otherwise)."""
        model.save_pretrained(out, safe_serialization=True)
        tokenizer.save_pretrained(out)
        return None

    @property
    def target_count(self):
        return count_targets

    def reduce_loss(self, loss: float) -> float:
        return loss

    def note_memory(self, report, out: Path) -> None:
        pass

    def teardown(self) -> None:
        pass


class TorchDistributed(Engine):
    """torchrun ranks on torch's own engines (memfit/distributed/sharding.py); every method that
    writes or reads files is collective: each rank calls it at the same step."""

    traced = False  # the trace is of one process; the ranks' own peaks go to distributed_memory.json

    def resume(self, out: Path, model, optimizer, scheduler, scaler, stream) -> TrainerState:
        found = sharded.newest_good_checkpoint(Path(out) / "checkpoints") if self.cfg.resume else None
        if found is None:
            if self.cfg.resume:
                log.warning("resume=true: no intact sharded checkpoint in %s; starting from step 0",
                            Path(out) / "checkpoints")
            return TrainerState(data=stream.state_dict())
        trainer = sharded.load_sharded(found, model, optimizer, self.ctx)
        if scheduler is not None and trainer["scheduler"] is not None:
            scheduler.load_state_dict(trainer["scheduler"])
        stream.load_state_dict(trainer["data"])
        return TrainerState(trainer["step"], trainer["data"], trainer["losses"], trainer["nonfinite_total"])

    def save(self, out: Path, state: TrainerState, model, optimizer, scheduler, scaler) -> Path:
        trainer = {"step": state.step, "data": state.data, "losses": list(state.losses),
                   "nonfinite_total": state.nonfinite_total,
                   "scheduler": scheduler.state_dict() if scheduler is not None else None}
        return sharded.save_sharded(out, state.step, trainer, model, optimizer, self.ctx, self.cfg.checkpoints.keep)

    def save_final(self, model, tokenizer, out: Path) -> dict[str, torch.Tensor] | None:
        return sharded.save_final(model, tokenizer, out, self.ctx)  # gathered to rank 0, which writes ordinary files

    @property
    def target_count(self):
        return launch.target_count(self.ctx)

    def reduce_loss(self, loss: float) -> float:
        return launch.mean_over_ranks(loss, self.ctx)

    def note_memory(self, report, out: Path) -> None:
        if self.ctx.enabled:  # every rank's peak -> distributed_memory.json
            sharded.write_rank_memory(self.ctx, out, report, self.load_rss_bytes)

    def teardown(self) -> None:
        launch.teardown(self.ctx)


class DeepSpeed(TorchDistributed):
    """deepspeed.initialize with the user's JSON (memfit/distributed/deepspeed_engine.py); also on
    one process without torchrun, where DeepSpeed still makes its own process group."""

    def wrap(self, model: torch.nn.Module, make_optimizer) -> tuple[torch.nn.Module, object]:
        wrapped = deepspeed_engine.initialize(model, make_optimizer, self.cfg, self.ctx, self.device)
        self.load_rss_bytes = launch.peak_rss_bytes()
        return wrapped

    def precision(self, model, plan):
        return deepspeed_engine.EnginePrecision(model, plan)  # engine.backward / engine.step

    def torch_optimizer(self, optimizer):
        return deepspeed_engine.torch_optimizer(optimizer)

    def resume(self, out: Path, model, optimizer, scheduler, scaler, stream) -> TrainerState:
        return deepspeed_engine.resume(self.cfg.resume, out, model, scheduler, stream)

    def save(self, out: Path, state: TrainerState, model, optimizer, scheduler, scaler) -> Path:
        return deepspeed_engine.save_deepspeed(out, state, model, scheduler, self.cfg.checkpoints.keep)

    def save_final(self, model, tokenizer, out: Path) -> None:
        deepspeed_engine.save_final(model, tokenizer, out)  # ZeRO-1/2 (LoRA's stages) keep whole parameters

    def note_memory(self, report, out: Path) -> None:
        report.notes.append(deepspeed_engine.TRACKER_NOTE)
        super().note_memory(report, out)
