"""Bad input gets one clear line (`memfit: error: ...`, exit status 2, no traceback) saying what and where,
and nothing already written is changed.

Each case is one row of the table in docs/reliability.md, and the test checks that the row shows exactly
the message the user sees (temporary paths written as <tmp>). After changing a message, regenerate the
rows with:   MEMFIT_UPDATE_DOCS=1 .venv/bin/python -m pytest tests/integration/test_bad_input.py
"""

from __future__ import annotations

import errno
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import pytest
import torch
import yaml

from memfit.cli import main
from memfit.config import load_config

DOC = Path(__file__).resolve().parents[2] / "docs" / "reliability.md"
BEGIN, END = "<!-- bad-input-table:begin -->", "<!-- bad-input-table:end -->"
UPDATE = os.environ.get("MEMFIT_UPDATE_DOCS") == "1"

BASE = {"model": {"name": "memfit/tiny-llama", "init": "random"},
        "data": {"path": "texts.jsonl", "format": "text", "seq_len": 32},
        "precision": "fp32", "optim": {"name": "adamw", "warmup_steps": 0}, "batch": {"micro_batch": 2},
        "max_steps": 2, "checkpoints": {"every": 1}, "logging": {"every": 1, "track_memory": False}, "device": "cpu"}


@dataclass
class Case:
    id: str
    what: str                                   # the bad input, as the doc's first column says it
    overrides: list[str] = field(default_factory=list)
    setup: Callable[[Path], list[str]] | None = None  # prepares files in tmp; may return more overrides
    mentions: tuple[str, ...] = ()              # the "what and where" the message must contain
    new_files_ok: bool = False                  # the run may add files (it failed while saving)
    env: dict[str, str] = field(default_factory=dict)  # environment variables set for the case


# ---------------------------------------------------------------- setups


def _model_dir(tmp: Path, name: str, config: dict | None = None, raw: str | None = None) -> list[str]:
    folder = tmp / name
    folder.mkdir()
    if raw is not None or config is not None:
        (folder / "config.json").write_text(raw if raw is not None else json.dumps(config))
    return [f"model={folder}", "model.init=pretrained"]


def _bert(tmp: Path) -> list[str]:
    from transformers import BertConfig

    BertConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2, intermediate_size=64).save_pretrained(tmp / "bert")
    return [f"model={tmp / 'bert'}", "model.init=pretrained"]


def _distilbert(tmp: Path) -> list[str]:
    from transformers import DistilBertConfig

    DistilBertConfig(dim=32, n_layers=1, n_heads=2, hidden_dim=64).save_pretrained(tmp / "distilbert")
    return [f"model={tmp / 'distilbert'}", "model.init=pretrained"]


def _pickled_weights(tmp: Path) -> list[str]:
    from transformers import LlamaConfig

    folder = tmp / "pickled"
    LlamaConfig(vocab_size=259, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                num_attention_heads=2).save_pretrained(folder)
    torch.save({"model.embed_tokens.weight": torch.zeros(1), "payload": Path}, folder / "pytorch_model.bin")
    return [f"model={folder}", "model.init=pretrained"]


TINY_LLAMA = {"model_type": "llama", "vocab_size": 259, "hidden_size": 32, "intermediate_size": 64,
              "num_hidden_layers": 1, "num_attention_heads": 2, "max_position_embeddings": 256}


def _saved_model(tmp: Path) -> Path:
    from transformers import LlamaConfig, LlamaForCausalLM

    folder = tmp / "mymodel"
    LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY_LLAMA.items() if k != "model_type"})).save_pretrained(folder)
    return folder


def _output_is_model(tmp: Path) -> list[str]:
    folder = _saved_model(tmp)
    return [f"model={folder}", "model.init=pretrained", f"output_dir={folder}"]


def _file(path: Path, *overrides: str) -> list[str]:
    path.write_text("a file")
    return list(overrides)


def _foreign_folder(tmp: Path, name: str) -> list[str]:
    (tmp / "run" / "checkpoints").mkdir(parents=True)
    (tmp / "run" / "checkpoints" / "epoch10.pt").write_bytes(b"someone's weights")
    (tmp / "run" / name).write_text("the user's own file")
    return []


def _data(tmp: Path, text: str, fmt: str = "text") -> list[str]:
    (tmp / "bad.jsonl").write_text(text)
    return [f"data.path={tmp / 'bad.jsonl'}", f"data.format={fmt}"]


def _cfg_file(tmp: Path, text: str) -> list[str]:
    (tmp / "config.yaml").write_text(text)
    return []


def _existing_run(tmp: Path, **changes) -> Path:
    """An output folder holding a finished-looking run of the same (or a changed) config."""
    run = tmp / "run"
    run.mkdir()
    (run / "run_config.yaml").write_text(load_config(tmp / "config.yaml", [f"output_dir={run}",
                                                                          *[f"{k}={v}" for k, v in changes.items()]]).to_yaml())
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 5.0}\n')
    (run / "checkpoints" / "step-00000001").mkdir(parents=True)
    (run / "checkpoints" / "step-00000001" / "model.safetensors").write_bytes(b"weights of another run")
    return run


def _with_run(tmp: Path, **changes) -> list[str]:
    _existing_run(tmp, **changes)
    return []


def _damaged_checkpoint(tmp: Path) -> list[str]:
    run = _existing_run(tmp)
    (run / "checkpoints" / "step-00000001" / "manifest.json").write_text(json.dumps(
        {"format": 1, "step": 1, "files": {"model.safetensors": {"bytes": 999, "sha256": "0" * 64}}}))
    return ["resume=true"]


CASES = [
    Case("unknown-field", "unknown config field `micro_bach=2`", ["micro_bach=2"], mentions=("micro_bach", "micro_batch")),
    Case("invalid-values", "two invalid values at once: `optim.lr=-1 precision=fp8`", ["optim.lr=-1", "precision=fp8"],
         mentions=("lr:", "precision:", "2 problem(s)")),
    Case("yaml-syntax", "config file that is not valid YAML", setup=lambda t: _cfg_file(t, "model: [unclosed\nlr: 1\n"),
         mentions=("config.yaml", "line")),
    Case("override-form", "command-line override without `=`", ["micro_batch"], mentions=("micro_batch", "key=value")),
    Case("model-missing", "model path that does not exist", ["model=/nonexistent/model"],
         mentions=("model.name", "/nonexistent/model", "does not exist")),
    Case("model-no-config", "model folder without config.json", setup=lambda t: _model_dir(t, "empty"),
         mentions=("empty", "config.json")),
    Case("model-unreadable", "model config.json that is not valid JSON",
         setup=lambda t: _model_dir(t, "garbage", raw="{not json"), mentions=("garbage/config.json", "could not be "
                                                                                                     "read")),
    Case("model-unknown-type", "model config.json with an unknown model_type",
         setup=lambda t: _model_dir(t, "unknown", {"model_type": "notamodel"}), mentions=("notamodel",)),
    Case("model-remote-code", "model that ships its own code, trust_remote_code not set",
         setup=lambda t: _model_dir(t, "remote", {"model_type": "foo", "auto_map": {
             "AutoConfig": "configuration_foo.FooConfig", "AutoModelForCausalLM": "modeling_foo.FooForCausalLM"}}),
         mentions=("remote", "trust_remote_code")),
    Case("model-encoder", "a saved BERT encoder config", setup=_bert, mentions=("bert", "not a causal language model")),
    Case("model-not-causal", "a saved DistilBERT config (no causal LM class at all)", setup=_distilbert,
         mentions=("distilbert", "not a causal language model")),
    Case("model-pickled-weights", "pytorch_model.bin holding pickled objects besides tensors", setup=_pickled_weights,
         mentions=("pickled", "safetensors")),
    Case("strategy-backend", "incompatible strategy mix: `optim.name=lion optim.backend=torchao`",
         ["optim.name=lion", "optim.backend=torchao"], mentions=("optim.backend", "lion")),
    Case("strategy-offload", "incompatible strategy mix: `distributed.offload=all` without sharding", ["distributed.offload=all"],
         mentions=("offload", "sharding")),
    Case("data-missing", "data path that does not exist", ["data.path=/nonexistent/data.jsonl"],
         mentions=("data.path", "/nonexistent/data.jsonl")),
    Case("data-invalid-json", "data file with a broken JSON line",
         setup=lambda t: _data(t, '{"text": "ok"}\n{"text": "fine"}\n{"text": "broken\n'), mentions=("bad.jsonl:3",)),
    Case("data-missing-field", "alpaca record without `output`",
         setup=lambda t: _data(t, '{"instruction": "a", "output": "b"}\n{"instruction": "c"}\n', "alpaca"),
         mentions=("bad.jsonl:2", "output")),
    Case("data-not-object", "data line that is a JSON list, not an object",
         setup=lambda t: _data(t, '{"text": "ok"}\n["text", "no"]\n'), mentions=("bad.jsonl:2", "object")),
    Case("output-holds-run", "output_dir that already holds another run",
         setup=lambda t: _with_run(t), mentions=("run", "resume=true", "overwrite=true")),
    Case("resume-and-overwrite", "`resume=true overwrite=true` together", ["resume=true", "overwrite=true"],
         setup=lambda t: _with_run(t), mentions=("resume", "overwrite")),
    Case("resume-other-run", "resume=true into a folder whose run used another lr", ["resume=true"],
         setup=lambda t: _with_run(t, lr=0.1), mentions=("run_config.yaml", "lr: 0.1")),
    Case("resume-damaged", "resume=true when every checkpoint is damaged", setup=_damaged_checkpoint,
         mentions=("step-00000001", "damaged")),
    Case("disk-full", "disk full while writing the checkpoint of step 2 (simulated ENOSPC)",
         mentions=("step-00000002", "No space left on device", "step-00000001 is intact"), new_files_ok=True),
    Case("metrics-write-fails", "disk full while writing metrics.jsonl at step 2 (simulated ENOSPC)",
         mentions=("metrics.jsonl", "No space left on device", "checkpoint of step 2 saved", "resume=true"),
         new_files_ok=True),
    Case("preset-without-weights", "one of memfit's own presets with `model.init=pretrained`",
         ["model.init=pretrained"], mentions=("memfit/tiny-llama", "no pretrained weights", "model.init=random")),
    Case("model-config-only", "model folder with a config.json and no weights",
         setup=lambda t: _model_dir(t, "shape", TINY_LLAMA), mentions=("shape", "no weights", "model.init=random")),
    Case("hub-offline", "a hub model (`model=gpt2`) with HF_HUB_OFFLINE=1 and an empty cache",
         ["model=gpt2", "model.init=pretrained"], env={"HF_HUB_OFFLINE": "1"},
         mentions=("gpt2", "HF_HUB_OFFLINE is set", "huggingface-cli download openai-community/gpt2")),
    Case("model-negative-size", "model config.json with a negative hidden_size",
         setup=lambda t: _model_dir(t, "negative", {**TINY_LLAMA, "hidden_size": -32}),
         mentions=("negative", "hidden_size must be a positive integer")),
    Case("seq-len-over-positions", "data.seq_len above the model's max_position_embeddings",
         setup=lambda t: _model_dir(t, "short", TINY_LLAMA) + ["model.init=random", "data.seq_len=512"],
         mentions=("data.seq_len", "512", "max_position_embeddings", "256")),
    Case("tensor-parallel-one-gpu", "`distributed.tensor_parallel=2` in a single process",
         ["distributed.tensor_parallel=2"], mentions=("tensor_parallel", "needs 2 GPUs")),
    Case("output-is-file", "output_dir that is an existing file",
         setup=lambda t: _file(t / "run"), mentions=("run", "existing file")),
    Case("output-under-file", "output_dir under a file",
         setup=lambda t: _file(t / "afile", f"output_dir={t / 'afile' / 'run'}"),
         mentions=("afile", "is a file")),
    Case("output-is-model", "output_dir set to the input model's folder", setup=_output_is_model,
         mentions=("mymodel", "is the model.name", "write over its own input")),
    Case("output-foreign", "output_dir holding files memfit did not write",
         setup=lambda t: _foreign_folder(t, "notes.txt"),
         mentions=("not a memfit run", "notes.txt", "overwrite=true")),
    Case("overwrite-foreign-clash", "`overwrite=true` on a folder holding the user's own config.json",
         ["overwrite=true"], setup=lambda t: _foreign_folder(t, "config.json"),
         mentions=("config.json", "would write over")),
    Case("record-oversize", "a 4 KiB data line with `data.max_record_bytes=1024`",
         ["data.max_record_bytes=1024"],
         setup=lambda t: _data(t, '{"text": "ok"}\n' + json.dumps({"text": "x" * 4096}) + "\n"),
         mentions=("bad.jsonl:2", "max_record_bytes")),
    Case("tiled-mlp-unsupported", "`memory.tiled_mlp=true` on a GPT-2 model (an MLP it cannot tile)",
         ["memory.tiled_mlp=true", "model.init=random"],
         setup=lambda t: _model_dir(t, "gpt2", {"model_type": "gpt2", "n_embd": 32, "n_layer": 2, "n_head": 2,
                                                "vocab_size": 300, "n_positions": 256}),
         mentions=("memory.tiled_mlp", "GPT2MLP", "LlamaMLP")),
    Case("prefetch-without-checkpointing", "`memory.activation_offload_prefetch=true` without full checkpointing",
         ["memory.activation_offload=true", "memory.activation_offload_prefetch=true"],
         mentions=("memory.activation_offload_prefetch", "memory.checkpointing: full")),
]


# ---------------------------------------------------------------- running a case


def _snapshot(root: Path) -> dict[Path, bytes]:
    return {p: p.read_bytes() for p in root.rglob("*") if p.is_file()}


def _fill_disk_on_step_2(monkeypatch) -> None:
    from memfit import checkpoint

    real = checkpoint._write_bytes

    def write(path: Path, data: bytes) -> None:
        if ".tmp-step-00000002" in str(path) and path.name == "training_state.pt":  # mid-checkpoint
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real(path, data)

    monkeypatch.setattr(checkpoint, "_write_bytes", write)


def _fail_metrics_on_step_2(monkeypatch) -> None:
    from memfit.train.metrics import MetricsLog

    real = MetricsLog.write

    def write(self, record: dict, prefix: str = "train") -> None:
        if record.get("step") == 2 and prefix == "train":
            raise_enospc = OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            self.file = _Failing(raise_enospc)
        real(self, record, prefix)

    monkeypatch.setattr(MetricsLog, "write", write)


class _Failing:
    """A file whose writes fail with `error`, as a full disk's do."""

    def __init__(self, error: OSError):
        self.error = error

    def write(self, *args):
        raise self.error

    flush = write

    def close(self):
        pass


def run_case(case: Case, tmp: Path, capsys, monkeypatch) -> tuple[int, str]:
    (tmp / "texts.jsonl").write_text("".join(json.dumps({"text": f"record {i} of the test data"}) + "\n"
                                             for i in range(8)))
    (tmp / "config.yaml").write_text(yaml.safe_dump({**BASE, "data": {**BASE["data"], "path": str(tmp / "texts.jsonl")}}))
    overrides = [*(case.setup(tmp) if case.setup else []), *case.overrides]
    if case.id == "disk-full":
        _fill_disk_on_step_2(monkeypatch)
    if case.id == "metrics-write-fails":
        _fail_metrics_on_step_2(monkeypatch)
    for name, value in case.env.items():
        monkeypatch.setenv(name, value)
    if case.env:
        monkeypatch.setenv("HF_HUB_CACHE", str(tmp / "empty-hf-cache"))
    before = _snapshot(tmp)
    capsys.readouterr()
    status = main(["train", str(tmp / "config.yaml"), f"output_dir={tmp / 'run'}", *overrides, "--no-progress"])
    stderr = capsys.readouterr().err
    after = _snapshot(tmp)
    assert {p: after.get(p) for p in before} == before, "a file that existed before was changed or removed"
    if not case.new_files_ok:
        assert after.keys() == before.keys(), f"files were written: {sorted(map(str, after.keys() - before.keys()))}"
    return status, stderr


def _user_message(stderr: str, tmp: Path) -> str:
    assert "Traceback" not in stderr
    start = stderr.index("memfit: error: ")  # log lines (warnings) may come before it
    message = stderr[start:].rstrip("\n").replace(str(tmp), "<tmp>")
    return message


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", "<br>")


def _doc_rows() -> dict[str, tuple[str, str]]:
    text = DOC.read_text()
    table = text[text.index(BEGIN):text.index(END)]
    rows = {}
    for line in table.splitlines():
        cells = re.split(r"(?<!\\) \| ", line.strip().strip("|").strip())
        if len(cells) == 3 and cells[0].startswith("`") and cells[0] != "`id`":
            rows[cells[0].strip("`")] = (cells[1], cells[2])
    return rows


def _write_row(case: Case, message: str) -> None:
    text = DOC.read_text()
    head, rest = text.split(BEGIN)
    table, tail = rest.split(END)
    rows = _doc_rows()
    rows[case.id] = (_cell(case.what), _cell(message))
    order = [c.id for c in CASES]
    lines = ["| `id` | bad input | what the user sees (stderr; exit status 2) |", "|---|---|---|"]
    lines += [f"| `{cid}` | {rows[cid][0]} | {rows[cid][1]} |" for cid in sorted(rows, key=lambda c: order.index(c)
                                                                                 if c in order else len(order))]
    DOC.write_text(f"{head}{BEGIN}\n" + "\n".join(lines) + f"\n{END}{tail}")


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_bad_input_is_refused_clearly_and_damages_nothing(case, tmp_path, capsys, monkeypatch):
    status, stderr = run_case(case, tmp_path, capsys, monkeypatch)
    assert status == 2, stderr
    message = _user_message(stderr, tmp_path)
    for needle in case.mentions:
        assert needle in message, f"{needle!r} missing from: {message}"
    if case.id == "disk-full":  # the previous checkpoint is whole and still resumable
        from memfit.checkpoint import checkpoint_dirs, verify

        kept = checkpoint_dirs(tmp_path / "run" / "checkpoints")
        assert [p.name for p in kept] == ["step-00000001"] and verify(kept[0]) is None
        assert not list((tmp_path / "run" / "checkpoints").glob(".tmp-*"))
    if UPDATE:
        _write_row(case, message)
    assert _doc_rows().get(case.id) == (_cell(case.what), _cell(message)), \
        "docs/reliability.md shows another message: rerun with MEMFIT_UPDATE_DOCS=1"


def test_doc_table_has_a_row_for_every_case_and_no_other():
    assert list(_doc_rows()) == [c.id for c in CASES]


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a machine without CUDA")
def test_cuda_asked_for_without_a_gpu(tmp_path, capsys, monkeypatch):
    status, stderr = run_case(Case("no-cuda", "", ["device=cuda"]), tmp_path, capsys, monkeypatch)
    assert status == 2 and "device: cuda was asked for" in _user_message(stderr, tmp_path)
