"""Every benchmark script in bench/ runs to the end with its smallest settings.

The benches are not imported by anything else, so an API change that breaks one goes unnoticed
until someone wants its numbers. Each runs here as its user runs it (a subprocess of this
interpreter, from the repository root), writing into tmp_path, and must exit 0 with the output
it promises. bench/gpu_validate.py needs CUDA: without it the test checks that it refuses
cleanly (says so, exits 0, writes nothing); with it, that it writes its table.
All twelve take about 4.5 minutes of CPU time on the 2-core machine (vs_hf.py the longest).
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
BENCH = ROOT / "bench"
NUMBER = r"[-+]?\d[\d,]*\.?\d*"


def run_bench(script: str, *args: str, timeout: int = 240) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT", "LOCAL_RANK")}
    done = subprocess.run([sys.executable, str(BENCH / script), *map(str, args)], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=timeout)
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout[-2000:]}\n{done.stderr[-4000:]}"
    return done


def table_rows(text: str, first_cell: str) -> list[list[str]]:
    """The cells of markdown table rows whose first cell starts with `first_cell`."""
    rows = [[c.strip() for c in line.strip().strip("|").split("|")] for line in text.splitlines()
            if line.startswith("|")]
    return [r for r in rows if r[0].startswith(first_cell)]


def check_accuracy(tmp: Path) -> None:
    out = tmp / "accuracy.md"
    done = run_bench("accuracy.py", "--rows", "1", "--out", out)
    published = (ROOT / "docs" / "accuracy.md").read_text().splitlines()
    written = out.read_text().splitlines()
    assert len(written) == len(published)  # the other rows copied as they were
    first = next(r for r in table_rows(out.read_text(), "") if re.match(r"^[A-Z]\d", r[0]))
    assert re.fullmatch(rf"{NUMBER} (GB|GiB) \((alloc|reserved)\)", first[2]) and first[4].endswith("%")
    assert re.search(rf"^\s*{first[0]}\s+{NUMBER} ", done.stderr, re.M)


def check_data_ram(tmp: Path) -> None:
    out = tmp / "data_ram"
    done = run_bench("data_ram.py", "--sizes-gb", "0.001", "0.002", "--throughput-records", "20", "--out", out)
    assert len(re.findall(r"streaming peak RSS [\d,]+ MB .* naive peak RSS [\d,]+ MB", done.stdout)) == 2
    assert len(re.findall(r"worker\(s\): [\d,]+ records/s, [\d,]+ tokens/s", done.stdout)) == 2
    assert not out.exists()  # the generated corpora are deleted


def check_distributed_load_ram(tmp: Path) -> None:
    done = run_bench("distributed_load_ram.py", "--layers", "3", "--hidden", "64", "--engines", "ddp")
    rows = [line.split() for line in done.stdout.splitlines() if re.search(r"layers\)? +ddp +\d+ +\d+$", line)]
    assert len(rows) == 2 and all(int(r[-1]) > 0 and int(r[-2]) > 0 for r in rows)
    assert re.search(rf"rank 1: ddp {NUMBER} MiB", done.stdout)


def check_rank_matrix(tmp: Path) -> None:
    done = run_bench("rank_matrix.py", "--mixes", "ddp-full", "--steps", "1", "--out", tmp / "table.md")
    rows = table_rows(done.stdout, "ddp-full")
    assert [row[1] for row in rows] == ["0", "1"]  # one row per rank
    assert all(re.fullmatch(rf"{NUMBER} / {NUMBER}", row[2]) for row in rows)  # measured / estimated peak
    assert re.search(rf"largest error: {NUMBER}% \(ddp-full, rank \d\)", done.stdout)
    assert (tmp / "table.md").read_text().startswith("| mix | rank |")


def check_estimate_vs_rss(tmp: Path) -> None:
    done = run_bench("estimate_vs_rss.py", "--layers", "1", "--hidden", "64", "--seq-len", "32",
                     "--micro-batch", "1")
    rows = [line for line in done.stdout.splitlines() if line.startswith(("glibc defaults", "MALLOC_MMAP"))]
    assert len(rows) == 2
    for row in rows:  # with the sizes taken out, the last number is the estimate / RSS ratio
        ratio = re.findall(NUMBER, re.sub(rf"{NUMBER} [KMGT]?i?B", "", row))[-1]
        assert float(ratio) > 0, row


def check_gpu_validate(tmp: Path) -> None:
    out = tmp / "gpu.md"
    done = run_bench("gpu_validate.py", out, "--configs", "1", "--steps", "1", timeout=600)
    if not torch.cuda.is_available():
        assert "needs CUDA" in done.stdout and not out.exists()
        return
    rows = table_rows(out.read_text(), "`")
    assert len(rows) == 1 and re.fullmatch(NUMBER, rows[0][2]), rows  # max_memory_allocated, not an error


def check_long_context(tmp: Path) -> None:
    out = tmp / "long_context.md"
    run_bench("long_context.py", "--lengths", "64,128", "--mixes", "plain", "--out", out)
    text = out.read_text()
    assert table_rows(text, "none of them") and table_rows(text, "every saver on")
    (plain,) = table_rows(text, "plain")
    assert re.fullmatch(rf"{NUMBER} / {NUMBER} MiB", plain[1])


def check_load_ram(tmp: Path) -> None:
    out = tmp / "load.md"
    run_bench("load_ram.py", "--layers", "1", "--hidden", "128", "--vocab", "512", "--files", "2",
              "--cases", "full bf16-pure", "--out", out)
    rows = table_rows(out.read_text(), "full bf16-pure")
    assert len(rows) == 1 and all(cell.endswith("MiB") for cell in (rows[0][1], rows[0][2], rows[0][4]))


def check_lora(tmp: Path) -> None:
    done = run_bench("lora.py", "--layers", "1", "--hidden", "64", "--vocab", "256", "--seq-len", "32",
                     "--micro-batch", "1", "--steps", "1", "--variants", "full", "lora")
    rows = {line.split()[0]: line.split() for line in done.stdout.splitlines() if line.startswith(("full ", "lora "))}
    assert set(rows) == {"full", "lora"} and float(rows["full"][-1]) == 1.0


def check_plan_speed(tmp: Path) -> None:
    done = run_bench("plan_speed.py", "--model", "memfit/tiny-llama", "--seq-len", "64")
    for target in ("cuda", "cpu"):  # wall s, CPU s, peak allocated
        assert re.search(rf"^{target}\s+{NUMBER}\s+{NUMBER}\s+{NUMBER} [KMG]?i?B", done.stdout, re.M), target


def check_plan_sweep(tmp: Path) -> None:
    done = run_bench("plan_sweep.py", "--count", "5")
    assert re.search(rf"^5 analytic estimates in {NUMBER} s", done.stdout, re.M)


def check_strategies(tmp: Path) -> None:
    out = tmp / "strategies.md"
    run_bench("strategies.py", "--rounds", "1", "--steps", "2", "--micro-batch", "1", "--seq-len", "32",
              "--layers", "1", "--hidden", "64", "--vocab", "512", "--write", out)
    text = out.read_text()
    assert "Command: `.venv/bin/python bench/strategies.py" in text
    assert len(table_rows(text, "")) == 2 + 5  # header, rule, one row per configuration


def check_vs_hf(tmp: Path) -> None:
    done = run_bench("vs_hf.py", "--steps", "2", "--strategies", "full", timeout=480)  # 4 fresh processes
    (row,) = [line.split() for line in done.stdout.splitlines() if line.startswith("full ")]
    assert row[-1] != "nan"
    assert "full: same tokens per step in every run: yes" in done.stdout


CHECKS = {name.removeprefix("check_") + ".py": check for name, check in globals().items()
          if name.startswith("check_")}


def test_every_bench_has_a_smoke_check():
    assert sorted(CHECKS) == sorted(p.name for p in BENCH.glob("*.py"))


@pytest.mark.slow
@pytest.mark.parametrize("script", sorted(CHECKS))
def test_bench_runs(script, tmp_path):
    CHECKS[script](tmp_path)
