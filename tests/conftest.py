"""Shared fixtures: tiny configs that train in seconds on 2 CPU cores."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from memfit.config import load_config

warnings.filterwarnings("ignore", message=".*Enum subclass.*")
logging.getLogger("torchao").setLevel(logging.ERROR)
torch.set_num_threads(2)


def tiny_overrides(output_dir, **extra) -> list[str]:
    """RunConfig overrides for a fast tiny-llama run on the shipped demo data."""
    base = {"output_dir": str(output_dir), "max_steps": 20, "seq_len": 128, "micro_batch": 8, "lr": 3e-3,
            "warmup_steps": 2, "data.limit": 256, "log_every": 1, "device": "cpu",
            "report_to": "[]"}  # metrics.jsonl only; the TensorBoard sink has tests of its own
    base.update(extra)
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def tiny_config(tmp_path):
    """Call with overrides (key=value) to get a validated RunConfig writing into tmp_path."""

    def make(**extra):
        return load_config(None, tiny_overrides(tmp_path / "run", **extra))

    return make
