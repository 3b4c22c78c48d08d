"""Shared fixtures: tiny configs that train in seconds on 2 CPU cores."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from memfit.config import RENAMED, load_config

warnings.filterwarnings("ignore", message=".*Enum subclass.*")
logging.getLogger("torchao").setLevel(logging.ERROR)
torch.set_num_threads(2)


def tiny_overrides(output_dir, **extra) -> list[str]:
    """RunConfig overrides for a fast tiny-llama run on the shipped demo data. Keywords are config
    paths, or a field's own name where it is unique (micro_batch=2 for batch.micro_batch=2)."""
    base = {"output_dir": str(output_dir), "max_steps": 20, "data.seq_len": 128, "batch.micro_batch": 8,
            "optim.lr": 3e-3, "optim.warmup_steps": 2, "data.limit": 256, "logging.every": 1, "device": "cpu",
            "logging.report_to": "[]",
            "model.init": "random"}  # metrics.jsonl only; the TensorBoard sink has tests of its own
    base.update({RENAMED.get(key, key): value for key, value in extra.items()})
    return [f"{k}={v}" for k, v in base.items()]


@pytest.fixture
def tiny_config(tmp_path):
    """Call with overrides (key=value) to get a validated RunConfig writing into tmp_path."""

    def make(**extra):
        return load_config(None, tiny_overrides(tmp_path / "run", **extra))

    return make
