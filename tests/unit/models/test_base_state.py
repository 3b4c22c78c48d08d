"""A PeftModel's state dict maps back to the base model's own names (used when FSDP2 shards a LoRA run)."""

import pytest
import torch
from peft import LoraConfig, get_peft_model

from memfit.config import ModelConfig
from memfit.errors import MemfitError
from memfit.models.loading import build_model, drop_tied_copies
from memfit.models.merge import base_state


def test_base_state_is_the_unloaded_base_under_its_own_names():
    torch.manual_seed(0)
    model = get_peft_model(build_model(ModelConfig(name="memfit/tiny-llama", init="random")), LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    state = base_state(model.state_dict(), torch.bfloat16)
    assert not any("lora_" in name for name in state)
    expected = model.unload().state_dict()
    assert sorted(state) == sorted(expected)
    for name, tensor in expected.items():
        assert state[name].dtype == torch.bfloat16
        torch.testing.assert_close(state[name], tensor.to(torch.bfloat16), rtol=0, atol=0, msg=name)


def test_fully_trained_modules_keep_their_trained_copy_as_unload_does():
    """lora.train_lm_head / train_embeddings (peft modules_to_save): PEFT's unload keeps the trained
    copy, so the base written from a gathered state must hold that copy under the module's own name."""
    torch.manual_seed(0)
    base = build_model(ModelConfig(name="memfit/tiny-llama", init="random"))
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"], modules_to_save=["lm_head"]))
    trained = model.base_model.model.lm_head.modules_to_save["default"].weight
    with torch.no_grad():
        trained.add_(1.0)  # the trained copy now differs from the original
    state = base_state(model.state_dict(), torch.float32)
    assert not any("modules_to_save" in name or "original_module" in name for name in state)
    expected = model.unload().state_dict()
    assert sorted(state) == sorted(expected)
    torch.testing.assert_close(state["lm_head.weight"], trained.detach(), rtol=0, atol=0)
    for name, tensor in expected.items():
        torch.testing.assert_close(state[name], tensor, rtol=0, atol=0, msg=name)


def test_tied_embeddings_appear_once_after_drop_tied_copies():
    torch.manual_seed(0)
    base = build_model(ModelConfig(name="memfit/tiny-llama", init="random"))
    base.config.tie_word_embeddings = True
    base.tie_weights()
    assert base.lm_head.weight is base.model.embed_tokens.weight
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["q_proj"]))
    state = drop_tied_copies(base, base_state(model.state_dict(), torch.float32))
    assert "model.embed_tokens.weight" in state and "lm_head.weight" not in state


def test_a_quantized_gathered_state_is_refused_with_its_names():
    state = {"base_model.model.model.layers.0.mlp.up_proj.base_layer.weight": torch.zeros(8, dtype=torch.uint8),
             "base_model.model.model.layers.0.mlp.up_proj.base_layer.weight.absmax": torch.zeros(2),
             "base_model.model.model.norm.weight": torch.ones(4)}
    with pytest.raises(MemfitError, match=r"quantized weights \(base_model\.model\.model\.layers\.0\.mlp\.up_proj"):
        base_state(state, torch.float32)
