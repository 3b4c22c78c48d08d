"""Who loads what (memfit/models/load_plan.py): the trainer's load path and the planner's load term read the
same rules."""

from __future__ import annotations

import pytest
import torch

from memfit.build import loading_kwargs
from memfit.config import load_config
from memfit.memory.analytic import analytic_estimate
from memfit.memory.model_shape import model_shape
from memfit.memory.single_device import load_bytes
from memfit.models.load_plan import hands_out_parts, node_load_bytes, streams_to_device
from memfit.strategies.quantization import torchao_quantize_peak_per_value
from memfit.models.presets import load_preset_config

GiB = 2**30
LLAMA70 = "meta-llama/Llama-3.1-70B"
LLAMA8 = "meta-llama/Llama-3.1-8B"


@pytest.mark.parametrize("engine, parts", [([], False), (["distributed.sharding=ddp"], False),
                                           (["distributed.sharding=zero1"], False),
                                           (["distributed.sharding=zero3"], True),
                                           (["distributed.tensor_parallel=2"], True),
                                           (["distributed.pipeline_parallel=2", "optim.max_grad_norm=null"], True)])
def test_only_engines_that_hand_out_parts_read_a_part_per_rank(engine, parts):
    cfg = load_config(None, engine)
    assert hands_out_parts(cfg) is parts
    assert streams_to_device(cfg, "cuda", quantized_after_load=False) is (not parts)
    assert not streams_to_device(cfg, "cpu", quantized_after_load=False)  # a CPU run loads in place


def test_a_process_that_keeps_the_model_on_its_gpu_reads_the_checkpoint_onto_it():
    cfg = load_config(None, ["method=full"])
    assert loading_kwargs(cfg, torch.device("cuda", 0), place_on=torch.device("cuda", 0)) == {
        "device_map": {"": "cuda:0"}}
    assert loading_kwargs(cfg, torch.device("cpu"), place_on=torch.device("cpu")) == {}  # in place
    assert loading_kwargs(cfg, torch.device("cuda", 1), place_on=None) == {}  # a rank that receives its part


def test_a_load_that_keeps_the_checkpoints_dtype_copies_nothing_to_the_host():
    """Same dtype: the parameters are views of the mapped checkpoint (bench/load_ram.py: 8 MiB of anonymous
    RSS for a 0.57 B-parameter bf16 model); converting bf16 to fp32: the fp32 copy (measured -0.4%)."""
    cfg = load_config(None, [f"model={LLAMA70}"])
    assert cfg.model.init == "pretrained"
    assert node_load_bytes(cfg, "cpu", 1, 10**9, 2, 2, 10**7, False, False) == 0
    assert node_load_bytes(cfg, "cpu", 1, 10**9, 4, 2, 10**7, False, False) == 4 * 10**9
    assert node_load_bytes(cfg, "cuda", 1, 10**9, 4, 2, 10**7, False, False) == 4 * 10**7  # streams: one tensor
    random = load_config(None, ["model.init=random"])  # from_config builds it on the host, whatever the dtype
    assert node_load_bytes(random, "cpu", 1, 10**9, 2, 2, 10**7, False, False) == 2 * 10**9


@pytest.mark.parametrize("device", ["cpu", "cuda"])
def test_each_quantization_backend_loads_as_the_trainer_does(device):
    """bitsandbytes quantizes tensor by tensor while loading (on any device): one tensor in flight; torchao
    quantizes the loaded base, built whole on the host first, one layer at a time; a full fp32 run on a GPU
    streams."""
    shape = model_shape(load_preset_config(LLAMA8))
    fp32 = 4
    bnb = load_config(None, [f"model={LLAMA8}", "method=qlora", "quant.backend=bitsandbytes", "precision=bf16-mixed"])
    torchao = bnb.updated({"quant.backend": "torchao"})
    full = load_config(None, [f"model={LLAMA8}", "precision=bf16-mixed"])
    assert load_bytes(shape, bnb, device) == shape.largest_tensor_params * fp32
    quantizing = int(shape.largest_linear_params * (2 + torchao_quantize_peak_per_value(2)))  # one bf16 layer
    assert load_bytes(shape, torchao, device) == shape.total_params * fp32 + quantizing
    expected = shape.largest_tensor_params if device == "cuda" else shape.total_params
    assert load_bytes(shape, full, device) == expected * fp32
    # and the trainer asks transformers for the same: a device map only where the load streams
    streams = loading_kwargs(full, torch.device(device), place_on=torch.device(device))
    assert ("device_map" in streams) is (device == "cuda")
    assert "device_map" not in loading_kwargs(torchao, torch.device("cpu"), place_on=None)


def test_no_rank_of_an_engine_that_hands_out_parts_holds_a_model_copy():
    """The node's load term where every rank reads its own part: one tensor in flight per rank, read in the
    checkpoint's dtype (the largest: its rows under FSDP2, whole under tensor and pipeline parallel) or one
    base linear being quantized; never a copy of the model."""
    shape = model_shape(load_preset_config(LLAMA70))
    bf16, fp32 = 2, 4
    for engine in (["distributed.tensor_parallel=8"], ["distributed.pipeline_parallel=8", "optim.max_grad_norm=null"],
                   ["distributed.sharding=zero3"], ["distributed.sharding=zero3", "method=qlora"]):
        cfg = load_config(None, [f"model={LLAMA70}", "precision=bf16-mixed", *engine])
        quantizing = shape.largest_linear_params * (bf16 + torchao_quantize_peak_per_value(bf16))
        read = shape.largest_tensor_params // (8 if "distributed.sharding=zero3" in engine else 1)  # FSDP2: rows
        in_flight = max(read * bf16, int(quantizing) if "method=qlora" in engine else 0)
        assert load_bytes(shape, cfg, "cuda", 8) == 8 * in_flight, engine
        assert load_bytes(shape, cfg, "cuda", 8) < shape.total_params  # far below one bf16 copy
    ddp = load_config(None, [f"model={LLAMA70}", "precision=bf16-mixed", "method=lora", "distributed.sharding=ddp"])
    assert load_bytes(shape, ddp, "cuda", 8) == 8 * shape.largest_tensor_params * fp32


def test_70b_qlora_on_one_48gib_gpu_needs_no_host_copy_of_the_model():
    cfg = load_config(None, [f"model={LLAMA70}", "method=qlora", "data.seq_len=2048", "batch.micro_batch=1",
                             "memory.checkpointing=full"])
    estimate = analytic_estimate(cfg, device="cuda")
    assert estimate.cpu_ram_bytes <= 64 * GiB  # the 4-bit base streams to the GPU as it is quantized


def test_host_ram_is_the_larger_of_the_load_and_the_steps():
    """The load's host copy is gone before the first step: the two do not add up."""
    from memfit.memory.single_device import host_peak_bytes

    ram = {"runtime": 10, "data": 5, "model_load": 100, "offloaded": 30}
    assert host_peak_bytes(ram) == 115
    assert host_peak_bytes({**ram, "offloaded": 300}) == 315
