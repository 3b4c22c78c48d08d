"""make_engine picks the engine from the config; the single-process one changes nothing."""

import json

import torch

from memfit.config import load_config
from memfit.distributed.deepspeed_engine import EnginePrecision
from memfit.distributed.engine import DeepSpeed, Engine, TorchDistributed, make_engine
from memfit.step import count_targets
from memfit.strategies.precision import make_precision


def test_one_process_gets_the_plain_engine_that_changes_nothing():
    engine = make_engine(load_config(None, ["device=cpu"]), torch.device("cpu"))
    assert type(engine) is Engine and engine.traced and engine.is_main
    assert not engine.builds_on_meta and engine.place_on == torch.device("cpu")
    plan = make_precision("fp32", torch.device("cpu"))
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert engine.precision(torch.nn.Linear(1, 1), plan) is plan
    assert engine.torch_optimizer(optimizer) is optimizer
    assert engine.reduce_loss(2.5) == 2.5 and engine.target_count is count_targets


def test_wrap_places_the_model_and_builds_its_optimizer_from_the_trainable_parameters():
    engine = make_engine(load_config(None, ["device=cpu"]), torch.device("cpu"))
    model = torch.nn.Linear(2, 2)
    model.bias.requires_grad_(False)
    wrapped, optimizer = engine.wrap(model, lambda params: torch.optim.SGD(params, lr=0.1))
    assert wrapped is model
    assert [p for group in optimizer.param_groups for p in group["params"]] == [model.weight]
    assert engine.load_rss_bytes > 0


def test_a_deepspeed_config_gets_the_deepspeed_engine_even_on_one_process(tmp_path):
    path = tmp_path / "ds.json"
    path.write_text(json.dumps({"zero_optimization": {"stage": 2}}))
    engine = make_engine(load_config(None, ["device=cpu", f"distributed.deepspeed={path}"]), torch.device("cpu"))
    assert isinstance(engine, DeepSpeed) and isinstance(engine, TorchDistributed) and not engine.traced
    plan = engine.precision(object(), make_precision("bf16-mixed", torch.device("cpu")))
    assert isinstance(plan, EnginePrecision) and plan.autocast_dtype is None
