"""What the torchrun integration tests share: launching gloo ranks on the CPU, the loop of a worker
script that trains several runs in one launch, reading a run's metrics.jsonl and final weights, and
writing the fixed-length text data they train on.

    from tests.torchrun import metrics, torchrun, write_fixed_length_text

    write_fixed_length_text(root / "data.jsonl")
    done = torchrun("-m", "memfit", "train", str(config), "--no-progress", ranks=2, timeout=420)
    assert done.returncode == 0, done.stderr[-4000:]
    losses = metrics(out, "loss")

A worker script (written next to the config, launched as `torchrun(str(worker), str(config), str(root), ...)`)
patches what it records, then hands over to `train_each_line(*sys.argv[1:3], "runs.txt")`: one launch pays
the process start-up and rendezvous once for every run.
"""

from __future__ import annotations

import json
import os
import random
import socket
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import torch
from safetensors.torch import load_file

ROOT = Path(__file__).resolve().parents[1]
WORDS = ("alpha", "beta", "gamma", "delta", "memory", "shard", "rank", "stage")

# Set by a launcher this test session may itself run under; a launch sets its own.
RANK_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def free_port() -> int:
    """A port no one listens on now: each launch its own, so launches never meet in one rendezvous."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def torchrun_env(**extra: str) -> dict[str, str]:
    """This process's environment for a child: one thread a rank (the ranks share the CPU cores),
    transformers quiet, the repository importable, no rank variables but those in `extra`."""
    env = dict(os.environ, OMP_NUM_THREADS="1", TRANSFORMERS_VERBOSITY="error", PYTHONPATH=str(ROOT))
    for key in RANK_VARIABLES:
        env.pop(key, None)
    env.update(extra)
    return env


def torchrun(*args: str, ranks: int = 2, timeout: float,
             env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """`python -m torch.distributed.run` on `ranks` local processes with `args`, from the repository root,
    output captured; past `timeout` seconds it raises, so a hung rank fails the test instead of hanging CI."""
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks),
               "--master-addr", "127.0.0.1", "--master-port", str(free_port()), *args]
    return subprocess.run(command, cwd=ROOT, env=torchrun_env() if env is None else env,
                          capture_output=True, text=True, timeout=timeout)


def train_each_line(config: str, out: str, runs_file: str) -> None:
    """Inside a worker under torchrun: memfit's train() for each line `name override ...` of out/runs_file,
    into out/name, all in one gloo group (train() leaves a group it did not create); then the process ends."""
    import torch.distributed as dist

    from memfit.config import load_config
    from memfit.train.loop import train
    from memfit.train.resolve import resolve_run

    dist.init_process_group("gloo")
    for line in open(os.path.join(out, runs_file)):
        name, *overrides = line.split()
        train(resolve_run(load_config(config, [f"output_dir={os.path.join(out, name)}", *overrides])), progress=False)
    dist.barrier()
    dist.destroy_process_group()
    os._exit(0)


def metrics(run_dir: Path, key: str) -> list:
    """`key` of every line of the run's metrics.jsonl, in step order."""
    return [json.loads(line)[key] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def assert_same_weights(weights_file: Path, reference_file: Path, atol: float, label: str) -> None:
    """Both safetensors files hold the same tensor names, each equal within `atol` (absolute: a weight's
    relative error is large where it is near 0); `label` names the run in a failure."""
    reference, weights = load_file(reference_file), load_file(weights_file)
    assert set(reference) == set(weights), (label, sorted(set(reference) ^ set(weights)))
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, atol=atol, rtol=0, msg=f"{label}: {key}")


def write_fixed_length_text(path: Path, words: Sequence[str] = WORDS, examples: int = 48, length: int = 80) -> None:
    """`examples` lines of `length` words drawn from `words` by random.Random(0), as {"text": ...} jsonl:
    the same data on every call. 80 words are more tokens than the tests' seq_len 64, so no example is padded."""
    rng = random.Random(0)
    with open(path, "w") as f:
        for _ in range(examples):
            f.write(json.dumps({"text": " ".join(rng.choice(words) for _ in range(length))}) + "\n")
