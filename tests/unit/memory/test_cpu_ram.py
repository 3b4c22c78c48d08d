"""The host-RAM estimate's data term comes from the data path's own estimate, never from a stand-in."""

import pytest

from memfit.config import load_config
from memfit.data.ram import estimate_data_ram_bytes
from memfit.data.sources import DataError
from memfit.memory.analytic import analytic_estimate
from memfit.memory.model_shape import model_shape
from memfit.memory.single_device import cpu_ram_bytes
from memfit.models.loading import load_model_config


def test_data_term_is_the_data_paths_estimate():
    cfg = load_config(None, ["model=memfit/tiny-llama", "data.num_workers=2", "batch.micro_batch=4"])
    shape = model_shape(load_model_config(cfg.model)[0])
    assert cpu_ram_bytes(shape, cfg, "cpu")["data"] == estimate_data_ram_bytes(cfg) > 0


def test_unreadable_data_path_is_an_error_not_a_guess(tmp_path):
    cfg = load_config(None, ["model=memfit/tiny-llama", f"data.path={tmp_path / 'missing.jsonl'}", "data.format=text"])
    with pytest.raises(DataError, match="missing.jsonl does not exist"):
        analytic_estimate(cfg, device="cpu")
