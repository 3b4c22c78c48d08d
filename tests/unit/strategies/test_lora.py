"""method: lora through PEFT: options map onto peft, only adapters train, the adapter reloads."""

from __future__ import annotations

import math

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from memfit.build import apply_configured_method
from memfit.errors import MemfitError
from memfit.memory.tracker import NullTracker
from memfit.models.loading import build_model
from memfit.models.merge import save_trained_base
from memfit.strategies.optimizers import build_optimizer
from memfit.strategies.precision import make_precision
from memfit.step import training_step

# --- helpers, also used by test_qlora.py and test_merge.py -------------------------------------------

def build(cfg, load_kwargs=None):
    torch.manual_seed(cfg.seed)
    precision = make_precision(cfg.precision, torch.device("cpu"))
    model = build_model(cfg.model, cfg.memory.attention, dtype=precision.weight_dtype, load_kwargs=load_kwargs)
    return apply_configured_method(model, cfg, "cpu").train()


def fixed_batch(batch: int = 4, seq: int = 32, seed: int = 1) -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 256, (batch, seq), generator=generator)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def train_steps(model, cfg, steps: int, lr: float = 1e-2) -> list[float]:
    """Overfit one fixed batch with the trainer's own step: the loss must fall."""
    precision = make_precision(cfg.precision, torch.device("cpu"))
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg.optim.name, params, lr)
    batch = fixed_batch()
    return [training_step(model, optimizer, [batch], precision, NullTracker(), params, 1.0).loss
            for _ in range(steps)]


def snapshot(model) -> dict[str, torch.Tensor]:
    """Every parameter and buffer, copied (quantized codes included)."""
    out = {}
    for name, tensor in list(model.named_parameters()) + list(model.named_buffers()):
        data = tensor.detach()
        if type(data).__name__ == "NF4Tensor":
            data = data.quantized_data
        out[name] = data.clone()
    return out


def is_adapter(name: str) -> bool:
    return "lora_" in name or "modules_to_save" in name


@torch.no_grad()
def logits(model, batch=None) -> torch.Tensor:
    """Logits in train mode (no dropout in these models), the mode the training loss is computed in."""
    model.train()
    return model(input_ids=(batch or fixed_batch(seed=7))["input_ids"]).logits.float()


# --- tests -------------------------------------------------------------------------------------------


@pytest.mark.slow  # 20-170 s each on 2 busy cores
@pytest.mark.parametrize("extra", [{}, {"lora.use_dora": "true"}, {"lora.use_rslora": "true", "lora.targets": "all-linear"}],
                         ids=["lora", "dora", "rslora-all-linear"])
def test_loss_falls_and_only_adapters_change(tiny_config, extra):
    cfg = tiny_config(method="lora", **extra)
    model = build(cfg)
    trainable = {n for n, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(is_adapter(n) for n in trainable)
    before = snapshot(model)
    losses = train_steps(model, cfg, 8)
    assert losses[-1] < losses[0] - 0.15  # random tokens: loss starts near ln(259) = 5.56
    after = snapshot(model)
    for name in before:
        if is_adapter(name):
            continue
        assert torch.equal(before[name], after[name]), f"frozen {name} changed"
    changed = [n for n in trainable if not torch.equal(before[n], after[n])]
    assert any("lora_B" in n for n in changed)  # lora_B starts at zero: it must have learned


def test_options_reach_peft(tiny_config):
    cfg = tiny_config(method="lora", **{"lora.targets": "all-linear", "lora.rank": 4, "lora.alpha": 8,
                                        "lora.use_rslora": "true", "lora.train_embeddings": "true"})
    model = build(cfg)
    wrapped = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if hasattr(m, "lora_A")}
    assert wrapped == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    layer = model.base_model.model.model.layers[0].self_attn.q_proj
    assert layer.scaling["default"] == pytest.approx(8 / math.sqrt(4))  # rsLoRA: alpha / sqrt(r)
    assert any(name.endswith("embed_tokens") for name in model.peft_config["default"].modules_to_save)
    assert any("embed_tokens.modules_to_save" in n and p.requires_grad for n, p in model.named_parameters())


def test_dora_adds_magnitudes(tiny_config):
    model = build(tiny_config(method="lora", **{"lora.use_dora": "true"}))
    assert any("lora_magnitude_vector" in n for n, _ in model.named_parameters())


def test_unknown_target_is_a_clear_error(tiny_config):
    with pytest.raises(MemfitError, match="lora.targets"):
        build(tiny_config(method="lora", **{"lora.targets": "[no_such_proj]"}))


def test_saved_adapter_reloads_with_peft_and_same_logits(tiny_config, tmp_path):
    cfg = tiny_config(method="lora", **{"lora.targets": "all-linear"})
    model = build(cfg)
    train_steps(model, cfg, 4)
    expected = logits(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    save_trained_base(model, cfg, tmp_path)  # preset = random init: the base is saved beside the adapter
    assert (tmp_path / "adapter_model.safetensors").is_file()
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "base_model")
    reloaded = PeftModel.from_pretrained(base, tmp_path)
    torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=1e-5)
    assert not torch.allclose(logits(base.__class__.from_pretrained(tmp_path / "base_model")), expected, atol=1e-3)
