"""Who loads what: the one description the trainer's load path and the planner's host-RAM load term read.

  streams    a process that keeps the whole model on one CUDA device (one process, each DDP or ZeRO-1
             rank) reads the checkpoint straight onto it (from_pretrained's `device_map`): tensor by
             tensor, never a host copy of the model
  host copy  rank 0 of an engine that hands each rank its part (FSDP2, tensor parallel, pipeline parallel)
             builds the whole model on the host and sends each rank its part; the other ranks build on
             `meta` and hold only what they receive. A base that torchao quantizes after loading, and any
             run on the CPU (where the loaded model is the training state), are built on the host too;
             a bitsandbytes base is quantized tensor by tensor as it loads, on any device.

What a host-built model costs the host (measured, bench/load_ram.py): transformers maps the checkpoint's
safetensors files into memory. When the weights' dtype is the checkpoint's, the parameters are views of
those file pages (page cache, which the kernel can reclaim; nothing is copied while loading); when it
converts (bf16 checkpoint, fp32 weights), the model is a copy in the weights' dtype, and every page of the
checkpoint is read and stays mapped until the load ends (page cache again). The host RAM a plan needs is
the memory that cannot be reclaimed: the converted copy, and one tensor in flight while converting.
"""

from __future__ import annotations

from memfit.strategies.engines import model_parallel_in_use, sharding_entry


def hands_out_parts(cfg) -> bool:
    """The engine gives each rank its part of rank 0's model (FSDP2's shards, a tensor-parallel slice, a
    pipeline stage) instead of each rank loading the whole model."""
    distributed = cfg.distributed
    return sharding_entry(distributed.sharding).fsdp2 or bool(model_parallel_in_use(distributed.model_dump()))


def streams_to_device(cfg, device_type: str, quantized_after_load: bool) -> bool:
    """Whether each loading process reads the checkpoint straight onto its CUDA device: it keeps the whole
    model there (no engine hands out parts) and nothing must be done to the weights on the host first."""
    return device_type == "cuda" and not hands_out_parts(cfg) and not quantized_after_load


def load_beside_host_states(cfg, device_type: str) -> bool:
    """FSDP2 gives each rank its host shards (CPU offload, or a run on the CPU) before rank 0's whole model is
    broadcast and dropped: the load and the states the steps keep on the host are there at once."""
    return sharding_entry(cfg.distributed.sharding).fsdp2 and (
        device_type == "cpu" or cfg.distributed.offload != "none")


def node_load_bytes(cfg, device_type: str, ranks: int, params: int, weight_bytes: int, checkpoint_bytes: int,
                    largest_tensor_params: int, quantized_after_load: bool, quantized_while_loading: bool) -> int:
    """Host RAM the loading processes of one node hold at once beyond their runtimes and the page cache.
    Random weights (`model.init: random`): each process that builds the model makes it on the host in the
    weights' dtype (`weight_bytes` per parameter). A checkpoint: where the load converts its dtype
    (`checkpoint_bytes` per parameter) to the weights', each process that builds the model on the host
    holds that copy, and each one that streams to its GPU (or quantizes while loading: bitsandbytes, on any
    device) one converted tensor in flight; nothing else (same-dtype weights are views of the mapped
    checkpoint)."""
    readers = 1 if hands_out_parts(cfg) else ranks
    if cfg.model.init == "random":
        return readers * params * weight_bytes
    if weight_bytes == checkpoint_bytes:
        return 0
    if quantized_while_loading or streams_to_device(cfg, device_type, quantized_after_load):
        return readers * largest_tensor_params * weight_bytes
    return readers * params * weight_bytes
