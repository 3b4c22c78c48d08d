"""DeepSpeed paths that need CUDA (tests/integration/test_deepspeed.py covers ZeRO 1/2/3, bf16 and
CPU offload with a torch optimizer on the CPU): fp16 with DeepSpeed's loss scaler, bf16 on the GPU,
ZeRO-3 offload with DeepSpeed's own CPU-Adam (a C++ op built on first use) lowering the device
peak, and NVMe offload (libaio). One process on one GPU (`python -m memfit train`, DeepSpeed joins
a one-rank process group). Skipped without CUDA, or without the op/library each needs; never faked.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]
ROOT = Path(__file__).resolve().parents[2]
STEPS = 6


def _op_available(builder_name: str) -> bool:
    """Whether DeepSpeed can build (or already has) one of its C++/CUDA ops on this machine."""
    try:
        import ninja  # noqa: F401  (DeepSpeed builds its ops just in time with ninja)
        from deepspeed.accelerator import get_accelerator

        return bool(get_accelerator().create_op_builder(builder_name).is_compatible(verbose=False))
    except Exception:
        return False


def _train(out: Path, ds: dict, *overrides: str) -> tuple[list[dict], dict]:
    config = out.parent / f"{out.name}.json"
    config.write_text(json.dumps(ds))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "DS_ACCELERATOR")}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), TRANSFORMERS_VERBOSITY="error")
    command = [sys.executable, "-m", "memfit", "train", str(ROOT / "memfit/configs/deepspeed_zero2.yaml"),
               f"output_dir={out}", "overwrite=true", f"max_steps={STEPS}", "optim.warmup_steps=0", "device=cuda",
               "checkpoints.every=0", "logging.every=1", "data.limit=64", "--no-progress", *overrides]
    if ds is not None:
        command.append(f"distributed.deepspeed={config}")
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, json.loads((out / "memory_report.json").read_text())


ZERO2 = json.loads((ROOT / "memfit/configs/deepspeed_zero2.json").read_text())


@pytest.mark.parametrize("precision", ["fp16-mixed", "bf16-mixed"])
def test_half_precision_engines_train_like_memfit(tmp_path, precision):
    """DeepSpeed's fp16 (dynamic loss scale) and bf16 engines against memfit's own mixed precision:
    not the same rounding (DeepSpeed computes with half-precision weights), so a loose tolerance."""
    if precision == "bf16-mixed" and not torch.cuda.is_bf16_supported():
        pytest.skip("this GPU has no bfloat16")
    ds = {**ZERO2, "fp16": {"enabled": "auto", "initial_scale_power": 8}}
    engine, _ = _train(tmp_path / "deepspeed", ds, f"precision={precision}")
    plain, _ = _train(tmp_path / "memfit", None, f"precision={precision}", "distributed.deepspeed=null")
    # fp16 may skip the first steps while the loss scale settles (skipped: true, like memfit's GradScaler)
    applied = [m for m in engine if not m["skipped"]]
    assert applied and all(torch.isfinite(torch.tensor(m["loss"])) for m in engine)
    assert engine[-1]["loss"] < engine[0]["loss"]
    assert [m["loss"] for m in engine][:1] == pytest.approx([plain[0]["loss"]], rel=1e-2)  # same start


def test_zero3_cpu_adam_offload_lowers_the_device_peak(tmp_path):
    if not _op_available("CPUAdamBuilder"):
        pytest.skip("DeepSpeed's CPUAdam op cannot be built here (needs ninja and a C++ compiler)")
    # torch's AdamW on the GPU (no FusedAdam op to build) against DeepSpeedCPUAdam on the CPU: same update rule
    zero3 = {"zero_optimization": {"stage": 3}, "optimizer": {"type": "AdamW", "params": {"torch_adam": True}}}
    offload = {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu", "pin_memory": True},
                                     "offload_optimizer": {"device": "cpu", "pin_memory": True}},
               "optimizer": {"type": "AdamW", "params": {"lr": "auto"}}}  # DeepSpeedCPUAdam when offloading
    plain_metrics, plain = _train(tmp_path / "zero3", zero3, "memory.checkpointing=none")
    off_metrics, off = _train(tmp_path / "offload", offload, "memory.checkpointing=none")
    assert off["cuda_max_allocated_bytes"] < plain["cuda_max_allocated_bytes"]
    assert [m["loss"] for m in off_metrics] == pytest.approx([m["loss"] for m in plain_metrics], rel=2e-2)


def test_nvme_offload(tmp_path):
    if not _op_available("AsyncIOBuilder") or not _op_available("CPUAdamBuilder"):
        pytest.skip("NVMe offload needs DeepSpeed's async_io op (libaio-dev) and its CPUAdam op")
    nvme = tmp_path / "nvme"
    nvme.mkdir()
    ds = {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": str(nvme)},
                                "offload_optimizer": {"device": "nvme", "nvme_path": str(nvme)}},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto"}},
          "aio": {"block_size": 1048576, "queue_depth": 8, "single_submit": False, "overlap_events": True}}
    metrics, _ = _train(tmp_path / "run", ds, "memory.checkpointing=none")
    assert metrics[-1]["loss"] < metrics[0]["loss"]
    assert any(nvme.rglob("*")), "DeepSpeed wrote nothing to the NVMe path"
