"""Quantized layers of any shape evaluate and train on CPU; shapes a backend cannot quantize are
refused before anything changes, and the planner's search does not recommend them.

bitsandbytes' 4-bit CPU inference fast path (eval mode under no_grad, CPUs with AVX512-BF16) fails
for in_features not a multiple of 64 or out_features not a multiple of 32, and a layer it repacked
passes no gradient to its input afterwards. On a CPU without AVX512-BF16 bitsandbytes never takes
that path, so the first two tests cannot fail there (they pass either way).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch import nn
from transformers import LlamaConfig

from memfit.cli import main
from memfit.config import load_config
from memfit.memory.gpus import DEFAULT_GPU, GPUS
from memfit.memory.search import search
from memfit.strategies.quantization import (QuantizationError, quantize_model, quantized_base_shape_problem,
                                            torchao_shape_problem)

FOUR_BIT = ("nf4", "nf4-dq", "fp4")
DEMO = Path(__file__).resolve().parents[3] / "memfit" / "configs" / "demo.yaml"


def _quantized(layers: list[tuple[int, int]], quant: str) -> nn.Sequential:
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(i, o, bias=False) for i, o in layers])
    return quantize_model(model, quant, "bitsandbytes", torch.float32)


@pytest.mark.parametrize("quant", FOUR_BIT)
def test_4bit_layers_the_fast_path_cannot_take_evaluate_like_they_train(quant):
    # 96 -> 48: in_features not a multiple of 64; 48 -> 40: out_features not a multiple of 32
    model = _quantized([(96, 48), (48, 40)], quant)
    x = torch.randn(3, 5, 96)
    with torch.no_grad():
        trained = model.train()(x)
        evaluated = model.eval()(x)
    torch.testing.assert_close(evaluated, trained)


@pytest.mark.parametrize("quant", FOUR_BIT)
def test_input_gradients_are_the_same_after_an_evaluation(quant):
    """Shapes the fast path accepts: once it ran, it would stay in use and drop the input gradient."""
    model = _quantized([(64, 64), (64, 64)], quant)
    x = torch.randn(3, 5, 64)

    def input_grad() -> torch.Tensor | None:
        inputs = x.clone().requires_grad_()
        model.train()(inputs).sum().backward()
        return inputs.grad

    before = input_grad()
    with torch.no_grad():
        model.eval()(x)
    after = input_grad()
    assert after is not None
    torch.testing.assert_close(after, before)


def test_torchao_refuses_a_layer_it_cannot_block_naming_it_and_changing_nothing():
    pytest.importorskip("torchao.quantization")
    model = nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 33))  # 33 x 64 = 2112 values: a multiple of 64
    model.append(nn.Linear(33, 7))  # 7 x 33 = 231 values: not
    with pytest.raises(QuantizationError) as raised:
        quantize_model(model, "nf4", "torchao", torch.float32)
    message = str(raised.value)
    assert "2 is 7 x 33 (231 values)" in message and "quant.backend: bitsandbytes" in message
    assert "\n" not in message
    assert all(type(layer) is nn.Linear and type(layer.weight) is nn.Parameter for layer in model)


def test_shape_rule_follows_the_backend_the_config_gets():
    linears = [("model.layers.0.mlp.down_proj", 33, 7), ("model.layers.0.mlp.up_proj", 7, 64)]
    assert torchao_shape_problem("nf4", linears[1:]) is None
    torchao = quantized_base_shape_problem(method="qlora", scheme="nf4", backend="torchao", linears=linears)
    assert "model.layers.0.mlp.down_proj is 7 x 33" in torchao
    assert quantized_base_shape_problem(method="qlora", scheme="nf4", backend="bitsandbytes", linears=linears) is None
    assert quantized_base_shape_problem(method="lora", scheme="none", backend="auto", linears=linears) is None


def _odd_llama() -> LlamaConfig:
    # hidden 36 x intermediate 50: 1,800 values per MLP weight, not a multiple of 64
    return LlamaConfig(vocab_size=259, hidden_size=36, intermediate_size=50, num_hidden_layers=1,
                       num_attention_heads=2, max_position_embeddings=256)


@pytest.mark.parametrize("backend, runnable", [("torchao", False), ("bitsandbytes", True)])
def test_the_search_does_not_recommend_qlora_a_backend_cannot_build(backend, runnable):
    pytest.importorskip("torchao.quantization")
    base = load_config(None, ["method=qlora", "quant.scheme=nf4-dq", f"quant.backend={backend}", "device=cpu",
                              "data.seq_len=32"])
    result = search(base, _odd_llama(), 2**30, GPUS[DEFAULT_GPU], device="cpu", fixed_fields={"quant.backend"})
    qlora = next(f for f in result.families if f.name == "QLoRA")
    assert qlora.fits is runnable, qlora.reason
    if not runnable:
        assert "torchao needs every quantized weight" in qlora.reason
        assert result.chosen is None or result.chosen.cfg.method != "qlora"


def test_qlora_run_on_the_demo_model_evaluates_and_saves(tmp_path, capsys):
    """The built-in model's down_proj (352 -> 128) is a shape the fast path cannot take."""
    data = tmp_path / "texts.jsonl"
    data.write_text("".join(json.dumps({"text": f"record {i} of the test data"}) + "\n" for i in range(16)))
    status = main(["train", str(DEMO), f"output_dir={tmp_path / 'run'}", f"data.path={data}",
                   "data.format=text", "data.seq_len=32", "method=qlora", "quant.scheme=nf4-dq", "precision=bf16-pure",
                   "optim.name=adamw", "batch.micro_batch=2", "max_steps=2", "eval.fraction=0.25", "eval.every=1",
                   "logging.report_to=[]", "logging.track_memory=false", "device=cpu", "--no-progress"])
    assert status == 0, capsys.readouterr().err
    evals = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()
             if "eval_loss" in line]
    assert [e["step"] for e in evals] == [1, 2] and all(e["eval_loss"] > 0 for e in evals)
    assert (tmp_path / "run" / "adapter_model.safetensors").is_file()
