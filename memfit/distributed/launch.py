"""Process group set-up and teardown from torchrun's environment.

`torchrun --nproc-per-node N -m memfit train run.yaml` sets RANK, WORLD_SIZE, LOCAL_RANK and
MASTER_ADDR/PORT; `init_distributed` reads them (a plain `python -m memfit train` sees none
and gets a single-process context that changes nothing). Backend: nccl on CUDA, gloo on CPU.

Exit protocol: a rank can abort at interpreter exit after a successful run (gloo, 2 processes on
CPU); ending with `dist.barrier(); dist.destroy_process_group(); os._exit(0)` ran clean in 40 of 40
tries. `teardown` does the first two at the end of `train`; the CLI calls `exit_process` last.
"""

from __future__ import annotations

import os
import resource
import sys
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist

from memfit.config.distributed import check_launch
from memfit.step import count_targets
from memfit.strategies.engines import mesh_2d_degree, model_parallel_in_use


@dataclass(frozen=True)
class DistContext:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    dp_rank: int = 0      # which slice of each global batch this rank trains on
    dp_size: int = 1      # slices: 1 for tensor/pipeline parallel, world_size / K on a 2-D (dp x K) mesh
    enabled: bool = False
    backend: str = ""     # gloo (CPU) or nccl (CUDA); collectives on nccl need CUDA tensors
    owns_group: bool = False  # this run created the process group, so its end destroys it

    def scalar(self, value: float, dtype=torch.float64) -> torch.Tensor:
        """A 0-d tensor on the device this rank's collectives run on."""
        device = torch.device("cuda", self.local_rank) if self.backend == "nccl" else torch.device("cpu")
        return torch.tensor(value, dtype=dtype, device=device)

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = DistContext()


def world_size_from_env() -> int:
    return int(os.environ.get("WORLD_SIZE", "1"))


def init_distributed(cfg, device: torch.device, model_config=None) -> DistContext:
    """Check the setup, then join the process group torchrun prepared (no-op for one process).

    `model_config`: the model's config, or a function returning it (read only when distributed)."""
    world = world_size_from_env()
    if world == 1 and cfg.distributed.sharding == "none":
        check_launch(cfg, world)
        return SINGLE
    if callable(model_config):
        model_config = model_config()
    check_launch(cfg, world, model_config)  # every rank refuses the same way, before any collective
    rank, local_rank = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if device.type == "cuda":
        torch.cuda.set_device(local_rank)
    owns_group = not dist.is_initialized()  # a caller's own group (several runs in one process) is left alone
    if owns_group:
        for key, value in (("MASTER_ADDR", "127.0.0.1"), ("MASTER_PORT", "29500"), ("RANK", "0"), ("WORLD_SIZE", "1")):
            os.environ.setdefault(key, value)  # one process asked for sharding without torchrun
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo")
    backend = dist.get_backend()
    dp_rank, dp_size = data_parallel_position(cfg, rank, world)
    return DistContext(rank, world, local_rank, dp_rank, dp_size, enabled=True, backend=backend, owns_group=owns_group)


def data_parallel_position(cfg, rank: int, world_size: int) -> tuple[int, int]:
    """(dp_rank, dp_size): which data slice `rank` trains on, of how many.

    A 2-D mesh (tensor_parallel K with zero2/zero3) is `init_device_mesh(..., (world_size // K, K),
    mesh_dim_names=("dp", "tp"))`, whose rank r sits at row r // K, column r % K: the K ranks of a
    row form one tensor-parallel group and share a batch; the row is the data slice. Tensor or
    pipeline parallel alone: every rank sees the same batch. Data parallel alone: one slice per rank.
    """
    tp = mesh_2d_degree(cfg.distributed.model_dump(), cfg.distributed.sharding)
    if tp:
        return rank // tp, world_size // tp
    if model_parallel_in_use(cfg.distributed.model_dump()):
        return 0, 1
    return rank, world_size


def local_device(device: torch.device, ctx: DistContext) -> torch.device:
    """cuda:LOCAL_RANK under torchrun on GPUs; the CPU stays the CPU."""
    if device.type == "cuda" and ctx.enabled:
        return torch.device("cuda", ctx.local_rank)
    return device


def teardown(ctx: DistContext) -> None:
    if not ctx.enabled:
        return
    if dist.is_initialized():
        dist.barrier()
        if ctx.owns_group:
            dist.destroy_process_group()


def exit_process(code: int = 0) -> None:
    """End a torchrun rank without running interpreter-exit hooks (see module docstring)."""
    if world_size_from_env() > 1:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def target_count(ctx: DistContext):
    """What each rank divides its summed token losses by: all data-parallel slices' targets / slices.

    The engines average gradients over the N data-parallel slices, so slice d's loss S_d / (G / N)
    averages to (sum of S_d) / G: the gradient one process would get from the whole global batch.
    """
    if ctx.dp_size == 1:
        return count_targets

    def count(micro_batches: list[dict]) -> float:
        return _mean_over_slices(float(count_targets(micro_batches)), ctx)

    return count


def mean_over_ranks(value: float, ctx: DistContext) -> float:
    """The step's loss as one process would report it (the mean of the data-parallel slices' losses)."""
    if ctx.dp_size == 1:
        return value
    return _mean_over_slices(value, ctx)


def _mean_over_slices(value: float, ctx: DistContext) -> float:
    """The mean over data slices of a value every rank of a slice holds alike (its target count, its loss).

    Summed over all world_size ranks, each slice's value counts world_size / dp_size times (once
    per rank of its tensor-parallel group; once in all on a 1-D mesh), so that sum / world_size is
    the mean over the dp_size slices: the default group serves a 2-D mesh without a dp group.
    """
    total = ctx.scalar(float(value))
    dist.all_reduce(total)
    return float(total) / ctx.world_size


def gather_to_main(value, ctx: DistContext) -> list:
    """Every rank's `value` (a small picklable object) as a list on every rank; [value] alone."""
    if not ctx.enabled:
        return [value]
    values = [None] * ctx.world_size
    dist.all_gather_object(values, value)
    return values


def on_main_first(ctx: DistContext, prepare, cfg):
    """Rank 0 runs `prepare(cfg)` (e.g. makes the output folder) while the others wait; all get its path."""
    if not ctx.enabled:
        return prepare(cfg)
    out = prepare(cfg) if ctx.is_main else Path(cfg.output_dir)
    dist.barrier()
    return out


def peak_rss_bytes() -> int:
    """This process's peak resident set size so far (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
