"""The built wheel is complete: installed on its own (no checkout on the path), `memfit demo` and
`memfit plan` run from its files alone (presets, demo data and configs are package data)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_wheel_alone_runs_the_demo_and_the_planner(tmp_path):
    wheels, target, elsewhere = tmp_path / "wheels", tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "wheel", str(ROOT), "--no-deps", "--no-build-isolation", "-w", str(wheels)], check=True,
                   cwd=tmp_path, timeout=300)
    wheel = next(wheels.glob("memfit-*.whl"))
    subprocess.run([*pip, "install", "--no-deps", "--target", str(target), str(wheel)], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}  # the dependencies come from this interpreter's environment

    def memfit(*args: str) -> str:
        done = subprocess.run([sys.executable, "-m", "memfit", *args], cwd=elsewhere, env=env, capture_output=True,
                              text=True, timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout

    where = subprocess.run([sys.executable, "-c", "import memfit; print(memfit.__file__)"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(target))  # the installed copy, not the checkout
    assert "Peak memory by category" in memfit("demo", "max_steps=5", "eval.every=0", "--no-progress")
    assert (elsewhere / "runs" / "demo" / "memory_timeline.json").is_file()
    assert "Recommendation" in memfit("plan", "meta-llama/Llama-3.1-8B", "--budget", "24GiB", "--seq-len", "2048")
