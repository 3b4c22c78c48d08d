"""Host RAM while loading a model on 2 ranks: DDP (every rank builds the model) vs zero3, tensor
parallel 2 and pipeline parallel 2 (every rank builds on `meta` and makes or reads only its part:
memfit/models/part_loading.py) and DeepSpeed ZeRO-3 (rank 0 builds the model, the others build on `meta`
and DeepSpeed's own ZeRO conversion partitions it). `ds_zero3_full` is DeepSpeed ZeRO-3 with every rank
loading the full model (every rank builds the full model, deepspeed.initialize partitions it), for the
side-by-side ratio. For both DeepSpeed rows each rank also records its peak RSS on entering
`deepspeed.initialize`: the model built (and, ds_zero3, already partitioned) but none of DeepSpeed's
optimizer partitions, which it allocates eagerly there (fp32 master copy, gradient partition, Adam states).

    .venv/bin/python bench/distributed_load_ram.py [--layers 8 --hidden 1024]
    .venv/bin/python bench/distributed_load_ram.py --layers 3 --hidden 64 --engines ddp   # smallest run

Each run is `torchrun --nproc-per-node 2 -m memfit train` for one step on a random-init Llama
written to a temporary folder; every rank records its peak RSS right after the model is
sharded and loaded (`load_peak_rss_bytes` in distributed_memory.json). Baseline: the same
ranks' RSS with a 2-layer model of the same width (Python + torch + transformers + data; 2 layers:
the fewest a 2-stage pipeline accepts).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def llama_config(layers: int, hidden: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 259,
            "hidden_size": hidden, "intermediate_size": int(hidden * 2.75) // 64 * 64, "num_hidden_layers": layers,
            "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 256, "eos_token_id": 257,
            "pad_token_id": 258, "hidden_act": "silu"}


# DeepSpeed ZeRO-3 with memfit's AdamW; "auto" thresholds partition every matrix of the model.
DS_ZERO3 = {"train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
            "gradient_clipping": "auto", "zero_optimization": {
                "stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                "stage3_param_persistence_threshold": "auto"}}
ENGINES = {"ddp": ["distributed.sharding=ddp"], "zero3": ["distributed.sharding=zero3"], "tp2": ["distributed.tensor_parallel=2"],
           "pp2": ["distributed.pipeline_parallel=2", "optim.max_grad_norm=null"],  # pipelines refuse gradient clipping
           "ds_zero3": ["distributed.deepspeed={ds_json}"], "ds_zero3_full": ["distributed.deepspeed={ds_json}"]}
# memfit's CLI recording each rank's peak RSS as deepspeed.initialize starts (build-rss-rank<r>.json);
# ds_zero3_full: with DeepSpeed's load-from-rank-0 switched off (every rank loads the full model).
DS_SCRIPT = """import json, os, runpy, sys
import deepspeed
import memfit.distributed.deepspeed_engine as deepspeed_engine
from memfit.distributed.launch import peak_rss_bytes
if {full}:
    deepspeed_engine.loads_from_rank0 = lambda cfg, ctx: False
_initialize = deepspeed.initialize
def recording_initialize(*args, **kwargs):
    with open(os.path.join({out!r}, "build-rss-rank" + os.environ["RANK"] + ".json"), "w") as f:
        json.dump({{"peak_rss_bytes": peak_rss_bytes()}}, f)
    return _initialize(*args, **kwargs)
deepspeed.initialize = recording_initialize
sys.argv[0] = "memfit"
runpy.run_module("memfit", run_name="__main__")
"""


def run(model_dir: Path, out: Path, engine: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    env["DS_ACCELERATOR"] = "cpu"  # DeepSpeed on the CPU even where a GPU exists
    # glibc hands a freed block of 1 MiB or more back to the kernel at once (mmap), so the peak RSS follows the
    # live tensors instead of how fragmented the heap became while tensors were made and freed one by one
    env["MALLOC_MMAP_THRESHOLD_"] = str(2**20)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))  # for the script
    ds_json, script = out.parent / "ds_zero3.json", out.parent / f"{out.name}.py"
    ds_json.write_text(json.dumps(DS_ZERO3))
    out.mkdir(parents=True, exist_ok=True)
    script.write_text(DS_SCRIPT.format(full=engine == "ds_zero3_full", out=str(out)))
    entry = [str(script)] if engine.startswith("ds_") else ["-m", "memfit"]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               *entry, "train", str(ROOT / "memfit/configs/demo.yaml"), f"model={model_dir}", "model.init=random",
               f"output_dir={out}", "overwrite=true", *(o.format(ds_json=ds_json) for o in ENGINES[engine]),
               "max_steps=1", "batch.micro_batch=1",
               "eval.fraction=0", "eval.every=0", "eval.save_best=false",  # 8 records leave none to hold out
               "data.seq_len=256", "data.limit=8", "checkpoints.every=0", "device=cpu", "optim.name=adamw", "precision=fp32", "--no-progress"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode:  # memfit's own message first: torchrun's traceback that follows it says little
        errors = "\n".join(line for line in result.stderr.splitlines() if line.startswith("memfit: error"))
        sys.exit(f"{engine} failed:\n{errors}\n{result.stderr[-3000:]}")
    ranks = json.loads((out / "distributed_memory.json").read_text())["ranks"]
    for rank, record in enumerate(ranks):
        build = out / f"build-rss-rank{rank}.json"
        record["build_peak_rss_bytes"] = json.loads(build.read_text())["peak_rss_bytes"] if build.exists() else None
    return ranks


BASE_LAYERS = 2


def parameter_count(layers: int, hidden: int) -> int:
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(LlamaConfig(**llama_config(layers, hidden)))
    return sum(p.numel() for p in model.parameters())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--engines", nargs="+", default=list(ENGINES), choices=list(ENGINES), metavar="ENGINE",
                        help=f"engines to run (default all: {', '.join(ENGINES)})")
    args = parser.parse_args()
    mib = 2**20
    base_name, big_name = f"baseline ({BASE_LAYERS} layers)", f"{args.layers} layers"
    with tempfile.TemporaryDirectory() as tmp:
        rows = {}
        for name, layers in ((base_name, BASE_LAYERS), (big_name, args.layers)):
            model_dir = Path(tmp) / f"model-{layers}"
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(llama_config(layers, args.hidden)))
            for engine in args.engines:
                ranks = run(model_dir, Path(tmp) / f"out-{layers}-{engine}", engine)
                rows[(name, engine)] = [r["load_peak_rss_bytes"] for r in ranks]
                if engine.startswith("ds_"):
                    rows[(name, engine + " (before deepspeed.initialize)")] = [r["build_peak_rss_bytes"]
                                                                               for r in ranks]
    params = parameter_count(args.layers, args.hidden)
    blocks_bytes = (params - parameter_count(BASE_LAYERS, args.hidden)) * 4  # what the bigger model adds, fp32
    print(f"model: {params / 1e6:.1f} M parameters = {params * 4 / mib:.0f} MiB in fp32; 2 ranks, gloo, CPU")
    print(f"{'run':24s} {'engine':8s} {'rank 0 RSS':>12s} {'rank 1 RSS':>12s}  (peak RSS after loading, MiB)")
    for (name, engine), values in rows.items():
        print(f"{name:24s} {engine:8s} " + " ".join(f"{v / mib:12.0f}" for v in values))
    print(f"model-dependent RSS = {big_name} minus the baseline, against the {args.layers - BASE_LAYERS} added blocks' "
          f"fp32 weights ({blocks_bytes / mib:.0f} MiB):")
    for rank in (0, 1):
        delta = {e: rows[(big_name, e)][rank] - rows[(base_name, e)][rank] for n, e in rows if n == big_name}
        ddp = delta.get("ddp")  # the side-by-side ratio needs the ddp run (--engines may leave it out)
        print(f"rank {rank}: " + ", ".join(f"{e} {d / mib:.0f} MiB ({d / blocks_bytes:.2f}x blocks"
                                          + (f", {d / max(ddp, 1):.2f}x ddp)" if ddp is not None else ")")
                                          for e, d in delta.items()))


if __name__ == "__main__":
    main()
