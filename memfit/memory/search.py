"""The planner's search: every strategy mix the trainer can run, the fastest that fits the budget.

A family is a method (full, LoRA, LoRA on an 8-bit base, QLoRA) with its engine (one process, FSDP2
CPU offload, or with several GPUs DDP / ZeRO / tensor / pipeline parallel). Inside a family the search
varies precision, optimizer, checkpointing, chunked loss, activation offload, optimizer-in-backward
and the micro_batch x grad_accum split of the user's sequences per step. Options the user gave stay
fixed. Every candidate is checked by the trainer's own config rules, scored by the analytic
estimate (fractions of a millisecond) and, if it fits with the margin, by the step-time model of
memory/costs.py. The space it walks is memory/search_space.py; the plans it scores and how it picks
among them, memory/candidates.py.

Pruning: a family's leanest member (every memory saver on, micro_batch 1) is estimated first; if
even that misses the budget the family is rejected with the amount it misses, without enumerating it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.config import RunConfig
from memfit.memory.analytic import analytic_estimate, device_total_bytes
from memfit.memory.candidates import Candidate, pareto, prefer_fidelity
from memfit.memory.costs import step_time
from memfit.memory.distributed_estimate import data_parallel_ranks
from memfit.memory.fits import FitRule, default_margin, largest_that_fits
from memfit.memory.gpus import GPU
from memfit.memory.model_shape import ModelShape, model_shape
from memfit.memory.search_space import (SEARCHED, families, family_members, fixed_values, lean_member, leanest_updates,
                                        member_config, sequences_per_step, tried_values, with_forced)
from memfit.memory.single_device import StrategyTerms
from memfit.strategies.table import STEP_STRATEGIES
from memfit.units import format_bytes


@dataclass
class FamilyResult:
    name: str
    fits: bool
    reason: str
    best: Candidate | None = None      # the fastest fit, else the leanest member (how close it came)
    max_micro_batch: int | None = None  # at the requested seq_len (with --max-micro-batch)
    max_seq_len: int | None = None      # at micro_batch 1 (with --max-seq-len)
    longest: Candidate | None = None    # the leanest settings at max_seq_len

    def to_dict(self) -> dict:
        out = {"family": self.name, "fits": self.fits, "reason": self.reason,
               "max_micro_batch": self.max_micro_batch, "max_seq_len": self.max_seq_len}
        if self.best is not None:
            out["best"] = self.best.to_dict()
        if self.longest is not None:
            out["longest"] = self.longest.to_dict()
        return out


@dataclass
class SearchResult:
    budget_bytes: int
    margin_bytes: int
    gpu: GPU
    families: list[FamilyResult]
    pareto: list[Candidate]            # fastest first; each smaller than every faster one
    chosen: Candidate | None
    evaluated: int                     # candidates estimated
    host_ram: int | None = None        # the host RAM limit plans were held to
    max_micro_batch: int | None = None  # of the chosen plan
    max_seq_len: int | None = None
    seq_len_ladder: list["Rung"] = field(default_factory=list)  # with --max-seq-len: what each saver buys


@dataclass
class Rung:
    """The chosen plan at micro_batch 1 with the memory savers up to `added` on: its longest seq_len,
    and the GPU and host memory and the step time it needs there."""
    added: str
    max_seq_len: int
    best: Candidate | None = None      # at max_seq_len (None when nothing fits)

    def to_dict(self) -> dict:
        out = {"added": self.added, "max_seq_len": self.max_seq_len}
        if self.best is not None:
            out.update(device_bytes=self.best.device_bytes, cpu_ram_bytes=self.best.estimate.cpu_ram_bytes,
                       step_seconds=round(self.best.step_seconds, 3))
        return out


class _Scorer:
    def __init__(self, model_config, shape: ModelShape, gpu: GPU, gpus: int, device: str, limit: int,
                 host_ram: int | None):
        self.model_config, self.shape, self.gpu, self.gpus, self.device = model_config, shape, gpu, gpus, device
        self.limit = limit  # budget - margin
        self.host_ram = host_ram
        self.count = 0

    def memory(self, cfg: RunConfig, family: str) -> Candidate:
        self.count += 1
        est = analytic_estimate(cfg, self.model_config, device=self.device, gpus=self.gpus)
        return Candidate(cfg, family, est, device_total_bytes(est))

    def fits(self, c: Candidate) -> bool:
        return FitRule(self.limit, self.host_ram).fits(c.estimate)

    def timed(self, c: Candidate) -> Candidate:
        cfg = c.cfg
        c.time_terms = step_time(StrategyTerms(self.shape, cfg, self.device), self.gpu, self.gpus)
        c.step_seconds = sum(c.time_terms.values())
        sequences = cfg.batch.micro_batch * cfg.batch.grad_accum * data_parallel_ranks(cfg, self.gpus)
        c.tokens_per_second = sequences * cfg.data.seq_len / c.step_seconds
        return c


def _limit_of(cfg: RunConfig, scorer: _Scorer, family: str, path: str, high: int) -> int:
    """The largest batch.micro_batch (at grad_accum 1) or data.seq_len of `cfg` that fits."""
    def fits(value: int) -> bool:
        update = {path: value}
        if path == "batch.micro_batch":
            update["batch.grad_accum"] = 1
        return scorer.fits(scorer.memory(cfg.updated(update), family))
    return largest_that_fits(fits, 1 if path == "batch.micro_batch" else 8, high)


def search(base: RunConfig, model_config, budget: int, gpu: GPU, gpus: int = 1, device: str = "cuda",
           fixed_fields: set[str] = frozenset(), margin: int | None = None, max_micro_batch: bool = False,
           max_seq_len: bool = False, host_ram: int | None = None) -> SearchResult:
    """Search every family for the fastest plan whose whole-GPU memory + margin fits the budget
    (and whose host RAM fits `host_ram`, when given)."""
    shape = model_shape(model_config)
    margin = default_margin(budget) if margin is None else margin
    scorer = _Scorer(model_config, shape, gpu, gpus, device, budget - margin, host_ram)
    fixed = fixed_values(base, set(fixed_fields) & set(SEARCHED))
    sequences = sequences_per_step(base)
    seq_limit = int(getattr(model_config, "max_position_embeddings", None) or getattr(model_config, "n_positions", 4096))
    results, fitting = [], []
    for name, family in families(base, gpus, device):
        if any(k in family and family[k] != v for k, v in fixed.items()):
            given = ", ".join(f"{k}={v}" for k, v in fixed.items() if k in family and family[k] != v)
            results.append(FamilyResult(name, False, f"excluded by your option(s) {given}"))
            continue
        built = [lean_member(base, update, model_config, gpus, fixed)
                 for update in leanest_updates(base, family, fixed, device, shape)]
        lean = [scorer.memory(cfg, name) for cfg in built if isinstance(cfg, RunConfig)]
        if not lean:
            results.append(FamilyResult(name, False, f"not runnable: {built[0][0]}"))
            continue
        leanest = min(lean, key=lambda c: (not scorer.fits(c), c.device_bytes))
        if max_seq_len:  # also for a family that misses at the requested length: how long it can go
            # the longest of the lean variants: with little host RAM, offloading may shorten it
            longest = max((_longest(c.cfg, scorer, name, seq_limit) for c in lean), key=lambda found: found[0])
        if leanest.device_bytes <= scorer.limit and not scorer.fits(leanest):
            results.append(FamilyResult(name, False, "its leanest plan needs "
                                                     f"{format_bytes(leanest.estimate.cpu_ram_bytes)}"
                                                     f" of host RAM; --host-ram is {format_bytes(host_ram)}", leanest))
            results[-1].max_seq_len, results[-1].longest = longest if max_seq_len else (None, None)
            continue
        if not scorer.fits(leanest):
            top = max(leanest.estimate.by_category.items(), key=lambda kv: kv[1])
            results.append(FamilyResult(
                name, False, f"needs at least {format_bytes(leanest.device_bytes)} (largest: "
                f"{top[0].replace('_', ' ')} {format_bytes(top[1])}) + margin {format_bytes(margin)}: misses the "
                f"budget by {format_bytes(leanest.device_bytes + margin - budget)}", leanest))
            results[-1].max_seq_len, results[-1].longest = longest if max_seq_len else (None, None)
            continue
        members = [scorer.timed(c) for update in family_members(base, family, fixed, sequences, device, shape)
                   if isinstance(cfg := member_config(base, update, model_config, gpus), RunConfig)
                   and scorer.fits(c := scorer.memory(cfg, name))]
        if not members:  # the lean pre-check fits, but not at the user's sequences per step
            results.append(FamilyResult(name, False, f"fits only with other batch settings; leanest "
                                                     f"{format_bytes(leanest.device_bytes)}", leanest))
            continue
        best = prefer_fidelity(members)
        fitting += members
        results.append(FamilyResult(name, True, f"fits: {format_bytes(best.device_bytes)} + margin "
                                                f"{format_bytes(margin)} of {format_bytes(budget)}", best))
        if max_micro_batch:
            results[-1].max_micro_batch = _limit_of(_lean_like(best.cfg, leanest.cfg), scorer, name, "batch.micro_batch",
                                                    4096)
        if max_seq_len:
            results[-1].max_seq_len, results[-1].longest = longest
    chosen = prefer_fidelity(fitting) if fitting else None
    result = SearchResult(budget, margin, gpu, results, pareto(fitting, chosen), chosen, scorer.count, host_ram)
    if chosen is not None:
        if max_micro_batch:
            result.max_micro_batch = _limit_of(chosen.cfg, scorer, chosen.family, "batch.micro_batch", 4096)
        if max_seq_len:
            one = chosen.cfg.updated({"batch.micro_batch": 1, "batch.grad_accum": 1})
            result.max_seq_len = _limit_of(one, scorer, chosen.family, "data.seq_len", seq_limit)
            result.seq_len_ladder = seq_len_ladder(one, scorer, chosen.family, seq_limit, fixed, model_config, gpus,
                                                   device)
        result.evaluated = scorer.count
    return result


def _longest(cfg: RunConfig, scorer: _Scorer, family: str, high: int) -> tuple[int, Candidate | None]:
    """The longest data.seq_len of `cfg` that fits, and the plan there (None when no length fits)."""
    longest = _limit_of(cfg, scorer, family, "data.seq_len", high)
    return longest, scorer.memory(cfg.updated({"data.seq_len": longest}), family) if longest else None


def seq_len_ladder(start: RunConfig, scorer: _Scorer, family: str, high: int, fixed: dict, model_config, gpus: int,
                   device: str) -> list[Rung]:
    """What each memory saver buys in context length: `start` (micro_batch 1) with checkpointing and
    every step strategy off, then the savers switched on one after another: checkpointing, then the
    step strategies in the strategy table's order. Savers the user fixed stay as given; a saver that buys no
    length here (the optimizer in the backward under LoRA, whose gradients are small) is left out."""
    savers = {} if "memory.checkpointing" in fixed else {"checkpointing full": {"memory.checkpointing": "full"}}
    shape = model_shape(model_config)
    savers |= {strategy.name.replace("_", " "): {strategy.path: True} for strategy in STEP_STRATEGIES
               if strategy.path not in fixed and True in tried_values(strategy, strategy.lean, device, shape)}
    off = {"memory.checkpointing": "none"} | {strategy.path: False for strategy in STEP_STRATEGIES}
    off |= {f"memory.{name}": values[0] for strategy in STEP_STRATEGIES for name, values in strategy.searched_options.items()}
    current = {path: value for path, value in off.items() if path not in fixed}

    def rung(added: str, update: dict) -> Rung | None:
        cfg = member_config(start, with_forced(dict(update), start, fixed), model_config, gpus)
        if not isinstance(cfg, RunConfig):
            return None
        longest, best = _longest(cfg, scorer, family, high)
        return Rung(added, longest, scorer.timed(best) if best else None)

    ladder = [r for r in [rung("none of them", current)] if r is not None]
    for name, update in savers.items():
        step = rung(f"+ {name}", current | update)
        if step is not None and (not ladder or step.max_seq_len > ladder[-1].max_seq_len):
            current |= update
            ladder.append(step)
    return ladder


def _lean_like(best: RunConfig, lean: RunConfig) -> RunConfig:
    """The leanest settings, for the largest micro-batch a family can take at the requested seq_len."""
    return lean.updated({"data.seq_len": best.data.seq_len})
