"""memfit command line: plan, train, demo, presets (and the subcommands other modules add).

Each subcommand is a small function; errors the user can fix (MemfitError) print one clear
message and exit with status 2, without a traceback.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings

from memfit.errors import MemfitError


def _quiet_libraries() -> None:
    """Silence import-time noise from optional backends (torchao's missing CUDA kernels etc.)."""
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_TELEMETRY", "1")
    warnings.filterwarnings("ignore", category=FutureWarning)
    warnings.filterwarnings("ignore", message=".*Enum subclass.*")
    for name in ("torchao", "torch.utils._pytree", "bitsandbytes"):
        logging.getLogger(name).setLevel(logging.ERROR)


def cmd_train(args) -> int:
    from memfit.config import load_config
    from memfit.train.loop import train

    cfg = load_config(args.config, args.overrides)
    result = train(cfg, progress=not args.no_progress)
    _print_summary(result)
    return 0


def cmd_demo(args) -> int:
    from memfit.config import load_config
    from memfit.train.loop import train

    overrides = ["output_dir=runs/demo", "overwrite=true", *args.overrides]
    cfg = load_config(_shipped_config("demo.yaml"), overrides)
    print(f"memfit demo: fine-tuning {cfg.model.name} on {cfg.data.path} for {cfg.max_steps} steps "
          f"({cfg.precision}, optimizer {cfg.optimizer}, checkpointing {cfg.checkpointing})")
    result = train(cfg, progress=not args.no_progress)
    _print_summary(result)
    return 0


def cmd_presets(args) -> int:
    from memfit.models.presets import list_presets

    print("\n".join(list_presets()))
    return 0


def _shipped_config(name: str) -> str:
    from pathlib import Path

    return str(Path(__file__).with_name("configs") / name)


def _print_summary(result) -> None:
    print()
    print(result.report.to_text())
    print(f"loss: {result.losses[0]:.3f} at step 1 -> {result.losses[-1]:.3f} at step {len(result.losses)} "
          f"(mean of last 10 steps: {sum(result.losses[-10:]) / len(result.losses[-10:]):.3f})")
    print(f"outputs in {result.output_dir}/: model.safetensors, run_config.yaml, metrics.jsonl, memory_report.txt/json")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="memfit", description=__doc__.splitlines()[0])
    parser.add_argument("-v", "--verbose", action="store_true", help="show debug logging and full tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="fine-tune a model as a YAML config describes")
    train.add_argument("config", help="RunConfig YAML file")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. micro_batch=2 lora.rank=16")
    train.add_argument("--no-progress", action="store_true", help="no progress bar")
    train.set_defaults(func=cmd_train)

    demo = sub.add_parser("demo", help="fine-tune the built-in tiny model on the shipped dataset (no downloads)")
    demo.add_argument("overrides", nargs="*", help="dotted overrides, e.g. max_steps=50")
    demo.add_argument("--no-progress", action="store_true", help="no progress bar")
    demo.set_defaults(func=cmd_demo)

    presets = sub.add_parser("presets", help="list the model presets usable offline")
    presets.set_defaults(func=cmd_presets)
    return parser


def main(argv: list[str] | None = None) -> int:
    _quiet_libraries()
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.DEBUG if args.verbose else logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    _quiet_libraries()
    try:
        return args.func(args)
    except MemfitError as exc:
        if args.verbose:
            raise
        print(f"memfit: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
