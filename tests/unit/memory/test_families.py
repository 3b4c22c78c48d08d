"""Model families: every family module keeps the protocol, and model_shape reads a model's family and
its linears' roles off the built model, not off its model_type or module names."""

from __future__ import annotations

import pytest
from transformers import AutoConfig

from memfit.config import load_config
from memfit.memory.families import FAMILIES, ModelFamily, family_of
from memfit.memory.model_shape import (ATTENTION_INPUT, ATTENTION_OUTPUT, MLP_INPUT, MLP_OUTPUT, block_linears,
                                       model_shape)
from memfit.models.presets import list_presets, load_preset_config

PROTOCOL = [name for name in vars(ModelFamily) if not name.startswith("_")] + list(ModelFamily.__annotations__)


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_every_family_module_keeps_the_protocol(name):
    module = FAMILIES[name]
    assert module.NAME == name
    missing = [member for member in PROTOCOL if not hasattr(module, member)]
    assert not missing, f"{module.__name__} lacks {missing}"


def test_every_preset_has_a_registered_family():
    for preset in list_presets():
        shape = model_shape(load_preset_config(preset))
        assert family_of(shape).NAME == shape.family, preset


@pytest.mark.parametrize("preset, family, norms", [
    ("memfit/tiny-llama", "gated_dense", 2), ("google/gemma-2-2b", "gated_dense", 4),
    ("microsoft/Phi-3-mini-4k-instruct", "gated_dense", 2), ("openai-community/gpt2", "plain_dense", 2),
    ("microsoft/phi-2", "plain_dense", 1), ("tiiuae/falcon-7b", "plain_dense", 1)])
def test_family_and_norms_are_read_off_the_model(preset, family, norms):
    shape = model_shape(load_preset_config(preset))
    assert (shape.family, shape.norms_per_layer) == (family, norms)


def test_roles_are_read_off_the_shapes():
    """Phi-3 builds o_proj before its fused qkv_proj and fuses gate and up: the roles still come out right."""
    shape = model_shape(load_preset_config("microsoft/Phi-3-mini-4k-instruct"))
    roles = {path: role for path, role, _, _ in shape.roles}
    assert roles == {"self_attn.o_proj": ATTENTION_OUTPUT, "self_attn.qkv_proj": ATTENTION_INPUT,
                     "mlp.gate_up_proj": MLP_INPUT, "mlp.down_proj": MLP_OUTPUT}


def test_a_plain_mlp_the_presets_never_named_is_plain():
    """GPT-J (fc_in, fc_out, one LayerNorm before parallel attention and MLP) is in no list of model types:
    its family, norms and roles come from its modules."""
    config = AutoConfig.for_model("gptj", n_embd=64, n_layer=2, n_head=4, vocab_size=128, rotary_dim=8, n_positions=64)
    shape = model_shape(config)
    assert (shape.family, shape.norms_per_layer) == ("plain_dense", 1)
    assert {role for _, role, _, _ in shape.roles} == {ATTENTION_INPUT, ATTENTION_OUTPUT, MLP_INPUT, MLP_OUTPUT}


def test_gpt2_targets_name_the_attention_and_mlp_c_proj_apart():
    """GPT-2's attention and MLP output projections are both called c_proj: roles keep them apart."""
    shape = model_shape(load_preset_config("openai-community/gpt2"))
    cfg = load_config(None, ["method=lora", "lora.targets=[attn.c_proj]"])
    assert [path for path, _, _ in block_linears(shape, cfg, ATTENTION_OUTPUT)] == ["attn.c_proj"]
    assert block_linears(shape, cfg, MLP_OUTPUT) == []
