"""The --gpu table: names resolve, unknown names list the known ones, every entry is complete and plausible."""

from __future__ import annotations

import pytest

from memfit.errors import MemfitError
from memfit.memory.gpus import DEFAULT_GPU, GPU, GPUS, find_gpu

GiB = 2**30


@pytest.mark.parametrize("name, key", [
    ("RTX 4090", "rtx4090"), ("rtx-4090", "rtx4090"), ("4090", "rtx4090"), ("NVIDIA GeForce RTX 4090", "rtx4090"),
    ("rtx3090", "rtx3090"), ("3090", "rtx3090"), ("L4", "l4"), ("H100", "h100"), ("h200", "h200"),
    ("A100-80GB", "a100-80gb"), ("a100 80gb", "a100-80gb"), ("A100_40GB", "a100-40gb"), (" a100-40GB ", "a100-40gb"),
])
def test_aliases_resolve(name, key):
    assert find_gpu(name) is GPUS[key]


def test_every_canonical_id_and_display_name_resolves_to_itself():
    assert set(GPUS) == {"rtx3090", "rtx4090", "rtx5090", "rtx-a6000", "rtx6000-ada", "l40s", "l4", "a100-40gb",
                         "a100-80gb", "h100", "h200"}
    for key, gpu in GPUS.items():
        assert find_gpu(key) is gpu and find_gpu(gpu.name) is gpu
    assert DEFAULT_GPU == "rtx4090" and DEFAULT_GPU in GPUS


@pytest.mark.parametrize("name", ["rtx 5080", "a100", "", "h100x"])
def test_unknown_name_raises_listing_all_names(name):
    with pytest.raises(MemfitError) as err:
        find_gpu(name)
    assert str(err.value) == (f"--gpu: unknown '{name}'; known: RTX 3090, RTX 4090, RTX 5090, RTX A6000, "
                              "RTX 6000 Ada, L40S, L4, A100-40GB, A100-80GB, H100, H200")


@pytest.mark.parametrize("name, key", [("RTX 5090", "rtx5090"), ("5090", "rtx5090"), ("A6000", "rtx-a6000"),
                                       ("rtx a6000", "rtx-a6000"), ("6000 Ada", "rtx6000-ada"), ("L40S", "l40s")])
def test_the_48gb_cards_and_the_5090_resolve(name, key):
    assert find_gpu(name) is GPUS[key]


def test_the_48gb_cards_hold_about_48_gib_and_the_5090_about_30():
    assert all(44 * GiB < GPUS[k].memory_bytes <= 48 * GiB for k in ("rtx-a6000", "rtx6000-ada", "l40s"))
    assert 29 * GiB < GPUS["rtx5090"].memory_bytes < 30 * GiB


@pytest.mark.parametrize("key", sorted(GPUS))
def test_every_entry_is_complete(key):
    gpu = GPUS[key]
    assert isinstance(gpu, GPU) and gpu.name and gpu.source.strip()
    assert isinstance(gpu.memory_bytes, int) and gpu.memory_bytes > 0
    for rate in (gpu.bf16_tflops, gpu.tf32_tflops, gpu.memory_gbps, gpu.host_link_gbps, gpu.interconnect_gbps):
        assert rate > 0
    assert gpu.bf16
    assert gpu.tf32_tflops <= gpu.bf16_tflops          # TF32 never runs faster than BF16
    assert gpu.interconnect_gbps >= gpu.host_link_gbps  # NVLink or the same PCIe link


@pytest.mark.parametrize("key", ["rtx3090", "rtx4090"])
def test_24gb_geforce_cards_report_about_24_gib(key):
    assert 23 * GiB < GPUS[key].memory_bytes < 24.1 * GiB


def test_l4_ecc_reserves_some_of_its_24_gb():
    assert 21.5 * GiB < GPUS["l4"].memory_bytes < 23 * GiB  # 22518 MiB with ECC on


def test_datacenter_memory_sizes_and_relative_rates():
    assert [round(GPUS[k].memory_bytes / GiB) for k in ("a100-40gb", "a100-80gb", "h100", "h200")] == [40, 79, 79, 140]
    assert GPUS["h200"].bf16_tflops == GPUS["h100"].bf16_tflops            # same GH100 compute
    assert GPUS["h200"].memory_gbps > GPUS["h100"].memory_gbps > GPUS["a100-80gb"].memory_gbps
    assert GPUS["rtx4090"].bf16_tflops > 2 * GPUS["rtx3090"].bf16_tflops
