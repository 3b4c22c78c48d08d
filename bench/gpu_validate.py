"""GPU validation: real training steps on a ~1B model vs the plan, on CUDA.

    python bench/gpu_validate.py docs/gpu_validation.md [--model meta-llama/Llama-3.2-1B] [--steps 3]
    python bench/gpu_validate.py docs/gpu_long_context.md --long-context [--model meta-llama/Llama-3.1-8B]
    python bench/gpu_validate.py /tmp/gpu_check.md --configs 1 --steps 1      # smallest run

For each configuration: build the model from its preset config (random init, no download), apply
memfit's strategies exactly as `memfit train` does, run a few optimizer steps on full-length random
batches, and compare torch.cuda.max_memory_allocated / max_memory_reserved with the analytic plan
(and the whole-GPU figure, total - free from cudaMemGetInfo, with the plan's nvidia-smi figure).
Each configuration is isolated by try/except (an OOM is recorded, not fatal). Writes a markdown
table with the date and the GPU's name to the given path. Without CUDA it says so and exits 0.

--long-context: the model (default Llama-3.1-8B, from its preset) is built once with QLoRA rank 32 and
every long-context saver (checkpointing full, activation offload, tiled MLP, chunked loss, pure bf16),
then trains one step at seq_len 8k, 16k, 32k, ... up to the model's window, stopping at the first OOM
or once a step takes longer than --max-seconds; each length's measured peaks stand beside the plan.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import sys
import time

import torch

CONFIGS = [  # RunConfig overrides; ~1B model, each well under a minute on a modern GPU
    "precision=bf16-mixed optim.name=adamw batch.micro_batch=4 data.seq_len=1024",
    "precision=bf16-mixed optim.name=adamw-8bit memory.checkpointing=full batch.micro_batch=8 data.seq_len=1024",
    "precision=bf16-pure optim.name=adamw batch.micro_batch=4 data.seq_len=2048",
    "precision=bf16-pure method=lora lora.rank=32 batch.micro_batch=4 data.seq_len=1024",
    "precision=bf16-mixed method=lora lora.targets=all-linear memory.checkpointing=full batch.micro_batch=8 "
    "data.seq_len=2048",
    "precision=bf16-mixed method=qlora lora.targets=all-linear batch.micro_batch=4 data.seq_len=1024",
    "precision=bf16-mixed memory.attention=eager optim.name=adamw-8bit batch.micro_batch=2 data.seq_len=1024",
    # terms that differ by device: dropout's 1 B CUDA mask, bitsandbytes' int8 kernel returning fp32
    "precision=bf16-pure method=qlora lora.rank=32 lora.dropout=0.05 batch.micro_batch=4 data.seq_len=1024",
    "precision=bf16-mixed method=lora quant.scheme=int8 lora.dropout=0.1 batch.micro_batch=4 data.seq_len=1024",
]


def run_one(overrides: list[str], steps: int) -> dict:
    from memfit.build import build_run
    from memfit.config import load_config
    from memfit.memory.analytic import analytic_estimate, device_total_bytes
    from memfit.memory.tracker import NullTracker
    from memfit.models.loading import load_model_config
    from memfit.step import step_strategies

    cfg = load_config(None, overrides + ["model.init=random", "device=cuda"])
    plan = analytic_estimate(cfg, load_model_config(cfg.model)[0], device="cuda")
    device = torch.device("cuda")
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    run = build_run(cfg, device, place_on=device)  # as the trainer builds a one-process run
    model, optimizer, precision, params = run.model, run.optimizer, run.precision, run.params
    strategies = step_strategies(cfg, device, optimizer, params)  # chunked loss, offload ... as train() runs them
    seconds, measured = _steps(cfg, run, precision, strategies, steps, NullTracker(), reset=False)  # load included
    del model, optimizer, params
    return dict(plan=plan, plan_device=device_total_bytes(plan), measured=measured, seconds=seconds)


def _steps(cfg, run, precision, strategies, steps: int, tracker, reset: bool = True) -> tuple[float, dict]:
    """`steps` optimizer steps on full-length random batches: seconds per step and the CUDA peaks
    (since the last reset; `reset`: from these steps on)."""
    from memfit.step import training_step

    device = torch.device("cuda")
    vocab = run.model.config.vocab_size
    if reset:
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(steps):
        ids = torch.randint(0, vocab, (cfg.batch.micro_batch, cfg.data.seq_len), device=device)
        batches = [dict(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids.clone())
                   for _ in range(cfg.batch.grad_accum)]
        training_step(run.model, run.optimizer, batches, precision, tracker, run.params, cfg.optim.max_grad_norm,
                      **strategies)
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    return (time.perf_counter() - started) / steps, dict(
        allocated=torch.cuda.max_memory_allocated(), reserved=torch.cuda.max_memory_reserved(),
        device_now=total - free, reserved_now=torch.cuda.memory_reserved())


LONG_CONTEXT = ("method=qlora lora.rank=32 precision=bf16-pure memory.checkpointing=full memory.activation_offload=true "
                "memory.tiled_mlp=true memory.chunked_loss=true batch.micro_batch=1")


def long_context_rows(model_name: str, max_seconds: float) -> list[str]:
    """One model, seq_len doubling from 8k: measured max_memory_reserved beside the plan at each length."""
    from memfit.build import build_run
    from memfit.config import load_config
    from memfit.memory.analytic import analytic_estimate
    from memfit.memory.tracker import NullTracker
    from memfit.models.loading import load_model_config
    from memfit.step import step_strategies

    gib, device = 2**30, torch.device("cuda")
    words = [f"model={model_name}", "model.init=random", "device=cuda", *LONG_CONTEXT.split()]
    cfg = load_config(None, words + ["data.seq_len=8192"])
    model_config = load_model_config(cfg.model)[0]
    run = build_run(cfg, device, place_on=device)
    strategies = step_strategies(cfg, device, run.optimizer, run.params)
    rows, length = [], 8192
    while length <= model_config.max_position_embeddings:
        at = load_config(None, words + [f"data.seq_len={length}"])
        plan = analytic_estimate(at, model_config, device="cuda")
        try:
            seconds, m = _steps(at, run, run.precision, strategies, 1, NullTracker())
        except torch.OutOfMemoryError as exc:
            rows.append(f"| {length:,} | {plan.peak_reserved_bytes / gib:.2f} | OOM | | | {str(exc).splitlines()[0][:80]} |")
            break
        error = (plan.peak_reserved_bytes - m["reserved"]) / m["reserved"]
        rows.append(f"| {length:,} | {plan.peak_reserved_bytes / gib:.2f} | {m['reserved'] / gib:.2f} | {error:+.1%} | "
                    f"{seconds:.1f} | {_rss_gib():.1f} / {plan.cpu_ram_bytes / gib:.1f} |")
        print(rows[-1], flush=True)
        if seconds > max_seconds:
            break
        length *= 2
        gc.collect()
        torch.cuda.empty_cache()
    return rows


def _rss_gib() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 2**30  # KiB on Linux


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("output", help="markdown file to write")
    parser.add_argument("--model", default="meta-llama/Llama-3.2-1B")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--configs", type=int, default=len(CONFIGS), help="run only the first N configurations")
    parser.add_argument("--long-context", action="store_true", help="the long-context case (see the docstring)")
    parser.add_argument("--max-seconds", type=float, default=90.0, help="--long-context: stop after a step this long")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench/gpu_validate.py needs CUDA: torch sees no GPU here; nothing measured, nothing written (exit 0)")
        return 0
    gib = 2**30
    name = torch.cuda.get_device_name()
    if args.long_context:
        model = "meta-llama/Llama-3.1-8B" if args.model == parser.get_default("model") else args.model
        rows = long_context_rows(model, args.max_seconds)
        with open(args.output, "w") as out:
            out.write("\n".join([
                f"# GPU long context: plan vs measured ({model}, random init, `{LONG_CONTEXT}`)", "",
                f"Date: {datetime.date.today().isoformat()}. GPU: {name}. torch {torch.__version__}. Command: "
                f"`python bench/gpu_validate.py {' '.join(sys.argv[1:])}`. One step per length. GiB = 2^30 bytes.", "",
                "| seq_len | plan reserved GiB | max_memory_reserved GiB | error | s/step | peak RSS / planned CPU RAM GiB |",
                "|---|---|---|---|---|---|", *rows]) + "\n")
        print(f"wrote {args.output}")
        return 0
    rows = []
    for overrides in CONFIGS[:args.configs]:
        words = [f"model={args.model}", *overrides.split()]
        try:
            r = run_one(words, args.steps)
            p, m = r["plan"], r["measured"]
            err_a = (p.peak_allocated_bytes - m["allocated"]) / m["allocated"]
            err_r = (p.peak_reserved_bytes - m["reserved"]) / m["reserved"]
            context = m["device_now"] - m["reserved_now"]  # context + libraries outside the allocator
            rows.append(f"| `{overrides}` | {p.peak_allocated_bytes / gib:.2f} | {m['allocated'] / gib:.2f} | "
                        f"{err_a:+.1%} | {p.peak_reserved_bytes / gib:.2f} | {m['reserved'] / gib:.2f} | {err_r:+.1%} "
                        "| "
                        f"{context / gib:.2f} | {r['seconds']:.2f} | {_rss_gib():.2f} / {p.cpu_ram_bytes / gib:.2f} |")
        except torch.OutOfMemoryError as exc:
            rows.append(f"| `{overrides}` | | OOM | | | | | | | {str(exc).splitlines()[0][:80]}")
        except Exception as exc:  # noqa: BLE001 - one failing configuration must not end the validation
            rows.append(f"| `{overrides}` | error: {type(exc).__name__}: {str(exc).splitlines()[0][:100]} | | | | | | "
                        "| |")
        print(rows[-1], flush=True)
        gc.collect()
        torch.cuda.empty_cache()
    header = [f"# GPU validation: plan vs measured ({args.model}, random init)", "",
              f"Date: {datetime.date.today().isoformat()}. GPU: {name}. torch {torch.__version__}, CUDA "
              f"{torch.version.cuda}.",
              f"Command: `python bench/gpu_validate.py {' '.join(sys.argv[1:])}`. {args.steps} optimizer steps per "
              "row, "
              "full-length random batches. GiB = 2^30 bytes.", "",
              "| config | plan alloc GiB | max_memory_allocated GiB | error | plan reserved GiB | "
              "max_memory_reserved GiB | error | outside allocator GiB (context) | s/step | "
              "process peak RSS so far / planned CPU RAM GiB |",
              "|---|---|---|---|---|---|---|---|---|---|"]
    with open(args.output, "w") as out:
        out.write("\n".join(header + rows) + "\n")
    print(f"wrote {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
