"""Resolve once: device, host RAM, `budget:` and `micro_batch: auto` become the run that trains, before
anything is loaded, judged by the planner's own fits rule."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
import torch
import yaml

from memfit.config import load_config
from memfit.errors import MemfitError
from memfit.memory.analytic import analytic_estimate, device_total_bytes
from memfit.memory.estimate import Estimate
from memfit.memory.fits import FitRule, default_margin
from memfit.models.presets import load_preset_config
from memfit.train import resolve
from memfit.train.loop import train
from memfit.train.resolve import check_host_ram, fit_budget, fit_micro_batch, resolve_run

GiB = 2**30
LOOP = Path(resolve.__file__).with_name("loop.py")


def _tiny_estimate(cfg, device):  # 1 MB fixed + 100 kB per sequence
    peak = 1_000_000 + 100_000 * cfg.batch.micro_batch
    return Estimate(peak_allocated_bytes=peak, peak_reserved_bytes=peak)


def _device_bytes(cfg) -> int:
    return device_total_bytes(analytic_estimate(cfg, load_preset_config("memfit/tiny-llama"), "cpu"))


# ---------------------------------------------------------------- the resolved run


def test_a_run_without_budget_or_auto_resolves_to_itself_on_its_device(tiny_config):
    cfg = tiny_config()
    resolved = resolve_run(cfg)
    assert resolved.cfg is cfg and resolved.device == torch.device("cpu")
    assert resolved.budget_bytes is None and resolved.notes == () and resolved.host_ram_bytes > 0


def test_cuda_asked_for_without_a_gpu_stops_at_resolve(tiny_config, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(MemfitError, match="device: cuda was asked for"):
        resolve_run(tiny_config(device="cuda", budget="8GiB"))


def test_a_budget_resolves_micro_batch_auto_in_its_search(tiny_config):
    resolved = resolve_run(tiny_config(micro_batch="auto", budget="8GiB", grad_accum=2))
    assert resolved.budget_bytes == 8 * GiB and resolved.cfg.budget is None
    assert isinstance(resolved.cfg.batch.micro_batch, int)
    assert resolved.notes and resolved.notes[0].startswith("budget 8.00 GiB: planner chose")


# ---------------------------------------------------------------- budget:


def test_a_budget_keeps_a_run_that_fits_and_refuses_an_impossible_one(tiny_config):
    fits = resolve_run(tiny_config(budget="8GiB"))
    assert fits.cfg.budget is None and fits.cfg.method == "full" and fits.cfg.batch.micro_batch == 8
    assert fits.notes[0].startswith("budget 8.00 GiB: the configured run fits")
    with pytest.raises(MemfitError, match="no configuration"):
        resolve_run(tiny_config(budget="1MiB"))


def test_a_budget_changes_the_setup_when_the_run_does_not_fit(tiny_config):
    cfg = tiny_config(micro_batch=8, seq_len=512, budget="40MiB")
    assert _device_bytes(cfg) > 40 * 2**20
    chosen = resolve_run(cfg).cfg
    assert chosen is not cfg and chosen.budget is None
    assert chosen.batch.micro_batch * chosen.batch.grad_accum == 8
    assert _device_bytes(chosen) <= 40 * 2**20


def test_the_configured_run_is_kept_by_the_searchs_rule_margin_and_host_ram_included(tiny_config):
    cfg = tiny_config(budget="8GiB")
    need = _device_bytes(cfg)
    budget = need * 2  # roomy on the device
    assert FitRule(budget - default_margin(budget)).fits(analytic_estimate(cfg, device="cpu"))
    assert fit_budget(cfg, budget, "cpu", host_ram=None).batch.micro_batch == 8
    # the same run against a host RAM it cannot fit: nothing the search tries fits either
    with pytest.raises(MemfitError, match="no configuration"):
        fit_budget(cfg, budget, "cpu", host_ram=2**20)


# ---------------------------------------------------------------- micro_batch: auto


def test_auto_micro_batch_is_the_largest_that_fits(tiny_config):
    cfg = tiny_config(micro_batch="auto", memory_budget="5555000B")
    assert fit_micro_batch(cfg, torch.device("cpu"), _tiny_estimate).batch.micro_batch == 45
    with pytest.raises(MemfitError, match="even one sequence"):
        fit_micro_batch(tiny_config(micro_batch="auto", memory_budget="1MB"), torch.device("cpu"), _tiny_estimate)


def test_auto_micro_batch_without_a_limit_keeps_the_planners_margin_free(tiny_config, monkeypatch):
    monkeypatch.setattr(resolve, "available_bytes", lambda device: 6_000_000)
    notes: list[str] = []
    chosen = fit_micro_batch(tiny_config(micro_batch="auto"), torch.device("cpu"), _tiny_estimate, notes=notes)
    room = 6_000_000 - default_margin(6_000_000)  # 5.4 MB: 44 sequences of 100 kB after the first 1 MB
    assert chosen.batch.micro_batch == (room - 1_000_000) // 100_000 == 44
    assert "half of the available RAM less the margin" in notes[0]


def test_train_builds_its_engine_from_the_resolved_micro_batch(tiny_config, monkeypatch):
    monkeypatch.setattr(resolve, "trace_estimate", _tiny_estimate)
    monkeypatch.setattr(resolve, "available_bytes", lambda device: 2_000_000)  # 1.8 MB after the margin: 8 fit
    made = []
    real = train.__globals__["make_engine"]
    monkeypatch.setattr("memfit.train.loop.make_engine", lambda cfg, device: made.append(cfg) or real(cfg, device))
    result = train(resolve_run(tiny_config(micro_batch="auto", max_steps=1)), progress=False)
    assert [cfg.batch.micro_batch for cfg in made] == [8]
    written = yaml.safe_load((result.output_dir / "run_config.yaml").read_text())
    assert written["batch"]["micro_batch"] == 8


@pytest.mark.slow
def test_auto_micro_batch_with_the_traced_planner_trains_within_budget(tiny_config):
    from memfit.memory.trace import trace_estimate

    budget = trace_estimate(tiny_config(micro_batch=6), "cpu").peak_reserved_bytes + 1000
    cfg = resolve_run(tiny_config(micro_batch="auto", memory_budget=f"{budget}B")).cfg
    assert cfg.batch.micro_batch >= 6
    result = train(resolve_run(cfg.updated({"max_steps": 2})), progress=False)  # runs under the budget: no OOM
    assert result.report.measured_peak_bytes <= budget


# ---------------------------------------------------------------- host RAM


def test_a_run_whose_offloaded_activations_exceed_host_ram_is_refused_with_the_numbers():
    long = load_config(None, ["model=meta-llama/Llama-3.1-8B", "method=qlora", "data.seq_len=131072",
                              "batch.micro_batch=1", "memory.checkpointing=full", "memory.activation_offload=true",
                              "memory.tiled_mlp=true", "memory.chunked_loss=true"])
    with pytest.raises(MemfitError) as caught:
        check_host_ram(long, "cuda", host_ram=16 * GiB)
    message = str(caught.value)
    assert "memory.activation_offload" in message and "16.00 GiB" in message and "131072" in message
    check_host_ram(long, "cuda", host_ram=128 * GiB)  # room enough
    check_host_ram(long.updated({"memory.activation_offload": False}), "cuda", host_ram=16 * GiB)


def test_any_run_that_needs_more_host_ram_than_the_machine_has_is_refused():
    """Not only parked activations: a CPU run's training state, every rank's runtime and load on the node."""
    cfg = load_config(None, ["model=meta-llama/Llama-3.1-8B", "method=qlora", "data.seq_len=4096",
                             "batch.micro_batch=1", "memory.checkpointing=full"])
    full = cfg.updated({"method": "full", "quant.scheme": "none"})  # ~124 GiB of fp32 training state
    with pytest.raises(MemfitError, match=r"this run on the CPU needs [\d.]+ GiB of host RAM for 1 process\(es\); "
                                          r"this machine has 16.00 GiB. `memfit plan meta-llama/Llama-3.1-8B "
                                          r"--host-ram 16.00GiB`"):
        check_host_ram(full, "cpu", host_ram=16 * GiB)
    check_host_ram(full, "cuda", host_ram=16 * GiB)  # streamed to the GPU: a tensor in flight on the host
    with pytest.raises(MemfitError, match="for 8 process"):
        check_host_ram(cfg.updated({"distributed.sharding": "ddp"}), "cuda", host_ram=4 * GiB, ranks=8)


def test_train_stops_before_loading_anything_when_host_ram_cannot_hold_the_offload(tmp_path, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # device auto resolves to CUDA
    monkeypatch.setattr(resolve, "machine_ram_bytes", lambda: 2**20)
    cfg = load_config(None, ["model=memfit/tiny-llama", "model.init=random", "device=auto", "max_steps=1",
                             "memory.activation_offload=true", f"output_dir={tmp_path / 'run'}"])
    with pytest.raises(MemfitError, match="host RAM"):
        train(resolve_run(cfg), progress=False)
    assert not (tmp_path / "run").exists()  # nothing was built or written


# ---------------------------------------------------------------- the loop never plans


def test_the_loop_imports_nothing_of_the_planner_and_never_patches_its_engine():
    tree = ast.parse(LOOP.read_text())
    imported = {node.module for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert not imported & {"memfit.memory.search", "memfit.memory.planner", "memfit.memory.fits",
                           "memfit.train.resolve"}  # the caller resolves and passes the ResolvedRun
    patched = [ast.unparse(target) for node in ast.walk(tree) if isinstance(node, ast.Assign)
               for target in node.targets if isinstance(target, ast.Attribute)]
    assert not [name for name in patched if name.startswith("engine.")]
