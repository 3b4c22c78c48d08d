"""DeepSpeed from the user's own JSON config: 2 gloo processes on the CPU, tiny Llama, fixed-length data.

DeepSpeed's CPU accelerator runs ZeRO 1, 2 and 3 over gloo, so this is DeepSpeed for real, not a
stand-in. One torchrun runs every JSON below through `memfit.train.loop.train` in the same two
processes (the worker script); two more run the real command line (`-m memfit train`) with
DeepSpeed checkpoints, the second resuming the first. Checks:

  losses     each run's losses and gradient norms equal the single-process memfit run's within
             LOSS_TOLERANCE (2 ranks x micro_batch 1 = the single run's micro_batch 2); bf16
             within BF16_TOLERANCE of memfit's bf16-mixed (DeepSpeed computes with bf16 weights,
             memfit's autocast with fp32 weights: not the same rounding)
  exit       every torchrun exits 0
  files      the final model is ordinary safetensors equal to the single run's weights (fp32 runs)
  resume     a run stopped at step 2 and resumed from its DeepSpeed checkpoint continues exactly
  loading    ZeRO-3: rank 1 builds the model on `meta` and ends with only its partition
             (load-rank<r>.json, written around deepspeed_engine.initialize); the random init
             (preset) and a saved safetensors folder both come out equal to the single run's

fp16 and DeepSpeed's own CPU-Adam / NVMe offload need CUDA: tests/gpu/test_deepspeed_gpu.py.
"""

from __future__ import annotations

import json
import subprocess

import pytest
import torch

from memfit.config import load_config
from tests.torchrun import ROOT, assert_same_weights, metrics, torchrun, torchrun_env, write_fixed_length_text

pytestmark = pytest.mark.slow  # ~1.5 min on 2 cores: three torchrun launches + five single-process runs

LOSS_TOLERANCE = 1e-4   # relative; float32 reductions split over ranks differ in the last bits
BF16_TOLERANCE = 5e-3   # relative; seen 4e-4 on 2 cores
WEIGHT_TOLERANCE = 1e-4  # absolute; Adam divides by sqrt(v): last-bit gradient differences move weights ~lr * 1e-2
TIMEOUT_S = 420          # a hung rank fails the test instead of hanging CI
STEPS = 3
SHIPPED = ROOT / "memfit" / "configs" / "deepspeed_zero2.json"  # "auto" everywhere, no optimizer block

TORCH_ADAMW = {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto", "torch_adam": True}}
USER_JSON = {  # a user's own files, as they might already have them
    # numbers that agree with the run config instead of "auto"; DeepSpeed builds the optimizer
    "zero1": {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "gradient_clipping": 100.0,
              "zero_optimization": {"stage": 1},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.001, "weight_decay": 0.0, "torch_adam": True}}},
    "zero3": {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
              "gradient_clipping": "auto", "bf16": {"enabled": "auto"},
              "zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": "auto",
                                    "stage3_param_persistence_threshold": "auto"},
              "optimizer": TORCH_ADAMW},
    # parameters and optimizer step on the CPU; a torch optimizer there needs zero_force_ds_cpu_optimizer
    # (stage3_param_persistence_threshold: DeepSpeed keeps parameters under 10^5 elements whole on every
    # rank by default, which is every parameter of the tiny model; "auto" = 10 x hidden partitions them.)
    "zero3_offload": {"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"},
                                            "offload_optimizer": {"device": "cpu"},
                                            "stage3_param_persistence_threshold": "auto"},
                      "optimizer": TORCH_ADAMW, "zero_force_ds_cpu_optimizer": False},
}
RUNS = {  # name -> (JSON, overrides, single-process reference)
    "zero1": ("zero1", [], "single"),
    "zero2": ("shipped", [], "single"),  # memfit's own AdamW handed to DeepSpeed
    "zero3": ("zero3", [], "single"),
    # accumulation counted by DeepSpeed; memfit's warm-up + cosine schedule drives DeepSpeed's optimizer
    "zero2_accum": ("shipped", ["batch.grad_accum=2", "optim.warmup_steps=1", "optim.schedule=cosine"], "single_accum"),
    "zero3_offload": ("zero3_offload", [], "single"),
    "zero3_bf16": ("zero3", ["precision=bf16-mixed"], "single_bf16"),
    "zero2_lora": ("shipped", ["method=lora", "optim.lr=0.01"], "single_lora"),  # adapters start at zero
    "zero3_saved": ("zero3", ["model={saved}"], "single_saved"),  # from_pretrained of a safetensors folder
}
SINGLE = {"single": [], "single_accum": ["batch.grad_accum=2", "optim.warmup_steps=1", "optim.schedule=cosine"],
          "single_bf16": ["precision=bf16-mixed"], "single_lora": ["method=lora", "optim.lr=0.01"], "single_saved": ["model={saved}"]}

WORKER = '''
import json, os, sys
from memfit.distributed import deepspeed_engine
from tests.torchrun import train_each_line


def recording_initialize(model, optimizer_factory, cfg, ctx, device, _initialize=deepspeed_engine.initialize):
    """What this rank held as built (meta or not) and after initialize (its parameter bytes): load-rank<r>.json."""
    built_on_meta = all(p.is_meta for p in model.parameters())
    engine, optimizer = _initialize(model, optimizer_factory, cfg, ctx, device)
    local = [getattr(p, "ds_tensor", p) for p in engine.module.parameters()]  # ZeRO-3: this rank's partition
    os.makedirs(cfg.output_dir, exist_ok=True)
    with open(os.path.join(cfg.output_dir, f"load-rank{ctx.rank}.json"), "w") as f:
        json.dump({"built_on_meta": built_on_meta,
                   "parameter_bytes": sum(t.numel() * t.element_size() for t in local)}, f)
    return engine, optimizer


deepspeed_engine.initialize = recording_initialize  # the loop looks it up at every run
train_each_line(*sys.argv[1:3], "runs.txt")
'''


def _torchrun(*args: str) -> subprocess.CompletedProcess:
    # DS_ACCELERATOR=cpu: the runs are on the CPU even where a GPU exists
    return torchrun(*args, timeout=TIMEOUT_S, env=torchrun_env(DS_ACCELERATOR="cpu"))


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Write data, config and JSON files; run the single-process references and every DeepSpeed run."""
    from memfit.models.loading import build_model
    from memfit.models.tokenizer import byte_tokenizer
    from memfit.train.loop import train
    from memfit.train.resolve import resolve_run

    root = tmp_path_factory.mktemp("deepspeed")
    write_fixed_length_text(root / "data.jsonl")
    config = root / "run.yaml"
    config.write_text(
        f"max_steps: {STEPS}\nmicro_batch: 2\nseq_len: 64\nlog_every: 1\nsave_every: 0\nlr: 0.001\n"
        "warmup_steps: 0\nlr_schedule: constant\nmax_grad_norm: 100.0\ndevice: cpu\noverwrite: true\n"
        f"data:\n  path: {root / 'data.jsonl'}\n  format: text\n")
    saved = root / "saved"  # a local model folder with safetensors weights (a seed the preset runs do not use)
    torch.manual_seed(1)
    build_model(load_config(config).model).save_pretrained(saved, safe_serialization=True)
    byte_tokenizer().save_pretrained(saved)  # real weights train only with their own tokenizer
    paths = {"shipped": SHIPPED}
    for name, content in USER_JSON.items():
        paths[name] = root / f"{name}.json"
        paths[name].write_text(json.dumps(content, indent=1))
    (root / "runs.txt").write_text("".join(f"{name} distributed.deepspeed={paths[js]} batch.micro_batch=1 "
                                           f"{' '.join(extra)}\n"
                                           .format(saved=saved) for name, (js, extra, _) in RUNS.items()))
    (root / "worker.py").write_text(WORKER)

    for name, overrides in SINGLE.items():
        cfg = load_config(config, [f"output_dir={root / name}", *(o.format(saved=saved) for o in overrides)])
        train(resolve_run(cfg), progress=False)
    result = _torchrun(str(root / "worker.py"), str(config), str(root))
    return root, config, paths, result


def test_every_run_exits_cleanly(runs):
    root, _, _, result = runs
    assert result.returncode == 0, result.stderr[-4000:]
    for name in RUNS:
        assert (root / name / ("adapter_model.safetensors" if "lora" in name else "model.safetensors")).exists(), name


@pytest.mark.parametrize("name", list(RUNS))
def test_losses_match_single_process(runs, name):
    root, _, _, result = runs
    assert result.returncode == 0, result.stderr[-4000:]
    reference = RUNS[name][2]
    tolerance = BF16_TOLERANCE if reference == "single_bf16" else LOSS_TOLERANCE
    losses = metrics(root / name, "loss")
    assert len(losses) == STEPS
    assert losses == pytest.approx(metrics(root / reference, "loss"), rel=tolerance), name
    assert losses[-1] < losses[0]  # it trained
    if reference != "single_bf16":  # DeepSpeed's gradient norm is the one memfit's single process reports
        assert metrics(root / name, "grad_norm") == pytest.approx(metrics(root / reference, "grad_norm"),
                                                                  rel=LOSS_TOLERANCE), name


@pytest.mark.parametrize("name", [n for n, (_, _, ref) in RUNS.items() if ref != "single_bf16"])
def test_final_weights_match_single_process(runs, name):
    root, *_ = runs
    file = "adapter_model.safetensors" if "lora" in name else "model.safetensors"  # LoRA: PEFT's adapter file
    assert_same_weights(root / name / file, root / RUNS[name][2] / file, WEIGHT_TOLERANCE, name)


ZERO3 = [name for name, (js, _, _) in RUNS.items() if js.startswith("zero3")]


@pytest.mark.parametrize("name", ZERO3)
def test_zero3_ranks_but_0_never_build_the_full_model(runs, name):
    """Under ZeRO-3 rank 1 builds on meta (no bytes) and keeps only its partition."""
    root, config, *_ = runs
    from memfit.models.loading import build_model

    loads = [json.loads((root / name / f"load-rank{rank}.json").read_text()) for rank in (0, 1)]
    assert [load["built_on_meta"] for load in loads] == [False, True], loads
    full = sum(p.numel() * p.element_size() for p in build_model(load_config(config).model, on_meta=True).parameters())
    if name.endswith("bf16"):
        full //= 2  # DeepSpeed's bf16 mode keeps bf16 partitions
    for rank, load in enumerate(loads):
        assert 0.4 * full < load["parameter_bytes"] < 0.6 * full, (rank, load, full)  # about half: 2 ranks


def test_zero3_check_tells_the_cases_apart(runs):
    """ZeRO 1 and 2 keep whole weights on every rank, so their rank 1 builds the full model."""
    root, *_ = runs
    for name in ("zero1", "zero2"):
        assert json.loads((root / name / "load-rank1.json").read_text())["built_on_meta"] is False, name


def test_bf16_engine_writes_bf16_weights(runs):
    """DeepSpeed's bf16 mode trains bf16 module weights (fp32 master copies inside its optimizer)."""
    from safetensors.torch import load_file

    root, *_ = runs
    weights = load_file(root / "zero3_bf16" / "model.safetensors")
    assert {value.dtype for value in weights.values()} == {torch.bfloat16}
    report = (root / "zero3_bf16" / "memory_report.txt").read_text()
    assert "DeepSpeed run: the tracker's categories are not this rank's memory" in report


def test_command_line_checkpoints_and_resumes(runs, tmp_path):
    """torchrun -m memfit train (ZeRO-3, 2 ranks, DeepSpeed checkpoints) stopped at step 2, then resumed."""
    from safetensors.torch import load_file

    root, config, paths, _ = runs
    out = tmp_path / "cli"
    common = [str(config), f"output_dir={out}", f"distributed.deepspeed={paths['zero3']}", "batch.micro_batch=1", "--no-progress"]
    first = _torchrun("-m", "memfit", "train", *common, f"max_steps={STEPS - 1}", "checkpoints.every=1")
    assert first.returncode == 0, first.stderr[-4000:]
    saved = sorted((out / "checkpoints").glob("deepspeed-step-*"))
    assert [p.name for p in saved] == ["deepspeed-step-00000001", "deepspeed-step-00000002"]
    assert (saved[-1] / "state").is_dir() and (saved[-1] / "trainer.json").exists()

    resumed = _torchrun("-m", "memfit", "train", *common, f"max_steps={STEPS}", "resume=true", "overwrite=false")
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    losses = metrics(out, "loss")
    assert metrics(out, "step") == [1, 2, 3]
    # Step 3 runs on the restored weights and Adam states: the same as an uninterrupted run.
    assert losses == pytest.approx(metrics(root / "single", "loss"), rel=LOSS_TOLERANCE)
    reference = load_file(root / "single" / "model.safetensors")
    weights = load_file(out / "model.safetensors")
    for key, value in reference.items():
        torch.testing.assert_close(weights[key], value, atol=WEIGHT_TOLERANCE, rtol=0, msg=key)
