"""Rank by rank: bench/rank_matrix.py's mixes (sharding x full/LoRA x precision x step strategy x micro-batch),
trained on gloo ranks on the CPU; each rank's tracked peak within 5% of the per-rank estimate `memfit plan`
computes for it (memfit.memory.analytic.analytic_estimate with gpus = the ranks)."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.slow  # ~4 min on 2 cores: one torchrun on 2 ranks, one on 4

ROOT = Path(__file__).resolve().parents[2]
TOLERANCE = 0.05
# mixes the estimate misses by more, each with how far and why (docs/distributed.md shows them)
EXCEPTIONS = {
    "zero3xtp2-full-chunked": (0.09, "over, never under: at the backward's start the tracker sees 0.92 MiB of "
                                     "temporaries where the estimate counts 1.59 (two gathered blocks, one block's "
                                     "all-gather output, the chunks' lm_head gradients): +7.8% on the tiny model, "
                                     "0.0% on the 124.7M-parameter bench model, whose peak is the backward's end"),
    "zero3-offload-full-chunked": (0.07, "over, never under: the estimate's backward-start and last-layer moments "
                                         "(13.13 MiB) count zero3's gathered blocks and a block's unsharded "
                                         "gradients at full size where the tracker saw 12.44-12.52 MiB (+4.8% to "
                                         "+5.6% by rank and run); 0.0% on the 124.7M-parameter bench model"),
}


def _bench():
    spec = importlib.util.spec_from_file_location("rank_matrix", ROOT / "bench" / "rank_matrix.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


MATRIX = _bench()
EVERY_MIX = {**MATRIX.MIXES, **MATRIX.MESH_MIXES}


@pytest.fixture(scope="module")
def rows(tmp_path_factory) -> dict[str, list[dict]]:
    out = tmp_path_factory.mktemp("rank_matrix") / "rows.json"
    done = subprocess.run([sys.executable, str(ROOT / "bench" / "rank_matrix.py"), "--json", str(out), "--timeout", "900"],
                          cwd=ROOT, capture_output=True, text=True, timeout=2400)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    found: dict[str, list[dict]] = {}
    for row in json.loads(out.read_text()):
        found.setdefault(row["mix"], []).append(row)
    return found


def test_the_matrix_covers_what_the_plan_must_get_right():
    """At least 16 mixes over every engine, the three methods (QLoRA: torchao's NF4 base sharded by FSDP2),
    three precisions, the four step strategies and micro-batches up to 16."""
    assert len(EVERY_MIX) >= 16
    settings = [dict(o.split("=", 1) for o in overrides) for overrides in EVERY_MIX.values()]
    engines = {s.get("distributed.sharding", "none") for s in settings}
    assert {"ddp", "zero1", "zero2", "zero3"} <= engines
    assert any("distributed.tensor_parallel" in s for s in settings)
    assert any("distributed.pipeline_parallel" in s for s in settings)
    assert any("distributed.offload" in s for s in settings)
    assert any("distributed.tensor_parallel" in s and "distributed.sharding" in s for s in settings)  # 2-D
    assert {s.get("method", "full") for s in settings} == {"full", "lora", "qlora"}
    assert {s.get("precision", "fp32") for s in settings} >= {"fp32", "bf16-mixed", "bf16-pure"}
    for strategy in ("chunked_loss", "tiled_mlp", "activation_offload", "optimizer_in_backward"):
        assert any(s.get(f"memory.{strategy}") == "true" for s in settings), strategy
    assert max(int(s["batch.micro_batch"]) for s in settings) == 16


@pytest.mark.parametrize("mix", list(EVERY_MIX))
def test_every_rank_within_5_percent_of_the_plan(rows, mix):
    tolerance, _ = EXCEPTIONS.get(mix, (TOLERANCE, ""))
    assert rows[mix], mix
    for row in rows[mix]:
        assert abs(row["error"]) <= tolerance, (mix, row["rank"], row["measured_peak_bytes"],
                                                row["estimate_peak_bytes"])
        if mix in EXCEPTIONS:  # an exception may only err on the safe side
            assert row["error"] > 0, (mix, row["rank"])


def test_exceptions_are_few_and_name_real_mixes():
    assert set(EXCEPTIONS) <= set(EVERY_MIX) and len(EXCEPTIONS) <= 2


@pytest.mark.parametrize("mix", list(EVERY_MIX))
def test_the_measured_categories_add_up_to_the_peak(rows, mix):
    """The breakdown the docs table shows is of the peak itself (FSDP2's resized storages included)."""
    for row in rows[mix]:
        assert sum(row["measured_by_category_bytes"].values()) == row["measured_peak_bytes"], (mix, row["rank"])
