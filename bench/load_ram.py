"""Host RAM while one process loads a model, beside the planner's load term (memfit/models/load_plan.py).

    .venv/bin/python bench/load_ram.py                       # a 0.5 B-parameter Llama in 4 safetensors files
    .venv/bin/python bench/load_ram.py --layers 2 --hidden 256 --out table.md   # a small one, quickly

The model (random weights, bf16, `save_pretrained(max_shard_size=...)`) is written once to a temporary
folder. Each case is a fresh child process on the CPU that imports memfit, then builds the run exactly
as the trainer does (`memfit.build.build_run`, the weights loaded from that folder) while a thread reads
/proc/self/status every 5 ms. Measured: the peak of anonymous RSS (RssAnon: memory the kernel cannot
reclaim) above its value before loading, and beside it the peak growth of file-backed RSS (RssFile: the
checkpoint's mapped pages, page cache the kernel can reclaim). Planned: the load term
`memfit.memory.single_device.load_bytes` (memfit/models/load_plan.py: the copy a dtype-converting load
makes on the host; same-dtype weights are views of the mapped file).
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

CHILD = '''
import json, sys, threading, time
import torch
from memfit.build import build_run
from memfit.config import load_config


def status():
    found = {}
    for line in open("/proc/self/status"):
        key, _, value = line.partition(":")
        if key in ("RssAnon", "RssFile"):
            found[key] = int(value.split()[0]) * 1024
    return found


cfg = load_config(None, sys.argv[2:])
before, peak, done = status(), {"RssAnon": 0, "RssFile": 0}, threading.Event()


def watch():
    while not done.is_set():
        for key, value in status().items():
            peak[key] = max(peak[key], value)
        time.sleep(0.005)


watcher = threading.Thread(target=watch, daemon=True)
watcher.start()
run = build_run(cfg, torch.device("cpu"), place_on="cpu")
done.set()
watcher.join()
for key, value in status().items():
    peak[key] = max(peak[key], value)
print(json.dumps({"anon": peak["RssAnon"] - before["RssAnon"], "file": peak["RssFile"] - before["RssFile"]}))
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


def measure(folder: Path, overrides: list[str]) -> dict:
    args = [f"model.name={folder}", "model.init=pretrained", "device=cpu", *overrides]
    done = subprocess.run([sys.executable, "-c", CHILD, "--", *args], capture_output=True, text=True, cwd=ROOT,
                          timeout=1800, env={"PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1",
                                             "TRANSFORMERS_VERBOSITY": "error", "HF_HUB_OFFLINE": "1",
                                             "PATH": "/usr/bin:/bin"})
    if done.returncode:
        sys.exit(f"{overrides}: exited {done.returncode}\n{done.stderr[-4000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def planned(folder: Path, overrides: list[str]) -> int:
    from memfit.config import load_config
    from memfit.memory.model_shape import model_shape
    from memfit.memory.single_device import load_bytes
    from memfit.models.loading import load_model_config

    cfg = load_config(None, [f"model.name={folder}", "model.init=pretrained", "device=cpu", *overrides])
    return load_bytes(model_shape(load_model_config(cfg.model)[0]), cfg, "cpu")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=20)
    parser.add_argument("--hidden", type=int, default=1408)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--files", type=int, default=4, help="safetensors files to cut the checkpoint into")
    parser.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES), metavar="CASE")
    parser.add_argument("--out", type=Path, help="write the markdown table here")
    parser.add_argument("--json", type=Path, help="write the rows here")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="memfit-load-ram-") as tmp:
        folder = Path(tmp) / "model"
        params = write_model(folder, args.layers, args.hidden, args.vocab, args.files)
        files = sorted(folder.glob("*.safetensors"))
        print(f"{params / 1e9:.3f} B parameters in {len(files)} files, largest "
              f"{max(f.stat().st_size for f in files) / MiB:.1f} MiB", flush=True)
        for name in args.cases:
            found = measure(folder, CASES[name])
            plan = planned(folder, CASES[name])
            rows.append({"case": name, "overrides": CASES[name], "params": params, "files": len(files),
                         "measured_bytes": found["anon"], "mapped_bytes": found["file"], "planned_bytes": plan})
            print(f"{name}: anonymous {found['anon'] / MiB:.1f} MiB (mapped {found['file'] / MiB:.1f} MiB), "
                  f"planned {plan / MiB:.1f} MiB", flush=True)
    table = ["| case | anonymous RSS growth while loading | planned load term | planned - measured | "
             "checkpoint pages mapped (reclaimable) |", "|---|---|---|---|---|"]
    for r in rows:
        gap = r["planned_bytes"] - r["measured_bytes"]
        table.append(f"| {r['case']} | {r['measured_bytes'] / MiB:,.1f} MiB | {r['planned_bytes'] / MiB:,.1f} MiB | "
                     f"{gap / MiB:+,.1f} MiB ({gap / max(r['measured_bytes'], r['planned_bytes'], 1):+.1%}) | "
                     f"{r['mapped_bytes'] / MiB:,.1f} MiB |")
    print("\n".join(table))
    if args.out:
        args.out.write_text("\n".join(table) + "\n")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
