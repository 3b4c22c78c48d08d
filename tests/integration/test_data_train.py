"""End to end on CPU: `memfit data prepare` then `memfit train` on the prepared (packed) data, and
`memfit train` streaming a raw chat dataset with worker processes."""

import json

import pytest
import yaml

from memfit.cli import main


def write_config(tmp_path, **data):
    config = {"model": {"name": "memfit/tiny-llama", "init": "random"}, "data": {"format": "alpaca", **data}, "seq_len": 128, "micro_batch": 4,
              "lr": 3.0e-3, "warmup_steps": 2, "max_steps": 10, "log_every": 3, "save_every": 0,
              "output_dir": str(tmp_path / "run"), "track_memory": False}
    path = tmp_path / "run.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def losses(tmp_path):
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in rows if "loss" in r]


@pytest.mark.slow
def test_prepare_then_train_packed(tmp_path, capsys):
    config = write_config(tmp_path, path="builtin:demo", num_workers=2, prepared_dir=str(tmp_path / "prepared"))
    assert main(["data", "prepare", str(config), "data.packing=true", "data.seq_len=256", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "records read: 2,000; examples: 2,000; rows stored: " in printed
    assert "tokens per example: min " in printed and "p95" in printed and "peak RSS: main process" in printed
    meta = json.loads((tmp_path / "prepared" / "meta.json").read_text())
    assert meta["packing"] is True and meta["report"]["rows"] < 2000  # several examples per 256-token row
    assert main(["train", str(config), "data.packing=true", "data.seq_len=256", "--no-progress"]) == 0
    trained = losses(tmp_path)
    assert trained[-1] < trained[0]
    # A config that does not match the prepared data is refused with the reason.
    assert main(["train", str(config), "data.seq_len=128", "data.packing=true", "overwrite=true", "--no-progress"]) == 2
    assert "seq_len: prepared with 256, config has 128" in capsys.readouterr().err


@pytest.mark.slow
def test_train_streaming_sharegpt_with_workers(tmp_path):
    records = [{"conversations": [{"from": "human", "value": f"reverse {w}"}, {"from": "gpt", "value": w[::-1]}]}
               for w in ["apple", "banana", "cherry", "delta", "echo", "falcon"] * 50]
    path = tmp_path / "chat.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    config = write_config(tmp_path, path=str(path), format="chat", streaming=True, num_workers=2, shuffle_buffer=64)
    assert main(["train", str(config), "--no-progress"]) == 0
    trained = losses(tmp_path)
    assert trained[-1] < trained[0]
