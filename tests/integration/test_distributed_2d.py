"""2-D meshes: tensor parallel 2 inside FSDP2 (zero2/zero3) over 2 data-parallel groups, 4 gloo processes
on the CPU, tiny Llama, fixed-length data.

Two torchrun launches of 4 processes: the real command line (`-m memfit train ... distributed.sharding=zero3
distributed.tensor_parallel=2`, writing sharded checkpoints), and a worker that runs zero2 x tp2, zero3 x tp2
with CPU offload, and a zero3 x tp2 run checkpointed after step 1 then resumed on the same 4 ranks. Every
2-D run takes micro_batch 1 on each of its 2 data-parallel groups: the single run's micro_batch 2. Checks:

  losses     every run's losses and gradient norms (clipping at 1.0 is active) equal the single-process
             run's within LOSS_TOLERANCE
  weights    the final model is ordinary safetensors equal to the single run's weights
  resume     the resumed run continues the single-process losses, with all Adam moments restored
  reshard    the sharded checkpoint holds the global tensors (read back on one process without a mesh)
  loading    ranks but 0 build on meta and hold a quarter of each split linear

The config rules (which combinations are refused, launch world sizes) are unit tests without torchrun:
tests/unit/distributed/test_mesh_2d.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from memfit.config import load_config
from tests.torchrun import assert_same_weights, metrics, torchrun, write_fixed_length_text

pytestmark = pytest.mark.slow  # two torchrun launches of 4 processes + one single-process run

LOSS_TOLERANCE = 1e-4      # relative, as the 1-D engines: float32 reductions split over ranks differ in the last bits
WEIGHT_TOLERANCE = 1e-4    # absolute: Adam divides by sqrt(v), so last-bit gradient differences move weights ~lr * 1e-2
TIMEOUT_S = 600            # a hung rank fails the test instead of hanging CI
STEPS = 3
RANKS = 4
MESH = ["distributed.tensor_parallel=2", "batch.micro_batch=1"]  # 4 ranks = 2 dp groups x tp 2
WORDS = ["alpha", "beta", "gamma", "delta", "memory", "shard", "rank", "mesh"]  # the data's vocabulary

RUNS = {  # worker runs: output folder name -> overrides, in order (the resume line continues its folder)
    "zero2_tp2": ["distributed.sharding=zero2", *MESH],
    "zero3_tp2_offload": ["distributed.sharding=zero3", "distributed.offload=all", *MESH],
    "resumed": ["distributed.sharding=zero3", *MESH, "max_steps=1", "checkpoints.every=1"],
}
RESUME = ["distributed.sharding=zero3", *MESH, f"max_steps={STEPS}", "resume=true", "overwrite=false"]

WORKER = '''
import json, os, sys
import memfit.distributed.engine as engine
from tests.torchrun import train_each_line


def recording_shard(model, optimizer_factory, cfg, ctx, device, _shard=engine.shard):
    """What this rank held as built (meta or not) and its parameters' local shapes after sharding."""
    built_on_meta = all(p.is_meta for p in model.parameters())
    model, optimizer = _shard(model, optimizer_factory, cfg, ctx, device)
    local = {name: list((p.to_local() if hasattr(p, "to_local") else p).shape) for name, p in model.named_parameters()}
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, f"load-rank{ctx.rank}.json"), "w") as f:
        json.dump({"built_on_meta": built_on_meta, "local_shapes": local}, f)
    return model, optimizer


engine.shard = recording_shard
train_each_line(*sys.argv[1:3], "runs.txt")
'''


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """The single-process reference, the command-line run and the worker's runs, each once."""
    from memfit.train.loop import train
    from memfit.train.resolve import resolve_run

    root = tmp_path_factory.mktemp("mesh2d")
    write_fixed_length_text(root / "data.jsonl", WORDS)
    config = root / "run.yaml"
    # max_grad_norm 1.0 is below every step's norm (3.5-7.9): clipping by the global norm runs on every step
    config.write_text(
        f"max_steps: {STEPS}\ndevice: cpu\noverwrite: true\nbatch:\n  micro_batch: 2\nlogging:\n  every: 1\n"
        "checkpoints:\n  every: 0\noptim:\n  lr: 0.001\n  warmup_steps: 0\n  schedule: constant\n  max_grad_norm: 1.0\n"
        f"data:\n  path: {root / 'data.jsonl'}\n  format: text\n  seq_len: 64\n")
    lines = [f"{name} {' '.join(overrides)}" for name, overrides in RUNS.items()] + [f"resumed {' '.join(RESUME)}"]
    (root / "runs.txt").write_text("\n".join(lines) + "\n")
    (root / "worker.py").write_text(WORKER)

    single = train(resolve_run(load_config(config, [f"output_dir={root / 'single'}"])), progress=False)
    cli = torchrun("-m", "memfit", "train", str(config), f"output_dir={root / 'zero3_tp2'}",
                   "distributed.sharding=zero3", *MESH, "checkpoints.every=1", "--no-progress",
                   ranks=RANKS, timeout=TIMEOUT_S)
    worker = torchrun(str(root / "worker.py"), str(config), str(root), ranks=RANKS, timeout=TIMEOUT_S)
    return root, config, single, {"zero3_tp2": cli, "worker": worker}


def test_launches_exit_cleanly(runs):
    root, _, _, launches = runs
    for name, launch in launches.items():
        assert launch.returncode == 0, (name, launch.stderr[-4000:])
    for name in ("zero3_tp2", *RUNS):
        assert (root / name / "model.safetensors").exists(), name


@pytest.mark.parametrize("name", ["zero3_tp2", "zero2_tp2", "zero3_tp2_offload", "resumed"])
def test_losses_and_gradient_norms_match_single_process(runs, name):
    """The loss is reduced over the 2 data-parallel groups (not over all 4 ranks), and the clipped
    global gradient norm is taken over every shard of the 2-D mesh once."""
    root, _, single, _ = runs
    reference = root / "single"
    assert metrics(root / name, "loss") == pytest.approx(metrics(reference, "loss"), rel=LOSS_TOLERANCE), name
    assert metrics(root / name, "grad_norm") == pytest.approx(metrics(reference, "grad_norm"), rel=LOSS_TOLERANCE)
    assert len(single.losses) == STEPS and single.losses[-1] < single.losses[0]  # it trained


@pytest.mark.parametrize("name", ["zero3_tp2", "zero2_tp2", "zero3_tp2_offload", "resumed"])
def test_final_weights_match_single_process(runs, name):
    root, *_ = runs
    reference = root / "single" / "model.safetensors"
    assert_same_weights(root / name / "model.safetensors", reference, WEIGHT_TOLERANCE, name)


def test_resume_on_the_same_ranks_restores_every_optimizer_state(runs):
    """Resumed after step 1, the run's losses matched the single run's above (step 3 needs step 2's
    update, which needs the restored Adam moments); its last checkpoint counts every update."""
    root, *_ = runs
    assert set(_saved_optimizer_steps(root / "resumed").values()) == {STEPS}
    assert [p.name for p in _checkpoints(root / "zero3_tp2")] == ["sharded-step-00000002", "sharded-step-00000003"]


def test_sharded_checkpoint_holds_global_tensors(runs):
    """DCP stores the 2-D shards as global tensors: one process without any mesh reads the last
    checkpoint's weights back whole, equal to the final model (so another mesh can re-shard them)."""
    import torch.distributed.checkpoint as dcp
    from safetensors.torch import load_file

    root, *_ = runs
    path = _checkpoints(root / "zero3_tp2")[-1] / "state"
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    final = load_file(root / "zero3_tp2" / "model.safetensors")
    saved = {key: torch.empty(meta[f"model.{key}"].size) for key in final}
    dcp.load({"model": saved}, checkpoint_id=str(path), no_dist=True)
    for key, value in final.items():
        assert torch.equal(saved[key], value), key


def test_no_rank_builds_the_full_model(runs):
    """Every rank builds on meta and ends with its part only: the split linears (q/k/v/gate/up by rows,
    o/down by columns over "tp") are held once across the 4 ranks, every other tensor (replicated over
    "tp") once per tensor-parallel rank, FSDP2 sharding both by rows over "dp"."""
    from memfit.distributed.tensor_parallel import sharded_fraction
    from memfit.models.loading import build_model

    root, config, *_ = runs
    full = {name: p.numel() for name, p in build_model(load_config(config).model, on_meta=True).named_parameters()}
    for name in ("zero2_tp2", "zero3_tp2_offload"):
        loads = [json.loads((root / name / f"load-rank{rank}.json").read_text()) for rank in range(RANKS)]
        assert all(load["built_on_meta"] for load in loads), name  # every rank reads only its part
        held = [{key: torch.Size(shape).numel() for key, shape in load["local_shapes"].items()} for load in loads]
        assert all(set(rank) == set(full) for rank in held), name
        for key, numel in full.items():
            assert sum(rank[key] for rank in held) == numel * (1 if sharded_fraction(key) else 2), (name, key)
        for rank in held:  # about a quarter of the linears and half of the embeddings: 0.26 of the model here
            assert sum(rank.values()) < 0.3 * sum(full.values()), (name, rank)


def _checkpoints(run_dir: Path) -> list[Path]:
    return sorted((run_dir / "checkpoints").glob("sharded-step-*"))


def _saved_optimizer_steps(run_dir: Path) -> dict[str, int]:
    """AdamW's per-parameter step count in the last checkpoint (FSDP2: DCP keys `optim.state.<name>.step`)."""
    import torch.distributed.checkpoint as dcp

    path = _checkpoints(run_dir)[-1] / "state"
    meta = dcp.FileSystemReader(str(path)).read_metadata().state_dict_metadata
    steps = {key: torch.empty(meta[key].size) for key in meta if key.startswith("optim.state.") and key.endswith(".step")}
    assert steps, f"no optimizer step counts in {path}"
    dcp.load(steps, checkpoint_id=str(path), no_dist=True)
    return {key: int(value) for key, value in steps.items()}
