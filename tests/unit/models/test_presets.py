"""Every preset builds (on `meta`, so no memory is spent) and has its published parameter count."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from memfit.models.presets import PRESETS_DIR, list_presets, load_preset_config, preset_path

# Published parameter counts, tied embeddings counted once. Unless noted, the exact number is the total the
# hub shows for the model's safetensors ("Model size"), which matches the paper or model card's rounded figure.
PUBLISHED = {
    "meta-llama/Llama-2-7b-hf": 6_738_415_616,  # Llama-2-7b: 6,738,415,616 (paper: 7B)
    "meta-llama/Llama-2-13b-hf": 13_015_864_320,  # Llama-2-13b: 13,015,864,320 (paper: 13B)
    "meta-llama/Llama-2-70b-hf": 68_976_648_192,  # Llama-2-70b: 68,976,648,192 (paper: 70B)
    "meta-llama/Meta-Llama-3-8B": 8_030_261_248,  # Llama-3-8B: 8,030,261,248
    "meta-llama/Meta-Llama-3-70B": 70_553_706_496,  # Llama-3-70B: 70,553,706,496
    "meta-llama/Llama-3.1-8B": 8_030_261_248,  # Llama-3.1-8B: same shape as Llama-3-8B (only rope/context differ)
    "meta-llama/Llama-3.1-70B": 70_553_706_496,  # Llama-3.1-70B: same shape as Llama-3-70B
    "meta-llama/Llama-3.1-405B": 405_853_388_800,  # Llama-3.1-405B: 405,853,388,800 (hub: 406B)
    "meta-llama/Llama-3.2-1B": 1_235_814_400,  # Llama-3.2-1B model card: 1.23B (tied embeddings)
    "meta-llama/Llama-3.2-3B": 3_212_749_824,  # Llama-3.2-3B model card: 3.21B (tied embeddings)
    "mistralai/Mistral-7B-v0.1": 7_241_732_096,  # Mistral-7B-v0.1: 7,241,732,096
    "mistralai/Mixtral-8x7B-v0.1": 46_702_792_704,  # Mixtral-8x7B: 46,702,792,704 (blog: 46.7B total)
    # Qwen2.5 model cards give the total (and non-embedding) count rounded; exact totals from the hub.
    "Qwen/Qwen2.5-0.5B": 494_032_768,  # card: 0.49B (non-embedding 0.36B), tied
    "Qwen/Qwen2.5-1.5B": 1_543_714_304,  # card: 1.54B (1.31B), tied
    "Qwen/Qwen2.5-3B": 3_085_938_688,  # card: 3.09B (2.77B), tied
    "Qwen/Qwen2.5-7B": 7_615_616_512,  # card: 7.61B (6.53B)
    "Qwen/Qwen2.5-14B": 14_770_033_664,  # card: 14.7B (13.1B)
    "Qwen/Qwen2.5-32B": 32_763_876_352,  # card: 32.5B (31.0B); hub: 32.8B
    "Qwen/Qwen2.5-72B": 72_706_203_648,  # card: 72.7B (70.0B)
    # Qwen3 model cards: total (non-embedding). 0.6B/1.7B/4B tie embeddings; their hub totals can include a
    # stored copy of lm_head (0.6B shows 752M), so the numbers here count the tied matrix once.
    "Qwen/Qwen3-0.6B": 596_049_920,  # card: 0.6B (0.44B)
    "Qwen/Qwen3-1.7B": 1_720_574_976,  # card: 1.7B (1.4B)
    "Qwen/Qwen3-4B": 4_022_468_096,  # card: 4.0B (3.6B)
    "Qwen/Qwen3-8B": 8_190_735_360,  # card: 8.2B (6.95B); hub: 8,190,735,360
    "Qwen/Qwen3-14B": 14_768_307_200,  # card: 14.8B (13.2B); hub: 14,768,307,200
    "Qwen/Qwen3-32B": 32_762_123_264,  # card: 32.8B (31.2B); hub: 32,762,123,264
    "google/gemma-2b": 2_506_172_416,  # gemma-2b: 2,506,172,416 (report: 2B, tied embeddings)
    "google/gemma-7b": 8_537_680_896,  # gemma-7b: 8,537,680,896 (report: 7.75B non-embedding + 786M embedding)
    "google/gemma-2-2b": 2_614_341_888,  # gemma-2-2b: 2,614,341,888 (hub: 2.61B)
    "google/gemma-2-9b": 9_241_705_984,  # gemma-2-9b: 9,241,705,984 (hub: 9.24B)
    "google/gemma-2-27b": 27_227_128_320,  # gemma-2-27b: 27,227,128,320 (hub: 27.2B)
    "microsoft/phi-1_5": 1_418_270_720,  # phi-1.5: 1.42B (paper: 1.3B)
    "microsoft/phi-2": 2_779_683_840,  # phi-2: 2.78B (blog: 2.7B)
    "microsoft/Phi-3-mini-4k-instruct": 3_821_079_552,  # Phi-3-mini: 3.82B (report: 3.8B)
    "TinyLlama/TinyLlama-1.1B-intermediate-step-1431k-3T": 1_100_048_384,  # TinyLlama: 1.1B (hub: 1,100,048,384)
    "openlm-research/open_llama_7b": 6_738_415_616,  # OpenLLaMA-7B: the LLaMA-7B shape, 6.74B
    "tiiuae/falcon-7b": 6_921_720_704,  # Falcon-7B: 6,921,720,704 (hub: 6.92B, tied embeddings)
    "openai-community/gpt2": 124_439_808,  # GPT-2 small: 124,439,808 (paper's "117M" was a miscount)
    "openai-community/gpt2-medium": 354_823_168,  # GPT-2 medium: 354,823,168 (paper: 345M)
    "openai-community/gpt2-large": 774_030_080,  # GPT-2 large: 774,030,080 (paper: 762M)
    "openai-community/gpt2-xl": 1_557_611_200,  # GPT-2 XL: 1,557,611,200 (paper: 1542M)
    "memfit/gpt3-175b": 175_000_000_000,  # GPT-3 paper (Brown et al. 2020, Table 2.1): 175.0B
}

# memfit's own toy presets: no published count to check against (they still have to build).
NO_PUBLISHED_COUNT = {"memfit/tiny-llama"}

PRESET_IDS = sorted(p.stem.replace("__", "/", 1) for p in PRESETS_DIR.glob("*.json"))


def count_parameters(name: str) -> int:
    """Parameter count of the preset's model, built on `meta` (no memory); shared tensors counted once."""
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(load_preset_config(name))
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("hub_id", PRESET_IDS)
def test_preset_builds_with_published_parameter_count(hub_id):
    count = count_parameters(hub_id)
    if hub_id in NO_PUBLISHED_COUNT:
        assert count > 0
        return
    published = PUBLISHED[hub_id]
    assert abs(count - published) <= 0.02 * published, f"{hub_id}: {count:,} params, published {published:,}"


def test_every_preset_file_has_a_published_count():
    # A new preset must come with its published count, so a config typo cannot slip in unchecked.
    assert set(PRESET_IDS) - NO_PUBLISHED_COUNT == set(PUBLISHED)


def test_preset_files_are_named_after_hub_ids():
    for path in PRESETS_DIR.glob("*.json"):
        assert path.stem.count("__") == 1, f"{path.name}: expected <org>__<name>.json"


def test_list_presets_has_hub_ids_and_short_alias():
    names = list_presets()
    assert set(PUBLISHED) <= set(names)
    assert "gpt3-175b" in names
    assert names == sorted(names, key=str.lower)


def test_load_preset_config_resolves_hub_id_stem_and_alias():
    by_hub_id = load_preset_config("meta-llama/Llama-2-7b-hf")
    assert by_hub_id.model_type == "llama" and by_hub_id.hidden_size == 4096
    assert preset_path("meta-llama__Llama-2-7b-hf") == preset_path("meta-llama/Llama-2-7b-hf")
    assert preset_path("Llama-2-7b-hf") == preset_path("meta-llama/Llama-2-7b-hf")
    assert load_preset_config("gpt3-175b").n_layer == 96
    assert preset_path("memfit/gpt3-175b") == preset_path("gpt3-175b")
    assert preset_path("no-such-model") is None
    assert preset_path("./some/local/dir") is None


def test_unknown_preset_error_suggests_close_matches():
    with pytest.raises(KeyError, match="Llama-2-7b-hf"):
        load_preset_config("meta-llama/Llama-2-7b-fh")


def test_gpt3_175b_fp16_weights_are_about_350_gb():
    # The classic seed figure: 175B parameters x 2 bytes (fp16) = 350 GB of weights alone.
    weight_bytes = count_parameters("gpt3-175b") * 2
    assert weight_bytes == pytest.approx(350e9, rel=0.01)
