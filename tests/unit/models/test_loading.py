"""Real weights or an explicit random init, and a hub that cannot be reached answers at once."""

from __future__ import annotations

import time

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.config import ModelConfig, load_config
from memfit.memory.planner import plan, write_config
from memfit.models import loading
from memfit.models.loading import ModelLoadError, build_model, load_tokenizer


@pytest.fixture
def saved(tmp_path):
    folder = tmp_path / "mymodel"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                                 num_attention_heads=2, max_position_embeddings=256)).save_pretrained(folder)
    return folder


def _weights(model) -> torch.Tensor:
    return model.get_input_embeddings().weight.detach()


def test_pretrained_loads_the_folder_weights_and_random_does_not(saved, caplog):
    pretrained = build_model(ModelConfig(name=str(saved)))
    again = build_model(ModelConfig(name=str(saved)))
    assert torch.equal(_weights(pretrained), _weights(again))
    with caplog.at_level("WARNING", logger="memfit.models.loading"):
        random = build_model(ModelConfig(name=str(saved), init="random"))
    assert not torch.equal(_weights(pretrained), _weights(random))
    assert "trains from random weights, not its pretrained ones" in caplog.text


def test_a_memfit_preset_needs_an_explicit_random_init():
    with pytest.raises(ModelLoadError, match="memfit's own presets.*set model.init=random"):
        build_model(ModelConfig(name="memfit/tiny-llama"))
    model = build_model(ModelConfig(name="memfit/tiny-llama", init="random"))
    assert model.config.num_hidden_layers >= 1


def test_a_config_only_folder_needs_an_explicit_random_init(saved):
    (saved / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="holds a config.json but no weights"):
        build_model(ModelConfig(name=str(saved)))
    build_model(ModelConfig(name=str(saved), init="random"))


def test_no_model_named_is_the_builtin_tiny_model_from_random_weights():
    cfg = load_config(None, [])
    assert cfg.model == ModelConfig(name="memfit/tiny-llama", init="random")
    assert load_config(None, ["model.name=gpt2"]).model.init == "pretrained"  # naming a model asks for its weights


def test_a_preset_that_is_a_hub_model_fails_fast_when_the_hub_is_unreachable(monkeypatch, tmp_path):
    # Nothing listens on port 9 of this machine: the probe is refused at once instead of retrying.
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    loading._probe.cache_clear()
    started = time.monotonic()
    unreachable = r"hub cannot be reached \(127\.0\.0\.1:9: .*lacks its weights.*huggingface-cli download"
    with pytest.raises(ModelLoadError, match=unreachable):
        build_model(ModelConfig(name="gpt2"))
    with pytest.raises(ModelLoadError, match="openai-community/gpt2"):
        load_tokenizer(ModelConfig(name="gpt2"))
    assert time.monotonic() - started < 10
    loading._probe.cache_clear()


def test_hf_hub_offline_is_honoured_without_the_network(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty-cache"))
    monkeypatch.setattr(loading, "_probe", lambda *a: pytest.fail("probed the network with HF_HUB_OFFLINE=1"))
    with pytest.raises(ModelLoadError, match="HF_HUB_OFFLINE is set"):
        build_model(ModelConfig(name="meta-llama/Llama-3.2-1B"))


def test_a_random_preset_uses_the_byte_tokenizer_without_the_hub(monkeypatch):
    monkeypatch.setattr(loading, "from_hub", lambda *a, **k: pytest.fail("asked the hub"))
    assert load_tokenizer(ModelConfig(name="gpt2", init="random")).vocab_size == 259


def test_the_written_plan_of_a_shape_without_weights_says_random(tmp_path):
    cfg = load_config(None, ["device=cpu", "batch.micro_batch=1", "data.seq_len=64"])
    written = write_config(plan("memfit/gpt3-175b", cfg, 2**30, device="cpu"), str(tmp_path / "a.yaml"))
    assert written.model == ModelConfig(name="memfit/gpt3-175b", init="random")
    assert load_config(tmp_path / "a.yaml").model.init == "random"
    hub = write_config(plan("gpt2", cfg, 2**30, device="cpu"), str(tmp_path / "b.yaml"))
    assert hub.model == ModelConfig(name="gpt2", init="pretrained")  # training it loads the real gpt2
