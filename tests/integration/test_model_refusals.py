"""`memfit train / plan / generate / merge` on models memfit cannot use as given: one line (exit 2), no
traceback, nothing written; and the named settings that let a user go on on purpose."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.cli import main
from memfit.config import load_config
from memfit.models.tokenizer import byte_tokenizer

TINY = dict(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=256)
RUN = {"data": {"format": "text", "seq_len": 32}, "precision": "fp32", "batch": {"micro_batch": 2}, "max_steps": 1,
       "checkpoints": {"every": 0}, "logging": {"every": 1, "track_memory": False, "report_to": []}, "device": "cpu"}


def _saved(folder: Path, tokenizer: bool = True) -> Path:
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    if tokenizer:
        byte_tokenizer().save_pretrained(folder)
    return folder


def _config_only(folder: Path, config: dict) -> Path:
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def _train(tmp: Path, capsys, *overrides: str) -> tuple[int, str]:
    (tmp / "texts.jsonl").write_text("".join(json.dumps({"text": f"record {i} of the data"}) + "\n" for i in range(8)))
    (tmp / "config.yaml").write_text(yaml.safe_dump({**RUN, "data": {**RUN["data"], "path": str(tmp / "texts.jsonl")}}))
    capsys.readouterr()
    status = main(["train", str(tmp / "config.yaml"), f"output_dir={tmp / 'run'}", *overrides, "--no-progress"])
    return status, capsys.readouterr().err


def _refused(status: int, stderr: str, tmp: Path, *needles: str) -> str:
    assert status == 2 and "Traceback" not in stderr, stderr
    message = stderr[stderr.index("memfit: error: "):]
    for needle in needles:
        assert needle in message, f"{needle!r} missing from: {message}"
    assert not (tmp / "run").exists(), "a refused run wrote its output_dir"
    return message


def test_a_checkpoint_missing_a_layer_is_refused_and_new_weights_opts_in(tmp_path, capsys, caplog):
    model = _saved(tmp_path / "m")
    weights = {k: v for k, v in load_file(model / "model.safetensors").items() if not k.startswith("model.layers.1.")}
    save_file(weights, model / "model.safetensors", metadata={"format": "pt"})
    status, err = _train(tmp_path, capsys, f"model={model}", "model.init=pretrained")
    _refused(status, err, tmp_path, f"model.name: {model}", "model.layers.1.* (9 tensors) missing", "model.new_weights")
    status, err = _train(tmp_path, capsys, f"model={model}", "model.init=pretrained",
                         "model.new_weights=[model.layers.1.*]")
    assert status == 0, err
    assert "model.new_weights: model.layers.1.* (9 tensors) not in the checkpoint: starts from random values" \
        in caplog.text


def test_weights_without_a_tokenizer_need_model_tokenizer(tmp_path, capsys):
    model = _saved(tmp_path / "m", tokenizer=False)
    status, err = _train(tmp_path, capsys, f"model={model}", "model.init=pretrained")
    _refused(status, err, tmp_path, f"{model} holds real weights but no tokenizer", "tokenizer.json", "model.tokenizer")
    source = _saved(tmp_path / "with-tokenizer")
    status, err = _train(tmp_path, capsys, f"model={model}", "model.init=pretrained", f"model.tokenizer={source}")
    assert status == 0, err
    assert (tmp_path / "run" / "tokenizer.json").is_file()  # so the run's folder works as model.name later


@pytest.mark.parametrize("name, config, needles", [
    ("mamba", {"model_type": "mamba", "vocab_size": 259, "hidden_size": 32, "num_hidden_layers": 2},
     ("'mamba' model has no num_attention_heads", "memfit trains decoder transformers")),
    ("gpt2-heads", {"model_type": "gpt2", "vocab_size": 259, "n_embd": 30, "n_layer": 2, "n_head": 4,
                    "n_positions": 256}, ("hidden_size (30) must be a multiple of num_attention_heads (4)",)),
    ("llama-heads", {"model_type": "llama", **TINY, "hidden_size": 30, "num_attention_heads": 4},
     ("llama-heads/config.json", "hidden size (30) is not a multiple of the number of attention heads (4)")),
    ("kv-heads", {"model_type": "llama", **TINY, "num_attention_heads": 4, "num_key_value_heads": 3},
     ("num_key_value_heads (3) must divide num_attention_heads (4)",)),
    ("small-vocab", {"model_type": "llama", **TINY, "vocab_size": 200},
     ("vocab_size is 200", "byte-level tokenizer", "259 token ids")),
])
def test_unusable_model_configs_are_one_clear_error(tmp_path, capsys, name, config, needles):
    folder = _config_only(tmp_path / name, config)
    status, err = _train(tmp_path, capsys, f"model={folder}", "model.init=random")
    _refused(status, err, tmp_path, str(folder), *needles)


def test_plan_refuses_an_architecture_memfit_cannot_train(tmp_path, capsys):
    folder = _config_only(tmp_path / "mamba", {"model_type": "mamba", "vocab_size": 259, "hidden_size": 32,
                                               "num_hidden_layers": 2})
    assert main(["plan", str(folder), "--device", "cpu"]) == 2
    assert "'mamba' model has no num_attention_heads" in capsys.readouterr().err


def _run_dir(tmp: Path) -> Path:
    """A finished full run's folder, as memfit writes it (weights, config, tokenizer, run_config.yaml)."""
    run = _saved(tmp / "finished")
    (run / "run_config.yaml").write_text(load_config(None, [f"model={run}", "model.init=random",
                                                            f"output_dir={run}"]).to_yaml())
    return run


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_generate_names_a_damaged_weights_file(tmp_path, capsys, damage):
    run = _run_dir(tmp_path)
    weights = run / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"\x00garbage" * 100)
    assert main(["generate", str(run), "hello"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"{weights} is damaged or not safetensors" in err and "train again" in err


@pytest.mark.parametrize("command", ["generate", "merge"])
def test_generate_and_merge_say_a_path_does_not_exist_or_is_not_a_run(tmp_path, capsys, command):
    args = ["hello"] if command == "generate" else []
    assert main([command, str(tmp_path / "nowhere"), *args]) == 2
    assert f"{tmp_path / 'nowhere'}: no such folder; memfit {command} needs" in capsys.readouterr().err
    assert main([command, str(tmp_path), *args]) == 2
    assert f"{tmp_path}: no run_config.yaml here, so it is not a memfit run" in capsys.readouterr().err
