"""Each rank reads only its part of the model (memfit/models/part_loading.py), checked in one process: the
same reads and initialisations a sharded rank makes, against a whole-model load."""

from __future__ import annotations

import pytest
import torch
from torchao.quantization import to_nf4

from memfit.config import load_config
from memfit.models.loading import build_model, random_model
from memfit.models.part_loading import Checkpoint, PartLoadError, PartSource, fill_parts, hf_name, part_source
from memfit.models.weights_check import WeightsMismatchError
from memfit.strategies.quantization import quantize_nf4_rows


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """The tiny Llama with random weights, saved as safetensors in several files (with an index)."""
    cfg = load_config(None, ["model.init=random"])
    torch.manual_seed(0)
    model = build_model(cfg.model)
    folder = tmp_path_factory.mktemp("tiny")
    model.save_pretrained(folder, safe_serialization=True, max_shard_size="200KB")
    return folder, model


def _meta_model(spec):
    model = build_model(spec, on_meta=True).to_empty(device="cpu")
    model.tie_weights()  # to_empty gives the tied embeddings and lm_head storage each
    return model


def test_wrapper_names_map_to_the_hugging_face_names():
    assert hf_name("base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight") == \
        "model.layers.0.self_attn.q_proj.weight"
    assert hf_name("model.layers.1._checkpoint_wrapped_module.mlp.up_proj.weight") == "model.layers.1.mlp.up_proj.weight"
    assert hf_name("base_model.model.lm_head.modules_to_save.default.weight") == "lm_head.weight"
    assert hf_name("base_model.model.lm_head.original_module.weight") == "lm_head.weight"


def test_slices_are_read_from_a_checkpoint_in_several_files(saved):
    folder, model = saved
    checkpoint = Checkpoint(folder)
    assert len(set(checkpoint.files.values())) > 1  # the index's files
    whole = model.state_dict()["model.layers.1.mlp.down_proj.weight"]
    assert checkpoint.shape("model.layers.1.mlp.down_proj.weight") == tuple(whole.shape)
    rows = (slice(32, 96), slice(0, whole.shape[1]))
    assert torch.equal(checkpoint.read("model.layers.1.mlp.down_proj.weight", rows), whole[rows])
    with pytest.raises(PartLoadError, match="no safetensors weights"):
        Checkpoint(folder / "nowhere")


def test_a_part_filled_model_equals_the_whole_model_load(saved):
    folder, model = saved
    spec = load_config(None, [f"model.name={folder}"]).model
    filled = _meta_model(spec)
    fill_parts(filled, part_source(spec, seed=0, dtype=torch.float32))
    expected = dict(model.named_parameters(remove_duplicate=False))  # rotary tables included:
    expected |= dict(model.named_buffers(remove_duplicate=False))
    got = dict(filled.named_parameters(remove_duplicate=False)) | dict(filled.named_buffers(remove_duplicate=False))
    assert sorted(got) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(got[name], tensor), name


def test_random_init_depends_on_the_seed_and_names_only():
    """A part-filled random model equals `random_model` (what one process builds) under the same seed, so a
    rank's part does not depend on how many ranks share the model."""
    spec = load_config(None, ["model.init=random"]).model
    torch.manual_seed(7)
    whole = build_model(spec)
    filled = _meta_model(spec)
    fill_parts(filled, part_source(spec, seed=7, dtype=torch.float32))
    for (name, tensor), (_, other) in zip(whole.state_dict().items(), filled.state_dict().items()):
        assert torch.equal(tensor, other), name
    torch.manual_seed(8)
    assert not torch.equal(build_model(spec).model.embed_tokens.weight, whole.model.embed_tokens.weight)


def test_a_missing_tensor_stops_the_load_unless_new_weights_allows_it(saved, tmp_path):
    folder, model = saved
    state = {k: v.clone() for k, v in model.state_dict().items()
             if not k.startswith("model.layers.2.mlp.") and k != "lm_head.weight"}  # tied: saved once
    from safetensors.torch import save_file

    save_file(state, tmp_path / "model.safetensors")
    (tmp_path / "config.json").write_text((folder / "config.json").read_text())
    spec = load_config(None, [f"model.name={tmp_path}"]).model
    with pytest.raises(WeightsMismatchError, match=r"model\.layers\.2\.mlp\.\*.*missing"):
        part_source(spec, seed=0, dtype=torch.float32)
    allowed = load_config(None, [f"model.name={tmp_path}", "model.new_weights=[\"model.layers.2.mlp.*\"]"]).model
    filled = _meta_model(allowed)
    fill_parts(filled, part_source(allowed, seed=0, dtype=torch.float32))
    assert torch.equal(filled.model.layers[1].mlp.up_proj.weight, model.model.layers[1].mlp.up_proj.weight)
    assert filled.model.layers[2].mlp.up_proj.weight.std() > 0  # initialised, not left as garbage or zeros


def test_lora_adapters_start_as_peft_starts_them(saved):
    from peft import LoraConfig, get_peft_model

    folder, model = saved
    spec = load_config(None, [f"model.name={folder}"]).model
    peft = get_peft_model(build_model(spec, on_meta=True), LoraConfig(r=4, target_modules=["q_proj"]))
    peft.to_empty(device="cpu")
    fill_parts(peft, part_source(spec, seed=0, dtype=torch.float32))
    layer = peft.base_model.model.model.layers[0].self_attn.q_proj
    assert torch.equal(layer.base_layer.weight, model.model.layers[0].self_attn.q_proj.weight)
    assert torch.count_nonzero(layer.lora_B["default"].weight) == 0
    a = layer.lora_A["default"].weight
    bound = 1 / a.shape[1] ** 0.5  # Kaiming-uniform with a = sqrt(5): U(-1/sqrt(fan_in), 1/sqrt(fan_in))
    assert 0 < a.abs().max() <= bound


def test_an_nf4_row_shard_is_the_whole_weights_quantization_cut():
    """Every shard is quantized with the whole weight's second-level scale, as one process quantizes it."""
    weight = torch.randn(128, 64)
    whole = to_nf4(weight, 64, 32)
    expected = torch.chunk(whole, 2)[1]
    local = torch.chunk(to_nf4(torch.zeros(128, 64), 64, 32), 2)[1]
    quantize_nf4_rows(local, weight, slice(64, 128))
    for name in ("quantized_scalers", "quantization_factor", "quantized_data", "scaler_mean", "nf4"):
        assert torch.equal(getattr(local, name), getattr(expected, name)), name


def test_a_source_without_a_checkpoint_initialises_buffers_as_the_model_builds_them():
    spec = load_config(None, ["model.init=random"]).model
    source = part_source(spec, seed=0, dtype=torch.float32)
    assert isinstance(source, PartSource) and source.checkpoint is None
    built = random_model(build_model(spec, on_meta=True).config, {"dtype": torch.float32})
    assert torch.equal(source.full("model.rotary_emb.inv_freq"), built.model.rotary_emb.inv_freq)
