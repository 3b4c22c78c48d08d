"""length_profile: tokens per sequence and per padded micro-batch, tokenized as training does."""

from __future__ import annotations

import json

from memfit.data.lengths import length_profile, percentile


def test_percentile_is_nearest_rank():
    assert percentile([5, 1, 4, 2, 3], 0.5) == 3
    assert percentile([1, 2, 3, 4], 0.5) == 2
    assert percentile(list(range(1, 11)), 0.9) == 9
    assert percentile([7], 0.9) == 7


def test_known_lengths_from_a_jsonl(tiny_config, tmp_path):
    chars = [10, 20, 30, 40, 50, 60, 70, 80, 90, 300]
    path = tmp_path / "texts.jsonl"
    path.write_text("".join(json.dumps({"text": "x" * n}) + "\n" for n in chars))
    # Byte-level tokenizer: BOS + one token per byte + EOS; the 300-char text is truncated to seq_len.
    overrides = {"data.path": str(path), "data.format": "text", "data.limit": "null", "seq_len": 128}
    one = length_profile(tiny_config(micro_batch=1, **overrides))
    assert (one.records, one.p50, one.p90, one.max) == (10, 52, 92, 128)
    assert (one.batch_p50, one.batch_p90) == (one.p50, one.p90)  # one sequence per batch: no padding
    whole = length_profile(tiny_config(micro_batch=10, **overrides))
    assert (whole.batch_p50, whole.batch_p90) == (128, 128)  # one batch, padded to its longest
    assert length_profile(tiny_config(micro_batch=1, **overrides), limit=3).max == 32
    assert "tokens" in one.to_text() and "p50 52" in one.to_text()


def test_shipped_demo_data(tiny_config):
    cfg = tiny_config(micro_batch=16)
    profile = length_profile(cfg)
    assert profile.records == 256  # data.limit of the fixture (below the default limit of 2000)
    assert 0 < profile.p50 <= profile.p90 <= profile.max < cfg.data.seq_len  # demo examples are short
    assert profile.p50 <= profile.batch_p50 <= profile.batch_p90 <= profile.max
    assert length_profile(tiny_config(seq_len=80)).max == 80  # truncated to seq_len
    packed = length_profile(tiny_config(seq_len=512, packing=True))
    assert packed.packing and packed.records == 256
    assert packed.p50 > 400 and packed.max <= 512  # several examples per row
