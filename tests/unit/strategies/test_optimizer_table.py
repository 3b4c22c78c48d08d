"""Each optimizer's table entry reaches every place that needs it (the config's choices and `memfit plan
--optimizer`: test_entry_tables.py): the trainer's optimizer, the analytic memory terms, the speed model,
the checkpoint phase, the search and the engine rules (FSDP2/tensor parallel, DeepSpeed, backends)."""

import json

import pytest
import torch

from memfit.config import ConfigError, load_config
from memfit.memory.candidates import gives_up
from memfit.memory.costs import MEMORY_EFFICIENCY, step_time
from memfit.memory.distributed_estimate import rank_model_states
from memfit.memory.gpus import find_gpu
from memfit.memory.model_shape import model_shape, trainable_params
from memfit.memory.phases import checkpoint_phase
from memfit.memory.search_space import inner_choices, leanest_updates
from memfit.memory.model_states import gradient_bytes, model_states, optimizer_state_bytes, trained_params, weights_bytes
from memfit.memory.single_device import StrategyTerms, peak_candidates
from memfit.memory.tracker import MemoryTracker
from memfit.models.presets import load_preset_config
from memfit.strategies.optimizers import OPTIMIZER_ENTRIES, TrainedParams, build_optimizer

LLAMA8 = "meta-llama/Llama-3.1-8B"
ENTRIES = pytest.mark.parametrize("entry", OPTIMIZER_ENTRIES, ids=lambda e: e.name)


def _cfg(entry, *overrides):
    return load_config(None, [f"model={LLAMA8}", f"optim.name={entry.name}", "data.seq_len=512",
                              "batch.micro_batch=1", *overrides])


@ENTRIES
def test_the_trainer_builds_it_and_its_states_take_the_bytes_the_entry_says(entry):
    torch.manual_seed(0)
    layer = torch.nn.Linear(256, 128, bias=False)  # 32768 values: large enough for 8-bit blockwise states
    optimizer = build_optimizer(entry.name, layer.parameters(), lr=1e-3)
    layer(torch.randn(4, 256)).sum().backward()
    optimizer.step()
    tracker = MemoryTracker()
    tracker.tag_optimizer(optimizer)
    measured = tracker.current_by_category()["optimizer_states"]
    expected = entry.states(TrainedParams(layer.weight.numel(), 4, matrices=((128, 256),)))
    assert measured == pytest.approx(expected, rel=0.1, abs=64)  # + step counters and 8-bit block scales


@ENTRIES
def test_the_analytic_terms_read_its_state_and_scratch_bytes(entry):
    shape = model_shape(load_preset_config(LLAMA8))
    for method in ("full", "lora"):
        cfg = _cfg(entry, f"method={method}", "precision=bf16-pure")
        states = optimizer_state_bytes(shape, cfg)
        assert states == entry.states(trained_params(shape, cfg)) > 0
        step = peak_candidates(shape, cfg, model_states(shape, cfg, "cuda"))["optimizer_step"]
        assert step["optimizer_states"] == states
        assert step["temporaries"] == (gradient_bytes(shape, cfg) if entry.foreach_scratch else 0)
        assert checkpoint_phase(shape, cfg, weights_bytes(shape, cfg), states, 0) == {
            "gpu": weights_bytes(shape, cfg) + states,
            "cpu_ram": trainable_params(shape, cfg) * (2 if method == "full" else 4) + states}
    if entry.on_dtensor:
        sharded = _cfg(entry, "distributed.sharding=zero3")
        rank = rank_model_states(shape, sharded, 4)
        assert rank.optimizer_scratch == (rank.gradients if entry.foreach_scratch else 0)


@ENTRIES
def test_the_speed_model_streams_its_states(entry):
    shape, gpu = model_shape(load_preset_config(LLAMA8)), find_gpu("RTX 4090")
    cfg = _cfg(entry, "method=full", "precision=bf16-mixed")
    seconds = step_time(StrategyTerms(shape, cfg, "cuda"), gpu)["optimizer"]
    per_value = 3 * 4 + 2 * entry.state_bytes_per_value(4)  # parameters read + written, gradients, states
    assert seconds == pytest.approx(shape.total_params * per_value / (gpu.memory_gbps * 1e9 * MEMORY_EFFICIENCY))


@ENTRIES
def test_the_search_tries_it_as_the_entry_says(entry):
    cfg = load_config(None, [])
    for device in ("cuda", "cpu"):
        assert (entry.name in inner_choices(cfg, device)["optim.name"]) == entry.searched
    leanest = {update["optim.name"] for update in leanest_updates(cfg, {"method": "full"}, {}, "cuda")}
    assert (entry.name in leanest) == entry.lean
    assert (entry.gives_up in gives_up(_cfg(entry))) == bool(entry.gives_up)


def _problems(*overrides) -> list[str]:
    try:
        load_config(None, list(overrides))
    except ConfigError as exc:
        return exc.problems
    return []


@ENTRIES
def test_the_engine_and_backend_rules_follow_the_entry(entry, tmp_path):
    name = f"optim.name={entry.name}"
    for engine in ("distributed.sharding=zero2", "distributed.tensor_parallel=2"):
        refused = any("sharded (DTensor)" in p for p in _problems(name, engine, "optim.max_grad_norm=null"))
        assert refused != entry.on_dtensor
    ds = tmp_path / "ds.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    assert any("ZeRO partitions plain torch optimizers only" in p
               for p in _problems(name, f"distributed.deepspeed={ds}")) != entry.deepspeed_client
    refused = any("torchao only provides" in p for p in _problems(name, "optim.backend=torchao",
                                                                   "logging.track_memory=false"))
    assert refused != ("torchao" in entry.backends)
