"""Adapter outputs: PEFT's format, the base beside it, and `memfit merge` / `merge: true`."""

from __future__ import annotations

import json

import pytest
import torch
from peft import PeftModel
from transformers import AutoModelForCausalLM

from memfit.build import configured_quantized_loading
from memfit.cli import main
from memfit.config import load_config
from memfit.models.loading import build_model
from memfit.models.tokenizer import byte_tokenizer
from memfit.train.loop import train
from memfit.train.resolve import resolve_run

FAST = {"max_steps": 3, "seq_len": 192, "micro_batch": 4, "data.limit": 32, "lr": 1e-2, "save_every": 0,
        "lora.targets": "all-linear"}


@torch.no_grad()
def _logits(model, training: bool = False) -> torch.Tensor:
    # bitsandbytes' 4-bit layers switch to a repacked bf16 CPU kernel in eval mode (on CPUs with
    # AVX512-BF16); the quantized reference runs in train mode (no dropout here) to compute as training did.
    ids = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(3))
    return model.train(training)(input_ids=ids).logits.float()


@pytest.mark.slow
def test_merge_true_matches_base_plus_adapter(tiny_config):
    """QLoRA on a random-init preset: base_model/ holds the dequantized base; merged == base + adapter."""
    cfg = tiny_config(method="qlora", merge="true", compute_dtype="fp32", **FAST)
    out = train(resolve_run(cfg), progress=False).output_dir
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((out / "base_model").resolve())
    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert all(p.dtype == torch.float32 for p in merged.parameters())  # the base dtype
    assert not any("lora" in name for name, _ in merged.named_parameters())
    base = AutoModelForCausalLM.from_pretrained(out / "base_model")
    plain = _logits(base)
    reference = _logits(PeftModel.from_pretrained(base, out))
    assert not torch.allclose(reference, plain, atol=1e-4)  # the adapter learned something to merge
    torch.testing.assert_close(_logits(merged), reference, rtol=0, atol=1e-4)


@pytest.mark.slow
def test_cli_merge_dequantizes_a_real_quantized_base(tiny_config, tmp_path, capsys):
    """A base with weights of its own: no copy is saved; merge re-quantizes it exactly as training did,
    dequantizes, merges. The merged model equals the 4-bit base + adapter that training ran."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(vocab_size=259, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=4)).save_pretrained(tmp_path / "base")
    byte_tokenizer().save_pretrained(tmp_path / "base")  # real weights train only with their own tokenizer
    cfg = tiny_config(method="qlora", quant="nf4", compute_dtype="fp32", model=str(tmp_path / "base"), **FAST)
    out = train(resolve_run(cfg), progress=False).output_dir
    assert not (out / "base_model").exists()
    assert main(["merge", str(out), "--output", str(tmp_path / "merged")]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    quantized_base = build_model(cfg.model, cfg.memory.attention, load_kwargs=configured_quantized_loading(cfg))
    reference = _logits(PeftModel.from_pretrained(quantized_base, out), training=True)
    torch.testing.assert_close(_logits(merged), reference, rtol=0, atol=1e-3)
    assert main(["merge", str(out), "--output", str(tmp_path / "merged")]) == 2  # never overwrites silently
    assert "already holds a model" in capsys.readouterr().err


def test_merge_refuses_a_run_without_adapter(tmp_path, capsys):
    (tmp_path / "run_config.yaml").write_text(load_config(None, ["method=full"]).to_yaml())
    assert main(["merge", str(tmp_path)]) == 2
    assert "holds no adapter" in capsys.readouterr().err
