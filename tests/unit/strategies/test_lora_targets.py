"""Every name in lora.targets must name a module of the model: one unknown name among known ones is
refused (peft would drop it silently), listing the unknown names and the names the model has, by
`memfit train` before anything is written and by `memfit plan`."""

from __future__ import annotations

import pytest
import torch

from memfit.build import apply_configured_method
from memfit.cli import main
from memfit.memory.planner import plan
from memfit.models.loading import build_model, load_model_config
from memfit.strategies.adapters import LoraTargetError, check_lora_targets_on_meta

NAMES = "down_proj, embed_tokens, gate_proj, k_proj, lm_head, o_proj, q_proj, up_proj, v_proj"


def tiny_model(cfg):
    torch.manual_seed(0)
    return build_model(cfg.model)


@pytest.mark.parametrize("targets, unknown", [("[q_proj,qproj]", "'qproj'"), ("[qproj,v_prj,o_proj]", "'qproj', 'v_prj'"),
                                              ("[nothing]", "'nothing'")])
def test_unknown_targets_are_refused_with_the_names_the_model_has(tiny_config, targets, unknown):
    cfg = tiny_config(method="lora", **{"lora.targets": targets})
    with pytest.raises(LoraTargetError) as error:
        apply_configured_method(tiny_model(cfg), cfg, "cpu")
    assert str(error.value) == (f"lora.targets: {unknown}: no such module in LlamaForCausalLM; its adaptable module "
                                f"names are {NAMES} (or set lora.targets: all-linear)")


@pytest.mark.filterwarnings("ignore:Model has `tie_word_embeddings=True`")
@pytest.mark.parametrize("targets", ["[q_proj,v_proj]", "[self_attn.q_proj]", "[lm_head,embed_tokens]", "all-linear"])
def test_names_peft_matches_are_accepted(tiny_config, targets):
    cfg = tiny_config(method="lora", **{"lora.targets": targets})
    model = apply_configured_method(tiny_model(cfg), cfg, "cpu")
    assert any("lora_A" in name for name, _ in model.named_parameters())


def test_the_planner_refuses_the_same_names(tiny_config):
    cfg = tiny_config(method="lora", **{"lora.targets": "[q_proj,qproj]"})
    with pytest.raises(LoraTargetError, match=f"lora.targets: 'qproj': no such module in LlamaForCausalLM; its "
                                              f"adaptable module names are {NAMES}"):
        plan(cfg.model.name, cfg, device="cpu")
    defaults = tiny_config(method="lora").lora.targets
    check_lora_targets_on_meta(load_model_config(cfg.model)[0], method="lora", targets=defaults,
                               trust_remote_code=False)  # the defaults exist


def test_plan_cli_refuses_an_unknown_target(capsys):
    status = main(["plan", "memfit/tiny-llama", "--method", "lora", "--lora-targets", "q_proj,qproj"])
    assert status == 2
    assert "memfit: error: lora.targets: 'qproj': no such module in LlamaForCausalLM" in capsys.readouterr().err
