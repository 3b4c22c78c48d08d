"""Obviously bad input to the CLI gets one line, `memfit: error: ...`, exit status 2, no traceback, and
is refused before any planning or benchmarking work is done."""

from __future__ import annotations

import json

import pytest

from memfit.cli import main
from memfit.config import ConfigError, load_config
from memfit.memory.tracker import CATEGORIES

TINY = {"model_type": "llama", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 64,
        "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 256}


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("memfit: error: "), err
    return lines[0]


class Reached(Exception):
    """Raised by a stand-in for expensive work: reaching it means a check came too late."""


@pytest.fixture
def no_planning(monkeypatch):
    def plan(*args, **kwargs):
        raise Reached(args, kwargs)
    monkeypatch.setattr("memfit.memory.planner.plan", plan)


# ---------------------------------------------------------------- the config file itself


@pytest.mark.parametrize("text, kind", [("- a\n", "got a list"), ("42\n", "got a number (42)"),
                                        ("false\n", "got a boolean (False)"),
                                        ("just words\n", "got a string ('just words')")])
def test_a_config_that_is_not_a_mapping(text, kind, tmp_path, capsys):
    path = tmp_path / "cfg.yaml"
    path.write_text(text)
    assert main(["train", str(path)]) == 2
    line = _one_line_error(capsys)
    assert line.startswith(f"memfit: error: {path}: the top level must be a mapping of keys to values")
    assert line.endswith(kind)


def test_an_empty_config_means_every_default(tmp_path):
    (tmp_path / "empty.yaml").write_text("# nothing set yet\n")
    assert load_config(tmp_path / "empty.yaml") == load_config()


def test_a_missing_config_is_one_line(tmp_path, capsys):
    assert main(["train", str(tmp_path / "nope.yaml")]) == 2
    assert _one_line_error(capsys) == (f"memfit: error: {tmp_path / 'nope.yaml'}: file not found; give the path of a "
                                       "RunConfig YAML file")
    with pytest.raises(ConfigError, match="file not found"):  # still a ConfigError for code that catches those
        load_config(tmp_path / "nope.yaml")


def test_a_run_folder_points_at_its_run_config(tmp_path, capsys):
    run = tmp_path / "run"
    run.mkdir()
    (run / "run_config.yaml").write_text(load_config(None, [f"output_dir={run}"]).to_yaml())
    assert main(["train", str(run)]) == 2
    line = _one_line_error(capsys)
    assert f"{run}: is a folder, not a config file" in line
    assert "to continue that run use resume=true with its run_config.yaml" in line
    assert f"({run / 'run_config.yaml'} resume=true)" in line


def test_another_folder_lists_its_yaml_files(tmp_path, capsys):
    (tmp_path / "a.yaml").write_text("max_steps: 1\n")
    assert main(["plan", "memfit/tiny-llama", "--config", str(tmp_path)]) == 2
    assert _one_line_error(capsys).endswith("is a folder, not a config file; give a RunConfig YAML file (this folder "
                                            "holds a.yaml)")


def test_a_binary_config_file(tmp_path, capsys):
    (tmp_path / "cfg.yaml").write_bytes(b"\xff\xfe\x00\x01")
    assert main(["data", "prepare", str(tmp_path / "cfg.yaml")]) == 2
    assert "is not a text file (UTF-8)" in _one_line_error(capsys)


# ---------------------------------------------------------------- memfit plan: sizes and output paths first


@pytest.mark.parametrize("args, message", [
    (["--budget", "24"], "--budget: '24' has no unit: add a unit, e.g. 24GiB (2^30 bytes) or 24GB (10^9 bytes)"),
    (["--budget", "24G"], "--budget: cannot read '24G' as a size: unknown unit 'G'"),
    (["--margin", "5"], "--margin: '5' has no unit"),
    (["--host-ram", "64"], "--host-ram: '64' has no unit"),
    (["--chart", "plan.txt"], "--chart plan.txt: '.txt' is not an image format matplotlib writes; end the name with "
                              "one of: .avif, .eps"),
    (["--chart", "plan"], "--chart plan: has no image suffix"),
    (["--chart", "no/such/folder/plan.png"], "--chart no/such/folder/plan.png: folder no/such/folder does not exist"),
    (["--write-config", "no/such/folder/plan.yaml"], "--write-config no/such/folder/plan.yaml: folder no/such/folder "
                                                     "does not exist"),
])
def test_plan_refuses_before_planning(args, message, no_planning, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["plan", "memfit/tiny-llama", *args]) == 2
    assert message in _one_line_error(capsys)
    assert not list(tmp_path.iterdir())  # nothing written


def test_plan_chart_into_a_folder(no_planning, capsys, tmp_path):
    assert main(["plan", "memfit/tiny-llama", "--chart", str(tmp_path)]) == 2
    line = _one_line_error(capsys)
    assert f"--chart {tmp_path}: is a folder; give a file name such as {tmp_path / 'chart.png'}" in line


def test_plan_reads_the_budget_with_its_unit(no_planning):
    with pytest.raises(Reached) as info:
        main(["plan", "memfit/tiny-llama", "--budget", "24 gib", "--margin", "0", "--chart", "p.SVG"])
    args, kwargs = info.value.args
    assert args[2] == 24 * 2**30 and kwargs["margin"] == 0


def _short_model(tmp_path):
    (tmp_path / "short").mkdir()
    (tmp_path / "short" / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path / "short")


def test_plan_checks_seq_len_against_the_positions_like_train(tmp_path, capsys):
    assert main(["plan", _short_model(tmp_path), "--seq-len", "512"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert ("data.seq_len: 512 is beyond the model's max_position_embeddings (256); lower it, or extend the positions "
            "with rope_scaling in the model's config.json") in err


def test_plan_longest_seq_len_stops_at_the_positions_and_says_so(tmp_path, capsys):
    assert main(["plan", _short_model(tmp_path), "--seq-len", "128", "--budget", "1GiB", "--device", "cpu",
                 "--max-seq-len"]) == 0
    out = capsys.readouterr().out
    assert ("longest seq_len that fits this plan at micro_batch 1: 256 (the model's max_position_embeddings: memory "
            "would allow more)") in out


# ---------------------------------------------------------------- memfit report


def _finished_run(tmp_path, timeline: str | None = None):
    run = tmp_path / "run"
    run.mkdir()
    (run / "memory_report.txt").write_text("the memory report\n")
    if timeline is not None:
        (run / "memory_timeline.json").write_text(timeline)
    return run


@pytest.mark.parametrize("chart, message", [("timeline.txt", "'.txt' is not an image format"),
                                            ("nowhere/t.png", "folder nowhere does not exist")])
def test_report_chart_refused_before_the_report_is_printed(chart, message, tmp_path, capsys, monkeypatch):
    run = _finished_run(tmp_path)
    monkeypatch.chdir(tmp_path)
    assert main(["report", str(run), "--chart", chart]) == 2
    out = capsys.readouterr()
    assert out.out == "" and "Traceback" not in out.err and f"memfit: error: --chart {chart}: {message}" in out.err


@pytest.mark.parametrize("timeline, message", [("{broken", "cannot be read as a memory timeline"),
                                               ("{}", "not a memory timeline memfit wrote")])
def test_report_damaged_timeline(timeline, message, tmp_path, capsys):
    run = _finished_run(tmp_path, timeline)
    assert main(["report", str(run), "--chart", str(tmp_path / "t.png")]) == 2
    assert f"{run / 'memory_timeline.json'}: {message}" in _one_line_error(capsys)


def test_report_run_that_is_a_file_or_missing(tmp_path, capsys):
    (tmp_path / "afile").write_text("x")
    assert main(["report", str(tmp_path / "afile")]) == 2
    assert _one_line_error(capsys).endswith("afile: is a file; give the output_dir of a finished memfit train run")
    assert main(["report", str(tmp_path / "gone")]) == 2
    assert _one_line_error(capsys).endswith("gone: does not exist; give the output_dir of a finished memfit train run")


def test_report_chart_is_drawn(tmp_path, capsys):
    samples = [{"phase": phase, "by_category": {c: 2**20 * (i + 1) for c in CATEGORIES}}
               for i, phase in enumerate(["forward", "backward", "optimizer"])]
    run = _finished_run(tmp_path, json.dumps({"samples": samples, "estimated_phase_peaks": {"forward": 2**22}}))
    assert main(["report", str(run), "--chart", str(tmp_path / "t.png")]) == 0
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert capsys.readouterr().out.startswith("the memory report")


# ---------------------------------------------------------------- bench and data prepare output folders


def test_bench_out_that_is_a_file_is_refused_before_the_variants_run(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("memfit.benchmark.run_bench", lambda *a, **k: (_ for _ in ()).throw(Reached(a)))
    (tmp_path / "results").write_text("mine")
    assert main(["bench", "--out", str(tmp_path / "results")]) == 2
    assert _one_line_error(capsys).endswith(f"--out {tmp_path / 'results'}: is a file; give a folder")
    assert main(["bench", "--out", str(tmp_path / "results" / "sub")]) == 2
    assert "which is a file" in _one_line_error(capsys)
    assert (tmp_path / "results").read_text() == "mine"


def test_bench_override_in_the_model_position_is_an_override(tmp_path, monkeypatch):
    monkeypatch.setattr("memfit.benchmark.run_bench", lambda *a, **k: (_ for _ in ()).throw(Reached(a)))
    with pytest.raises(Reached) as info:
        main(["bench", "model.init=random", "--out", str(tmp_path / "b")])
    model, *_, overrides = info.value.args[0]
    assert model == "memfit/tiny-llama" and overrides == ["model.init=random"]


def test_data_prepare_into_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "cfg.yaml").write_text("model: {name: memfit/tiny-llama, init: random}\n")
    (tmp_path / "notes.txt").write_text("mine")
    assert main(["data", "prepare", str(tmp_path / "cfg.yaml"), "--out", str(tmp_path / "notes.txt"),
                 "--overwrite"]) == 2
    assert _one_line_error(capsys).endswith("notes.txt: is a file; give a folder")
    assert (tmp_path / "notes.txt").read_text() == "mine"
