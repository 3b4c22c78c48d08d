"""The tracker's timeline of the peak step, and the picture memfit train and memfit report draw from it."""

import json

import matplotlib.image
import torch

from memfit.cli import main
from memfit.memory.tracker import CATEGORIES, TIMELINE_POINTS, MemoryTracker
from memfit.train.loop import train
from memfit.train.resolve import resolve_run


def _total(sample: dict) -> int:
    return sum(sample["by_category"].values())


def test_the_timeline_keeps_the_highest_step_and_its_peak_within_the_point_limit():
    tracker = MemoryTracker(timeline=True)
    layer = torch.nn.Linear(64, 64)
    with tracker:
        tracker.tag_module(layer)
        for rows in (8, 256, 16):  # the second step holds the peak
            tracker.mark_step()
            with tracker.phase("forward"):
                loss = sum(layer(torch.randn(rows, 64)).relu().sum() for _ in range(200))
            with tracker.phase("backward"):
                loss.backward()
            tracker.tag_gradients(layer.parameters())
            layer.zero_grad(set_to_none=True)
            del loss
        samples = tracker.timeline
        assert sum(tracker.current_by_category().values()) == tracker.current_bytes  # running totals agree
    assert len(samples) <= TIMELINE_POINTS
    assert max(map(_total, samples)) == tracker.peak_bytes
    assert {s["phase"] for s in samples} >= {"forward", "backward"}
    assert all(set(s["by_category"]) == set(CATEGORIES) and min(s["by_category"].values()) >= 0 for s in samples)


def test_a_run_writes_its_timeline_and_memfit_report_draws_it(tiny_config, tmp_path, capsys):
    result = train(resolve_run(tiny_config(max_steps=2, **{"data.limit": 32})), progress=False)
    record = json.loads((result.output_dir / "memory_timeline.json").read_text())
    assert max(map(_total, record["samples"])) == result.report.measured_peak_bytes
    assert set(record["estimated_phase_peaks"]) >= {"forward", "backward", "optimizer"}
    for png in (result.output_dir / "memory_timeline.png", tmp_path / "again.png"):
        if png.name == "again.png":
            assert main(["report", str(result.output_dir), "--chart", str(png)]) == 0
            assert "Peak memory by category" in capsys.readouterr().out
        height, width, _ = matplotlib.image.imread(png).shape
        assert png.stat().st_size > 20_000 and (width, height) == (1200, 600)


def test_report_of_a_folder_without_a_run_says_so(tmp_path, capsys):
    assert main(["report", str(tmp_path)]) != 0
    assert "memory_report.txt not found" in capsys.readouterr().err
