"""The planner's growth with seq_len against the tracker's: d(peak)/d(seq_len) per strategy combination.

A constant error in the analytic estimate (a runtime buffer, a per-parameter term) hides the
per-token terms at the lengths the unit tests use; the slope between two lengths isolates them.
For each combination the tracker measures the peak of a real CPU training step (set up as
train() does: memfit's model build, checkpointing, optimizer and step_strategies, so chunked_loss
runs the real chunked loss) at three sequence lengths, and the slope (peak(L3) - peak(L1)) /
(L3 - L1) must be within 10 % of the slope of analytic_estimate(..., device="cpu").

activation_offload is a no-op on a CPU run (the saved tensors already live in host RAM), so its
combinations run the CUDA path with the CPU as the device (memfit/memory/measure.py) and compare with
the estimate for device="cuda", which differs from the CPU one only by what offloading removes.

The model is tiny-llama reshaped so that activations dominate the model states (4 layers, hidden 32,
2 heads, intermediate 88, vocab 512: 66 k parameters): at batch.micro_batch=2 and data.seq_len=1024 the part of
the peak that grows with seq_len is 67-73 % of it (checked below), and every op stays cheap.
Batches are synthetic full-length sequences (micro_batch x seq_len tokens), so
the measured batch really is seq_len long (the shipped demo records are shorter than 1024 tokens).
"""

from __future__ import annotations

import json

import pytest

from memfit.config import load_config
from memfit.memory.analytic import analytic_estimate
from memfit.memory.measure import tracked_step_peaks
from memfit.models.loading import load_model_config
from memfit.models.presets import load_preset_config

SEQ_LENS = (256, 512, 1024)
MICRO_BATCH = 2
TOLERANCE = 0.10

COMBINATIONS = {
    "fp32": [],
    "bf16-mixed": ["precision=bf16-mixed"],
    "checkpointing": ["memory.checkpointing=full"],
    "chunked_loss": ["memory.chunked_loss=true"],
    "checkpointing+chunked_loss": ["memory.checkpointing=full", "memory.chunked_loss=true"],
    "tiled_mlp": ["memory.tiled_mlp=true"],
    "checkpointing+tiled_mlp": ["memory.checkpointing=full", "memory.tiled_mlp=true"],
    "checkpointing+tiled_mlp+chunked_loss": ["memory.checkpointing=full", "memory.tiled_mlp=true",
                                             "memory.chunked_loss=true"],
    "checkpointing+offload": ["memory.checkpointing=full", "memory.activation_offload=true"],
    "checkpointing+offload+prefetch": ["memory.checkpointing=full", "memory.activation_offload=true",
                                       "memory.activation_offload_prefetch=true"],
    "checkpointing+offload+tiled_mlp+chunked_loss": ["memory.checkpointing=full", "memory.activation_offload=true",
                                                     "memory.tiled_mlp=true", "memory.chunked_loss=true"],
}

@pytest.fixture(scope="module")
def wide_activation_model(tmp_path_factory):
    """tiny-llama (4 layers) narrowed so that activations are large against its 66 k parameters."""
    raw = json.loads(load_preset_config("memfit/tiny-llama").to_json_string())
    raw.update(hidden_size=32, intermediate_size=88, num_attention_heads=2, num_key_value_heads=2, vocab_size=512,
               max_position_embeddings=max(SEQ_LENS), bos_token_id=1, eos_token_id=2, pad_token_id=0)
    folder = tmp_path_factory.mktemp("wide_activations")
    (folder / "config.json").write_text(json.dumps(raw))
    return str(folder)


def _config(words: list[str], model: str, seq_len: int):
    return load_config(None, words + [f"model={model}", "model.init=random", f"data.seq_len={seq_len}",
                                      f"batch.micro_batch={MICRO_BATCH}", "device=cpu", "optim.max_grad_norm=1.0"])


def measured_peaks(words: list[str], model: str) -> list[int]:
    """Tracked peak of one real training step per seq_len, with the optimizer states already there
    (memfit/memory/measure.py: one model per combination, a short warm-up step first)."""
    return tracked_step_peaks(_config(words, model, SEQ_LENS[0]), list(SEQ_LENS))


def predicted_peaks(words: list[str], model: str) -> list[int]:
    model_config = load_model_config(_config(words, model, SEQ_LENS[0]).model)[0]
    device = "cuda" if "memory.activation_offload=true" in words else "cpu"
    return [analytic_estimate(_config(words, model, n), model_config, device=device).peak_allocated_bytes
            for n in SEQ_LENS]


def slope(peaks: list[int]) -> float:
    return (peaks[-1] - peaks[0]) / (SEQ_LENS[-1] - SEQ_LENS[0])


@pytest.mark.parametrize("combination", list(COMBINATIONS))
def test_peak_grows_with_seq_len_at_the_planned_slope(combination, wide_activation_model):
    words = COMBINATIONS[combination]
    measured, predicted = measured_peaks(words, wide_activation_model), predicted_peaks(words, wide_activation_model)
    assert measured[0] < measured[1] < measured[2], f"{combination}: peaks do not grow with seq_len: {measured}"
    # the per-token terms must dominate, or the slope would be noise on top of the model states
    assert measured[-1] - measured[0] > 0.5 * measured[-1], f"{combination}: peaks {measured}"
    error = (slope(predicted) - slope(measured)) / slope(measured)
    assert abs(error) < TOLERANCE, (
        f"{combination}: analytic slope {slope(predicted):.0f} B per seq_len token vs tracked "
        f"{slope(measured):.0f} ({error:+.1%}); peaks tracked {measured}, analytic {predicted}")
