"""The planner: estimate a run; with a budget, search every strategy mix for the fastest that fits.

`plan` estimates the run as described and, given a budget, hands the search (memory/search.py) the
model, the budget, the margin and the GPU the times are predicted for (memory/gpus.py). Options the
user gave are held fixed; everything else is free. The traced engine, when asked for, confirms the
chosen plan on the trainer's own step. What `memfit plan` prints is memory/plan_text.py; `memfit train`
runs the same search for `budget:` in its resolve step (memfit/train/resolve.py).
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from memfit.config import RunConfig
from memfit.errors import MemfitError
from memfit.memory.analytic import analytic_estimate, device_total_bytes
from memfit.memory.candidates import Candidate
from memfit.memory.estimate import Estimate
from memfit.memory.gpus import DEFAULT_GPU, GPU, GPUS, find_gpu
from memfit.memory.search import SearchResult, search
from memfit.memory.search_space import SEARCHED
from memfit.memory.trace import trace_estimate
from memfit.models.loading import load_model_config, missing_weights
from memfit.models.validate import check_model, model_where
from memfit.strategies.adapters import check_lora_targets_on_meta
from memfit.units import format_bytes, parse_bytes


@dataclass
class Plan:
    model: str
    cfg: RunConfig
    estimate: Estimate
    device_bytes: int
    budget_bytes: int | None
    gpus: int
    search: SearchResult | None = None
    seconds: float = 0.0  # wall time of the search

    @property
    def recommendation(self) -> Candidate | None:
        return self.search.chosen if self.search else None

    def to_dict(self) -> dict:
        out = {"model": self.model, "gpus": self.gpus, "budget_bytes": self.budget_bytes,
               "estimate": self.estimate.to_dict(), "device_bytes": self.device_bytes}
        if self.search is not None:
            found = self.search
            out.update(margin_bytes=found.margin_bytes, host_ram_bytes=found.host_ram, gpu=found.gpu.name, evaluated=found.evaluated,
                       families=[f.to_dict() for f in found.families], pareto=[c.to_dict() for c in found.pareto],
                       chosen=found.chosen.to_dict() if found.chosen else None,
                       recommendation=found.chosen.cfg.model_dump(mode="json") if found.chosen else None,
                       max_micro_batch=found.max_micro_batch, max_seq_len=found.max_seq_len,
                       seq_len_ladder=[r.to_dict() for r in found.seq_len_ladder])
        return out


def user_fixed_fields(cfg: RunConfig) -> set[str]:
    """The searched config paths this config sets explicitly (from YAML or the command line)."""
    return cfg.explicit_paths() & set(SEARCHED)


def reference_gpu(name: str | None, budget: int | None) -> GPU:
    """--gpu NAME, else the listed card whose memory is closest to the budget (times only)."""
    if name:
        return find_gpu(name)
    if budget is None:
        return GPUS[DEFAULT_GPU]
    return min(GPUS.values(), key=lambda g: abs(g.memory_bytes - budget))


def plan(model_name: str, cfg: RunConfig, budget_bytes: int | None = None, gpus: int = 1,
         engine: str = "analytic", device: str = "cuda", gpu: str | None = None, margin: int | None = None,
         fixed: set[str] | None = None, max_micro_batch: bool = False, max_seq_len: bool = False,
         host_ram: int | None = None) -> Plan:
    """Estimate `cfg` for `model_name`; with a budget, search for the fastest plan that fits."""
    if gpus < 1:
        raise MemfitError(f"--gpus: must be 1 or more (got {gpus})")
    if budget_bytes is not None and budget_bytes <= 0:
        raise MemfitError(f"--budget: must be a positive size such as 24GiB (got {budget_bytes} bytes)")
    if margin is not None and budget_bytes is not None and not 0 <= margin < budget_bytes:
        raise MemfitError(f"--margin: must be at least 0 and less than the budget ({format_bytes(budget_bytes)}); "
                          f"got {format_bytes(margin)}")
    reference = reference_gpu(gpu, budget_bytes)
    fixed = user_fixed_fields(cfg) if fixed is None else fixed
    if cfg.model.name != model_name:
        # Another model: its weights are the default again, whatever init the configured model had.
        cfg = cfg.updated({"model.name": model_name, "model.init": "pretrained"})
    model_config, _ = load_model_config(cfg.model)
    check_model(cfg, model_config, model_where(cfg.model), gpus)
    # a name the analytic count would drop silently
    check_lora_targets_on_meta(model_config, method=cfg.method, targets=cfg.lora.targets,
                               trust_remote_code=cfg.model.trust_remote_code)
    described = cfg
    if not isinstance(cfg.batch.micro_batch, int):
        described = cfg.updated({"batch.micro_batch": 1})
    estimate = _engine_estimate(described, model_config, device, engine, gpus)
    result = Plan(model_name, described, estimate, device_total_bytes(estimate), budget_bytes, gpus)
    if budget_bytes is None:
        return result
    started = time.perf_counter()
    result.search = search(described, model_config, budget_bytes, reference, gpus, device,
                           fixed, margin, max_micro_batch, max_seq_len,
                           host_ram)
    result.seconds = time.perf_counter() - started
    chosen = result.recommendation
    if chosen is not None:
        if engine == "traced":  # confirm the choice on the trainer's own step
            chosen.estimate = _engine_estimate(chosen.cfg, model_config, device, "traced", gpus)
            chosen.device_bytes = device_total_bytes(chosen.estimate)
    return result


def _engine_estimate(cfg: RunConfig, model_config, device: str, engine: str, gpus: int = 1) -> Estimate:
    if engine == "analytic":
        return analytic_estimate(cfg, model_config, device=device, gpus=gpus)
    if engine != "traced":
        raise MemfitError(f"--engine: unknown '{engine}'; allowed: analytic, traced")
    traced = trace_estimate(cfg, device=device)
    analytic = analytic_estimate(cfg, model_config, device=device, gpus=gpus)
    # host RAM beyond the training tensors (runtime, loading path, data) comes from the analytic terms
    on_host = traced.peak_allocated_bytes if device == "cpu" else 0
    analytic_on_host = analytic.peak_allocated_bytes if device == "cpu" else 0
    traced.cpu_ram_bytes = analytic.cpu_ram_bytes - analytic_on_host + on_host
    if device == "cuda" and not traced.overheads:
        # the tracker sees tensors only: add the same named runtime terms the analytic engine uses
        traced.overheads = dict(analytic.overheads)
        traced.peak_reserved_bytes = (traced.peak_allocated_bytes + analytic.overheads["cublas_workspace"]
                                      + analytic.overheads["allocator_reserve"])
    return traced


def parse_budget(text: str | None, option: str = "--budget", allow_zero: bool = False) -> int | None:
    if text is None:
        return None
    try:
        value = parse_bytes(text)
    except ValueError as exc:
        raise MemfitError(f"{option}: {exc}") from None
    if value < 0 or (value == 0 and not allow_zero):
        raise MemfitError(f"{option}: must be a positive size such as 24GiB (got {text!r})")
    return value


def check_config_path(path: str) -> Path:
    """The --write-config file, refused before any planning when it cannot be written there."""
    target = Path(path)
    if target.is_dir():
        raise MemfitError(f"--write-config {path}: is a folder; give a file name such as {target / 'plan.yaml'}")
    if not target.parent.is_dir():
        raise MemfitError(f"--write-config {path}: folder {target.parent} does not exist; create it or give a path "
                          "in an existing folder")
    return target


def write_config(result: Plan, path: str) -> RunConfig:
    """Write the recommendation (or the described run) as a RunConfig YAML `memfit train` accepts."""
    cfg = result.recommendation.cfg if result.recommendation else result.cfg
    if missing_weights(cfg.model):
        # A shape without weights anywhere: the written run says outright that it starts from random ones.
        cfg = cfg.updated({"model.init": "random"})
    target = check_config_path(path)
    try:
        target.write_text(cfg.to_yaml())
    except OSError as exc:
        raise MemfitError(f"--write-config {path}: cannot write ({exc.strerror})") from None
    return cfg
