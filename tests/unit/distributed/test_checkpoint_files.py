"""Sharded checkpoints' trainer state is data: JSON plus a weights_only file of scheduler state."""

import json

import pytest
import torch

from memfit.distributed.checkpoint import TENSORS, TRAINER, load_trainer
from memfit.errors import MemfitError


class Payload:  # any class torch.load(weights_only=True) does not allow
    pass


def _write(folder, scheduler):
    (folder / TRAINER).write_text(json.dumps({"step": 3, "losses": [2.0, 1.5], "data": {"epoch": 0}}))
    torch.save({"scheduler": scheduler, "param_groups": [{"lr": 0.1, "betas": (0.9, 0.99)}]}, folder / TENSORS)


def test_trainer_state_round_trips(tmp_path):
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 0.5)
    _write(tmp_path, scheduler.state_dict())
    trainer = load_trainer(tmp_path)
    assert trainer["step"] == 3 and trainer["losses"] == [2.0, 1.5]
    assert trainer["scheduler"]["last_epoch"] == scheduler.state_dict()["last_epoch"]
    assert trainer["param_groups"] == [{"lr": 0.1, "betas": (0.9, 0.99)}]


def test_pickled_objects_are_refused(tmp_path):
    _write(tmp_path, {"last_epoch": 3, "hook": Payload()})
    with pytest.raises(MemfitError, match="refusing to unpickle"):
        load_trainer(tmp_path)
