"""Which tokenizer a run gets: the model's own, model.tokenizer, or the byte-level one only where no
real weights learned other ids; every one must fit the model's embedding."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from memfit.config import ModelConfig, load_config
from memfit.models import loading
from memfit.models.loading import TokenizerError, check_tokenizer, load_tokenizer, tokenizer_source
from memfit.models.tokenizer import byte_tokenizer

TINY = dict(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            max_position_embeddings=256)


@pytest.fixture
def weights_only(tmp_path):
    """Real weights saved with save_pretrained, no tokenizer files beside them."""
    folder = tmp_path / "weights"
    torch.manual_seed(0)
    LlamaForCausalLM(LlamaConfig(**TINY)).save_pretrained(folder)
    return folder


def _tokenizer_folder(path, extra_tokens: int = 0):
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([f"<extra{i}>" for i in range(extra_tokens)])
    tokenizer.save_pretrained(path)
    return path


def test_real_weights_without_a_tokenizer_are_refused_saying_where_memfit_looked(weights_only):
    with pytest.raises(TokenizerError) as err:
        load_tokenizer(ModelConfig(name=str(weights_only)))
    message = str(err.value)
    assert str(weights_only) in message and "tokenizer.json" in message and "set model.tokenizer" in message
    with pytest.raises(TokenizerError):
        check_tokenizer(ModelConfig(name=str(weights_only)))  # the check train runs before anything heavy


def test_model_tokenizer_points_at_a_folder_such_as_a_finished_run(weights_only, tmp_path):
    run = _tokenizer_folder(tmp_path / "run")
    tokenizer = load_tokenizer(ModelConfig(name=str(weights_only), tokenizer=str(run)))
    assert tokenizer.convert_tokens_to_ids("</s>") == 257 and tokenizer.pad_token == "<pad>"
    check_tokenizer(ModelConfig(name=str(weights_only), tokenizer=str(run)))


def test_the_folders_own_tokenizer_is_used_before_the_byte_one(weights_only):
    _tokenizer_folder(weights_only, extra_tokens=0)
    assert tokenizer_source(ModelConfig(name=str(weights_only))) == str(weights_only)


def test_the_byte_tokenizer_serves_random_init_and_memfit_presets_only(weights_only):
    assert tokenizer_source(ModelConfig(name=str(weights_only), init="random")) is None
    assert tokenizer_source(ModelConfig(name="memfit/tiny-llama", init="random")) is None
    assert tokenizer_source(ModelConfig(name="gpt2", init="random")) is None  # a preset's shape from scratch
    assert tokenizer_source(ModelConfig(name="gpt2")) == "openai-community/gpt2"  # its real weights: its own
    assert load_tokenizer(ModelConfig(name=str(weights_only), init="random")).vocab_size == 259


def test_the_byte_tokenizer_must_fit_the_embedding(tmp_path):
    folder = tmp_path / "small"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", **TINY, "vocab_size": 200}))
    spec = ModelConfig(name=str(folder), init="random")
    with pytest.raises(TokenizerError, match=r"vocab_size is 200, but memfit's byte-level tokenizer.* uses 259"):
        check_tokenizer(spec)


def test_a_tokenizer_given_in_model_tokenizer_must_fit_the_embedding(weights_only, tmp_path):
    big = _tokenizer_folder(tmp_path / "big", extra_tokens=5)
    with pytest.raises(TokenizerError, match=r"model\.tokenizer: the tokenizer of .*big' uses 264 token ids, but the "
                                             r"model's embedding \(.*config\.json: vocab_size\) has 259 rows"):
        check_tokenizer(ModelConfig(name=str(weights_only), tokenizer=str(big)))


@pytest.mark.parametrize("where, expected", [("missing", "does not exist"), ("empty", "not a folder holding a "
                                                                                        "tokenizer")])
def test_a_model_tokenizer_folder_that_holds_none_is_refused(weights_only, tmp_path, where, expected):
    (tmp_path / "empty").mkdir()
    with pytest.raises(TokenizerError, match=f"model.tokenizer: .*{where}.*{expected}"):
        check_tokenizer(ModelConfig(name=str(weights_only), tokenizer=str(tmp_path / where)))


def test_a_hub_tokenizer_is_not_fetched_by_the_early_check(weights_only, monkeypatch):
    monkeypatch.setattr(loading, "from_hub", lambda *a, **k: pytest.fail("asked the hub"))
    check_tokenizer(ModelConfig(name=str(weights_only), tokenizer="some-org/some-tokenizer"))
    assert tokenizer_source(ModelConfig(name=str(weights_only), tokenizer="some-org/some-tokenizer")) == \
        "some-org/some-tokenizer"


def test_weight_lists_are_refused_with_random_init():
    from memfit.config import ConfigError

    with pytest.raises(ConfigError, match="new_weights / dropped_weights only apply to init: pretrained"):
        load_config(None, ["model.init=random", "model.new_weights=[lm_head.*]"])
    assert load_config(None, ["model.name=gpt2", "model.new_weights=[lm_head.*]"]).model.new_weights == ["lm_head.*"]
