"""Host RAM while a model loads, beside the planner's load term (memfit/models/load_plan.py): one process,
and each of 2 gloo ranks of the engines that read a part per rank.

    .venv/bin/python bench/load_ram.py                       # a 0.5 B-parameter Llama in 4 safetensors files
    .venv/bin/python bench/load_ram.py --layers 2 --hidden 256 --out table.md   # a small one, quickly
    .venv/bin/python bench/load_ram.py --ranks 2             # zero3, tensor parallel 2, QLoRA over zero3

The model (random weights, bf16, `save_pretrained(max_shard_size=...)`) is written once to a temporary
folder. Each case is a fresh child process on the CPU (under torchrun for --ranks 2) that imports memfit,
then builds the run exactly as the trainer does (`memfit.build.build_run`, the weights loaded from that
folder; with 2 ranks through the trainer's engine, which shards the model and fills each rank's part)
while a thread reads /proc/self/status every millisecond. Measured: the peak of anonymous RSS (RssAnon: memory
the kernel cannot reclaim) above its value before loading, and beside it the peak growth of file-backed
RSS (RssFile: the checkpoint's mapped pages, page cache the kernel can reclaim). Planned, one process: the
load term `memfit.memory.single_device.load_bytes` (the copy a dtype-converting load makes on the host;
same-dtype weights are views of the mapped file). Planned, per rank: that rank's share of the node's load
term (its tensor in flight) plus its part of the weights, which on the CPU stays in host RAM as the
training state (`memfit.memory.distributed_estimate.rank_model_states`). The bound each rank must keep:
its part + the largest checkpoint file + nothing else of the model.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
MiB = 2**20

CASES = {
    "full bf16-pure": ["method=full", "precision=bf16-pure"],
    "full bf16-mixed": ["method=full", "precision=bf16-mixed"],
    "LoRA bf16-mixed": ["method=lora", "precision=bf16-mixed"],
    "QLoRA (torchao nf4)": ["method=qlora", "precision=bf16-mixed", "quant.backend=torchao"],
}

RANK_CASES = {
    "zero3 bf16-mixed": ["method=full", "precision=bf16-mixed", "distributed.sharding=zero3"],
    "tensor parallel 2, bf16-mixed": ["method=full", "precision=bf16-mixed", "distributed.tensor_parallel=2"],
    "QLoRA over zero3 (torchao nf4)": ["method=qlora", "precision=bf16-mixed", "distributed.sharding=zero3"],
}

CHILD = '''
import json, os, sys, threading, time
import torch
from memfit.build import build_run
from memfit.config import load_config
from memfit.distributed.engine import make_engine
import peft, torchao.quantization  # imported before measuring: their import is not the load


def status():
    found = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            found[key] = int(value.split()[0]) * 1024
    return found


cfg = load_config(None, [arg for arg in sys.argv[1:] if arg != "--"])
before, peak, done = status(), {"RssAnon": 0, "RssFile": 0}, threading.Event()


def watch():
    while not done.is_set():
        for key, value in status().items():
            peak[key] = max(peak[key], value)
        time.sleep(0.001)


engine = make_engine(cfg, torch.device("cpu")) if "RANK" in os.environ else None
before = status()
watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
if engine is None:
    run = build_run(cfg, torch.device("cpu"), place_on="cpu")
else:  # as the trainer builds it (memfit/train/loop.py)
    run = build_run(cfg, engine.device, on_meta=engine.builds_on_meta, place_on=engine.place_on, wrap=engine.wrap,
                    quant_shards=engine.quant_shards)
done.set()
watcher.join()
for key, value in status().items():
    peak[key] = max(peak[key], value)
print(json.dumps({"rank": int(os.environ.get("RANK", 0)), "anon": peak["RssAnon"] - before["RssAnon"],
                  "file": peak["RssFile"] - before["RssFile"]}))
if engine is not None:
    engine.teardown()
'''


def llama_config(layers: int, hidden: int, vocab: int) -> dict:
    return {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": vocab,
            "hidden_size": hidden, "intermediate_size": int(hidden * 2.75) // 64 * 64, "num_hidden_layers": layers,
            "num_attention_heads": hidden // 64, "num_key_value_heads": hidden // 64, "max_position_embeddings": 2048,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "bos_token_id": 1, "eos_token_id": 2,
            "hidden_act": "silu", "torch_dtype": "bfloat16"}


def write_model(folder: Path, layers: int, hidden: int, vocab: int, files: int) -> int:
    """A random-init Llama saved in bf16, cut into about `files` safetensors files; returns its parameters."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    config = LlamaConfig(**{k: v for k, v in llama_config(layers, hidden, vocab).items() if k != "model_type"})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    params = sum(p.numel() for p in model.parameters())
    model.save_pretrained(folder, max_shard_size=f"{params * 2 // files // 2**20 + 1}MB")
    return params


def measure(folder: Path, overrides: list[str], ranks: int = 1) -> list[dict]:
    """Each process's peak growth of anonymous and file-backed RSS while it builds the run."""
    args = [f"model.name={folder}", "model.init=pretrained", "device=cpu", *overrides]
    launch = [sys.executable, "-c", CHILD, "--"]
    if ranks > 1:  # torchrun runs a file, not -c
        script = folder.parent / "child.py"
        script.write_text(CHILD)
        launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(ranks), "--master-port",
                  str(_free_port()), str(script), "--"]
    done = subprocess.run([*launch, *args], capture_output=True, text=True, cwd=ROOT, timeout=1800,
                          env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "TRANSFORMERS_VERBOSITY": "error",
                               "HF_HUB_OFFLINE": "1", "PATH": "/usr/bin:/bin",
                               # glibc hands a freed block of 1 MiB or more back to the kernel at once (mmap),
                               # so RSS follows the live tensors instead of the heap's fragmentation
                               "MALLOC_MMAP_THRESHOLD_": str(2**20)})
    if done.returncode:
        sys.exit(f"{overrides}: exited {done.returncode}\n{done.stderr[-4000:]}")
    rows = [json.loads(line) for line in done.stdout.splitlines() if line.startswith("{")]
    return sorted(rows, key=lambda row: row["rank"])


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def planned(folder: Path, overrides: list[str], ranks: int = 1) -> tuple[int, int]:
    """(the load term per process, the weights each process keeps: 0 for one process, whose model the load
    term already is, or a rank's part of them)."""
    from memfit.config import load_config
    from memfit.memory.distributed_estimate import rank_model_states, rank_shape
    from memfit.memory.model_shape import model_shape
    from memfit.memory.single_device import load_bytes
    from memfit.models.loading import load_model_config

    cfg = load_config(None, [f"model.name={folder}", "model.init=pretrained", "device=cpu", *overrides])
    shape = model_shape(load_model_config(cfg.model)[0])
    if ranks == 1:
        return load_bytes(shape, cfg, "cpu"), 0
    part = rank_model_states(rank_shape(shape, cfg), cfg, ranks, "cpu").weights
    return load_bytes(shape, cfg, "cpu", ranks) // ranks, part


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--files", type=int, default=4, help="safetensors files to cut the checkpoint into")
    parser.add_argument("--ranks", type=int, default=1, choices=(1, 2), help="2: each of 2 gloo ranks")
    parser.add_argument("--cases", nargs="+", metavar="CASE", help="default: every case for --ranks")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    cases = CASES if args.ranks == 1 else RANK_CASES
    unknown = set(args.cases or ()) - set(cases)
    if unknown:
        parser.error(f"--cases: unknown {sorted(unknown)}; with --ranks {args.ranks}: {list(cases)}")
    rows = []
    with tempfile.TemporaryDirectory(prefix="memfit-load-ram-") as tmp:
        folder = Path(tmp) / "model"
        params = write_model(folder, args.layers, args.hidden, args.vocab, args.files)
        files = sorted(folder.glob("*.safetensors"))
        largest_file = max(f.stat().st_size for f in files)
        print(f"{params / 1e9:.3f} B parameters in {len(files)} files, largest {largest_file / MiB:.1f} MiB", flush=True)
        for name in args.cases or cases:
            load, part = planned(folder, cases[name], args.ranks)
            for found in measure(folder, cases[name], args.ranks):
                rows.append({"case": name, "rank": found["rank"], "overrides": cases[name], "params": params,
                             "files": len(files), "measured_bytes": found["anon"], "mapped_bytes": found["file"],
                             "planned_bytes": load + part, "part_bytes": part, "largest_file_bytes": largest_file})
                print(f"{name} (rank {found['rank']}): anonymous {found['anon'] / MiB:.1f} MiB (mapped "
                      f"{found['file'] / MiB:.1f} MiB), planned {(load + part) / MiB:.1f} MiB", flush=True)
    print("\n".join(table(rows, args.ranks)))
    if args.out:
        args.out.write_text("\n".join(table(rows, args.ranks)) + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


def table(rows: list[dict], ranks: int) -> list[str]:
    head = "| case | " + ("rank | " if ranks > 1 else "")
    lines = [head + "anonymous RSS growth while loading | planned | planned - measured | checkpoint pages mapped "
             "(reclaimable) |" + (" its part + largest file |" if ranks > 1 else ""),
             "|---" * (5 + (ranks > 1) * 2) + "|"]
    for r in rows:
        gap = r["planned_bytes"] - r["measured_bytes"]
        cells = [r["case"], *([str(r["rank"])] if ranks > 1 else []), f"{r['measured_bytes'] / MiB:,.1f} MiB",
                 f"{r['planned_bytes'] / MiB:,.1f} MiB",
                 f"{gap / MiB:+,.1f} MiB ({gap / max(r['measured_bytes'], r['planned_bytes'], 1):+.1%})",
                 f"{r['mapped_bytes'] / MiB:,.1f} MiB"]
        if ranks > 1:
            cells.append(f"{(r['part_bytes'] + r['largest_file_bytes']) / MiB:,.1f} MiB")
        lines.append("| " + " | ".join(cells) + " |")
    return lines


if __name__ == "__main__":
    main()
