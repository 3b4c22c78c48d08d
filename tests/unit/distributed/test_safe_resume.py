"""Sharded and DeepSpeed checkpoints are read as data: a crafted file runs nothing, a damaged one is
skipped by its manifest. Each payload is first shown to work on the reader memfit replaces, so
these tests fail if the payload (not the safe reader) is what does nothing."""

import builtins
import logging
import pickle

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from memfit.checkpoint import CheckpointError, verify, write_manifest
from memfit.distributed.checkpoint import TRAINER, newest_good_checkpoint
from memfit.distributed.safe_load import SafeReader, dcp_load, dcp_metadata, deepspeed_loads_weights_only


class CreatesFile:
    """Unpickling this opens (creates) `target`: the stand-in for arbitrary code."""

    def __init__(self, target):
        self.target = str(target)

    def __reduce__(self):
        return builtins.open, (self.target, "w")


def _state():
    return {"model": {"w": torch.arange(6.0).reshape(2, 3)},
            "optim": {"step": torch.tensor(4.0), "lr": 0.1, "betas": (0.9, 0.99)}}


def _empty():
    return {"model": {"w": torch.zeros(2, 3)}, "optim": {"step": torch.tensor(0.0), "lr": None, "betas": None}}


def test_a_dcp_checkpoint_round_trips_through_the_safe_reader(tmp_path):
    dcp.save(_state(), checkpoint_id=str(tmp_path))
    loaded = _empty()
    dcp_load(loaded, tmp_path)
    torch.testing.assert_close(loaded["model"]["w"], _state()["model"]["w"])
    assert loaded["optim"]["lr"] == 0.1 and loaded["optim"]["betas"] == (0.9, 0.99)
    assert float(loaded["optim"]["step"]) == 4.0
    assert set(dcp_metadata(tmp_path).state_dict_metadata) >= {"model.w", "optim.lr"}


def test_crafted_dcp_metadata_runs_nothing(tmp_path):
    folder, marker = tmp_path / "state", tmp_path / "pwned"
    dcp.save(_state(), checkpoint_id=str(folder))
    (folder / ".metadata").write_bytes(pickle.dumps(CreatesFile(marker)))

    torch.distributed.checkpoint.FileSystemReader(str(folder)).read_metadata()  # torch's own reader...
    assert marker.exists()  # ...runs the payload
    marker.unlink()

    with pytest.raises(CheckpointError, match=r"\.metadata: refusing to load its metadata: (io|builtins)\.open is not one"):
        SafeReader(str(folder)).read_metadata()
    with pytest.raises(CheckpointError, match="refusing"):
        dcp_load(_empty(), folder)
    assert not marker.exists()


def test_crafted_non_tensor_item_runs_nothing(tmp_path):
    folder, marker = tmp_path / "state", tmp_path / "pwned"
    dcp.save({"optim": {"hook": CreatesFile(marker)}}, checkpoint_id=str(folder))
    assert not marker.exists()

    dcp.load({"optim": {"hook": None}}, checkpoint_id=str(folder))  # torch's default planner runs it
    assert marker.exists()
    marker.unlink()

    with pytest.raises(CheckpointError, match=r"state: refusing to load its item optim\.hook: .*Unsupported global.*open"):
        dcp_load({"optim": {"hook": None}}, folder)
    assert not marker.exists()


def test_truncated_dcp_metadata_is_reported_as_unreadable(tmp_path):
    dcp.save(_state(), checkpoint_id=str(tmp_path))
    metadata = tmp_path / ".metadata"
    metadata.write_bytes(metadata.read_bytes()[: 40])
    with pytest.raises(CheckpointError, match=r"\.metadata: its metadata is unreadable \(\w+Error.*truncated, corrupt"):
        SafeReader(str(tmp_path)).read_metadata()


def test_deepspeed_checkpoint_reads_are_weights_only(tmp_path):
    deepspeed = pytest.importorskip("deepspeed")
    from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum

    class Engine:  # the one attribute deepspeed_loads_weights_only uses
        checkpoint_engine = TorchCheckpointEngine()

    marker, crafted, honest = tmp_path / "pwned", tmp_path / "crafted.pt", tmp_path / "optim_states.pt"
    torch.save({"optimizer_state_dict": {"hook": CreatesFile(marker)}}, crafted)
    fp16_scaler = DynamicLossScaler(init_scale=2.0**16, scale_window=1000, min_scale=1.0, delayed_shift=2,
                                    consecutive_hysteresis=False)  # what an fp16 run saves
    torch.save({"loss_scaler": LossScaler(1.0), "fp16_loss_scaler": fp16_scaler, "zero_stage": ZeroStageEnum.weights,
                "ds_version": deepspeed.__version__, "w": torch.ones(3)}, honest)
    Engine.checkpoint_engine.load(str(crafted))  # DeepSpeed's own read runs the payload
    assert marker.exists()
    marker.unlink()

    with deepspeed_loads_weights_only(Engine):
        with pytest.raises(CheckpointError, match="crafted.pt: refusing to load this file: .*Unsupported global"):
            Engine.checkpoint_engine.load(str(crafted))
        state = Engine.checkpoint_engine.load(str(honest), map_location="cpu")
    assert not marker.exists()
    assert state["zero_stage"] is ZeroStageEnum.weights and state["loss_scaler"].cur_scale == 1.0
    assert state["fp16_loss_scaler"].cur_scale == 2.0**16 and state["fp16_loss_scaler"].dtype == torch.half
    assert "load" not in vars(Engine.checkpoint_engine)  # the engine's own method is back afterwards


def test_manifest_names_the_damaged_shard(tmp_path):
    dcp.save(_state(), checkpoint_id=str(tmp_path / "state"))
    (tmp_path / TRAINER).write_text("{}")
    write_manifest(tmp_path, 3)
    assert verify(tmp_path) is None
    shard = next((tmp_path / "state").glob("*.distcp"))
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard.write_bytes(bytes(data))
    assert verify(tmp_path) == f"state/{shard.name} does not match its sha256 in the manifest (corrupt)"


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_resume_skips_a_checkpoint_that_fails_its_manifest(tmp_path, one_rank, caplog):
    root = tmp_path / "checkpoints"
    for step in (1, 2):
        folder = root / f"sharded-step-{step:08d}"
        dcp.save(_state(), checkpoint_id=str(folder / "state"))
        (folder / TRAINER).write_text("{}")
        write_manifest(folder, step)
    assert newest_good_checkpoint(root) == root / "sharded-step-00000002"

    (root / "sharded-step-00000002" / "state" / ".metadata").write_bytes(pickle.dumps(CreatesFile(tmp_path / "x")))
    with caplog.at_level(logging.WARNING):
        assert newest_good_checkpoint(root) == root / "sharded-step-00000001"
    assert "sharded-step-00000002 is damaged (state/.metadata has" in caplog.text
    assert (root / "sharded-step-00000002.damaged" / TRAINER).is_file()  # set aside, not deleted
    (root / "sharded-step-00000001" / TRAINER).write_text('{"step": 9}')
    with pytest.raises(CheckpointError, match="every checkpoint in .* is damaged \\(sharded-step-00000001"):
        newest_good_checkpoint(root)
