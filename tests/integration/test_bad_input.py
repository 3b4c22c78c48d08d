"""Bad input gets one clear line (`memfit: error: ...`, exit status 2, no traceback) saying what and where,
and nothing already written is changed.

Each case is one row of the table in docs/reliability.md, and the test checks that the row shows exactly
the message the user sees (temporary paths written as <tmp>). After changing a message, regenerate the
rows with:   MEMFIT_UPDATE_DOCS=1 .venv/bin/python -m pytest tests/integration/test_bad_input.py
"""

from __future__ import annotations

import errno
import fcntl
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
from memfit.models.tokenizer import byte_tokenizer

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
    byte_tokenizer().save_pretrained(folder)
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


def _parquet_nulls(tmp: Path) -> list[str]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"text": pa.array(["ok", None], pa.string())}), tmp / "bad.parquet")
    return [f"data.path={tmp / 'bad.parquet'}"]


def _config_is_run_folder(tmp: Path) -> list[str]:
    """`memfit train DIR` on a finished run's folder: the path the case passes as the config becomes one."""
    text = (tmp / "config.yaml").read_text()
    (tmp / "config.yaml").unlink()
    (tmp / "config.yaml").mkdir()
    (tmp / "config.yaml" / "run_config.yaml").write_text(text)
    return []


def _long_eval_data(tmp: Path) -> list[str]:
    (tmp / "eval.jsonl").write_text("".join(json.dumps({"text": f"held-out record {i}, long enough to fill its row " * 3})
                                            + "\n" for i in range(64)))
    return [f"eval.data={tmp / 'eval.jsonl'}"]


_HELD_FOLDERS: list[int] = []  # descriptors of folders a case keeps locked for the rest of the test process


def _folder_in_use(tmp: Path) -> list[str]:
    """tmp/run held by another memfit run: its lock taken (a second descriptor conflicts even in this
    process) and its info file written, with fixed values so that the message is always the same."""
    run = tmp / "run"
    run.mkdir()
    fd = os.open(run, os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    _HELD_FOLDERS.append(fd)
    (run / ".memfit-running.json").write_text(json.dumps({
        "pid": 4242, "host": "gpu-box", "started": "2026-12-01 09:00:00 UTC",
        "command": "memfit train config.yaml resume=true"}))
    return []


def _data_changed(tmp: Path) -> list[str]:
    """A run whose recorded data identity says texts.jsonl had 1 byte: it changed since."""
    run = _existing_run(tmp)
    data = str(tmp / "texts.jsonl")
    (run / "data_identity.json").write_text(json.dumps({"source": data, "files": {
        data: {"bytes": 1, "mtime": 0.0, "sha256_ends": "0" * 64}}}))
    return ["resume=true"]


def _edited_model(tmp: Path, drop: str = "", add: dict | None = None, config: dict | None = None,
                  tokenizer: bool = True, damage: bool = False) -> list[str]:
    """A saved tiny model with memfit's byte tokenizer beside it, its checkpoint or config.json then edited."""
    from safetensors.torch import load_file, save_file

    folder = _saved_model(tmp)
    if tokenizer:
        byte_tokenizer().save_pretrained(folder)
    weights = folder / "model.safetensors"
    if drop or add:
        state = {k: v for k, v in load_file(weights).items() if not (drop and k.startswith(drop))}
        save_file({**state, **(add or {})}, weights, metadata={"format": "pt"})
    if config:
        (folder / "config.json").write_text(json.dumps({**json.loads((folder / "config.json").read_text()), **config}))
    if damage:
        weights.write_bytes(weights.read_bytes()[:weights.stat().st_size // 2])
    return [f"model={folder}", "model.init=pretrained"]


def _big_tokenizer(tmp: Path) -> list[str]:
    tokenizer = byte_tokenizer()
    tokenizer.add_tokens([f"<extra{i}>" for i in range(5)])
    tokenizer.save_pretrained(tmp / "bigtok")
    return _edited_model(tmp) + [f"model.tokenizer={tmp / 'bigtok'}"]


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
    Case("resume-other-run", "resume=true into a folder whose run used another seed", ["resume=true"],
         setup=lambda t: _with_run(t, seed=5), mentions=("run_config.yaml", "seed: 5")),
    Case("output-in-use", "output_dir in use by another memfit run (its lock held)", setup=_folder_in_use,
         mentions=("<tmp>/run", "in use by another memfit run", "pid 4242", "gpu-box")),
    Case("resume-data-changed", "resume=true after the training data file changed", setup=_data_changed,
         mentions=("texts.jsonl", "bytes, had 1", "resume_data_changed=continue")),
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
    Case("mesh-2d-one-gpu", "a 2-D mesh (`distributed.sharding=zero3 distributed.tensor_parallel=2`) in a single process",
         ["distributed.sharding=zero3", "distributed.tensor_parallel=2"],
         mentions=("distributed.tensor_parallel: 2 with distributed.sharding: zero3", "multiple of 2 GPUs (got 1)")),
    Case("tensor-parallel-with-ddp", "`distributed.tensor_parallel=2` with `distributed.sharding=ddp`",
         ["distributed.tensor_parallel=2", "distributed.sharding=ddp"],
         mentions=("distributed.tensor_parallel > 1 with distributed.sharding: ddp", "zero2 or zero3")),
    Case("strategy-engine-cannot-run", "`memory.chunked_loss=true` with `distributed.pipeline_parallel=2`",
         ["distributed.pipeline_parallel=2", "memory.chunked_loss=true", "optim.max_grad_norm=null"],
         mentions=("memory.chunked_loss: true with distributed.pipeline_parallel: 2", "switch one of them off")),
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
    Case("data-null-text", "JSONL record with `\"text\": null`",
         setup=lambda t: _data(t, '{"text": "ok"}\n{"text": null}\n'), mentions=("bad.jsonl:2", "'text' is null")),
    Case("data-number-output", "alpaca record whose `output` is a number",
         setup=lambda t: _data(t, '{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": 7}\n', "alpaca"),
         mentions=("bad.jsonl:2", "'output' is a number (7)")),
    Case("data-null-chat-content", "chat message with `\"content\": null`",
         setup=lambda t: _data(t, '{"messages": [{"role": "user", "content": "hi"}, '
                                  '{"role": "assistant", "content": null}]}\n', "chat"),
         mentions=("bad.jsonl:1", "'messages[1].content' is null")),
    Case("data-null-parquet", "Parquet file with a null in its `text` column", setup=_parquet_nulls,
         mentions=("bad.parquet: row 1", "'text' is null")),
    Case("lora-unknown-target", "an unknown name among `lora.targets`: `lora.targets=[q_proj,qproj]`",
         ["method=lora", "lora.targets=[q_proj,qproj]"],
         mentions=("lora.targets", "'qproj'", "no such module", "q_proj, up_proj, v_proj")),
    Case("config-list", "config file whose top level is a list (`- a`)", setup=lambda t: _cfg_file(t, "- a\n"),
         mentions=("config.yaml", "top level must be a mapping", "got a list")),
    Case("config-scalar", "config file that holds one number (`42`)", setup=lambda t: _cfg_file(t, "42\n"),
         mentions=("config.yaml", "top level must be a mapping", "got a number (42)")),
    Case("config-is-run-folder", "a run's folder given as the config (`memfit train RUN_DIR`)",
         setup=_config_is_run_folder, mentions=("is a folder", "resume=true", "config.yaml/run_config.yaml")),
    Case("budget-no-unit", "`budget=24` (a size without a unit)", ["budget=24"],
         mentions=("budget", "has no unit", "24GiB (2^30 bytes)", "24GB (10^9 bytes)")),
    Case("budget-unknown-unit", "`budget=24G` (not a unit memfit reads)", ["budget=24G"],
         mentions=("budget", "unknown unit 'G'", "GiB")),
    Case("limit-no-unit", "`memory.limit=1000000` (a size without a unit)", ["memory.limit=1000000"],
         mentions=("memory.limit", "has no unit")),
    Case("tensorboard-disk-full", "disk full while TensorBoard (the default sink) writes step 2's events "
         "(simulated ENOSPC)", ["logging.report_to=[tensorboard]"],
         mentions=("tensorboard", "No space left on device", "checkpoint of step 2 saved", "resume=true"),
         new_files_ok=True),
    Case("eval-out-of-memory", "evaluation needing more than `memory.limit` (`eval.micro_batch=64 memory.limit=14MiB`)",
         ["eval.every=1", "eval.micro_batch=64", "memory.limit=14MiB"], setup=_long_eval_data,
         mentions=("evaluation at step 1 failed", "memory.limit", "step-00000001", "lower eval.micro_batch",
                   "resume=true"), new_files_ok=True),
    Case("torchao-shape", "`quant.backend=torchao` on a model whose MLP weights hold 1,056 values (not a multiple of 64)",
         ["method=qlora", "quant.scheme=nf4", "quant.backend=torchao", "model.init=random"],
         setup=lambda t: _model_dir(t, "odd", {**TINY_LLAMA, "intermediate_size": 33}),
         mentions=("torchao", "mlp.gate_proj", "33 x 32", "quant.backend: bitsandbytes")),
    Case("model-weights-missing", "saved model whose checkpoint lacks a layer's tensors (`model.layers.0.*` deleted)",
         setup=lambda t: _edited_model(t, drop="model.layers.0."),
         mentions=("mymodel", "model.layers.* (9 tensors) missing", "model.new_weights")),
    Case("model-more-layers", "model config.json with more layers than its weights hold",
         setup=lambda t: _edited_model(t, config={"num_hidden_layers": 2}),
         mentions=("mymodel", "model.layers.1.* (9 tensors) missing")),
    Case("model-weights-unexpected", "checkpoint holding a tensor the model has no place for",
         setup=lambda t: _edited_model(t, add={"v_head.weight": torch.zeros(1, 32)}),
         mentions=("v_head.weight unexpected", "model.dropped_weights")),
    Case("model-weights-shape", "model config.json whose sizes disagree with the weights (`intermediate_size`)",
         setup=lambda t: _edited_model(t, config={"intermediate_size": 96}),
         mentions=("mymodel", "is 64x32 in the checkpoint but 96x32 in the model")),
    Case("model-weights-damaged", "truncated model.safetensors",
         setup=lambda t: _edited_model(t, damage=True), mentions=("mymodel/model.safetensors", "damaged")),
    Case("model-no-tokenizer", "folder of real weights without tokenizer files",
         setup=lambda t: _edited_model(t, tokenizer=False),
         mentions=("mymodel", "no tokenizer", "tokenizer.json", "model.tokenizer")),
    Case("tokenizer-missing", "`model.tokenizer` pointing at a folder that does not exist",
         ["model.tokenizer=/nonexistent/tokenizer"], setup=_edited_model,
         mentions=("model.tokenizer", "/nonexistent/tokenizer", "does not exist")),
    Case("tokenizer-too-big", "`model.tokenizer` with more token ids than the model's vocab_size",
         setup=_big_tokenizer, mentions=("model.tokenizer", "264 token ids", "vocab_size", "259")),
    Case("byte-tokenizer-vocab", "random-init model whose vocab_size (200) is below the byte tokenizer's 259 ids",
         ["model.init=random"], setup=lambda t: _model_dir(t, "small", {**TINY_LLAMA, "vocab_size": 200}),
         mentions=("small/config.json", "vocab_size is 200", "259")),
    Case("model-not-transformer", "a saved mamba config (no attention heads)", ["model.init=random"],
         setup=lambda t: _model_dir(t, "mamba", {"model_type": "mamba", "vocab_size": 259, "hidden_size": 32,
                                                 "num_hidden_layers": 2}),
         mentions=("mamba", "num_attention_heads", "memfit trains decoder transformers")),
    Case("model-heads-split", "model config.json whose heads do not divide the hidden size", ["model.init=random"],
         setup=lambda t: _model_dir(t, "heads", {**TINY_LLAMA, "hidden_size": 30, "num_attention_heads": 4}),
         mentions=("heads/config.json", "hidden size (30)", "attention heads (4)")),
    Case("model-kv-heads", "model config.json whose key/value heads do not divide the heads", ["model.init=random"],
         setup=lambda t: _model_dir(t, "kv", {**TINY_LLAMA, "num_attention_heads": 4, "num_key_value_heads": 3}),
         mentions=("kv/config.json", "num_key_value_heads (3) must divide num_attention_heads (4)")),
    Case("limit-below-weights", "`memory.limit=64KiB`, below the model's own weights", ["memory.limit=64KiB"],
         mentions=("memory.limit", "64.00 KiB", "below the model's own weights"), new_files_ok=True),
    Case("weights-lists-random", "`model.new_weights` with `model.init=random`",
         ["model.init=random", "model.new_weights=[lm_head.*]"], mentions=("new_weights", "init: pretrained")),
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


def _fail_tensorboard_on_step_2(monkeypatch) -> None:
    from tensorboard.summary.writer.record_writer import RecordWriter

    from memfit.train.metrics import MetricsLog

    full = {"now": False}
    real_record, real_write = RecordWriter.write, MetricsLog.write

    def record(self, data):  # TensorBoard's writer thread appending to its event file
        if full["now"]:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        real_record(self, data)

    def write(self, record: dict, prefix: str = "train") -> None:
        full["now"] = full["now"] or (record.get("step") == 2 and prefix == "train")
        real_write(self, record, prefix)

    monkeypatch.setattr(RecordWriter, "write", record)
    monkeypatch.setattr(MetricsLog, "write", write)


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
    if case.id == "tensorboard-disk-full":
        _fail_tensorboard_on_step_2(monkeypatch)
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
