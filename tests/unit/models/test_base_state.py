"""A PeftModel's state dict maps back to the base model's own names (used when FSDP2 shards a LoRA run)."""

import torch
from peft import LoraConfig, get_peft_model

from memfit.config import ModelConfig
from memfit.models.loading import build_model
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
