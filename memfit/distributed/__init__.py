"""Scale-out on existing engines: torchrun, DDP, ZeroRedundancyOptimizer, FSDP2, DTensor tensor
parallel, torch.distributed.pipelining, and DeepSpeed from the user's JSON. No home-made
communication layer: every byte that crosses ranks goes through those engines or torch.distributed's
collectives. Which combinations can run is checked when the config loads (memfit/config/distributed.py).

  engine.py           the one interface the training loop calls (one process, torch's engines, DeepSpeed)
  launch.py           process group from torchrun's environment; clean teardown
  sharding.py         ddp / zero1 / zero2 / zero3 / CPU offload, and sharded loading
  tensor_parallel.py  Llama-family blocks through parallelize_module
  pipeline.py         stages and the GPipe schedule
  checkpoint.py       torch.distributed.checkpoint save/reload, full state dict on rank 0
  deepspeed_engine.py deepspeed.initialize with the user's JSON (checked and filled in memfit/config/deepspeed.py), ZeRO-3 partitions from rank 0, driven by the one loop
"""
