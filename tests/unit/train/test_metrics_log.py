"""Metrics sinks: every record in metrics.jsonl, and its numbers as TensorBoard scalars."""

from __future__ import annotations

import importlib.util
import json

import pytest
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

from memfit.config import ConfigError, load_config
from memfit.train.metrics import MetricsLog, default_sinks, scalars

RECORD = {"step": 3, "loss": 2.5, "lr": 1e-3, "grad_norm": None, "skipped": False, "tokens_per_s": 812.5,
          "peak_bytes": 4096, "peak_by_category_bytes": {"weights": 1024, "activations": 2048}}


def test_numbers_become_named_scalars_and_the_rest_is_left_out():
    assert scalars(RECORD, "train") == {"train/loss": 2.5, "train/lr": 1e-3, "train/tokens_per_s": 812.5,
                                        "train/peak_bytes": 4096.0, "memory/weights_bytes": 1024.0,
                                        "memory/activations_bytes": 2048.0}


def test_tensorboard_holds_what_metrics_jsonl_holds(tmp_path):
    with MetricsLog(tmp_path, ["tensorboard"], {"lr": 1e-3}) as log:
        log.write(RECORD)
        log.write({**RECORD, "step": 4, "loss": 2.0})
        log.write({"step": 4, "eval_loss": 2.2, "eval_perplexity": 9.03}, prefix="eval")
    lines = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == [3, 4, 4]
    events = EventAccumulator(str(tmp_path / "tensorboard"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("train/loss")] == [(3, 2.5), (4, 2.0)]
    assert [(e.step, round(e.value, 2)) for e in events.Scalars("eval/perplexity")] == [(4, 9.03)]
    assert [e.value for e in events.Scalars("memory/activations_bytes")] == [2048.0, 2048.0]


def test_other_ranks_write_nothing(tmp_path):
    with MetricsLog(tmp_path, ["tensorboard"], {}, is_main=False) as log:
        log.write(RECORD)
    assert not (tmp_path / "metrics.jsonl").exists() and not (tmp_path / "tensorboard").exists()


def test_tensorboard_is_the_default_and_a_missing_sink_package_is_named_at_load(monkeypatch):
    assert default_sinks() == ["tensorboard"]  # it is in requirements.txt
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "wandb" else real_find_spec(name, *a))
    with pytest.raises(ConfigError, match=r"report_to: wandb needs the 'wandb' package: pip install wandb"):
        load_config(None, ["logging.report_to=[wandb]"])


def test_weights_and_biases_gets_the_same_scalars(tmp_path, monkeypatch):
    wandb = pytest.importorskip("wandb")
    monkeypatch.setenv("WANDB_MODE", "offline")  # no account, no network: the run is written under RUN_DIR/wandb
    monkeypatch.setenv("WANDB_SILENT", "true")
    logged, real_log = [], wandb.Run.log
    monkeypatch.setattr(wandb.Run, "log", lambda run, values, step: (logged.append((step, values)),
                                                                       real_log(run, values, step=step)))
    with MetricsLog(tmp_path, ["wandb"], {"lr": 1e-3}) as log:
        log.write(RECORD)
        log.write({**RECORD, "step": 4, "loss": 2.0})
        assert log.sinks[0].run.config["lr"] == 1e-3
    assert logged == [(3, scalars(RECORD, "train")), (4, {**scalars(RECORD, "train"), "train/loss": 2.0})]
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and next(runs[0].glob("run-*.wandb")).stat().st_size > 0  # `wandb sync` uploads it
    assert wandb.run is None  # finished on exit


def test_mlflow_gets_the_same_scalars(tmp_path, monkeypatch):
    mlflow = pytest.importorskip("mlflow")
    monkeypatch.setenv("MLFLOW_TRACKING_URI", (tmp_path / "mlruns").as_uri())  # a local file store
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    with MetricsLog(tmp_path, ["mlflow"], {"optim": {"lr": 1e-3}}) as log:
        log.write(RECORD)
        log.write({**RECORD, "step": 4, "loss": 2.0})
        run_id = mlflow.active_run().info.run_id
    client = mlflow.tracking.MlflowClient()
    assert [(m.step, m.value) for m in client.get_metric_history(run_id, "train.loss")] == [(3, 2.5), (4, 2.0)]
    assert client.get_run(run_id).data.params["optim.lr"] == "0.001"
    assert mlflow.active_run() is None
