"""`deepspeed: ds_config.json`: the JSON is checked at load (every problem at once), values memfit
owns are filled where the JSON says "auto" or nothing, contradictions name both values, and the
step adapter drives an engine the way DeepSpeed expects. No DeepSpeed import: fast."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memfit.config import ConfigError, load_config
from memfit.config.deepspeed import deepspeed_problems, resolved_config
from memfit.distributed.deepspeed_engine import EnginePrecision, torch_optimizer
from memfit.config.distributed import launch_problems
from memfit.errors import MemfitError
from memfit.strategies.precision import make_precision

CONFIG_DIR = Path(__file__).resolve().parents[3] / "memfit" / "configs"


def _json(tmp_path, value, name="ds.json") -> str:
    path = tmp_path / name
    path.write_text(value if isinstance(value, str) else json.dumps(value))
    return str(path)


AUTO = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
        "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                              "stage3_param_persistence_threshold": "auto"},
        "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}}


def test_auto_values_are_filled_from_the_run_config(tmp_path):
    cfg = load_config(None, [f"distributed.deepspeed={_json(tmp_path, AUTO)}", "batch.micro_batch=3", "batch.grad_accum=2",
                             "optim.max_grad_norm=0.5", "precision=bf16-mixed", "optim.lr=2e-4", "optim.weight_decay=0.1"])
    ds = resolved_config(cfg, world_size=4, hidden_size=64)
    assert ds["train_micro_batch_size_per_gpu"] == 3
    assert ds["gradient_accumulation_steps"] == 2
    assert ds["train_batch_size"] == 3 * 2 * 4
    assert ds["gradient_clipping"] == 0.5
    assert ds["bf16"] == {"enabled": True}
    assert ds["optimizer"]["params"] == {"lr": 2e-4, "weight_decay": 0.1, "torch_adam": True}
    zero = ds["zero_optimization"]
    assert (zero["reduce_bucket_size"], zero["stage3_prefetch_bucket_size"],
            zero["stage3_param_persistence_threshold"]) == (64 * 64, int(0.9 * 64 * 64), 640)
    assert "fp16" not in ds  # fp32/bf16 runs do not grow an fp16 section


def test_missing_owned_values_are_filled_like_auto(tmp_path):
    cfg = load_config(None, [f"distributed.deepspeed={_json(tmp_path, {'zero_optimization': {'stage': 1}})}",
                             "batch.micro_batch=2", "optim.max_grad_norm=null", "precision=fp32"])
    ds = resolved_config(cfg, world_size=2)
    filled = (ds["train_micro_batch_size_per_gpu"], ds["gradient_accumulation_steps"], ds["train_batch_size"])
    assert filled == (2, 1, 4)
    assert ds["gradient_clipping"] == 0.0  # DeepSpeed's "no clipping"
    assert "bf16" not in ds and "optimizer" not in ds  # no optimizer block: memfit's own optimizer is passed


def test_agreeing_numbers_are_accepted(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "gradient_clipping": 1.0,
          "bf16": {"enabled": False}, "fp16": {"enabled": False}, "train_batch_size": 16,
          "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0}}}
    cfg = load_config(None, [f"distributed.deepspeed={_json(tmp_path, ds)}", "batch.micro_batch=2", "batch.grad_accum=4",
                             "optim.max_grad_norm=1", "optim.lr=1e-3"])
    assert resolved_config(cfg, world_size=2)["train_batch_size"] == 16


def test_every_contradiction_is_listed_with_both_values(tmp_path):
    ds = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 8, "gradient_clipping": 2.0,
          "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 0.01}}}
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"distributed.deepspeed={_json(tmp_path, ds)}", "batch.micro_batch=2", "batch.grad_accum=1",
                           "optim.max_grad_norm=1.0", "precision=fp32", "optim.lr=1e-3"])
    problems = info.value.problems
    assert len(problems) == 5, problems
    text = "\n".join(problems)
    for both in ("train_micro_batch_size_per_gpu is 4 but the run config has batch.micro_batch: 2",
                 "gradient_accumulation_steps is 8 but the run config has batch.grad_accum: 1",
                 "gradient_clipping is 2.0 but the run config has optim.max_grad_norm: 1.0",
                 "bf16.enabled is true but the run config has precision: fp32",
                 "optimizer.params.lr is 0.01 but the run config has optim.lr: 0.001"):
        assert both in text, (both, text)


def test_train_batch_size_is_checked_at_launch_against_the_ranks(tmp_path):
    cfg = load_config(None, [f"distributed.deepspeed={_json(tmp_path, {'train_batch_size': 8})}", "batch.micro_batch=2"])
    assert resolved_config(cfg, world_size=4)["train_batch_size"] == 8
    with pytest.raises(MemfitError, match=r"train_batch_size is 8 but micro_batch 2 x grad_accum 1 x 2 ranks = 4"):
        resolved_config(cfg, world_size=2)


@pytest.mark.parametrize("content, message", [
    (None, "file not found"),
    ('{"zero_optimization": {"stage": 2,}}', "not valid JSON: .* at line 1, column 35"),
    ("[1, 2]", "must hold a JSON object"),
])
def test_unreadable_files_are_reported_with_where(tmp_path, content, message):
    path = str(tmp_path / "missing.json") if content is None else _json(tmp_path, content)
    with pytest.raises(ConfigError, match=message):
        load_config(None, [f"distributed.deepspeed={path}"])


def test_fields_deepspeed_replaces_are_refused_all_at_once(tmp_path):
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"distributed.deepspeed={_json(tmp_path, {})}", "distributed.sharding=zero2", "distributed.offload=all",
                           "distributed.tensor_parallel=2", "memory.optimizer_in_backward=true", "batch.grad_accum=1", "optim.max_grad_norm=null",
                           "memory.activation_offload=true", "memory.chunked_loss=true", "batch.micro_batch=auto",
                           "precision=bf16-pure", "method=qlora"])
    text = "\n".join(info.value.problems)
    for field in ("distributed.sharding: zero2 with deepspeed", "distributed.offload: all with deepspeed", "distributed.tensor_parallel: 2 with deepspeed",
                  "memory.optimizer_in_backward: true with deepspeed", "memory.activation_offload: true with deepspeed",
                  "memory.chunked_loss: true with deepspeed", "batch.micro_batch: auto with deepspeed",
                  "precision: bf16-pure with deepspeed", "method: qlora with quant: nf4-dq"):
        assert field in text, (field, text)


def test_scheduler_unknown_auto_and_optimizer_clashes_are_refused(tmp_path):
    ds = {"scheduler": {"type": "WarmupLR"}, "zero_optimization": {"stage": 2, "sub_group_size": "auto"},
          "optimizer": {"type": "AdamW"}, "checkpoint": {"load_universal": True}}
    with pytest.raises(ConfigError) as info:
        load_config(None, [f"distributed.deepspeed={_json(tmp_path, ds)}", "optim.name=lion"])
    text = "\n".join(info.value.problems)
    assert "scheduler block" in text
    assert "checkpoint.load_universal is true" in text  # universal checkpoints are unpickled without weights_only
    assert 'zero_optimization.sub_group_size is "auto"' in text
    assert "optimizer block and optim.name: lion" in text
    with pytest.raises(ConfigError, match="ZeRO partitions plain torch optimizers only"):
        load_config(None, [f"distributed.deepspeed={_json(tmp_path, {})}", "optim.name=adamw-8bit"])


def test_two_processes_without_sharding_are_fine_under_deepspeed(tmp_path):
    plain = load_config(None, [])
    ds = load_config(None, [f"distributed.deepspeed={_json(tmp_path, {})}"])
    assert launch_problems(plain, 2) and not launch_problems(ds, 2)
    assert deepspeed_problems(plain) == []


def test_shipped_deepspeed_configs_resolve():
    shipped = sorted(CONFIG_DIR.glob("deepspeed*.json"))
    assert shipped
    for path in shipped:
        cfg = load_config(None, [f"distributed.deepspeed={path}", "precision=bf16-mixed"])
        ds = resolved_config(cfg, world_size=2, hidden_size=128)
        assert "auto" not in json.dumps(ds), path


class FakeEngine:
    """Records what the adapter asks of a DeepSpeed engine with managed gradient accumulation."""

    def __init__(self, gas: int):
        self.gas, self.micro_steps, self.calls, self.skipped_steps = gas, 0, [], 0

    def backward(self, loss, scale_wrt_gas=True):
        self.calls.append(("backward", scale_wrt_gas))

    def is_gradient_accumulation_boundary(self):
        return (self.micro_steps + 1) % self.gas == 0

    def step(self):
        self.calls.append(("step", self.is_gradient_accumulation_boundary()))
        self.micro_steps += 1

    def get_global_grad_norm(self):
        return 2.5


def test_engine_precision_steps_between_micro_batches_and_updates_at_the_boundary():
    engine = FakeEngine(gas=3)
    plan = EnginePrecision(engine, make_precision("bf16-mixed", torch.device("cpu")))
    assert plan.autocast_dtype is None
    assert plan.scaler is not None  # training_step leaves the gradients to the engine (no .grad check)
    for _ in range(3):
        with plan.autocast():
            plan.backward(torch.zeros(()))
    assert plan.step(None, [], 1.0) == (2.5, False)
    # memfit's loss is already per step: DeepSpeed must not divide it by grad_accum again
    assert engine.calls == [("backward", False), ("step", False), ("backward", False), ("step", False),
                            ("backward", False), ("step", True)]


def test_a_torch_optimizer_is_what_the_scheduler_drives_unchanged():
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    assert torch_optimizer(optimizer) is optimizer


def test_a_non_finite_loss_stops_before_deepspeed_sees_it():
    engine = FakeEngine(gas=2)
    plan = EnginePrecision(engine, make_precision("fp32", torch.device("cpu")))
    with pytest.raises(MemfitError, match="loss is nan under DeepSpeed"):
        plan.backward(torch.tensor(float("nan")))
    assert engine.calls == []


def test_lora_is_refused_with_zero3_only(tmp_path):
    assert load_config(None, [f"distributed.deepspeed={_json(tmp_path, {'zero_optimization': {'stage': 2}})}", "method=lora"])
    with pytest.raises(ConfigError, match="stage 3 with method: lora"):
        load_config(None, [f"distributed.deepspeed={_json(tmp_path, {'zero_optimization': {'stage': 3}})}", "method=lora"])
