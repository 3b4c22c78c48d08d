"""OOM recovery: a tracked memory budget makes out-of-memory reproducible on CPU."""

import json

import pytest
import torch

from memfit.errors import MemfitError
from memfit.train.loop import train
from memfit.train.oom import MemoryBudget, OomRecovery, evaluate_with_retry, smaller_split, split_batches
from memfit.train.resolve import resolve_run


def test_smaller_split_divides_the_micro_batch():
    assert [smaller_split(n) for n in (2, 3, 4, 5, 6, 8, 12)] == [1, 1, 2, 1, 3, 4, 6]


def test_split_keeps_every_row_and_trims_padding():
    mask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0], [1, 1, 1, 0]])
    ids = torch.arange(16).view(4, 4)
    batch = {"input_ids": ids, "attention_mask": mask, "labels": ids.clone()}
    pieces = split_batches([batch], 2)
    assert [p["input_ids"].shape for p in pieces] == [(2, 4), (2, 3)]  # second piece's last column is all padding
    assert torch.equal(torch.cat([p["input_ids"][:, :3] for p in pieces]), ids[:, :3])


def test_budget_raises_out_of_memory_and_gives_the_bytes_back():
    with MemoryBudget(limit_bytes=1 << 20) as budget:
        small = torch.ones(1000)
        with pytest.raises(torch.OutOfMemoryError, match="memory.limit"):
            torch.ones(1 << 20)  # 4 MiB
        assert budget.current_bytes == small.untyped_storage().nbytes()
    assert budget.peak_bytes == small.untyped_storage().nbytes()  # the failed allocation never counted


def test_evaluation_oom_splits_only_the_evaluation_batch():
    batch = {"input_ids": torch.arange(24).view(8, 3), "attention_mask": torch.ones(8, 3, dtype=torch.long)}

    def eval_fn(piece):
        if piece["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("too big")
        return piece["input_ids"].sum(), piece["input_ids"].numel()

    recovery = OomRecovery(micro_batch=8, grad_accum=1)
    assert evaluate_with_retry(eval_fn, batch) == (float(torch.arange(24).sum()), 24)
    assert (recovery.micro_batch, recovery.grad_accum) == (8, 1)  # training shape untouched


def test_no_recovery_with_optimizer_in_backward():
    recovery = OomRecovery(4, 1, enabled=False, reason_disabled="optimizer_in_backward already updated")

    def step(pieces):
        raise torch.OutOfMemoryError("full")

    with pytest.raises(MemfitError, match="optimizer_in_backward"):
        recovery.run(step, [{"input_ids": torch.zeros(4, 2)}], torch.optim.SGD([torch.zeros(1, requires_grad=True)], 0.1))


def _peak(tiny_config, **extra):
    result = train(resolve_run(tiny_config(max_steps=1, **extra)), progress=False)
    return result.report.measured_peak_bytes


@pytest.mark.slow  # three short training runs: about a minute on 2 busy cores
def test_oom_in_training_halves_micro_batch_and_loses_nothing(tiny_config, tmp_path):
    steps = 3
    plain = train(resolve_run(tiny_config(max_steps=steps, overwrite=True, micro_batch=8)), progress=False)
    peak_8 = plain.report.measured_peak_bytes
    peak_4 = _peak(tiny_config, overwrite=True, micro_batch=4, grad_accum=2)
    assert peak_4 < peak_8
    budget = (peak_4 + peak_8) // 2  # micro_batch 8 cannot fit, 4 can
    cfg = tiny_config(max_steps=steps, overwrite=True, micro_batch=8, memory_budget=f"{budget}B")
    recovered = train(resolve_run(cfg), progress=False)
    # Same data in the same order, same effective batch: the same losses step by step.
    assert recovered.losses == pytest.approx(plain.losses, rel=1e-4)
    assert len(recovered.losses) == steps
    assert recovered.report.measured_peak_bytes <= budget
    lines = [json.loads(line) for line in (recovered.output_dir / "metrics.jsonl").read_text().splitlines()]
    assert [line["step"] for line in lines] == list(range(1, steps + 1))  # no step lost or repeated


def test_oom_at_micro_batch_one_says_what_to_do(tiny_config):
    with pytest.raises(MemfitError, match="micro_batch 1"):
        # The fp32 weights (3.3 MB) fit; AdamW's states (twice that) cannot, at any micro-batch.
        train(resolve_run(tiny_config(max_steps=1, micro_batch=2, memory_budget="3500000B")), progress=False)
