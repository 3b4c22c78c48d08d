"""QLoRA (4-bit base) and 8-bit base + LoRA: backends, byte layout, training, validation, loading."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from memfit.config import ConfigError, load_config
from memfit.errors import MissingPackageError
from memfit.models.merge import save_trained_base
from memfit.strategies import quantization
from memfit.build import configured_quantized_loading
from memfit.strategies.quantization import QuantizationError, is_quantized_linear, quantized_bytes

sys.path.insert(0, str(Path(__file__).parent))
from test_lora import build, is_adapter, logits, snapshot, train_steps  # noqa: E402

VARIANTS = {  # name -> overrides, expected quantized layer class
    "bnb-nf4": ({"method": "qlora", "quant": "nf4"}, "Linear4bit"),
    "bnb-nf4-dq": ({"method": "qlora"}, "Linear4bit"),
    "bnb-fp4": ({"method": "qlora", "quant": "fp4"}, "Linear4bit"),
    "torchao-nf4": ({"method": "qlora", "quant_backend": "torchao"}, "Linear"),
    "bnb-int8": ({"method": "lora", "quant": "int8"}, "Linear8bitLt"),
}


@pytest.mark.slow  # 20-170 s each on 2 busy cores
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_loss_falls_and_only_adapters_change(tiny_config, variant):
    overrides, layer_class = VARIANTS[variant]
    model = build(tiny_config(**overrides, **{"lora.targets": "all-linear"}))
    quantized = [m for m in model.modules() if is_quantized_linear(m)]
    assert len(quantized) == 4 * 7 and {type(m).__name__ for m in quantized} == {layer_class}
    assert type(model.get_output_embeddings()) is torch.nn.Linear  # the head stays in high precision
    before = snapshot(model)
    losses = train_steps(model, tiny_config(**overrides), 8)
    assert losses[-1] < losses[0] - 0.15
    after = snapshot(model)
    frozen_changed = [n for n in before if not is_adapter(n) and not torch.equal(before[n], after[n])]
    assert frozen_changed == []
    assert any("lora_B" in n and not torch.equal(before[n], after[n]) for n in before)


@pytest.mark.parametrize("precision, kept", [("bf16-pure", torch.bfloat16), ("bf16-mixed", torch.float32)])
def test_non_quantized_parameters_follow_the_precision(tiny_config, precision, kept):
    """A bf16-pure QLoRA run keeps norms and embeddings in bf16 (fp32 ones would make every activation
    fp32); a mixed run keeps its fp32 master weights."""
    model = build(tiny_config(method="qlora", quant="nf4", precision=precision))
    rest = {p.dtype for n, p in model.named_parameters() if "lora_" not in n and p.dtype.is_floating_point}
    assert rest == {kept}
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if "lora_" in n)  # peft's fp32 adapters


@pytest.mark.slow  # 20-170 s each on 2 busy cores
def test_byte_layout_per_backend(tiny_config):
    """Packed codes are half a byte per value; the scales follow each backend's layout (docs/lora.md)."""
    values = 4 * (4 * 128 * 128 + 3 * 128 * 352)  # the base Linear layers of tiny-llama
    layers = 4 * 7
    expected = {
        "bnb-nf4": (values // 2, values // 64 * 4 + layers * 64),
        "bnb-nf4-dq": (values // 2, None),
        "torchao-nf4": (values // 2, None),
        "bnb-int8": (values, 4 * 4 * (4 * 128 + 2 * 352 + 128)),  # one fp32 scale per output row
    }
    for variant, (codes, scales) in expected.items():
        got = quantized_bytes(build(tiny_config(**VARIANTS[variant][0])))
        assert got["codes"] == codes, variant
        if scales is not None:
            assert got["scales"] == scales, variant
    # nf4-dq per layer: uint8 absmax per 64 values, fp32 second-level absmax per 256 blocks,
    # 256-entry fp32 second-level code table, fp32 offset, 16-entry fp32 code table.
    def dq_layer(n):
        return n // 64 + 4 * -(-(n // 64) // 256) + 1024 + 4 + 64

    dq = quantized_bytes(build(tiny_config(**VARIANTS["bnb-nf4-dq"][0])))["scales"]
    assert dq == 4 * (4 * dq_layer(128 * 128) + 3 * dq_layer(128 * 352))
    torchao = quantized_bytes(build(tiny_config(**VARIANTS["torchao-nf4"][0])))["scales"]
    assert values // 64 < torchao < values // 64 * 1.2  # int8 scalers + small fp32 factors and tables


def test_qlora_adapter_reloads_on_the_dequantized_base(tiny_config, tmp_path):
    cfg = tiny_config(method="qlora", compute_dtype="fp32")
    model = build(cfg)
    train_steps(model, cfg, 3)
    expected = logits(model)
    model.save_pretrained(tmp_path, safe_serialization=True)
    save_trained_base(model, cfg, tmp_path)
    reloaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tmp_path / "base_model"), tmp_path)
    torch.testing.assert_close(logits(reloaded), expected, rtol=0, atol=1e-4)


@pytest.mark.slow  # 20-170 s each on 2 busy cores
def test_real_weights_load_straight_into_bitsandbytes_layers(tiny_config, tmp_path):
    """A local model with weights loads through transformers' BitsAndBytesConfig (no second quantization)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4)).save_pretrained(tmp_path / "base")
    cfg = tiny_config(method="qlora", model=str(tmp_path / "base"))
    kwargs = configured_quantized_loading(cfg)
    assert kwargs["quantization_config"].bnb_4bit_use_double_quant
    model = build(cfg, load_kwargs=kwargs)
    layers = [m for m in model.modules() if is_quantized_linear(m)]
    assert len(layers) == 2 * 7 and all(type(m).__name__ == "Linear4bit" for m in layers)
    assert quantized_bytes(model)["scales"] > 0  # the quant_state is visible to the tracker
    losses = train_steps(model, cfg, 3)
    assert losses[-1] < losses[0]


def test_invalid_combinations_listed_at_once(tmp_path):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["method=full", "quant.scheme=nf4", "lora.merge=true", f"output_dir={tmp_path}"])
    assert len(err.value.problems) == 2
    assert "needs method: lora or qlora" in str(err.value) and "merge" in str(err.value)
    with pytest.raises(ConfigError, match="qlora needs 4-bit"):
        load_config(None, ["method=qlora", "quant.scheme=int8"])
    with pytest.raises(ConfigError, match="torchao provides only nf4"):
        load_config(None, ["method=qlora", "quant.scheme=fp4", "quant.backend=torchao"])
    assert load_config(None, ["method=qlora"]).quant.scheme == "nf4-dq"  # QLoRA's own default
    assert load_config(None, ["method=lora", "quant=int8"]).quant.scheme == "int8"


def test_no_backend_error_lists_the_backends(monkeypatch):
    def missing(module, purpose, install=None):
        raise MissingPackageError(f"{purpose} needs the '{install or module}' package: pip install {install}")

    monkeypatch.setattr(quantization, "require", missing)
    with pytest.raises(QuantizationError) as err:
        quantization.choose_backend("nf4", "auto")
    message = str(err.value)
    assert "bitsandbytes: not installed" in message and "torchao: not installed" in message
    with pytest.raises(QuantizationError, match="torchao: has no int8"):
        quantization.choose_backend("int8", "torchao")
