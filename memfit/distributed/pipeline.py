"""Pipeline parallel with torch.distributed.pipelining: S stages, GPipe schedule.

Rank s holds stage s: the first holds the embeddings, the last the final norm and lm_head,
and the decoder blocks are split as evenly as possible. Each micro-batch of the training loop
(micro_batch sequences, padded to seq_len: the pipeline sends fixed shapes between stages) is
cut into micro_batch pipeline micro-batches of one sequence, which the GPipe schedule pushes
through the stages (all forwards, then all backwards).

`PipelineModel` stands in for the model in memfit's unchanged training step: calling it runs
the schedule, which does the forward and the backward, and returns the loss (broadcast from
the last stage) as a leaf tensor whose `.backward()` has nothing left to do.

Loading: every rank builds the model on `meta`, allocates its own stage only and reads that stage's
tensors from the checkpoint (memfit/models/part_loading.py; rotary tables included).

Tied embeddings (embed_tokens = lm_head, e.g. the tiny demo model): the first and last stage
each hold a copy (the last stage reads the embedding weights), and after every
schedule step the two copies' new gradient contributions are all-reduced between those two
ranks, so both take the same update and stay equal.

Padding: stages run causal attention without the padding mask. With right padding, real
tokens never attend to the padding after them, and padded positions carry no loss.
"""

from __future__ import annotations

import copy
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.pipelining import PipelineStage, ScheduleGPipe
from transformers import AutoModelForCausalLM

from memfit.distributed.launch import DistContext
from memfit.errors import MemfitError
from memfit.models.part_loading import PartSource, fill_parts

IGNORE_INDEX = -100


class _Stage(torch.nn.Module):
    """One stage: [embeddings] + some decoder blocks + [final norm + lm_head]."""

    def __init__(self, embed, blocks, rotary, norm, head):
        super().__init__()
        self.embed_tokens, self.layers, self.rotary_emb, self.norm, self.lm_head = (
            embed, torch.nn.ModuleList(blocks), rotary, norm, head)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.embed_tokens(x) if self.embed_tokens is not None else x
        positions = torch.arange(hidden.shape[1], device=hidden.device).unsqueeze(0)
        rotary = self.rotary_emb(hidden, position_ids=positions)
        for block in self.layers:
            hidden = block(hidden, position_embeddings=rotary, position_ids=positions)
        if self.lm_head is not None:
            hidden = self.lm_head(self.norm(hidden))
        return hidden


def stage_blocks(num_layers: int, stages: int, stage: int) -> range:
    """The decoder-block indices of `stage` (sizes differ by at most one, earlier stages larger)."""
    base, extra = divmod(num_layers, stages)
    start = stage * base + min(stage, extra)
    return range(start, start + base + (stage < extra))


class PipelineModel(torch.nn.Module):
    def __init__(self, stage: _Stage, names: dict[str, str], cfg, ctx: DistContext, device, tied: bool):
        super().__init__()
        self.stage, self.ctx, self.cfg, self.device, self.tied = stage, ctx, cfg, device, tied
        self.names = names  # stage parameter name -> name in the Hugging Face model
        self.first, self.last = ctx.rank == 0, ctx.rank == ctx.world_size - 1
        self._targets = 1.0
        pipe_stage = PipelineStage(stage, ctx.rank, ctx.world_size, device)
        self.schedule = ScheduleGPipe(pipe_stage, n_microbatches=cfg.batch.micro_batch, loss_fn=self._loss,
                                      scale_grads=False)  # the loss is already divided by the step's targets
        # Every rank must take part in creating a group, even those outside it.
        self._tie_group = dist.new_group([0, ctx.world_size - 1]) if tied else None

    def _loss(self, logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        # As Hugging Face's causal-LM loss: predict token t+1 from position t; summed / step targets.
        return F.cross_entropy(logits[:, :-1].float().flatten(0, 1), labels[:, 1:].flatten(),
                               ignore_index=IGNORE_INDEX, reduction="sum") / self._targets

    def _fixed_shape(self, tensor: torch.Tensor, fill: int) -> torch.Tensor:
        rows, length = self.cfg.batch.micro_batch, self.cfg.data.seq_len
        out = torch.full((rows, length), fill, dtype=tensor.dtype, device=tensor.device)
        out[:tensor.shape[0], :tensor.shape[1]] = tensor
        return out

    def _tied_weight(self) -> torch.nn.Parameter | None:
        if not self.tied:
            return None
        return self.stage.embed_tokens.weight if self.first else self.stage.lm_head.weight if self.last else None

    def forward(self, input_ids, labels, attention_mask=None, num_items_in_batch=None, **_):
        if "position_ids" in _:
            raise MemfitError("pipeline_parallel does not support packed batches (data.packing: true) yet")
        self._targets = float(num_items_in_batch or 1)
        tied = self._tied_weight()
        before = tied.grad.clone() if tied is not None and tied.grad is not None else None
        losses: list[torch.Tensor] = []
        if self.first:
            self.schedule.step(self._fixed_shape(input_ids, 0))
        elif self.last:
            self.schedule.step(target=self._fixed_shape(labels, IGNORE_INDEX), losses=losses)
        else:
            self.schedule.step()
        if tied is not None and tied.grad is not None:  # sum the two copies' new contributions
            delta = tied.grad if before is None else tied.grad - before
            dist.all_reduce(delta, group=self._tie_group)
            tied.grad = delta if before is None else before + delta
        total = torch.stack(losses).sum().detach() if self.last else torch.zeros((), device=self.device)
        dist.broadcast(total, src=self.ctx.world_size - 1)
        return SimpleNamespace(loss=total.requires_grad_())  # backward already happened in the schedule

    # --- checkpoints and the final model -------------------------------------------------------
    @property
    def hf_model(self) -> torch.nn.Module:
        """A weightless (meta) Hugging Face model of the whole network, for save_pretrained."""
        with torch.device("meta"):
            return AutoModelForCausalLM.from_config(self.hf_config)

    def stage_state_dict(self) -> dict[str, torch.Tensor]:
        return {self.names[name]: tensor for name, tensor in self.stage.state_dict().items() if name in self.names}

    def load_stage_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        inverse = {hf: name for name, hf in self.names.items()}
        self.stage.load_state_dict({inverse[k]: v for k, v in state.items()}, strict=False)

    def full_state_dict(self) -> dict[str, torch.Tensor]:
        """Collective: every stage's weights gathered on rank 0 (CPU), Hugging Face names."""
        mine = {k: v.detach().cpu() for k, v in self.stage_state_dict().items()}
        if self.tied and self.last:
            mine.pop("lm_head.weight", None)  # the first stage's copy is the one saved
        parts = [None] * self.ctx.world_size if self.ctx.is_main else None
        dist.gather_object(mine, parts, dst=0)
        return {k: v for part in parts for k, v in part.items()} if self.ctx.is_main else {}


def build_pipeline(model: torch.nn.Module, cfg, ctx: DistContext, device: torch.device,
                   source: PartSource) -> PipelineModel:
    """Keep this rank's stage of `model` (a Llama-family causal LM, built on `meta`), allocate it on `device`,
    read its tensors from `source` and wrap it in a schedule."""
    part, names, tied = _stage_of(model, ctx.world_size, ctx.rank)
    part = part.to_empty(device=device)
    fill_parts(part, source, names=names.__getitem__)
    wrapper = PipelineModel(part, names, cfg, ctx, device, tied)
    wrapper.__dict__["hf_config"] = model.config  # the rest of `model` is freed when the caller drops it
    return wrapper


def _stage_of(model: torch.nn.Module, stages: int, stage: int) -> tuple[_Stage, dict[str, str], bool]:
    """Stage `stage` of `model` (sharing its modules; a tied lm_head gets its own copy), the Hugging Face
    model's name of each of its parameters and buffers, and whether the embeddings are tied to lm_head."""
    prefix = getattr(model, "base_model_prefix", "model")
    decoder = getattr(model, prefix)
    blocks = list(decoder.layers)
    first, last = stage == 0, stage == stages - 1
    tied = bool(getattr(model.config, "tie_word_embeddings", False))
    keep = stage_blocks(len(blocks), stages, stage)
    head = model.lm_head
    if tied and last and not first:
        head = copy.deepcopy(model.lm_head)  # its own copy; the gradients are summed with stage 0's
    part = _Stage(decoder.embed_tokens if first else None, [blocks[i] for i in keep], decoder.rotary_emb,
                  decoder.norm if last else None, head if last else None)
    names = {}
    tensors = [n for n, _ in part.named_parameters(remove_duplicate=False)]
    for name in tensors + [n for n, _ in part.named_buffers(remove_duplicate=False)]:
        kind, _, rest = name.partition(".")
        if kind == "layers":
            index, _, tail = rest.partition(".")
            names[name] = f"{prefix}.layers.{keep[int(index)]}.{tail}"
        elif kind in ("embed_tokens", "norm", "rotary_emb"):
            names[name] = f"{prefix}.{name}"
        else:
            names[name] = name  # lm_head.*
    return part, names, tied
