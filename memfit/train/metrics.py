"""Where a run's metrics go: metrics.jsonl always, plus TensorBoard, Weights & Biases or MLflow.

Every record is one JSON line in RUN_DIR/metrics.jsonl (the run's own history, read by resume and
the tests); each numeric field also becomes a scalar in every sink of `report_to`, named
`<prefix>/<field>` (train/loss, eval/loss, memory/activations_bytes, ...). Only the main process
writes. A sink's package is imported when the sink is chosen, and its absence is an error naming it.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

from memfit.errors import MemfitError, require


def default_sinks() -> list[str]:
    """TensorBoard when it is installed (it is in memfit's requirements), else none."""
    return ["tensorboard"] if importlib.util.find_spec("tensorboard") is not None else []


def scalars(record: dict, prefix: str) -> dict[str, float]:
    """The record's numbers as flat scalar names; per-category memory goes under memory/."""
    out = {}
    for key, value in record.items():
        if key == "step":
            continue
        if isinstance(value, dict):
            out.update({f"memory/{name}_bytes": float(v) for name, v in value.items() if _number(v)})
        elif _number(value):
            out[f"{prefix}/{key.removeprefix(prefix + '_')}"] = float(value)  # eval_loss -> eval/loss
    return out


def _number(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value  # not NaN


class _TensorBoard:
    def __init__(self, out: Path, config: dict):
        require("tensorboard", "report_to: tensorboard")
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(log_dir=str(out / "tensorboard"))
        self.writer.add_text("run_config", f"```\n{json.dumps(config, indent=2, default=str)}\n```")

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        self.writer.close()


class _Wandb:
    def __init__(self, out: Path, config: dict):
        self.wandb = require("wandb", "report_to: wandb")
        self.run = self.wandb.init(project=os.environ.get("WANDB_PROJECT", "memfit"), dir=str(out), config=config,
                                   name=out.name)

    def log(self, values: dict[str, float], step: int) -> None:
        self.run.log(values, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.run.finish()


class _MLflow:
    def __init__(self, out: Path, config: dict):
        self.mlflow = require("mlflow", "report_to: mlflow")
        self.mlflow.start_run(run_name=out.name)
        self.mlflow.log_params({k: str(v)[:250] for k, v in _flat(config).items()})  # MLflow's value limit

    def log(self, values: dict[str, float], step: int) -> None:
        self.mlflow.log_metrics({k.replace("/", "."): v for k, v in values.items()}, step=step)

    def flush(self) -> None:
        pass

    def close(self) -> None:
        self.mlflow.end_run()


def _flat(config: dict, prefix: str = "") -> dict:
    """A sectioned config as dotted names (optim.lr), the way the command line names them."""
    out = {}
    for key, value in config.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[prefix + key] = value
    return out


_MAKERS = {"tensorboard": _TensorBoard, "wandb": _Wandb, "mlflow": _MLflow}


class OutputWriteError(MemfitError):
    """A file of the run could not be written (disk full, file-size limit, permissions)."""


class MetricsLog:
    """Append-only metrics of one run. A context manager: sinks are flushed and closed on exit."""

    def __init__(self, out: Path, sinks: list[str] | None, config: dict, is_main: bool = True):
        """`sinks` None: the default ones (TensorBoard when it is installed)."""
        sinks = default_sinks() if sinks is None else sinks
        self.path = Path(out) / "metrics.jsonl"
        self.is_main = is_main
        try:
            self.file = open(self.path if is_main else os.devnull, "a")
        except OSError as exc:
            raise OutputWriteError(f"cannot open {self.path}: {exc.strerror or exc}") from None
        self.sinks = [_MAKERS[name](Path(out), config) for name in sinks] if is_main else []

    def write(self, record: dict, prefix: str = "train") -> None:
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
            values = scalars(record, prefix)
            for sink in self.sinks:
                sink.log(values, int(record["step"]))
                sink.flush()
        except OSError as exc:  # disk full, file-size limit: the caller keeps the work and stops
            raise OutputWriteError(f"writing the metrics of step {record['step']} to {self.path} failed: "
                                   f"{exc.strerror or exc}") from None

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:  # the write that failed already said why
            pass
        for sink in self.sinks:
            sink.close()

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
