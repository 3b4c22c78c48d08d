"""Who loads what: the one description the trainer's load path and the planner's host-RAM load term read.

  parts      every rank of an engine that gives each rank a part of the model (FSDP2's shards, a
             tensor-parallel slice, a pipeline stage) builds it on `meta` and reads only its part from
             the checkpoint's files, one tensor at a time (memfit/models/part_loading.py); no process
             ever holds the whole model
  streams    a process that keeps the whole model on one CUDA device (one process, each DDP or ZeRO-1
             rank) reads the checkpoint straight onto it (from_pretrained's `device_map`): tensor by
             tensor, never a host copy of the model
  host copy  a base that torchao quantizes after loading and any run on the CPU (where the loaded model
             is the training state) are built on the host; a bitsandbytes base is quantized tensor by
             tensor as it loads, on any device. DeepSpeed ZeRO-3 partitions rank 0's model.

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
    """The engine gives each rank a part of the model (FSDP2's shards, a tensor-parallel slice, a pipeline
    stage), which each rank reads itself, instead of a whole replica."""
    distributed = cfg.distributed
    return sharding_entry(distributed.sharding).fsdp2 or bool(model_parallel_in_use(distributed.model_dump()))


def streams_to_device(cfg, device_type: str, quantized_after_load: bool) -> bool:
    """Whether each loading process reads the checkpoint straight onto its CUDA device: it keeps the whole
    model there (no engine hands out parts) and nothing must be done to the weights on the host first."""
    return device_type == "cuda" and not hands_out_parts(cfg) and not quantized_after_load


def load_beside_host_states(cfg, device_type: str) -> bool:
    """FSDP2 ranks whose shards live on the host (CPU offload, or a run on the CPU) read their part into them:
    the load's tensors in flight and the states the steps keep on the host are there at once."""
    return sharding_entry(cfg.distributed.sharding).fsdp2 and (
        device_type == "cpu" or cfg.distributed.offload != "none")


def node_load_bytes(cfg, device_type: str, ranks: int, params: int, weight_bytes: int, checkpoint_bytes: int,
                    largest_tensor_params: int, quantized_after_load: bool, quantized_while_loading: bool,
                    quantizing_bytes: int = 0) -> int:
    """Host RAM the loading processes of one node hold at once beyond their runtimes, the page cache and
    the parts they keep (counted with the training states).
    Parts: each rank holds one tensor in flight, read in the checkpoint's dtype and converted into its part
    (the largest: its rows under FSDP2, whole where tensor or pipeline parallel read it whole); or, for a
    base torchao quantizes, one whole block linear being quantized (`quantizing_bytes`), whichever is more.
    Random weights (`model.init: random`): each process that builds the whole model makes it on the host in
    the weights' dtype (`weight_bytes` per parameter).
    A checkpoint: where the load converts its dtype (`checkpoint_bytes` per parameter) to the weights', each
    process that builds the model on the host holds that copy, and each one that streams to its GPU (or
    quantizes while loading: bitsandbytes, on any device) one converted tensor in flight; nothing else
    (same-dtype weights are views of the mapped checkpoint). torchao quantizes a host-built model one layer
    at a time: + `quantizing_bytes`."""
    if hands_out_parts(cfg):
        random = cfg.model.init == "random"
        # FSDP2 alone reads each rank's rows of every tensor; tensor parallel reads its replicated tensors
        # (embeddings, lm_head) whole, a pipeline stage its tensors whole, random init makes each one whole
        whole = random or bool(model_parallel_in_use(cfg.distributed.model_dump()))
        tensor = largest_tensor_params if whole else -(-largest_tensor_params // ranks)
        return ranks * max(tensor * (weight_bytes if random else checkpoint_bytes), quantizing_bytes)
    if cfg.model.init == "random":
        return ranks * params * weight_bytes
    if weight_bytes == checkpoint_bytes:
        return ranks * quantizing_bytes
    if quantized_while_loading or streams_to_device(cfg, device_type, quantized_after_load):
        return ranks * largest_tensor_params * weight_bytes
    return ranks * (params * weight_bytes + quantizing_bytes)  # torchao quantizes the host copy layer by layer
