"""The data-parallel engines (`distributed.sharding`) and their CPU offload (`distributed.offload`): what
each one shards, keeps gathered, sends between ranks or parks in host RAM, written once and read by the
config's rules, the torch wrapper (memfit/distributed/sharding.py), the per-rank estimate
(memory/distributed_estimate.py), the speed model (memory/costs.py) and the planner's search
(memory/search_space.py).

ZeRO's rule, as memfit's engines run it: stage 1 shards the optimizer states over the data-parallel
ranks, stage 2 also the gradients, stage 3 also the weights. Entries hold values, never the RunConfig.
"""

from __future__ import annotations

from dataclasses import dataclass

from memfit.strategies.entries import entry_lookup

# the ZeRO stage from which each kind of model state is sharded
SHARDED_FROM_STAGE = {"optimizer_states": 1, "gradients": 2, "weights": 3}


@dataclass(frozen=True)
class ShardingEntry:
    name: str                     # the value of distributed.sharding
    label: str                    # how the plan's table names it
    zero_stage: int               # 0: every rank holds every model state
    ranks: bool                   # runs one process per GPU under torchrun
    gradient_buckets: bool        # DDP: gradients are views into buckets allocated at every moment
    fsdp2: bool                   # FSDP2 fully_shard: DTensor parameters, sharded at rest, CPU offload possible
    reshard_after_forward: bool   # gathers each block's weights again for its backward (else keeps them)
    full_only: bool = False       # the search offers it to full fine-tuning only

    def shards(self, category: str) -> bool:
        """Whether this engine splits one kind of model state over the data-parallel ranks."""
        return self.zero_stage >= SHARDED_FROM_STAGE[category]

    def split(self, weights: int, gradients: int, states: int, ranks: int,
              at_rest: bool = False) -> tuple[int, int, int]:
        """One rank's share of the model states (bytes, rounded up) by ZeRO's rule for this stage, or
        `at_rest`, as the rank holds them between uses: FSDP2 shards every state at rest (zero2 too)."""
        stage = 3 if at_rest and self.fsdp2 else self.zero_stage

        def share(nbytes: int, category: str) -> int:
            return -(-nbytes // ranks) if stage >= SHARDED_FROM_STAGE[category] else nbytes

        return share(weights, "weights"), share(gradients, "gradients"), share(states, "optimizer_states")

    def gradient_traffic(self) -> float:
        """Gradient bytes each rank sends per gradient byte, as a fraction of a ring all-reduce: a
        reduce-scatter (FSDP2) moves half of what an all-reduce does."""
        return 0.5 if self.fsdp2 else 1.0

    def weight_gathers(self) -> int:
        """All-gathers of the weights per micro-batch under FSDP2 (weights sharded at rest, zero2 too): the
        forward's and, when resharded after it, the backward's."""
        if not self.fsdp2:
            return 0
        return 2 if self.reshard_after_forward else 1


SHARDING_ENTRIES = (
    ShardingEntry("none", "one process", 0, False, False, False, False),
    ShardingEntry("ddp", "DDP", 0, True, True, False, False),
    ShardingEntry("zero1", "ZeRO-1", 1, True, True, False, False, full_only=True),
    ShardingEntry("zero2", "ZeRO-2", 2, True, False, True, False),
    ShardingEntry("zero3", "ZeRO-3", 3, True, False, True, True),
)
SHARDINGS, sharding_entry = entry_lookup(SHARDING_ENTRIES, "distributed.sharding")


@dataclass(frozen=True)
class OffloadEntry:
    name: str                # the value of distributed.offload
    host_states: bool        # FSDP2's CPUOffloadPolicy: the rank's sharded weights, gradients and optimizer
                             # states live in host RAM, the optimizer step runs there, and each block's
                             # parameters are copied in for its forward and backward


# "params" and "all" both mean FSDP2's CPUOffloadPolicy, which moves every sharded state
OFFLOAD_ENTRIES = (OffloadEntry("none", False), OffloadEntry("params", True), OffloadEntry("all", True))
OFFLOADS, offload_entry = entry_lookup(OFFLOAD_ENTRIES, "distributed.offload")


@dataclass(frozen=True)
class ModelParallelEntry:
    """A way to split one model over ranks that all see the same batch (`distributed.<name>`: the degree,
    1 when off). memfit runs one at a time, for full fine-tuning; tensor parallel also inside FSDP2 (a 2-D
    mesh: FSDP2 over the data-parallel dimension, tensor parallel over groups of K ranks)."""

    name: str                     # the config field under distributed
    label: str                    # how the plan's table names it
    dtensor: bool                 # its parameters are DTensors: the optimizer must run on them
    clipping_problem: str         # why clipping by global norm cannot run across its ranks ("" = it can)
    all_reduces_per_layer: int    # activation all-reduces per layer per micro-batch (forward + backward)
    bubble: bool                  # a GPipe schedule: (S - 1) of (M + S - 1) slots idle
    with_fsdp2: bool              # FSDP2 (zero2/zero3) shards its DTensors over the data-parallel ranks: a 2-D mesh
    instead_of_sharding: str      # what works when it is asked for with a sharding it cannot run with


MODEL_PARALLEL_ENTRIES = (
    ModelParallelEntry("tensor_parallel", "tensor parallel", dtensor=True, clipping_problem="",
                       all_reduces_per_layer=4, bubble=False, with_fsdp2=True, instead_of_sharding=(
                           "use distributed.sharding: zero2 or zero3 for a 2-D mesh (FSDP2 over the data-parallel "
                           "ranks, tensor parallel inside each group of K), or sharding: none for tensor parallel "
                           "alone (DDP and zero1 hold plain tensors, not DTensor shards)")),
    ModelParallelEntry("pipeline_parallel", "pipeline parallel", dtensor=False,
                       clipping_problem="gradient clipping across pipeline stages is not implemented",
                       all_reduces_per_layer=0, bubble=True, with_fsdp2=False, instead_of_sharding=(
                           "every rank is one pipeline stage (there is no data-parallel dimension around the "
                           "stages): use distributed.sharding: none")),
)


def model_parallel_in_use(degrees: dict[str, int]) -> list[tuple[ModelParallelEntry, int]]:
    """The model-parallel entries switched on, with their degrees (`degrees`: field name -> degree)."""
    return [(entry, degrees[entry.name]) for entry in MODEL_PARALLEL_ENTRIES if degrees[entry.name] > 1]


def mesh_2d_degree(degrees: dict[str, int], sharding: str) -> int:
    """K of a 2-D (data-parallel x K) mesh: the degree of the model-parallel entry FSDP2 shards, or 0 when the
    run is not one (`degrees`: the distributed section's fields, `sharding`: distributed.sharding)."""
    if not sharding_entry(sharding).fsdp2:
        return 0
    return next((degree for entry, degree in model_parallel_in_use(degrees) if entry.with_fsdp2), 0)
