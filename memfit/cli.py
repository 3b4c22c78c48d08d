"""memfit command line: plan, train, demo, presets (and the subcommands other modules add).

Each subcommand is a small function; errors the user can fix (MemfitError) print one clear
message and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings
from pathlib import Path
from typing import get_args

from memfit.errors import MemfitError


def _quiet_libraries() -> None:
    """Silence import-time noise from optional backends (torchao's missing CUDA kernels etc.)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*Enum subclass.*")
    for name in ("torchao", "torch.utils._pytree", "bitsandbytes"):
        logging.getLogger(name).setLevel(logging.ERROR)
    # transformers imports DeepSpeed (when installed) to save a model, and DeepSpeed then warns that it
    # found no GPU; it configures its "DeepSpeed" logger itself, but keeps a filter added beforehand.
    logging.getLogger("DeepSpeed").addFilter(_not_the_cpu_accelerator_warning)  # once: the same object


def _not_the_cpu_accelerator_warning(record: logging.LogRecord) -> bool:
    return "Setting accelerator to CPU" not in record.getMessage()


def _library_progress_bars(enabled: bool) -> None:
    """--no-progress also silences the bars transformers and huggingface_hub draw (loading and saving
    weights), so that the terminal shows only memfit's own lines."""
    if enabled:
        return
    # Imported here: huggingface_hub reads HF_HUB_DISABLE_TELEMETRY at import, so only after _quiet_libraries
    # has set it; and transformers takes 0.5-0.9 s to import, which `memfit --help` should not pay.
    from huggingface_hub.utils import disable_progress_bars
    from transformers.utils.logging import disable_progress_bar

    disable_progress_bar()
    disable_progress_bars()


def cmd_train(args) -> int:
    from memfit.config import load_config
    from memfit.train.loop import train
    from memfit.train.resolve import resolve_run

    _library_progress_bars(not args.no_progress)
    cfg = load_config(args.config, args.overrides)
    result = train(resolve_run(cfg), progress=not args.no_progress)
    if os.environ.get("RANK", "0") == "0":  # under torchrun only rank 0 prints
        _print_summary(result)
    from memfit.distributed.launch import exit_process

    exit_process(0)  # torchrun ranks end with os._exit after the teardown (distributed/launch.py); else no-op
    return 0


def _plan_options() -> dict:
    """`memfit plan` options: flag -> (the RunConfig path it sets, argparse settings). Choices come from
    the config's own types, so the CLI never keeps a copy of them."""
    from memfit.config import Attention, Method, Offload, Optimizer, Precision, Quant, Sharding
    from memfit.strategies.table import STEP_STRATEGIES

    def choices(kind):
        return dict(choices=list(get_args(kind)))

    switch = dict(action="store_const", const="true")
    return {
        "method": ("method", choices(Method)), "precision": ("precision", choices(Precision)),
        "optimizer": ("optim.name", choices(Optimizer)),
        "checkpointing": ("memory.checkpointing", dict(help="none, full or every-N")),
        "attention": ("memory.attention", choices(Attention)),
        "micro-batch": ("batch.micro_batch", dict(help="sequences per forward/backward (or auto)")),
        "seq-len": ("data.seq_len", dict(type=int)), "grad-accum": ("batch.grad_accum", dict(type=int)),
        "packing": ("data.packing", dict(choices=["true", "false"])),
        "lora-rank": ("lora.rank", dict(type=int)), "lora-alpha": ("lora.alpha", dict(type=float)),
        "lora-targets": ("lora.targets", dict(help="comma-separated module names, or all-linear")),
        "lora-dropout": ("lora.dropout", dict(type=float, help="dropout on each adapter's input (default 0)")),
        "quant": ("quant.scheme", choices(Quant)), "sharding": ("distributed.sharding", choices(Sharding)),
        "offload": ("distributed.offload", choices(Offload)),
        "tensor-parallel": ("distributed.tensor_parallel", dict(type=int, help="tensor-parallel degree K (alias --tp)")),
        "pipeline-parallel": ("distributed.pipeline_parallel", dict(type=int, help="pipeline stages S (alias --pp)")),
        "max-grad-norm": ("optim.max_grad_norm", dict(help="gradient clipping norm, or null")),
        **{strategy.name.replace("_", "-"): (strategy.path, dict(switch, help=strategy.description))
           for strategy in STEP_STRATEGIES},
    }


PLAN_OPTIONS = _plan_options()


def cmd_plan(args) -> int:
    from memfit.config import load_config
    from memfit.memory.fits import machine_ram_bytes, plans_for_this_machine
    from memfit.memory.plan_text import plan_text
    from memfit.memory.planner import check_config_path, parse_budget, plan, write_config
    from memfit.strategies.table import STEP_STRATEGIES
    from memfit.units import format_bytes

    # Sizes and output paths are checked first: a typo should not cost the planning work.
    budget = parse_budget(args.budget)
    margin = parse_budget(args.margin, "--margin", allow_zero=True)
    host_ram = None if args.host_ram == "unlimited" else parse_budget(args.host_ram, "--host-ram")
    if args.write_config:
        check_config_path(args.write_config)
    if args.chart:
        from memfit.memory.chart import check_chart_path

        check_chart_path(args.chart)
    overrides = [f"model={args.model}"]
    for path, _ in PLAN_OPTIONS.values():
        value = getattr(args, path.replace(".", "_"))
        if value is None:
            continue
        if path == "lora.targets" and value != "all-linear":
            value = "[" + value + "]"
        overrides.append(f"{path}={value}")
    overrides += list(args.set or [])
    for strategy in STEP_STRATEGIES:  # a switch brings the settings it needs, unless given
        if getattr(args, strategy.path.replace(".", "_")):
            overrides += [f"{path}={'null' if value is None else value}" for path, value in strategy.forces.items()
                          if not any(o.startswith(path + "=") for o in overrides)]
    cfg = load_config(args.config, overrides)
    device = args.device or ("cpu" if cfg.device == "cpu" else "cuda")
    if host_ram is None and args.host_ram is None and plans_for_this_machine(device, args.gpu, args.gpus):
        host_ram = machine_ram_bytes()
    result = plan(args.model, cfg, budget, gpus=args.gpus, engine=args.engine, device=device,
                  gpu=args.gpu, margin=margin, max_micro_batch=args.max_micro_batch, max_seq_len=args.max_seq_len,
                  host_ram=host_ram)
    # a plan is written only when it is one to run: the fitting recommendation, or without a budget the run
    # as described; when nothing fits nothing is written and the exit status says so
    unfit = budget is not None and result.recommendation is None
    if args.write_config and not unfit:
        write_config(result, args.write_config)
    if args.chart:
        from memfit.memory.chart import plan_chart

        plan_chart(result, args.chart)
    if args.json:
        print(json.dumps(result.to_dict(), indent=2))
    else:
        print(plan_text(result))
        if args.write_config and not unfit:
            print(f"wrote {args.write_config} (run it with: memfit train {args.write_config})")
        if args.chart:
            print(f"wrote {args.chart}")
    if args.write_config and unfit:
        print(f"error: nothing fits {format_bytes(budget)} per GPU, so {args.write_config} was not written; the "
              "closest plan of each family is listed above", file=sys.stderr)
        return 1
    return 0


def cmd_demo(args) -> int:
    from memfit.config import load_config
    from memfit.train.loop import train
    from memfit.train.resolve import resolve_run

    _library_progress_bars(not args.no_progress)
    overrides = ["output_dir=runs/demo", "overwrite=true", *args.overrides]
    cfg = load_config(_shipped_config("demo.yaml"), overrides)
    print(f"memfit demo: fine-tuning {cfg.model.name} on {cfg.data.path} for {cfg.max_steps} steps "
          f"({cfg.precision}, optimizer {cfg.optim.name}, checkpointing {cfg.memory.checkpointing})")
    result = train(resolve_run(cfg), progress=not args.no_progress)
    _print_summary(result)
    return 0


def cmd_data_prepare(args) -> int:
    from memfit.config import load_config
    from memfit.data.prepare import prepare_dataset
    from memfit.models.loading import load_tokenizer

    cfg = load_config(args.config, args.overrides)
    out = args.out or cfg.data.prepared_dir
    if not out:
        raise MemfitError("memfit data prepare: set data.prepared_dir in the config (or pass --out DIR)")
    _check_out_folder(out, "--out" if args.out else "data.prepared_dir")
    report = prepare_dataset(cfg, load_tokenizer(cfg.model), out, overwrite=args.overwrite, progress=not args.no_progress)
    print(report.to_text())
    return 0


BENCH_MODEL = "memfit/tiny-llama"


def cmd_bench(args) -> int:
    from memfit.benchmark import VARIANTS, run_bench, save_results, to_table

    if args.list:
        print("\n".join(f"{name:<28}{overrides}" for name, overrides in VARIANTS.items()))
        return 0
    if "=" in args.model and not os.path.exists(args.model):  # `memfit bench key=value`: an override, no model
        args.overrides, args.model = [args.model, *args.overrides], BENCH_MODEL
    _check_out_folder(args.out, "--out")  # before the variants run, not after
    rows = run_bench(args.model, args.steps, args.seq_len, args.micro_batch, args.variants, args.overrides)
    title = (f"memfit bench {args.model}: {args.steps} steps, micro_batch {args.micro_batch} x seq_len {args.seq_len}"
             + (f", {' '.join(args.overrides)}" if args.overrides else ""))
    print(title)
    print(to_table(rows))
    text, data, chart = save_results(rows, args.out, title)
    print(f"results in {text}, {data}, chart {chart}")
    return 0


def _check_out_folder(folder: str, option: str) -> None:
    """A folder memfit will create (or write into) must not be a file, nor lie under one or in a read-only place."""
    path = Path(folder)
    existing = next(p for p in (path, *path.parents) if p.exists())  # the part that is there already
    if not existing.is_dir():
        where = "is a file" if existing == path else f"is under {existing}, which is a file"
        raise MemfitError(f"{option} {folder}: {where}; give a folder")
    if not os.access(existing, os.W_OK):
        raise MemfitError(f"{option} {folder}: cannot write into {existing} (permission denied); give another folder")


def cmd_merge(args) -> int:
    from memfit.models.merge import merge_run

    output = merge_run(args.run_dir, args.output, overwrite=args.overwrite)
    print(f"merged model (base + adapters, safetensors) written to {output}/")
    return 0


def cmd_generate(args) -> int:
    from memfit.generate import generate

    print(generate(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.seed, args.input))
    return 0


def cmd_report(args) -> int:
    from memfit.memory.timeline import read_timeline, timeline_chart

    if args.chart:  # checked before anything is read or printed
        from memfit.memory.chart import check_chart_path

        check_chart_path(args.chart)
    run, text = Path(args.run_dir), Path(args.run_dir) / "memory_report.txt"
    if not run.is_dir():
        raise MemfitError(f"{run}: {'is a file' if run.exists() else 'does not exist'}; give the output_dir of a "
                          "finished memfit train run")
    if not text.is_file():
        raise MemfitError(f"{text} not found: is {args.run_dir} the output_dir of a finished memfit train run?")
    timeline = read_timeline(run) if args.chart else None
    print(text.read_text().rstrip())
    if args.chart:
        timeline_chart(timeline, Path(args.chart), f"memory timeline of {args.run_dir} (the step with the highest "
                                                   "peak)", option="--chart")
        print(f"wrote {args.chart}")
    return 0


def cmd_presets(args) -> int:
    from memfit.models.presets import list_presets

    print("\n".join(list_presets()))
    return 0


def _shipped_config(name: str) -> str:
    return str(Path(__file__).with_name("configs") / name)


def _print_summary(result) -> None:
    print()
    print(result.report.to_text())
    print(f"loss: {result.losses[0]:.3f} at step 1 -> {result.losses[-1]:.3f} at step {len(result.losses)} "
          f"(mean of last 10 steps: {sum(result.losses[-10:]) / len(result.losses[-10:]):.3f})")
    for line in result.data_notes.lines() if result.data_notes is not None else []:  # truncated, dropped, shrunk
        print(line)
    if result.eval_losses:
        best = min(result.eval_losses, key=result.eval_losses.get)
        print("eval loss by step: " + ", ".join(f"{step} {loss:.3f}" for step, loss in result.eval_losses.items())
              + f" (lowest at step {best})")
    written = sorted(p.name + ("/" if p.is_dir() else "") for p in Path(result.output_dir).iterdir())
    print(f"outputs in {result.output_dir}/: {', '.join(written)}")


def build_parser() -> argparse.ArgumentParser:
    from memfit.memory.gpus import GPUS

    parser = argparse.ArgumentParser(prog="memfit", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="show debug logging and full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="fine-tune a model as a YAML config describes")
    train.add_argument("config", help="RunConfig YAML file")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. batch.micro_batch=2 lora.rank=16")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=cmd_train)

    demo = sub.add_parser("demo", help="fine-tune the built-in tiny model on the shipped dataset (no downloads)")
    demo.add_argument("overrides", nargs="*", help="dotted overrides, e.g. max_steps=50")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=cmd_demo)

    bench = sub.add_parser("bench", help="measure peak memory and step time of each strategy on this machine")
    bench.add_argument("model", nargs="?", default=BENCH_MODEL, help="model name, preset or local folder")
    bench.add_argument("overrides", nargs="*", help="dotted overrides for every variant, e.g. data.path=my.jsonl")
    bench.add_argument("--steps", type=int, default=4, help="optimizer steps per variant (default 4)")
    bench.add_argument("--seq-len", type=int, default=256, help="tokens per sequence (default 256)")
    bench.add_argument("--micro-batch", type=int, default=4, help="sequences per step (default 4)")
    bench.add_argument("--variants", nargs="+", help="only these variants (see --list); baseline always runs")
    bench.add_argument("--list", action="store_true", help="list the variants and exit")
    bench.add_argument("--out", default="runs/bench", help="folder for bench.txt, bench.json, bench.png")
    bench.set_defaults(func=cmd_bench)

    merge = sub.add_parser("merge", help="merge a LoRA/QLoRA run's adapters into its base: a full safetensors model")
    merge.add_argument("run_dir", help="output_dir of a method: lora or qlora run")
    merge.add_argument("--output", help="folder for the merged model (default: RUN_DIR/merged)")
    merge.add_argument("--overwrite", action="store_true", help="replace a model already in the output folder")
    merge.set_defaults(func=cmd_merge)

    gen = sub.add_parser("generate", help="complete a prompt with a trained run's model (base + adapter for LoRA)")
    gen.add_argument("run_dir", help="a finished run's output_dir")
    gen.add_argument("prompt", help="rendered like the run's training data (alpaca/chat template, or as is)")
    gen.add_argument("--input", default="", help="an alpaca record's input field (the prompt is its instruction)")
    gen.add_argument("--max-new-tokens", type=int, default=64, help="tokens to generate at most (default 64)")
    gen.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default); above 0 samples")
    gen.add_argument("--seed", type=int, default=0, help="the sampling seed (default 0)")
    gen.set_defaults(func=cmd_generate)

    report = sub.add_parser("report", help="a finished run's memory report; --chart draws its memory timeline")
    report.add_argument("run_dir", help="a finished run's output_dir")
    report.add_argument("--chart", metavar="FILE.png", help="stacked memory by category across the peak step, "
                                                            "with the estimated phase peaks dashed")
    report.set_defaults(func=cmd_report)

    plan_cmd = sub.add_parser("plan", help="predict a run's peak GPU/CPU memory; with --budget, pick the fastest setup "
                                           "that fits")
    plan_cmd.add_argument("model", help="preset name (`memfit presets`), local folder with config.json, or hub id")
    for flag, (path, kwargs) in PLAN_OPTIONS.items():
        aliases = {"tensor-parallel": ["--tp"], "pipeline-parallel": ["--pp"]}.get(flag, [])
        plan_cmd.add_argument("--" + flag, *aliases, dest=path.replace(".", "_"), **kwargs)
    plan_cmd.add_argument("--config", help="start from this RunConfig YAML (options override it)")
    plan_cmd.add_argument("--set", action="append", metavar="KEY=VALUE", help="any other RunConfig key (repeatable)")
    plan_cmd.add_argument("--budget", help="GPU memory per device, e.g. 24GiB or 80GB: search for the fastest plan "
                                           "that fits")
    plan_cmd.add_argument("--gpus", type=int, default=1, help="GPUs (per-device budget; sharding needs 2+)")
    plan_cmd.add_argument("--gpu", help="the card step times are predicted for: "
                                        f"{', '.join(gpu.name for gpu in GPUS.values())} "
                                        "(default: the one closest to --budget)")
    plan_cmd.add_argument("--margin", help="memory kept free under the budget (default 5%% of it, at least 1 GiB "
                                           "on cards of 10 GiB or more)")
    plan_cmd.add_argument("--host-ram", help="host RAM a plan may use per node (offloaded states and activations, "
                                             "loading), e.g. 128GiB, or unlimited (default: this machine's RAM "
                                             "when the plan is for this machine -- --device cpu, or its CUDA GPUs "
                                             "-- else unlimited, each plan stating what it needs)")
    plan_cmd.add_argument("--max-seq-len", action="store_true",
                          help="also find the longest seq_len that fits, for the chosen plan and each family")
    plan_cmd.add_argument("--max-micro-batch", action="store_true",
                          help="also find the largest micro_batch that fits, for the chosen plan and each family")
    plan_cmd.add_argument("--device", choices=["cuda", "cpu"], help="device the run is planned for (default cuda)")
    plan_cmd.add_argument("--engine", choices=["analytic", "traced"], default="analytic",
                          help="analytic formulas (instant) or a traced run of the real step on fake tensors")
    plan_cmd.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    plan_cmd.add_argument("--write-config", metavar="FILE", help="write the recommendation as a RunConfig YAML")
    plan_cmd.add_argument("--chart", metavar="FILE.png", help="stacked bars of the fastest plans against the budget")
    plan_cmd.set_defaults(func=cmd_plan)

    presets = sub.add_parser("presets", help="list the model presets usable offline")
    presets.set_defaults(func=cmd_presets)

    data = sub.add_parser("data", help="dataset tools").add_subparsers(dest="data_command", required=True)
    prepare = data.add_parser("prepare", help="tokenize data.path with data.num_workers processes into "
                                              "memory-mapped Arrow at data.prepared_dir (memfit train reuses it)")
    prepare.add_argument("config", help="RunConfig YAML file")
    prepare.add_argument("overrides", nargs="*", help="dotted overrides, e.g. data.num_workers=4 data.packing=true")
    prepare.add_argument("--out", help="output folder (default: data.prepared_dir)")
    prepare.add_argument("--overwrite", action="store_true", help="replace an existing prepared folder")
    prepare.add_argument("--no-progress", action="store_true", help="no progress bar")
    prepare.set_defaults(func=cmd_data_prepare)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    parser = build_parser()
    # Overrides (key=value) may come after flags too: collect any stragglers argparse left over.
    args, extra = parser.parse_known_args(argv)
    stray = [item for item in extra if "=" not in item or item.startswith("-")]
    if stray or (extra and not hasattr(args, "overrides")):
        parser.error(f"unrecognized arguments: {' '.join(stray or extra)}")
    if extra:
        args.overrides = [*args.overrides, *extra]
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: "
                                                                                      "%(message)s")
    _quiet_libraries()
    try:
        return args.func(args)
    except MemfitError as exc:
        if args.verbose:
            raise
        # A requested stop (SIGTERM/SIGINT, checkpoint saved) is not an error and exits 128 + signal; a run
        # that has nothing left to do exits 0.
        status = getattr(exc, "exit_status", 2)
        kind = "error: " if status == 2 else "stopped: " if status else ""
        print(f"memfit: {kind}{exc}", file=sys.stderr)
        return status


if __name__ == "__main__":
    sys.exit(main())
