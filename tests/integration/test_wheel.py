"""The built wheel is complete: installed on its own (no checkout on the path), `memfit demo` and
`memfit plan` run from its files alone (presets, demo data and configs are package data); and
installed with `[all]` into a fresh venv, under the constraints, it declares every dependency it
imports (nothing comes from the test environment)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _build_wheel(tmp_path: Path) -> Path:
    wheels = tmp_path / "wheels"
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "wheel", str(ROOT), "--no-deps",
                    "--no-build-isolation", "-w", str(wheels)], check=True, cwd=tmp_path, timeout=300)
    return next(wheels.glob("memfit-*.whl"))


def _runner(python: str, cwd: Path, env: dict):
    def memfit(*args: str) -> str:
        done = subprocess.run([python, "-m", "memfit", *args], cwd=cwd, env=env, capture_output=True, text=True,
                              timeout=600)
        assert done.returncode == 0, done.stderr[-2000:]
        return done.stdout
    return memfit


@pytest.mark.slow
def test_the_wheel_alone_runs_the_demo_and_the_planner(tmp_path):
    target, elsewhere = tmp_path / "site", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps",
                    "--target", str(target), str(_build_wheel(tmp_path))], check=True, timeout=300)
    env = {**os.environ, "PYTHONPATH": str(target)}  # the dependencies come from this interpreter's environment
    memfit = _runner(sys.executable, elsewhere, env)
    where = subprocess.run([sys.executable, "-c", "import memfit; print(memfit.__file__)"], cwd=elsewhere, env=env,
                           capture_output=True, text=True, check=True).stdout
    assert where.startswith(str(target))  # the installed copy, not the checkout
    assert "Peak memory by category" in memfit("demo", "max_steps=5", "eval.every=0", "--no-progress")
    assert (elsewhere / "runs" / "demo" / "memory_timeline.json").is_file()
    assert "Recommendation" in memfit("plan", "meta-llama/Llama-3.1-8B", "--budget", "24GiB", "--seq-len", "2048")


@pytest.mark.slow
def test_the_wheel_with_all_extras_installs_into_a_fresh_venv_and_runs(tmp_path):
    """What the README's install table promises: torch first, then `memfit[all]` under the constraints
    (about a minute from the local wheel cache; pip's index is the machine's own)."""
    wheel, venv, elsewhere = _build_wheel(tmp_path), tmp_path / "venv", tmp_path / "elsewhere"
    elsewhere.mkdir()
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    python = str(venv / "bin" / "python")
    pip = [python, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run([*pip, "install", "torch==2.13.0"], check=True, timeout=900)
    subprocess.run([*pip, "install", "-c", str(ROOT / "constraints.txt"), "-c", str(ROOT / "requirements.txt"),
                    f"{wheel}[all]"], check=True, timeout=1200)
    subprocess.run([*pip, "check"], check=True, timeout=300)
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    imports = "import peft, bitsandbytes, torchao, datasets, pyarrow, matplotlib, deepspeed, tensorboard, wandb, mlflow"
    subprocess.run([python, "-c", imports], check=True, cwd=elsewhere, env=env, timeout=300)
    memfit = _runner(python, elsewhere, env)
    assert "Peak memory by category" in memfit("demo", "max_steps=3", "eval.every=0", "--no-progress")
    lora = memfit("demo", "max_steps=2", "method=lora", "output_dir=lora", "eval.every=0", "--no-progress")
    assert "adapter_model.safetensors" in lora and (elsewhere / "lora" / "adapter_config.json").is_file()
    assert "Recommendation" in memfit("plan", "meta-llama/Llama-3.1-8B", "--budget", "24GiB", "--seq-len", "2048")
