"""What `memfit plan` prints at the top: the model, its parameter counts in short form, the engine."""

from __future__ import annotations

import pytest

from memfit.cli import main
from memfit.config import load_config
from memfit.memory.plan_text import plan_text
from memfit.memory.planner import plan

LLAMA8 = "meta-llama/Llama-3.1-8B"


def test_the_plan_header_gives_parameter_counts_in_short_form(capsys):
    assert main(["plan", LLAMA8]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == ("memfit plan: meta-llama/Llama-3.1-8B (8.03 B parameters, 8.03 B trainable), "
                        "engine analytic, per GPU")
    assert lines[1].startswith("run as described: {'method': 'full', ")
    assert lines[2:4] == ["", "Predicted peak GPU memory (GiB = 2^30 bytes)"]


@pytest.mark.parametrize("model, method, header", [
    (LLAMA8, "qlora", "memfit plan: meta-llama/Llama-3.1-8B (8.03 B parameters, 3.41 M trainable), engine "
                      "analytic, per GPU"),
    ("gpt2", "full", "memfit plan: gpt2 (124.44 M parameters, 124.44 M trainable), engine analytic, per GPU"),
])
def test_the_header_counts_trainable_parameters_of_the_method(model, method, header):
    result = plan(model, load_config(None, [f"model={model}", f"method={method}"]))
    assert plan_text(result).splitlines()[0] == header


def test_seq_lens_in_the_decision_stay_in_full():
    """Token counts are not parameter counts: the longest seq_len is printed digit for digit."""
    cfg = load_config(None, [f"model={LLAMA8}", "method=qlora"])
    result = plan(LLAMA8, cfg, 24 * 2**30, max_seq_len=True, host_ram=128 * 2**30)
    longest = result.search.max_seq_len
    line = next(line for line in plan_text(result).splitlines() if "longest seq_len that fits this plan" in line)
    assert longest >= 1000 and line.endswith(f": {longest:,}")
