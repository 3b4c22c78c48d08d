"""The sequence-tiled MLP: same gradients, one slice's MLP intermediates alive, clear refusals."""

from __future__ import annotations

import logging

import pytest
import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, MistralConfig, Qwen2Config

from memfit.build import build_run
from memfit.config import load_config
from memfit.errors import MemfitError
from memfit.memory.analytic import analytic_estimate
from memfit.memory.measure import tracked_step_peaks
from memfit.models.loading import load_model_config
from memfit.strategies import tiled_mlp
from memfit.strategies.tiled_mlp import apply_tiled_mlp, slice_tokens

SHAPE = dict(vocab_size=300, hidden_size=32, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=1024)


@pytest.fixture(params=[LlamaConfig, MistralConfig, Qwen2Config], ids=["llama", "mistral", "qwen2"])
def model_dir(request, tmp_path):
    config = request.param(**SHAPE)
    config.save_pretrained(tmp_path / "shape")
    return str(tmp_path / "shape")


def _cfg(model: str, *words: str, seq_len: int = 128):
    return load_config(None, [f"model={model}", "model.init=random", "device=cpu", f"data.seq_len={seq_len}",
                              "batch.micro_batch=2", *words])


def _gradients(cfg, ids: torch.Tensor) -> tuple[float, dict[str, torch.Tensor]]:
    torch.manual_seed(0)
    run = build_run(cfg, torch.device("cpu"))
    with run.precision.autocast():
        loss = run.model(input_ids=ids, labels=ids).loss
    loss.backward()
    return float(loss.detach()), {n: p.grad.float().clone() for n, p in run.model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("words", [[], ["memory.checkpointing=full"], ["method=lora", "lora.targets=all-linear"],
                                   ["method=lora", "memory.checkpointing=full"]],
                         ids=["full", "full+checkpointing", "lora-all-linear", "lora+checkpointing"])
def test_fp32_gradients_equal_the_untiled_ones(model_dir, words):
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 128))
    loss, plain = _gradients(_cfg(model_dir, *words), ids)
    tiled_loss, tiled = _gradients(_cfg(model_dir, *words, "memory.tiled_mlp=true"), ids)  # 8 slices of 32 tokens
    assert tiled_loss == pytest.approx(loss, abs=1e-6)
    assert plain.keys() == tiled.keys() and plain
    for name in plain:
        torch.testing.assert_close(tiled[name], plain[name], rtol=1e-5, atol=1e-5, msg=name)


def test_bf16_gradients_equal_within_bf16_tolerance(model_dir):
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 128))
    _, plain = _gradients(_cfg(model_dir, "precision=bf16-pure"), ids)
    _, tiled = _gradients(_cfg(model_dir, "precision=bf16-pure", "memory.tiled_mlp=true",
                               "memory.tiled_mlp_slices=3"), ids)
    for name in plain:
        torch.testing.assert_close(tiled[name], plain[name], rtol=2e-2, atol=2e-2, msg=name)


def test_qlora_gradients_equal_the_untiled_ones(tmp_path):
    pytest.importorskip("bitsandbytes")
    LlamaConfig(**SHAPE).save_pretrained(tmp_path / "shape")
    words = ["method=qlora", "precision=bf16-mixed", "lora.targets=all-linear"]
    ids = torch.randint(0, SHAPE["vocab_size"], (2, 128))
    _, plain = _gradients(_cfg(str(tmp_path / "shape"), *words), ids)
    _, tiled = _gradients(_cfg(str(tmp_path / "shape"), *words, "memory.tiled_mlp=true"), ids)
    assert any("mlp" in name for name in plain)  # the adapters inside the MLP train
    for name in plain:
        torch.testing.assert_close(tiled[name], plain[name], rtol=1e-3, atol=1e-4, msg=name)


@pytest.mark.parametrize("words", [[], ["memory.checkpointing=full"]], ids=["plain", "checkpointing"])
def test_tiling_lowers_the_measured_peak_as_the_planner_predicts(tmp_path, words):
    # An MLP 8x wider than the model so the MLP intermediates set the peak, as at long context.
    LlamaConfig(**{**SHAPE, "intermediate_size": 256}).save_pretrained(tmp_path / "wide")
    model = str(tmp_path / "wide")
    config = load_model_config(_cfg(model).model)[0]
    plain_cfg, tiled_cfg = _cfg(model, *words, seq_len=512), _cfg(model, *words, "memory.tiled_mlp=true", seq_len=512)
    measured = tracked_step_peaks(plain_cfg, [512])[0], tracked_step_peaks(tiled_cfg, [512])[0]
    predicted = (analytic_estimate(plain_cfg, config, device="cpu").peak_allocated_bytes,
                 analytic_estimate(tiled_cfg, config, device="cpu").peak_allocated_bytes)
    assert measured[1] < 0.8 * measured[0], measured
    saved_measured, saved_predicted = measured[0] - measured[1], predicted[0] - predicted[1]
    assert saved_predicted == pytest.approx(saved_measured, rel=0.10), (measured, predicted)


def test_an_mlp_it_cannot_tile_is_named():
    model = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=300))
    with pytest.raises(MemfitError, match=r"GPT2MLP \(transformer\.h\.0\.mlp\) is not a gated MLP.*LlamaMLP"):
        apply_tiled_mlp(model)
    with pytest.raises(MemfitError, match="has no decoder layer with an `mlp`"):
        apply_tiled_mlp(torch.nn.Sequential(torch.nn.Linear(2, 2)))


def test_more_slices_than_tokens_are_clamped_with_a_note(caplog):
    tiled_mlp._CLAMP_SAID.clear()
    with caplog.at_level(logging.INFO, logger="memfit.strategies.tiled_mlp"):
        assert slice_tokens(tokens=10, hidden=32, slices=64) == 1
    assert "more than the 10 tokens" in caplog.text
    assert slice_tokens(tokens=100, hidden=32, slices=None) == 32
    assert slice_tokens(tokens=100, hidden=32, slices=3) == 34


def test_a_tiny_batch_and_evaluation_run_untiled_and_tiled_alike(model_dir):
    cfg = _cfg(model_dir, "memory.tiled_mlp=true")
    run = build_run(cfg, torch.device("cpu"))
    ids = torch.randint(0, SHAPE["vocab_size"], (1, 8))  # fewer tokens than one slice: the MLP's own forward
    with torch.no_grad():
        tiled = run.model(input_ids=torch.randint(0, SHAPE["vocab_size"], (2, 100))).logits
    assert tiled.shape == (2, 100, SHAPE["vocab_size"])
    run.model(input_ids=ids, labels=ids).loss.backward()
