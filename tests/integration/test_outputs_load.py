"""A run's output folder is what Hugging Face tools load: a full run with transformers' Auto classes,
a LoRA run with peft on its base; both give the trained module's logits."""

from __future__ import annotations

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM, AutoTokenizer

from memfit.distributed.engine import Engine
from memfit.train.loop import train
from memfit.train.resolve import resolve_run

FAST = {"max_steps": 2, "data.limit": 16, "save_every": 0, "lr": 1e-2}
IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(5))


@torch.no_grad()
def _logits(model) -> torch.Tensor:
    return model.eval()(input_ids=IDS).logits.float()


@pytest.fixture
def trained_logits(monkeypatch):
    """The logits of the trained module itself, taken as the run saves its final model."""
    seen = {}
    original = Engine.save_final

    def save_final(self, model, tokenizer, out):
        if out.name != "best":
            seen["logits"] = _logits(model)
            model.train()
        return original(self, model, tokenizer, out)

    monkeypatch.setattr(Engine, "save_final", save_final)
    return seen


def test_a_full_run_loads_with_transformers_and_gives_the_trained_logits(tiny_config, trained_logits):
    out = train(resolve_run(tiny_config(**FAST)), progress=False).output_dir
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json"} <= {
        p.name for p in out.iterdir()}
    loaded = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer("abc")["input_ids"]  # the run's own tokenizer, offline
    torch.testing.assert_close(_logits(loaded), trained_logits["logits"], rtol=0, atol=1e-5)


def test_a_lora_run_loads_with_peft_on_its_base_and_gives_the_trained_logits(tiny_config, trained_logits):
    out = train(resolve_run(tiny_config(method="lora", **FAST)), progress=False).output_dir
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in out.iterdir()}
    base = AutoModelForCausalLM.from_pretrained(out / "base_model")  # the random-init preset's base, saved beside
    adapted = PeftModel.from_pretrained(base, out)
    torch.testing.assert_close(_logits(adapted), trained_logits["logits"], rtol=0, atol=1e-5)
