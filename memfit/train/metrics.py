"""Where a run's metrics go: metrics.jsonl always, plus TensorBoard, Weights & Biases or MLflow.

Every record is one JSON line in RUN_DIR/metrics.jsonl (the run's own history, read by resume and
the tests); each numeric field also becomes a scalar in every sink of `report_to`, named
`<prefix>/<field>` (train/loss, eval/loss, memory/activations_bytes, ...). Only the main process
writes. A sink's package is imported when the sink is chosen, and its absence is an error naming it.

A write that fails (disk full, file-size limit) is an OutputWriteError naming the file or sink, which
the loop turns into "stopped at step N, this was kept". TensorBoard writes from a thread of its own:
its failure reaches us as the thread's exception, re-raised by its next call, including `close`,
which must not then replace the error the run is already stopping with.
"""

from __future__ import annotations

import importlib.util
import json
import logging
import os
from pathlib import Path

from memfit.errors import MemfitError, require

log = logging.getLogger(__name__)


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
        from torch.utils.tensorboard import SummaryWriter  # imported here: it imports the optional tensorboard

        self.where = out / "tensorboard"
        self.writer = SummaryWriter(log_dir=str(self.where))
        self.writer.add_text("run_config", f"```\n{json.dumps(config, indent=2, default=str)}\n```")

    def log(self, values: dict[str, float], step: int) -> None:
        for name, value in values.items():
            self.writer.add_scalar(name, value, step)

    def flush(self) -> None:
        self.writer.flush()

    def close(self) -> None:
        writers = list((self.writer.all_writers or {}).values())
        try:
            self.writer.close()  # flushes first: after its thread failed, that raises the thread's error
        except OSError:
            for writer in writers:  # still close each file, which waits for the thread to end
                try:
                    writer.close()
                except OSError:
                    pass
            raise


class _Wandb:
    def __init__(self, out: Path, config: dict):
        self.wandb = require("wandb", "report_to: wandb")
        self.where = f"Weights & Biases ({out / 'wandb'})"
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
        self.where = "MLflow"
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
        self.sinks = []
        for name in sinks if is_main else []:
            try:
                self.sinks.append(_MAKERS[name](Path(out), config))
            except OSError as exc:
                self.close()
                raise OutputWriteError(f"report_to: {name}: cannot start writing in {out}: "
                                       f"{exc.strerror or exc}") from None

    def write(self, record: dict, prefix: str = "train") -> None:
        """Append `record`; an OutputWriteError names the file or sink that could not take it."""
        step = record["step"]
        try:
            self.file.write(json.dumps(record) + "\n")
            self.file.flush()
        except OSError as exc:  # disk full, file-size limit: the caller keeps the work and stops
            raise OutputWriteError(f"writing the metrics of step {step} to {self.path} failed: "
                                   f"{exc.strerror or exc}") from None
        values = scalars(record, prefix)
        for sink in self.sinks:
            try:
                sink.log(values, int(step))
                sink.flush()  # TensorBoard: waits for its thread, so that its failure is this step's
            except OSError as exc:
                raise OutputWriteError(f"writing the metrics of step {step} to {sink.where} failed: "
                                       f"{exc.strerror or exc}") from None

    def close(self) -> list[str]:
        """Close the file and every sink, even after one fails; what could not be closed."""
        failed = []
        for where, closing in [(self.path, self.file.close), *((sink.where, sink.close) for sink in self.sinks)]:
            try:
                closing()
            except OSError as exc:  # the last buffered lines could not be written
                failed.append(f"{where}: {exc.strerror or exc}")
        return failed

    def __enter__(self) -> "MetricsLog":
        return self

    def __exit__(self, exc_type, *exc) -> None:
        failed = self.close()
        # While an error is on its way out, that error says what went wrong; otherwise training
        # went well and its weights are still to be saved, so a lost last metrics line is a warning.
        if failed and exc_type is None:
            log.warning("the last metrics may be missing: closing %s failed", "; ".join(failed))
