"""A plan the search scored, what it shows and what it trades against full fine-tuning, and how the
search picks among the plans that fit: the fastest, unless a plan within TIE of it gives up less.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from memfit.config import RunConfig
from memfit.memory.estimate import Estimate
from memfit.strategies.methods import method_entry
from memfit.strategies.optimizers import optimizer_entry
from memfit.strategies.precision import precision_entry
from memfit.strategies.quantization import quant_entry
from memfit.strategies.table import STEP_STRATEGIES

TIE = 0.05  # plans within 5% of the fastest step time count as equally fast: fidelity decides
# what a plan's summary shows: short name -> config path
SUMMARY = {"method": "method", "quant": "quant.scheme", "precision": "precision", "optimizer": "optim.name",
           "checkpointing": "memory.checkpointing", **{strategy.name: strategy.path for strategy in STEP_STRATEGIES},
           "attention": "memory.attention", "micro_batch": "batch.micro_batch", "grad_accum": "batch.grad_accum",
           "seq_len": "data.seq_len"}
SUMMARY_IF_SET = {"sharding": "distributed.sharding", "offload": "distributed.offload",
                  "tensor_parallel": "distributed.tensor_parallel", "pipeline_parallel": "distributed.pipeline_parallel"}


@dataclass
class Candidate:
    cfg: RunConfig
    family: str
    estimate: Estimate
    device_bytes: int          # what the GPU must hold (nvidia-smi): reserved + CUDA context
    step_seconds: float = 0.0
    tokens_per_second: float = 0.0
    time_terms: dict = field(default_factory=dict)

    @property
    def gives_up(self) -> list[str]:
        return gives_up(self.cfg)

    def to_dict(self) -> dict:
        return {"family": self.family, "config": config_summary(self.cfg), "device_bytes": self.device_bytes,
                "peak_reserved_bytes": self.estimate.peak_reserved_bytes, "cpu_ram_bytes": self.estimate.cpu_ram_bytes,
                "step_seconds": round(self.step_seconds, 4), "tokens_per_second": round(self.tokens_per_second, 1),
                "gives_up": self.gives_up}


def config_summary(cfg: RunConfig) -> dict:
    out = {name: cfg.get(path) for name, path in SUMMARY.items()}
    out.update({name: cfg.get(path) for name, path in SUMMARY_IF_SET.items() if cfg.get(path) not in ("none", 1)})
    return out


def gives_up(cfg: RunConfig) -> list[str]:
    """What a plan trades against full fine-tuning in bf16-mixed with AdamW and clipping."""
    out = [method_entry(cfg.method).gives_up, quant_entry(cfg.quant.scheme).gives_up, precision_entry(cfg.precision).gives_up,
           optimizer_entry(cfg.optim.name).gives_up]
    if cfg.optim.max_grad_norm is None:
        out.append("no gradient clipping")
    return [item for item in out if item]


def fidelity_rank(cfg: RunConfig) -> tuple:
    """Lower is closer to full fine-tuning: method first (full > LoRA > 8-bit base > 4-bit base)."""
    method = {"full": 0, "lora": 1, "qlora": 3}[cfg.method] + (1 if cfg.quant.scheme == "int8" else 0)
    return method, len(gives_up(cfg))


def prefer_fidelity(candidates: list[Candidate]) -> Candidate:
    """The fastest; among plans within TIE of it, the one that gives up least."""
    fastest = min(c.step_seconds for c in candidates)
    close = [c for c in candidates if c.step_seconds <= fastest * (1 + TIE)]
    return min(close, key=lambda c: (fidelity_rank(c.cfg), c.step_seconds))


def pareto(candidates: list[Candidate], chosen: Candidate | None = None, keep: int = 8) -> list[Candidate]:
    """Fastest first; a plan stays only if it needs less memory than every faster one. The chosen
    plan is always listed (it may be a slightly slower plan that gives up less)."""
    front, smallest = [], None
    for c in sorted(candidates, key=lambda c: (c.step_seconds, c.device_bytes)):
        if c is chosen or smallest is None or c.device_bytes < smallest:
            front.append(c)
            smallest = c.device_bytes if smallest is None else min(smallest, c.device_bytes)
    shown = front[:keep]
    if chosen is not None and chosen not in shown:
        shown = sorted(shown[:keep - 1] + [chosen], key=lambda c: c.step_seconds)
    return shown
