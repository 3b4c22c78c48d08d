"""Host RAM while loading a model on 2 ranks: DDP (every rank builds the model) vs zero3
(rank 0 builds it, the others build on `meta` and receive their shards by broadcast).

    .venv/bin/python bench/distributed_load_ram.py [--layers 8 --hidden 1024]

Each run is `torchrun --nproc-per-node 2 -m memfit train` for one step on a random-init Llama
written to a temporary folder; every rank records its peak RSS right after the model is
sharded and loaded (`load_peak_rss_bytes` in distributed_memory.json). Baseline: the same
ranks' RSS with a 1-layer model of the same width (Python + torch + transformers + data).
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


def run(model_dir: Path, out: Path, sharding: str) -> list[dict]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "MASTER_PORT")}
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(port),
               "-m", "memfit", "train", str(ROOT / "memfit/configs/demo.yaml"), f"model={model_dir}",
               f"output_dir={out}", "overwrite=true", f"sharding={sharding}", "max_steps=1", "micro_batch=1",
               "seq_len=256", "data.limit=8", "save_every=0", "device=cpu", "optimizer=adamw", "precision=fp32", "--no-progress"]
    result = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
    if result.returncode:
        sys.exit(result.stderr[-3000:])
    return json.loads((out / "distributed_memory.json").read_text())["ranks"]


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    args = parser.parse_args()
    mib = 2**20
    with tempfile.TemporaryDirectory() as tmp:
        rows = {}
        for name, layers in (("baseline (1 layer)", 1), (f"{args.layers} layers", args.layers)):
            model_dir = Path(tmp) / f"model-{layers}"
            model_dir.mkdir()
            (model_dir / "config.json").write_text(json.dumps(llama_config(layers, args.hidden)))
            for sharding in ("ddp", "zero3"):
                ranks = run(model_dir, Path(tmp) / f"out-{layers}-{sharding}", sharding)
                rows[(name, sharding)] = [r["load_peak_rss_bytes"] for r in ranks]
        import torch  # noqa: F401  (parameter count only)
        from transformers import AutoModelForCausalLM, LlamaConfig

        with torch.device("meta"):
            params = sum(p.numel() for p in AutoModelForCausalLM.from_config(
                LlamaConfig(**llama_config(args.layers, args.hidden))).parameters())
        print(f"model: {params / 1e6:.1f} M parameters = {params * 4 / mib:.0f} MiB in fp32; 2 ranks, gloo, CPU")
        print(f"{'run':24s} {'sharding':8s} {'rank 0 RSS':>12s} {'rank 1 RSS':>12s}  (peak RSS after loading, MiB)")
        for (name, sharding), values in rows.items():
            print(f"{name:24s} {sharding:8s} " + " ".join(f"{v / mib:12.0f}" for v in values))
        base = {s: rows[("baseline (1 layer)", s)] for s in ("ddp", "zero3")}
        big = {s: rows[(f"{args.layers} layers", s)] for s in ("ddp", "zero3")}
        for rank in (0, 1):
            ddp_model = big["ddp"][rank] - base["ddp"][rank]
            zero_model = big["zero3"][rank] - base["zero3"][rank]
            print(f"rank {rank}: model-dependent RSS, zero3 / ddp = {zero_model / mib:.0f} MiB / "
                  f"{ddp_model / mib:.0f} MiB = {zero_model / max(ddp_model, 1):.2f}")


if __name__ == "__main__":
    main()
