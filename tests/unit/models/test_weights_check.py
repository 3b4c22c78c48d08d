"""A checkpoint that does not fill its model is one error, never random weights in silence."""

from __future__ import annotations

import json
import logging
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM, MixtralConfig, MixtralForCausalLM

from memfit.config import ModelConfig
from memfit.models.loading import ModelLoadError, build_model
from memfit.models.weights_check import WeightsMismatchError, describe, group_keys

TINY = dict(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=2,
            max_position_embeddings=256)


def _save(folder, tie: bool = False, **changes):
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**{**TINY, **changes}, tie_word_embeddings=tie))
    model.save_pretrained(folder)
    return model


def _edit_weights(folder, drop: str = "", add: dict | None = None) -> None:
    state = {k: v for k, v in load_file(folder / "model.safetensors").items() if not (drop and k.startswith(drop))}
    save_file({**state, **(add or {})}, folder / "model.safetensors", metadata={"format": "pt"})


def _edit_config(folder, **changes) -> None:
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, **changes}))


def _build(folder, **spec):
    return build_model(ModelConfig(name=str(folder), **spec))


# ---------------------------------------------------------------- grouping


def test_a_whole_module_is_one_group_and_layers_merge_into_ranges():
    model = {f"model.layers.{i}.{n}.weight" for i in range(8) for n in ("q", "k", "mlp")} | {"lm_head.weight"}
    missing = {k for k in model if k.startswith(("model.layers.4.", "model.layers.5.", "model.layers.7."))}
    assert group_keys(missing, model - missing) == ["model.layers.{4-5,7}.* (9 tensors)"]
    one = {"model.layers.0.q.weight", "lm_head.weight"}
    assert group_keys(one, model - one) == ["lm_head.weight", "model.layers.0.q.weight"]


def test_numbers_merge_only_when_every_combination_is_there():
    # Expert 3 of layer 1 and expert 5 of layer 2: "{1-2}...{3,5}" would claim four experts.
    keys = {"m.layers.1.experts.3.w", "m.layers.2.experts.5.w"}
    assert group_keys(keys, {"m.layers.1.experts.0.w", "m.layers.2.experts.0.w"}) == sorted(keys)


def test_mismatched_shapes_are_grouped_by_both_shapes():
    mismatched = {(f"model.layers.{i}.up.weight", (64, 32), (96, 32)) for i in range(4)}
    mismatched.add(("model.embed.weight", (259, 32), (300, 32)))
    text = describe(set(), set(), mismatched, {k for k, _, _ in mismatched})
    assert "model.layers.{0-3}.up.weight (4 tensors) is 64x32 in the checkpoint but 96x32 in the model" in text
    assert "model.embed.weight is 259x32 in the checkpoint but 300x32 in the model" in text
    assert describe(set(), set(), set(), {"a.b"}) == ""


# ---------------------------------------------------------------- loading real checkpoints


def test_a_complete_checkpoint_loads_its_weights_also_with_a_tied_head(tmp_path):
    for tie in (False, True):
        saved = _save(tmp_path / f"tied-{tie}", tie=tie)
        loaded = _build(tmp_path / f"tied-{tie}")
        assert torch.equal(loaded.model.layers[1].mlp.up_proj.weight, saved.model.layers[1].mlp.up_proj.weight)
        assert (loaded.lm_head.weight is loaded.model.embed_tokens.weight) == tie


def test_a_missing_layer_is_refused_with_its_tensors_grouped(tmp_path):
    _save(tmp_path / "m")
    _edit_weights(tmp_path / "m", drop="model.layers.1.")
    with pytest.raises(WeightsMismatchError) as err:
        _build(tmp_path / "m")
    message = str(err.value)
    assert f"model.name: {tmp_path / 'm'}" in message and "\n" not in message
    assert "model.layers.1.* (9 tensors) missing" in message and "model.new_weights" in message


def test_a_config_with_more_layers_than_the_weights_is_refused(tmp_path):
    _save(tmp_path / "m")
    _edit_config(tmp_path / "m", num_hidden_layers=3)
    with pytest.raises(WeightsMismatchError, match=r"model\.layers\.2\.\* \(9 tensors\) missing"):
        _build(tmp_path / "m")


def test_an_unexpected_tensor_is_refused_unless_dropped_on_purpose(tmp_path, caplog):
    _save(tmp_path / "m")
    _edit_weights(tmp_path / "m", add={"v_head.weight": torch.zeros(1, 32), "v_head.bias": torch.zeros(1)})
    with pytest.raises(WeightsMismatchError, match=r"v_head\.\* \(2 tensors\) unexpected"):
        _build(tmp_path / "m")
    with caplog.at_level(logging.WARNING):
        _build(tmp_path / "m", dropped_weights=["v_head.*"])
    assert "model.dropped_weights: v_head.* (2 tensors) in the checkpoint left out" in caplog.text


def test_shapes_that_disagree_with_config_json_are_one_line_with_both_shapes(tmp_path):
    _save(tmp_path / "m")
    _edit_config(tmp_path / "m", intermediate_size=96)
    with pytest.raises(WeightsMismatchError) as err:
        _build(tmp_path / "m")
    assert "model.layers.{0-1}.mlp.up_proj.weight (2 tensors) is 64x32 in the checkpoint but 96x32 in the model" \
        in str(err.value)
    assert "\n" not in str(err.value)


def test_new_weights_start_from_random_values_and_are_logged(tmp_path, caplog):
    saved = _save(tmp_path / "m")
    _edit_weights(tmp_path / "m", drop="lm_head.")
    with pytest.raises(WeightsMismatchError, match="lm_head.weight missing"):
        _build(tmp_path / "m")
    with caplog.at_level(logging.WARNING):
        model = _build(tmp_path / "m", new_weights=["lm_head.*", "score.*"])
    assert "model.new_weights: lm_head.weight not in the checkpoint: starts from random values" in caplog.text
    assert "'score.*' matches no tensor" in caplog.text  # a pattern that did nothing is said, not ignored
    assert not torch.equal(model.lm_head.weight, saved.lm_head.weight)
    assert torch.equal(model.model.layers[0].mlp.up_proj.weight, saved.model.layers[0].mlp.up_proj.weight)


def test_moe_experts_saved_per_expert_load_into_fused_tensors(tmp_path):
    """transformers 5 fuses per-expert checkpoint keys into one tensor: its report, not a key diff, decides."""
    torch.manual_seed(0)
    config = MixtralConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2)
    saved = MixtralForCausalLM(config)
    saved.save_pretrained(tmp_path / "moe")
    assert any(".experts.3." in k for k in load_file(tmp_path / "moe" / "model.safetensors"))  # per-expert keys
    loaded = _build(tmp_path / "moe")
    assert torch.equal(loaded.model.layers[1].mlp.experts.down_proj, saved.model.layers[1].mlp.experts.down_proj)
    shutil.copytree(tmp_path / "moe", tmp_path / "three")
    _edit_weights(tmp_path / "three", drop="model.layers.1.block_sparse_moe.experts.3.")
    with pytest.raises(WeightsMismatchError, match=r"experts\.down_proj is 3x32x64 in the checkpoint but 4x32x64"):
        _build(tmp_path / "three")


@pytest.mark.parametrize("damage", ["truncated", "garbage"])
def test_a_damaged_safetensors_file_is_named(tmp_path, damage):
    _save(tmp_path / "m")
    weights = tmp_path / "m" / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:len(data) // 2] if damage == "truncated" else b"not safetensors" * 64)
    with pytest.raises(ModelLoadError, match=f"{weights} is damaged or not safetensors"):
        _build(tmp_path / "m")


def test_a_quantized_layer_filled_from_another_shape_is_refused(tmp_path):
    """bitsandbytes quantizes whatever tensor it is given, so transformers' own shape check misses it."""
    from memfit.config import load_config
    from memfit.build import configured_quantized_loading

    pytest.importorskip("bitsandbytes")
    _save(tmp_path / "m")
    _edit_config(tmp_path / "m", intermediate_size=96)
    cfg = load_config(None, [f"model.name={tmp_path / 'm'}", "model.init=pretrained", "method=lora", "quant=int8",
                             "quant.backend=bitsandbytes", "model.new_weights=[model.layers.*]"])
    with pytest.raises(WeightsMismatchError, match=r"is 64x32 in the checkpoint but 96x32 in the model \(quantized"):
        build_model(cfg.model, load_kwargs=configured_quantized_loading(cfg))


def test_a_hub_checkpoint_is_checked_too(tmp_path, monkeypatch):
    """The hub path (here: the local Hugging Face cache, hub offline) goes through the same check."""
    from huggingface_hub import constants

    snapshot = tmp_path / "cache" / "models--some-org--tiny" / "snapshots" / "0123abc"
    _save(snapshot)
    (snapshot.parents[1] / "refs").mkdir()
    (snapshot.parents[1] / "refs" / "main").write_text("0123abc")
    _edit_weights(snapshot, drop="model.layers.1.")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "cache"))
    with pytest.raises(WeightsMismatchError, match=r"model\.name: some-org/tiny: .*model\.layers\.1\.\* \(9 tensors\)"):
        build_model(ModelConfig(name="some-org/tiny"))
    model = build_model(ModelConfig(name="some-org/tiny", new_weights=["model.layers.1.*"]))
    assert model.config.num_hidden_layers == 2
