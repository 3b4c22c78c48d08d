"""memfit vs Hugging Face Trainer (+ PEFT): same model, data, sequence length, batch and strategies.

One run on this machine; every (tool, strategy) cell runs in its own fresh Python process so
that its peak RSS (ru_maxrss: the process's resident high-water mark, libraries included) is
its own. Both tools build the same Llama config with the same seed (random init), train on
memfit's shipped Alpaca-format demo data tokenized once by memfit's byte-level tokenizer and
padded by memfit's collate (so both see identical examples), fp32, AdamW, lr 3e-4, clip 1.0.

Speed: tokens (padding excluded) / wall time, over steps 2..N (step 1 pays one-off costs).
memfit's speed/RSS run has its tracker off (the tracker is a dispatch mode that costs time);
a second, 2-step memfit run with the tracker on gives the tracked peak.

    .venv/bin/python bench/vs_hf.py                 # all strategies, 8 steps each
    .venv/bin/python bench/vs_hf.py --steps 4 --strategies full lora

TRL's SFTTrainer is not compared: trl is not among this project's pinned dependencies.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout: memfit importable

MODEL = {  # a small Llama (10.6M parameters) with memfit's byte-level vocabulary
    "model_type": "llama", "architectures": ["LlamaForCausalLM"], "vocab_size": 259, "hidden_size": 384,
    "intermediate_size": 1024, "num_hidden_layers": 6, "num_attention_heads": 6, "num_key_value_heads": 6,
    "max_position_embeddings": 1024, "rms_norm_eps": 1e-5, "tie_word_embeddings": True,
    "bos_token_id": 256, "eos_token_id": 257, "pad_token_id": 258,
}
STRATEGIES = {  # name -> (checkpointing, lora)
    "full": (False, False),
    "full+ckpt": (True, False),
    "lora": (False, True),
    "lora+ckpt": (True, True),
}
LORA = dict(rank=8, alpha=16.0, targets=["q_proj", "v_proj"])
SEQ_LEN, MICRO_BATCH, LR, SEED = 256, 4, 3e-4, 0


def peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # KiB on Linux


def rate(tokens: list[int], seconds: list[float]) -> float:
    """tokens/s over steps 2..N."""
    return sum(tokens[1:]) / sum(seconds[1:])


def run_memfit(model_dir: str, strategy: str, steps: int, track: bool) -> dict:
    from memfit.config import build_config
    from memfit.train.loop import train

    checkpointing, lora = STRATEGIES[strategy]
    with tempfile.TemporaryDirectory() as out:
        cfg = build_config({
            "model": model_dir, "data": {"path": "builtin:demo", "format": "alpaca"}, "output_dir": out,
            "method": "lora" if lora else "full", "lora": LORA, "checkpointing": "full" if checkpointing else "none",
            "precision": "fp32", "optimizer": "adamw", "micro_batch": MICRO_BATCH, "seq_len": SEQ_LEN, "lr": LR,
            "warmup_steps": 0, "max_steps": steps, "log_every": 1, "save_every": 0, "seed": SEED,
            "track_memory": track, "device": "cpu"})
        result = train(cfg, progress=False)
        lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"tokens_per_s": rate([l["tokens"] for l in lines], [l["step_time_s"] for l in lines]),
            "tracker_peak_bytes": result.report.measured_peak_bytes if track else None,
            "final_loss": result.losses[-1]}


def run_hf(model_dir: str, strategy: str, steps: int) -> dict:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from memfit.config import DataConfig
    from memfit.data.loader import collate, load_examples
    from memfit.models.tokenizer import byte_tokenizer

    checkpointing, lora = STRATEGIES[strategy]
    tokenizer = byte_tokenizer()
    examples = load_examples(DataConfig(path="builtin:demo", format="alpaca"), tokenizer, SEQ_LEN)
    torch.manual_seed(SEED)
    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    if lora:
        import peft

        model = peft.get_peft_model(model, peft.LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"],
                                                           target_modules=LORA["targets"], task_type="CAUSAL_LM"))
    tokens: list[int] = []

    def collator(batch):
        out = collate(batch, tokenizer.pad_token_id)
        tokens.append(int(out["attention_mask"].sum()))
        return out

    class StepTimer(TrainerCallback):
        def __init__(self):
            self.seconds, self.started = [], None

        def on_step_begin(self, args, state, control, **kwargs):
            self.started = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):
            self.seconds.append(time.perf_counter() - self.started)

    timer = StepTimer()
    with tempfile.TemporaryDirectory() as out:
        args = TrainingArguments(
            output_dir=out, per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=1, max_steps=steps,
            learning_rate=LR, warmup_steps=0, lr_scheduler_type="cosine", max_grad_norm=1.0, optim="adamw_torch",
            gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
            use_cpu=True, report_to=[], save_strategy="no", logging_steps=10_000, disable_tqdm=True,
            remove_unused_columns=False, dataloader_num_workers=0, seed=SEED)
        trainer = Trainer(model=model, args=args, train_dataset=examples, data_collator=collator, callbacks=[timer])
        # The step-begin callback fires after the batch is fetched, so `tokens` may hold one more batch.
        metrics = trainer.train().metrics
    # Step time includes the timed step's own data work as memfit's does (its loop fetches inside the timer).
    return {"tokens_per_s": rate(tokens[:len(timer.seconds)], timer.seconds), "tracker_peak_bytes": None,
            "final_loss": metrics.get("train_loss")}


def worker(tool: str, strategy: str, steps: int, model_dir: str) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    if tool == "hf":
        result = run_hf(model_dir, strategy, steps)
    else:
        result = run_memfit(model_dir, strategy, steps, track=tool == "memfit-tracked")
    result["peak_rss_bytes"] = peak_rss_bytes()
    print("RESULT " + json.dumps(result), flush=True)


def cell(tool: str, strategy: str, steps: int, model_dir: str) -> dict:
    command = [sys.executable, __file__, "--worker", tool, strategy, "--steps", str(steps), "--model-dir", model_dir]
    done = subprocess.run(command, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{tool} {strategy} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--worker", nargs=2, metavar=("TOOL", "STRATEGY"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker, args.steps, args.model_dir)
        return

    from memfit.memory.report import format_bytes

    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(MODEL))
        print(f"memfit vs HF Trainer+PEFT: Llama 10.6M params (hidden 384, 6 layers, vocab 259), fp32, AdamW, "
              f"micro_batch {MICRO_BATCH} x seq_len {SEQ_LEN}, {args.steps} steps, CPU "
              f"({os.environ.get('BENCH_THREADS', '2')} threads); RSS in MiB = 2^20 bytes")
        header = (f"{'strategy':<11}{'HF RSS':>11}{'memfit RSS':>12}{'RSS ratio':>10}{'memfit tracker':>16}"
                  f"{'HF tok/s':>10}{'memfit tok/s':>14}{'speed ratio':>12}")
        print(header)
        print("-" * len(header))
        for strategy in args.strategies:
            hf = cell("hf", strategy, args.steps, model_dir)
            mf = cell("memfit", strategy, args.steps, model_dir)
            tracked = cell("memfit-tracked", strategy, 2, model_dir)
            print(f"{strategy:<11}{format_bytes(hf['peak_rss_bytes']):>11}{format_bytes(mf['peak_rss_bytes']):>12}"
                  f"{mf['peak_rss_bytes'] / hf['peak_rss_bytes']:>9.2f}x"
                  f"{format_bytes(tracked['tracker_peak_bytes']):>16}{hf['tokens_per_s']:>10,.0f}"
                  f"{mf['tokens_per_s']:>14,.0f}{mf['tokens_per_s'] / hf['tokens_per_s']:>11.2f}x", flush=True)
        print("RSS ratio = memfit / HF (below 1: memfit uses less); speed ratio = memfit / HF tokens/s "
              "(above 1: memfit is faster)")


if __name__ == "__main__":
    main()
