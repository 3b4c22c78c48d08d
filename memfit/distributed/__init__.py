"""Scale-out on existing engines: torchrun, DDP, ZeroRedundancyOptimizer, FSDP2, DTensor tensor
parallel, torch.distributed.pipelining, and DeepSpeed from the user's JSON. No home-made
communication layer: every byte that crosses ranks goes through those engines or torch.distributed's
collectives.

  launch.py           process group from torchrun's environment; clean teardown
  validate.py         refuse impossible combinations before any process does work
  sharding.py         ddp / zero1 / zero2 / zero3 / CPU offload, and sharded loading
  tensor_parallel.py  Llama-family blocks through parallelize_module
  pipeline.py         stages and the GPipe schedule
  checkpoint.py       torch.distributed.checkpoint save/reload, full state dict on rank 0
  deepspeed_config.py the user's DeepSpeed JSON checked against the run config, "auto" values filled
  deepspeed_engine.py deepspeed.initialize with it, ZeRO-3 partitions from rank 0, driven by the one loop
"""
