"""`memfit bench` runs on its defaults: memfit's own preset has no weights, so bench trains random ones."""

from __future__ import annotations

import json

from memfit.cli import main


def test_bench_on_the_default_model_measures_baseline_and_variant(tmp_path, capsys):
    status = main(["bench", "--steps", "2", "--seq-len", "128", "--micro-batch", "2", "--variants", "checkpointing",
                   "--out", str(tmp_path / "bench")])
    assert status == 0, capsys.readouterr().err
    rows = json.loads((tmp_path / "bench" / "bench.json").read_text())
    assert [row["name"] for row in rows] == ["baseline", "checkpointing"]
    assert all(row["error"] is None and row["peak_bytes"] > 0 for row in rows)
    # Checkpointing keeps only each layer's input: its measured peak is below the baseline's.
    assert rows[1]["peak_bytes"] < rows[0]["peak_bytes"]
