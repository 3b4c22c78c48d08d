"""memfit vs Hugging Face Trainer (+ PEFT) and TRL's SFTTrainer: same model, data, sequence length, batch, strategies.

One run on this machine; every (tool, strategy) cell runs in its own fresh Python process so
that its peak RSS (ru_maxrss: the process's resident high-water mark, libraries included) is
its own. All three build the same Llama config with the same seed (random init), train on
memfit's shipped Alpaca-format demo data tokenized once by memfit's byte-level tokenizer and
padded by memfit's collate, in memfit's batch order (so all see identical batches and labels),
fp32, AdamW, lr 3e-4, clip 1.0.

TRL's SFTTrainer gets that same pre-tokenized data (as a `datasets.Dataset`, which it requires) with
dataset preparation skipped, memfit's collate as its collator, no packing, no padding-free, and
loss_type "nll" (plain cross-entropy, as HF and memfit compute it). TRL's default loss_type,
"chunked_nll", is a memory strategy of its own (memfit's counterpart is `chunked_loss`); run it
with `--trl-loss chunked_nll`. What cannot be made identical: SFTTrainer computes token entropy and
accuracy over the full logits after every step's forward (for its logs; with loss_type "nll" no option
turns that off).

Speed: tokens (padding excluded) / wall time, over steps 2..N (step 1 pays one-off costs).
memfit's speed/RSS run has its tracker off (the tracker is a dispatch mode that costs time);
a second, 2-step memfit run with the tracker on gives the tracked peak.

    .venv/bin/python bench/vs_hf.py                 # all strategies, 8 steps each
    .venv/bin/python bench/vs_hf.py --steps 4 --strategies full lora
    .venv/bin/python bench/vs_hf.py --steps 2 --strategies full    # smallest run
    BENCH_THREADS=1 .venv/bin/python bench/vs_hf.py --repeats 3   # on a shared machine (docs/vs_hf.md)

BENCH_THREADS (default 2) sets torch's intra-op threads. When other processes load the cores, two
threads that wait on each other at every op stall whenever either is descheduled: the same cell then
varies several-fold from run to run, where one thread stays steady.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
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
    from memfit.train.resolve import resolve_run

    checkpointing, lora = STRATEGIES[strategy]
    with tempfile.TemporaryDirectory() as out:
        cfg = build_config({
            "model": {"name": model_dir, "init": "random"},  # config-only folder: the same random init as HF's
            "data": {"path": "builtin:demo", "format": "alpaca", "seq_len": SEQ_LEN}, "output_dir": out,
            "method": "lora" if lora else "full", "lora": LORA,
            "memory": {"checkpointing": "full" if checkpointing else "none"}, "precision": "fp32",
            "optim": {"name": "adamw", "lr": LR, "warmup_steps": 0}, "batch": {"micro_batch": MICRO_BATCH},
            "max_steps": steps, "logging": {"every": 1, "track_memory": track}, "checkpoints": {"every": 0},
            "seed": SEED, "device": "cpu"})
        result = train(resolve_run(cfg), progress=False)
        lines = [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]
    return {"tokens_per_s": rate([l["tokens"] for l in lines], [l["step_time_s"] for l in lines]),
            "tracker_peak_bytes": result.report.measured_peak_bytes if track else None,
            "step_tokens": [l["tokens"] for l in lines], "mean_loss": statistics.fmean(result.losses)}


def run_trainer(tool: str, model_dir: str, strategy: str, steps: int, trl_loss: str) -> dict:
    """One run of HF `Trainer` (tool "hf") or TRL's `SFTTrainer` (tool "trl") on the shared setup."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, Trainer, TrainerCallback, TrainingArguments

    from memfit.config import DataConfig
    from memfit.data.loader import BatchStream, collate, load_examples
    from memfit.models.tokenizer import byte_tokenizer

    checkpointing, lora = STRATEGIES[strategy]
    tokenizer = byte_tokenizer()
    examples = load_examples(DataConfig(path="builtin:demo", format="alpaca"), tokenizer, SEQ_LEN)
    # memfit's first-epoch order (its seeded permutation), read sequentially below: all three tools then train on
    # the same batches, so the same padding and tokens per step (main() checks the per-step token counts agree).
    order = BatchStream(examples, MICRO_BATCH, tokenizer.pad_token_id, SEED)._order()
    examples = [examples[i] for i in order]
    torch.manual_seed(SEED)
    config = AutoConfig.from_pretrained(model_dir)
    config._attn_implementation = "sdpa"
    model = AutoModelForCausalLM.from_config(config)
    lora_config = None
    if lora:
        import peft

        lora_config = peft.LoraConfig(r=LORA["rank"], lora_alpha=LORA["alpha"], target_modules=LORA["targets"],
                                      task_type="CAUSAL_LM")
        if tool == "hf":  # SFTTrainer wraps the model itself from `peft_config` (its documented way)
            model = peft.get_peft_model(model, lora_config)
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
        common = dict(
            output_dir=out, per_device_train_batch_size=MICRO_BATCH, gradient_accumulation_steps=1, max_steps=steps,
            learning_rate=LR, warmup_steps=0, lr_scheduler_type="cosine", max_grad_norm=1.0, optim="adamw_torch",
            gradient_checkpointing=checkpointing, gradient_checkpointing_kwargs={"use_reentrant": False},
            use_cpu=True, report_to=[], save_strategy="no", logging_steps=10_000, disable_tqdm=True,
            remove_unused_columns=False, dataloader_num_workers=0, train_sampling_strategy="sequential", seed=SEED)
        if tool == "hf":
            trainer = Trainer(model=model, args=TrainingArguments(**common), train_dataset=examples,
                              data_collator=collator, callbacks=[timer])
        else:
            from datasets import Dataset
            from trl import SFTConfig, SFTTrainer

            # SFTConfig defaults differ from TrainingArguments (bf16 on, checkpointing on, chunked loss):
            # every one that matters is set here so TRL trains the same way on the same tokens.
            args = SFTConfig(**common, bf16=False, fp16=False, loss_type=trl_loss, packing=False, padding_free=False,
                             max_length=SEQ_LEN, shuffle_dataset=False, use_liger_kernel=False,
                             activation_offloading=False, dataset_kwargs={"skip_prepare_dataset": True})
            trainer = SFTTrainer(model=model, args=args, train_dataset=Dataset.from_list(examples),
                                 data_collator=collator, processing_class=tokenizer, peft_config=lora_config,
                                 callbacks=[timer])
        # The step-begin callback fires after the batch is fetched and collated, so `tokens` may hold one more
        # batch, and the timed span leaves out that collate (memfit's includes its own: a 4-example collate).
        metrics = trainer.train().metrics
    return {"tokens_per_s": rate(tokens[:len(timer.seconds)], timer.seconds), "tracker_peak_bytes": None,
            "step_tokens": tokens[:len(timer.seconds)], "mean_loss": metrics["train_loss"]}


def worker(tool: str, strategy: str, steps: int, model_dir: str, trl_loss: str) -> None:
    import logging
    import warnings

    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    import torch

    torch.set_num_threads(int(os.environ.get("BENCH_THREADS", "2")))
    if tool in ("hf", "trl"):
        result = run_trainer(tool, model_dir, strategy, steps, trl_loss)
    else:
        result = run_memfit(model_dir, strategy, steps, track=tool == "memfit-tracked")
    result["peak_rss_bytes"] = peak_rss_bytes()
    print("RESULT " + json.dumps(result), flush=True)


def cell(tool: str, strategy: str, steps: int, model_dir: str, trl_loss: str) -> dict:
    command = [sys.executable, __file__, "--worker", tool, strategy, "--steps", str(steps), "--model-dir", model_dir,
               "--trl-loss", trl_loss]
    done = subprocess.run(command, capture_output=True, text=True)
    for line in done.stdout.splitlines():
        if line.startswith("RESULT "):
            return json.loads(line[len("RESULT "):])
    raise RuntimeError(f"{tool} {strategy} failed:\n{done.stderr[-3000:]}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--strategies", nargs="+", default=list(STRATEGIES), choices=list(STRATEGIES))
    parser.add_argument("--trl-loss", default="nll", choices=["nll", "chunked_nll"],
                        help="SFTTrainer's loss_type: nll = the same loss as HF and memfit (default); chunked_nll = "
                             "TRL's own default, a chunked-loss memory strategy")
    parser.add_argument("--repeats", type=int, default=1,
                        help="run each tool's cell this many times, round-robin, and report the medians")
    parser.add_argument("--worker", nargs=2, metavar=("TOOL", "STRATEGY"), help=argparse.SUPPRESS)
    parser.add_argument("--model-dir", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.steps < 2:
        parser.error("--steps: at least 2 (speed is measured over steps 2..N)")
    if args.worker:
        worker(*args.worker, args.steps, args.model_dir, args.trl_loss)
        return

    from memfit.units import format_bytes

    def load() -> str:  # other processes on the machine slow every cell; print it so readers can judge the noise
        return "/".join(f"{x:.1f}" for x in os.getloadavg())

    with tempfile.TemporaryDirectory() as model_dir:
        (Path(model_dir) / "config.json").write_text(json.dumps(MODEL))
        print(f"memfit vs HF Trainer+PEFT vs TRL SFTTrainer (loss_type {args.trl_loss}): Llama 10.6M params "
              f"(hidden 384, 6 layers, vocab 259), fp32, AdamW, micro_batch {MICRO_BATCH} x seq_len {SEQ_LEN}, "
              f"{args.steps} steps, CPU ({os.environ.get('BENCH_THREADS', '2')} threads); RSS in MiB = 2^20 bytes; "
              f"median of {args.repeats} fresh process(es) per tool and strategy; "
              f"load average (1/5/15 min) at start {load()}")
        header = (f"{'strategy':<11}{'HF RSS':>12}{'TRL RSS':>12}{'memfit RSS':>12}{'mf/HF':>7}{'mf/TRL':>8}"
                  f"{'mf tracker':>12}{'HF tok/s':>10}{'TRL tok/s':>10}{'mf tok/s':>10}{'mf/HF':>7}{'mf/TRL':>8}"
                  f"{'load after':>16}")
        print(header)
        print("-" * len(header))
        checks: list[str] = []
        for strategy in args.strategies:
            runs: dict[str, list[dict]] = {"hf": [], "trl": [], "memfit": []}
            for _ in range(args.repeats):  # round-robin, so a swing in the machine's load hits every tool alike
                for tool, results in runs.items():
                    results.append(cell(tool, strategy, args.steps, model_dir, args.trl_loss))
            hf, trl, mf = ({key: statistics.median(r[key] for r in results)
                            for key in ("peak_rss_bytes", "tokens_per_s")} for results in runs.values())
            # A fair race needs the same work: the same batches (tokens per step). The losses are equal at step 1
            # (same init); after it memfit's cosine, which ends at 10 % of lr (Transformers': 0), moves its mean a bit.
            reference = runs["memfit"][0]["step_tokens"]
            same = all(r["step_tokens"] == reference for results in runs.values() for r in results)
            losses = "/".join(f"{statistics.fmean(r['mean_loss'] for r in results):.4f}" for results in runs.values())
            checks.append(f"{strategy}: same tokens per step in every run: {'yes' if same else 'NO'}; "
                          f"mean loss over the steps HF/TRL/memfit {losses}")
            tracked = cell("memfit-tracked", strategy, 2, model_dir, args.trl_loss)
            rss = [format_bytes(r["peak_rss_bytes"]) for r in (hf, trl, mf)]
            print(f"{strategy:<11}{rss[0]:>12}{rss[1]:>12}{rss[2]:>12}"
                  f"{mf['peak_rss_bytes'] / hf['peak_rss_bytes']:>6.2f}x"
                  f"{mf['peak_rss_bytes'] / trl['peak_rss_bytes']:>7.2f}x"
                  f"{format_bytes(tracked['tracker_peak_bytes']):>12}{hf['tokens_per_s']:>10,.0f}"
                  f"{trl['tokens_per_s']:>10,.0f}{mf['tokens_per_s']:>10,.0f}"
                  f"{mf['tokens_per_s'] / hf['tokens_per_s']:>6.2f}x{mf['tokens_per_s'] / trl['tokens_per_s']:>7.2f}x"
                  f"{load():>16}", flush=True)
        print("\n".join(checks))
        print("mf = memfit. RSS ratios = memfit / other (below 1: memfit uses less); speed ratios = memfit / other "
              "tokens/s (above 1: memfit is faster)")


if __name__ == "__main__":
    main()
