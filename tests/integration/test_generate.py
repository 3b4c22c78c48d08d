"""memfit generate: prompts rendered as training rendered them; full and LoRA runs answer what they learned."""

from __future__ import annotations

import json

import pytest

from memfit.cli import main
from memfit.data.formats import render_chat, render_segments
from memfit.errors import MemfitError
from memfit.generate import generate, render_prompt
from memfit.models.tokenizer import byte_tokenizer
from memfit.train.loop import train
from memfit.train.resolve import resolve_run

RECORD = {"instruction": "Reverse the word.", "input": "cherry", "output": "yrrehc"}


def test_prompts_are_the_masked_part_of_a_training_example():
    tokenizer = byte_tokenizer()
    segments, _ = render_segments(RECORD, "alpaca", tokenizer)
    assert render_prompt(RECORD["instruction"], "alpaca", tokenizer, RECORD["input"]) == (segments[0][0], False)
    chat = render_chat([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}], tokenizer)
    assert render_prompt("hi", "chat", tokenizer) == (chat[0][0], True)
    assert render_prompt("hi", "text", tokenizer) == ("hi", False)


@pytest.fixture(scope="module")
def one_record(tmp_path_factory):
    path = tmp_path_factory.mktemp("data") / "one.jsonl"
    path.write_text(json.dumps(RECORD) + "\n")
    return path


@pytest.mark.parametrize("method", ["full", "lora"])
def test_a_run_that_memorised_one_record_answers_it(tiny_config, one_record, method, capsys):
    extra = {"lora.rank": 16, "lr": 2e-2} if method == "lora" else {}
    cfg = tiny_config(**{"data.path": str(one_record), "data.format": "alpaca", "data.limit": 1,
                         "micro_batch": 1, "max_steps": 80, "method": method, **extra})
    out = train(resolve_run(cfg), progress=False).output_dir
    assert generate(out, RECORD["instruction"], max_new_tokens=12, context=RECORD["input"]) == RECORD["output"]
    assert main(["generate", str(out), RECORD["instruction"], "--input", RECORD["input"],
                 "--max-new-tokens", "12"]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == RECORD["output"]  # after any library warning


def test_bad_run_folder_and_options_are_clear_errors(tmp_path):
    with pytest.raises(MemfitError, match="no run_config.yaml"):
        generate(tmp_path, "x")
    with pytest.raises(MemfitError, match="--max-new-tokens must be at least 1"):
        generate(tmp_path, "x", max_new_tokens=0)
