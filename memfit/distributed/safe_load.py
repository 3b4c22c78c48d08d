"""Reading sharded checkpoints without running code that a checkpoint file could carry.

A checkpoint folder is data someone may have copied from elsewhere; unpickling it must never run
code. Three readers would otherwise unpickle freely:

  DCP `.metadata`     torch's FileSystemReader reads it with plain `pickle.load`. `SafeReader` reads
                      it with an unpickler that builds only the metadata classes DCP writes (listed
                      below: every class the checkpoints of memfit's engines name).
  DCP byte items      non-tensor values (optimizer hyperparameters) go through
                      `torch.load(weights_only=False)` in DefaultLoadPlanner; `SafePlanner` loads
                      them with weights_only=True. Tensors DCP already loads with weights_only=True.
  DeepSpeed `.pt`     DeepSpeed's checkpoint engine calls `torch.load(weights_only=False)`;
                      `deepspeed_loads_weights_only` swaps in weights_only=True, allowing just the
                      three DeepSpeed classes its ZeRO checkpoints hold.

A file that names anything else fails with a CheckpointError naming the file and the global, and
nothing from it is built. Written against torch 2.13 (FileSystemReader and DefaultLoadPlanner
internals: `_get_metadata_path`, `set_element`); tests/unit/distributed/test_safe_resume.py fails
if they change.
"""

from __future__ import annotations

import io
import pickle
from contextlib import contextmanager
from pathlib import Path

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta

from memfit.checkpoint import CheckpointError

# Every global a DCP .metadata of FSDP2, DDP, zero1, TP and pipeline checkpoints names (dtypes,
# layouts and memory formats are checked by type below).
DCP_METADATA_GLOBALS = frozenset({
    ("torch.distributed.checkpoint.metadata", "Metadata"),
    ("torch.distributed.checkpoint.metadata", "MetadataIndex"),
    ("torch.distributed.checkpoint.metadata", "StorageMeta"),
    ("torch.distributed.checkpoint.metadata", "TensorStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "BytesStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "ChunkStorageMetadata"),
    ("torch.distributed.checkpoint.metadata", "TensorProperties"),
    ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"),
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch.serialization", "_get_layout"),   # maps a layout's name back to torch.strided etc.
    ("torch", "Size"),
    ("pathlib", "PosixPath"),                 # StorageMeta.checkpoint_id: a path object, nothing more
    ("pathlib", "PurePosixPath"),
})
_TORCH_CONSTANTS = (torch.dtype, torch.layout, torch.memory_format)


_UNREADABLE = (EOFError, ValueError, KeyError, IndexError)  # what a truncated or corrupt pickle raises


class NotAllowed(pickle.UnpicklingError):
    """A pickle names a global outside the allow-list."""


def refused(path, what: str, exc: Exception) -> CheckpointError:
    lines = str(exc).splitlines() or [type(exc).__name__]
    # torch's weights_only error opens with advice to load unsafely; the reason is on a later line
    reason = next((line.strip() for line in lines if "Unsupported global" in line), None)
    if reason is None and not isinstance(exc, NotAllowed):  # not a refused global: broken bytes
        return CheckpointError(f"{path}: {what} is unreadable ({type(exc).__name__}: {lines[0]}): the file is "
                               "truncated, corrupt or tampered with")
    reason = reason or lines[0]
    return CheckpointError(f"{path}: refusing to load {what}: {reason}. A checkpoint holds tensors and "
                           "plain numbers only; this file may have been tampered with")


class MetadataUnpickler(pickle.Unpickler):
    """Builds DCP metadata and nothing else."""

    def find_class(self, module: str, name: str):
        if (module, name) in DCP_METADATA_GLOBALS:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), _TORCH_CONSTANTS):
            return getattr(torch, name)
        raise NotAllowed(f"{module}.{name} is not one of the DCP metadata classes")


class SafeReader(FileSystemReader):
    """FileSystemReader whose metadata comes through MetadataUnpickler."""

    def read_metadata(self, *args, **kwargs) -> Metadata:
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as stream:
            try:
                metadata = MetadataUnpickler(stream).load()
            except (pickle.UnpicklingError, AttributeError, TypeError, *_UNREADABLE) as exc:
                raise refused(path, "its metadata", exc) from None
        if not isinstance(metadata, Metadata):
            raise CheckpointError(f"{path}: holds a {type(metadata).__name__}, not DCP metadata")
        if getattr(metadata, "storage_meta", None) is None:  # as FileSystemReader does
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafePlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner that loads non-tensor items with weights_only=True."""

    def __init__(self, folder: Path):
        super().__init__()
        self.folder = folder  # named in errors: DCP's items carry only their state-dict key

    def load_bytes(self, read_item, value: io.BytesIO) -> None:
        try:
            loaded = torch.load(value, weights_only=True)
        except (pickle.UnpicklingError, *_UNREADABLE) as exc:
            raise refused(self.folder, f"its item {read_item.dest_index.fqn}", exc) from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded


def dcp_load(state: dict, folder: Path) -> None:
    """`torch.distributed.checkpoint.load` of `folder` into `state`, through the safe reader and planner."""
    dcp_metadata(folder)  # read once up front: inside dcp.load a refusal comes back only as text
    try:
        dcp.load(state, storage_reader=SafeReader(str(folder)), planner=SafePlanner(folder))
    except CheckpointException as exc:  # DCP gathers every rank's failure; ours says what was refused
        ours = [error for error, _ in exc.failures.values() if isinstance(error, CheckpointError)]
        if ours:
            raise ours[0] from None
        raise


def dcp_metadata(folder: Path) -> Metadata:
    return SafeReader(str(folder)).read_metadata()


def deepspeed_globals() -> list:
    """The classes DeepSpeed's ZeRO stage 1-3 checkpoints pickle besides tensors and containers
    (the loss scaler is a LossScaler in bf16/fp32 runs, a DynamicLossScaler in fp16 ones)."""
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, DynamicLossScaler, ZeroStageEnum, fragment_address]


@contextmanager
def deepspeed_loads_weights_only(engine):
    """While inside, the DeepSpeed engine's checkpoint reads use torch.load(weights_only=True) with
    only `deepspeed_globals()` allowed beyond torch's own safe set."""
    checkpoint_engine = engine.checkpoint_engine
    allowed = deepspeed_globals()

    def load(path, map_location=None):
        try:
            with torch.serialization.safe_globals(allowed):
                return torch.load(path, map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as exc:
            raise refused(path, "this file", exc) from None

    checkpoint_engine.load = load  # an instance attribute shadows the class's method
    try:
        yield
    finally:
        del checkpoint_engine.load
