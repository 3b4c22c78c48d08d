"""Refuse distributed setups the engines cannot run, before any process does work.

Two levels:
  config_problems(cfg)          combinations that are impossible whatever the model or machine
                                (called by RunConfig's validator, so `memfit plan` and every
                                rank see them at load time, all listed at once);
  launch_problems(cfg, world,   what needs the model's shape and torchrun's world size (heads
                  model_config) divisible by K, layers >= S, world size = K or S, or dp x K
                                for a 2-D mesh...).
`check_launch` raises one DistributedSetupError listing every launch problem.
"""

from __future__ import annotations

from memfit.errors import MemfitError
from memfit.strategies.engines import mesh_2d_degree, model_parallel_in_use, offload_entry, sharding_entry
from memfit.strategies.optimizers import optimizer_entry
from memfit.strategies.precision import precision_entry
from memfit.strategies.quantization import sharded_quantization_problems

# Module names the tensor-parallel plan shards; models whose blocks lack them are refused.
LLAMA_FAMILY = ("llama", "mistral", "qwen2", "qwen3", "gemma", "gemma2", "olmo", "olmo2", "granite")


class DistributedSetupError(MemfitError):
    """The distributed configuration cannot run as given; the message lists every reason."""


def config_problems(cfg) -> list[str]:
    """Field combinations no engine here can run. Each message names the fields and a fix."""
    problems = []
    engines = cfg.distributed
    sharding, offload = engines.sharding, engines.offload
    fsdp2 = sharding_entry(sharding).fsdp2  # DTensor parameters, sharded at rest
    parallel = [entry for entry, _ in model_parallel_in_use(engines.model_dump())]
    if offload_entry(offload).host_states and not fsdp2:
        problems.append(f"distributed.offload: {offload} needs distributed.sharding: zero2 or zero3 (FSDP2's "
                        f"CPUOffloadPolicy); sharding is {sharding}")
    if len(parallel) > 1:
        problems.append(f"{' and '.join(entry.name for entry in parallel)} together (a tensor x pipeline mesh) are "
                        "not supported yet: set one of them to 1")
    for entry in parallel:
        if sharding != "none" and not (entry.with_fsdp2 and fsdp2):
            problems.append(f"distributed.{entry.name} > 1 with distributed.sharding: {sharding} is not supported: "
                            f"{entry.instead_of_sharding}")
    if parallel and cfg.method != "full":
        problems.append(f"method: {cfg.method} with tensor/pipeline parallel is not supported: use method: full, "
                        "or distributed.sharding: ddp/zero* for adapters")
    if cfg.quant.scheme != "none" and fsdp2:
        problems += sharded_quantization_problems(cfg.quant.scheme, cfg.quant.backend, sharding)
    if precision_entry(cfg.precision).scaler and (fsdp2 or parallel):
        problems.append(f"precision: {cfg.precision}'s loss scaler does not handle sharded (DTensor) gradients here: "
                        "use bf16-mixed or bf16-pure")
    if not optimizer_entry(cfg.optim.name).on_dtensor and (fsdp2 or any(entry.dtensor for entry in parallel)):
        problems.append(f"optim.name: {cfg.optim.name} keeps quantized states that cannot follow sharded (DTensor) "
                        "parameters: use optim.name: adamw with zero2/zero3 or tensor_parallel")
    for entry in parallel:
        if entry.clipping_problem and cfg.optim.max_grad_norm is not None:
            problems.append(f"{entry.name} > 1 needs optim.max_grad_norm: null ({entry.clipping_problem})")
    return problems


def launch_problems(cfg, world_size: int, model_config=None) -> list[str]:
    """Problems that need torchrun's world size and the model's shape."""
    problems = []
    tp, pp = cfg.distributed.tensor_parallel, cfg.distributed.pipeline_parallel
    sharding = cfg.distributed.sharding
    if mesh_2d_degree(cfg.distributed.model_dump(), sharding):  # a 2-D mesh: dp groups of tp ranks each
        if world_size % tp:
            problems.append(f"distributed.tensor_parallel: {tp} with distributed.sharding: {sharding} needs a world "
                            f"size that {tp} divides (dp x {tp} processes, e.g. torchrun --nproc-per-node "
                            f"{tp * max(world_size // tp, 1)}); got {world_size}")
    elif tp > 1 and world_size != tp:
        problems.append(f"distributed.tensor_parallel: {tp} needs exactly {tp} processes (torchrun --nproc-per-node "
                        f"{tp}), or distributed.sharding: zero2/zero3 for a 2-D mesh of {tp}-process groups; "
                        f"got {world_size}")
    if pp > 1 and world_size != pp:
        problems.append(f"distributed.pipeline_parallel: {pp} needs exactly {pp} processes (torchrun --nproc-per-node "
                        f"{pp}); "
                        f"got {world_size}")
    if world_size > 1 and sharding == "none" and tp == 1 and pp == 1 and not cfg.distributed.deepspeed:
        problems.append(f"{world_size} processes were started but sharding is none: set distributed.sharding: ddp "
                        "(or zero1/zero2/zero3), or start one process")
    if model_config is None:
        return problems
    model_type = getattr(model_config, "model_type", "?")
    problems += model_parallel_family_problems(cfg, model_type)
    if tp > 1:
        for name in ("num_attention_heads", "num_key_value_heads", "intermediate_size"):
            value = getattr(model_config, name, None)
            if value is not None and value % tp:
                problems.append(f"distributed.tensor_parallel: {tp} must divide the model's {name} ({value})")
    if pp > 1:
        layers = getattr(model_config, "num_hidden_layers", 0)
        if layers < pp:
            problems.append(f"distributed.pipeline_parallel: {pp} needs at least {pp} layers; the model has {layers}")
    return problems


def model_parallel_family_problems(cfg, model_type: str) -> list[str]:
    """Tensor and pipeline parallel split Llama-family blocks only (their module names); the launch and the
    planner's model check both refuse other models with this."""
    return [f"{entry.name} needs a Llama-family model ({', '.join(LLAMA_FAMILY)}); model is {model_type}"
            for entry, _ in model_parallel_in_use(cfg.distributed.model_dump()) if model_type not in LLAMA_FAMILY]


def check_launch(cfg, world_size: int, model_config=None) -> None:
    problems = launch_problems(cfg, world_size, model_config)
    if problems:
        lines = "\n".join(f"  - {p}" for p in problems)
        raise DistributedSetupError(f"distributed setup has {len(problems)} problem(s):\n{lines}")
