from pathlib import Path

import pytest
from pydantic import ValidationError

from memfit.config import ConfigError, RunConfig, load_config

CONFIG_DIR = Path(__file__).resolve().parents[2] / "memfit" / "configs"


def test_defaults_are_valid_and_frozen():
    cfg = load_config()
    assert cfg.precision == "fp32" and cfg.memory.activation_checkpoint_every == 0
    with pytest.raises(ValidationError, match="frozen"):
        cfg.precision = "bf16-mixed"


def test_every_problem_is_listed_at_once_with_its_field_path(tmp_path):
    path = tmp_path / "bad.yaml"
    path.write_text("precision: fp8\nmicro_batch: 0\ncheckpointing: every-0\nmicro_bach: 2\nlora:\n  rank: -1\n")
    with pytest.raises(ConfigError) as info:
        load_config(path)
    message = str(info.value)
    assert "5 problem(s)" in message
    assert "precision: got 'fp8'; allowed: 'fp32', 'bf16-mixed', 'fp16-mixed' or 'bf16-pure'" in message
    assert "batch.micro_batch: must be an integer >= 1 or 'auto' (got 0)" in message
    assert "memory.checkpointing: must be 'none', 'full' or 'every-N'" in message
    assert "micro_bach: unknown field (did you mean 'batch.micro_batch'?)" in message
    assert "lora.rank:" in message
    assert str(path) in message


def test_overrides_are_dotted_and_typed():
    cfg = load_config(None, ["lora.rank=16", "optim.max_grad_norm=null", "optim.lr=1e-4", "model=some/dir", "memory.checkpointing=every-2"])
    assert cfg.lora.rank == 16 and cfg.optim.max_grad_norm is None and cfg.optim.lr == 1e-4
    assert cfg.model.name == "some/dir" and cfg.memory.activation_checkpoint_every == 2


def test_override_without_equals_is_reported():
    with pytest.raises(ConfigError, match="expected key=value"):
        load_config(None, ["micro_batch"])


def test_yaml_syntax_error_names_the_line(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("precision: fp32\nmicro_batch: [1, 2\n")
    with pytest.raises(ConfigError, match="line 3"):
        load_config(path)


def test_missing_file_is_a_clear_error(tmp_path):
    with pytest.raises(ConfigError, match="file not found"):
        load_config(tmp_path / "nope.yaml")


def test_yaml_round_trip_is_identical(tmp_path):
    cfg = load_config(None, ["precision=bf16-mixed", "optim.name=adamw-8bit", "lora.targets=all-linear"])
    path = tmp_path / "again.yaml"
    path.write_text(cfg.to_yaml())
    assert load_config(path) == cfg


@pytest.mark.parametrize("path", sorted(CONFIG_DIR.glob("*.yaml")), ids=lambda p: p.name)
def test_shipped_configs_validate(path):
    assert isinstance(load_config(path), RunConfig)


def test_configs_folder_is_not_empty():
    assert len(list(CONFIG_DIR.glob("*.yaml"))) >= 1


def test_torchao_optimizer_with_the_tracker_is_refused_up_front():
    with pytest.raises(ConfigError, match="logging.track_memory: false"):
        load_config(None, ["optim.name=adamw-8bit", "optim.backend=torchao"])
    assert load_config(None, ["optim.name=adamw-8bit", "optim.backend=torchao", "logging.track_memory=false"])
