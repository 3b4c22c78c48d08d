"""On CUDA: CPU offload lowers the per-rank device peak (on a CPU device it cannot, see
tests/integration/test_distributed.py). Needs 2 GPUs; skipped elsewhere, never faked."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs (nccl)")]
ROOT = Path(__file__).resolve().parents[2]


def _run(out: Path, *overrides: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               "-m", "memfit", "train", str(ROOT / "memfit/configs/demo.yaml"), f"output_dir={out}",
               "overwrite=true", "max_steps=2", "device=cuda", "checkpoints.every=0", "optim.name=adamw", "--no-progress",
               *overrides]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-4000:]
    return json.loads((out / "distributed_memory.json").read_text())["ranks"]


def test_offload_lowers_the_device_peak(tmp_path):
    plain = _run(tmp_path / "zero3", "distributed.sharding=zero3")
    offload = _run(tmp_path / "offload", "distributed.sharding=zero3", "distributed.offload=all")
    for a, b in zip(plain, offload):
        assert b["cuda_max_allocated_bytes"] < a["cuda_max_allocated_bytes"]
