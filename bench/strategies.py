"""Measure what each basic memory saver saves and costs, side by side in one run.

Configurations (same model, data, batch and sequence length):
  baseline (fp32 + AdamW), each strategy alone (bf16-mixed, gradient checkpointing, 8-bit AdamW),
  and the three together. Each runs `memfit train` for a few steps; peak memory is the tracker's
  (tensor bytes by category), step time the median of the steps after the first.
Runs are interleaved round-robin so machine noise hits every configuration alike.

    .venv/bin/python bench/strategies.py --rounds 2 --steps 4 --write docs/strategies.md
    .venv/bin/python bench/strategies.py --rounds 1 --steps 2 --micro-batch 1 --seq-len 32 --layers 1 --hidden 64 \
        --vocab 512                                  # smallest run (step 1 is not timed: 2 steps at least)
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from transformers import LlamaConfig

from memfit.config import load_config
from memfit.train.loop import train
from memfit.train.resolve import resolve_run
from memfit.units import format_bytes

CONFIGS = {
    "baseline fp32 + AdamW": [],
    "bf16-mixed": ["precision=bf16-mixed"],
    "checkpointing (every layer)": ["memory.checkpointing=full"],
    "8-bit AdamW (bitsandbytes)": ["optim.name=adamw-8bit"],
    "all three": ["precision=bf16-mixed", "memory.checkpointing=full", "optim.name=adamw-8bit"],
}


def write_model(folder: Path, layers: int, hidden: int, vocab: int) -> int:
    """A Llama config only (random init); the defaults make it ~58M parameters (8 layers, hidden 512, 32k vocab)."""
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=hidden * 11 // 4,
                         num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=hidden // 64,
                         max_position_embeddings=2048, tie_word_embeddings=False, bos_token_id=256, eos_token_id=257,
                         pad_token_id=258)
    config.save_pretrained(folder)
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        return sum(p.numel() for p in AutoModelForCausalLM.from_config(config).parameters())


def write_data(path: Path, rows: int = 64) -> None:
    """Plain-text records longer than seq_len, so every sequence is full length (no padding)."""
    words = "memory tensor gradient activation optimizer checkpoint precision budget".split()
    with path.open("w") as handle:
        for i in range(rows):
            handle.write(json.dumps({"text": " ".join(words[(i + j) % len(words)] for j in range(400))}) + "\n")


def run_once(name: str, overrides: list[str], model_dir: Path, data: Path, out: Path, args) -> dict:
    cfg = load_config(None, [f"model={model_dir}", "model.init=random", f"data.path={data}", "data.format=text",
                             f"output_dir={out}",
                             "overwrite=true", f"max_steps={args.steps}", f"batch.micro_batch={args.micro_batch}",
                             f"data.seq_len={args.seq_len}", "logging.every=1", "optim.warmup_steps=0", "device=cpu", *overrides])
    result = train(resolve_run(cfg), progress=False)
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return {"peak_bytes": result.report.measured_peak_bytes, "by_category": result.report.measured_by_category,
            "step_times": [r["step_time_s"] for r in rows if r["step"] > 1]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2, help="round-robin passes over all configurations")
    parser.add_argument("--steps", type=int, default=4, help="optimizer steps per run (the first is not timed)")
    parser.add_argument("--micro-batch", type=int, default=4)
    parser.add_argument("--seq-len", type=int, default=512)
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=512, help="a multiple of 64 (heads of 64)")
    parser.add_argument("--vocab", type=int, default=32000, help="at least 259 (memfit's byte-level tokenizer)")
    parser.add_argument("--write", type=Path, help="write the markdown results here (e.g. docs/strategies.md)")
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 (the first step is not timed)")

    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        params = write_model(tmp / "model", args.layers, args.hidden, args.vocab)
        write_data(tmp / "data.jsonl")
        results = {name: {"peak_bytes": [], "by_category": None, "step_times": []} for name in CONFIGS}
        for round_index in range(args.rounds):
            for name, overrides in CONFIGS.items():
                print(f"round {round_index + 1}/{args.rounds}: {name} ...", file=sys.stderr, flush=True)
                one = run_once(name, overrides, tmp / "model", tmp / "data.jsonl", tmp / "out", args)
                results[name]["peak_bytes"].append(one["peak_bytes"])
                results[name]["by_category"] = one["by_category"]
                results[name]["step_times"].extend(one["step_times"])

    base = results["baseline fp32 + AdamW"]
    base_peak = max(base["peak_bytes"])
    base_time = statistics.median(base["step_times"])
    lines = [
        f"| configuration | peak (tracker) | vs baseline | weights | gradients | optimizer states | activations "
        f"| temporaries | step time (median) | vs baseline |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, r in results.items():
        peak, step = max(r["peak_bytes"]), statistics.median(r["step_times"])
        c = r["by_category"]
        lines.append(f"| {name} | {format_bytes(peak)} | {peak / base_peak:.2f}x | {format_bytes(c['weights'])} "
                     f"| {format_bytes(c['gradients'])} | {format_bytes(c['optimizer_states'])} "
                     f"| {format_bytes(c['activations'])} | {format_bytes(c['temporaries'])} "
                     f"| {step:.2f} s | {step / base_time:.2f}x |")
    table = "\n".join(lines)
    header = (f"Measured {datetime.date.today()} on {platform.machine()} CPU ({torch.get_num_threads()} threads), "
              f"torch {torch.__version__}; model: Llama, {params / 1e6:.1f}M parameters ({args.layers} layers, hidden "
              f"{args.hidden}, vocab {args.vocab}), micro-batch "
              f"{args.micro_batch} x {args.seq_len} tokens, {args.rounds} interleaved rounds x {args.steps} steps.\n"
              f"Command: `.venv/bin/python bench/strategies.py --rounds {args.rounds} --steps {args.steps} "
              f"--micro-batch {args.micro_batch} --seq-len {args.seq_len}"
              + "".join(f" --{name} {getattr(args, name)}" for name in ("layers", "hidden", "vocab")
                        if getattr(args, name) != parser.get_default(name))
              + f"{' --write ' + str(args.write) if args.write else ''}`\n")
    print(header + "\n" + table)
    if args.write:
        text = args.write.read_text() if args.write.exists() else ""
        marker = "<!-- results -->"
        if marker in text:
            text = text.split(marker)[0] + marker + "\n" + header + "\n" + table + "\n"
        else:
            text += f"\n{marker}\n{header}\n{table}\n"
        args.write.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
