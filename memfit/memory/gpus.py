"""GPUs the planner can target with `--gpu NAME`: memory, peak rates and links, each from a spec sheet.

Used to rank candidate plans by predicted step time (memory/planner.py): within one GPU only the ratios
between compute, memory bandwidth and link bandwidth matter; absolute times are rough. Peak rates are dense
(no 2:4 sparsity) tensor-core figures; training runs BF16 matmuls with FP32 accumulate, which GeForce cards
execute at half their FP16-accumulate rate, so those are the figures used. `memory_bytes` is what
torch.cuda.get_device_properties().total_memory (= cudaDeviceProp.totalGlobalMem, also printed by the CUDA
deviceQuery sample) reports; it varies by a few hundred MiB with driver and ECC setting. Bandwidths in
GB/s = 1e9 B/s, links per direction.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from memfit.errors import MemfitError

MiB = 2**20


@dataclass(frozen=True)
class GPU:
    name: str                 # display name
    memory_bytes: int         # total_memory as torch reports it (see module docstring)
    bf16_tflops: float        # dense BF16 tensor-core TFLOP/s, FP32 accumulate
    tf32_tflops: float        # dense TF32 tensor-core TFLOP/s (fp32 matmuls with TF32 allowed)
    memory_gbps: float        # device memory bandwidth, GB/s
    host_link_gbps: float     # host<->device per direction, GB/s (PCIe 4.0 x16 = 32, 5.0 x16 = 64; theoretical)
    interconnect_gbps: float  # GPU<->GPU per direction, GB/s (NVLink, else the PCIe figure)
    bf16: bool                # native bf16
    source: str               # where the numbers come from


GA102 = "NVIDIA Ampere GA102 GPU Architecture whitepaper v2, Appendix A"
ADA = "NVIDIA Ada GPU Architecture whitepaper, Appendix A"
A100 = "NVIDIA A100 datasheet (nvidia-a100-datasheet-us-nvidia-1758950-r4-web.pdf)"
H100 = "NVIDIA H100 Tensor Core GPU datasheet (SXM column)"

GPUS: dict[str, GPU] = {
    # 3090 NVLink bridge (56.25 GB/s/direction, GA102 whitepaper) is an optional part; PCIe assumed.
    "rtx3090": GPU("RTX 3090", 25447170048, 71.0, 35.6, 936.0, 32.0, 32.0, True,
                   f"{GA102}: 71 BF16 w/ FP32 acc, 35.6 TF32 (not verified here; 142 FP16-acc dense seen on spec "
                   "pages), 936 GB/s; memory: deviceQuery/torch 24268 MiB"),
    "rtx4090": GPU("RTX 4090", 25756696576, 165.2, 82.6, 1008.0, 32.0, 32.0, True,
                   f"{ADA}: 165.2 BF16 w/ FP32 acc, 82.6 TF32, 1008 GB/s; no NVLink; memory: deviceQuery 24564 MiB"),
    "rtx5090": GPU("RTX 5090", 32 * 1000**3, 209.5, 104.8, 1792.0, 64.0, 64.0, True,
                   "spec pages (spheron.network/blog/nvidia-rtx-5090-specs, Linux Format May 2025): 838.4 FP16 "
                   "tensor with sparsity = 419.2 dense with FP16 accumulate, halved for FP32 accumulate as on every "
                   "GeForce card: 209.5 BF16, 104.8 TF32 (derived, not measured); 1792 GB/s GDDR7; PCIe 5.0 x16; "
                   "no NVLink; memory: 32 GB nominal (torch reports a little less; not measured here)"),
    # The 48 GB cards: workstation and data-centre parts run BF16 with FP32 accumulate at the full rate.
    "rtx-a6000": GPU("RTX A6000", 48 * 2**30, 154.8, 77.4, 768.0, 32.0, 56.25, True,
                     f"{GA102} and microway.com's Ampere comparison (via llmperf.net): 154.8 BF16 dense (309.7 with "
                     "sparsity), TF32 half of it; 768 GB/s GDDR6 with ECC; NVLink bridge 112.5 GB/s bidirectional "
                     "(servethehome.com); memory: 48 GiB nominal, not measured here"),
    "rtx6000-ada": GPU("RTX 6000 Ada", 48 * 2**30, 364.2, 182.1, 960.0, 32.0, 32.0, True,
                       f"{ADA}: 18,176 CUDA cores, 568 tensor cores like the L40S (its 362 BF16 dense at a slightly "
                       "higher boost clock: 364.2 BF16, 182.1 TF32, derived); 960 GB/s GDDR6 with ECC "
                       "(grafikkarten.com spec table); PCIe 4.0 x16, no NVLink; memory: 48 GiB nominal, not "
                       "measured here"),
    "l40s": GPU("L40S", 46068 * MiB, 362.05, 183.0, 864.0, 32.0, 32.0, True,
                "NVIDIA L40/L40S datasheet table (mullet.se listing): 362.05 BF16 / 183 TF32 dense (733 / 366 with "
                "sparsity), 864 GB/s GDDR6 with ECC on, PCIe Gen4 x16 64 GB/s bidirectional, no NVLink; memory: "
                "46068 MiB as nvidia-smi lists the L40 family with ECC on (not measured here)"),
    # L4 ships with ECC on, which reserves ~1.5 GiB of its 24 GB.
    "l4": GPU("L4", 23612293120, 121.0, 60.0, 300.0, 32.0, 32.0, True,
              "NVIDIA L4 datasheet: 242 BF16 / 120 TF32 with sparsity (halved; accumulate not stated), 300 GB/s, "
              "PCIe Gen4 x16 64 GB/s bidirectional, no NVLink; memory: deviceQuery 22518 MiB (ECC on)"),
    "a100-40gb": GPU("A100-40GB", 40536 * MiB, 312.0, 156.0, 1555.0, 32.0, 300.0, True,
                     f"{A100} (SXM4): 312 BF16, 156 TF32, 1555 GB/s, NVLink 600 GB/s bidirectional, PCIe Gen4 64 "
                     "bidirectional; memory: torch-style repr 40536 MiB"),
    "a100-80gb": GPU("A100-80GB", 84987740160, 312.0, 156.0, 2039.0, 32.0, 300.0, True,
                     f"{A100} (SXM4): 312 BF16, 156 TF32, 2039 GB/s, NVLink 600 GB/s bidirectional; memory: "
                     "deviceQuery 81051 MiB"),
    "h100": GPU("H100", 85028896768, 989.4, 494.7, 3350.0, 64.0, 450.0, True,
                f"{H100} + Hopper whitepaper: 989.4 BF16 / 494.7 TF32 dense (datasheet: 1979 / 989 with sparsity), "
                "3350 GB/s, NVLink 900 GB/s and PCIe Gen5 128 GB/s bidirectional; memory: deviceQuery 81090 MiB"),
    "h200": GPU("H200", 143156 * MiB, 989.4, 494.7, 4800.0, 64.0, 450.0, True,
                "NVIDIA H200 datasheet (SXM): 141 GB HBM3e, 4800 GB/s, same GH100 compute as H100 SXM "
                "(1979 BF16 with sparsity), NVLink 900 GB/s bidirectional; memory: torch 143156 MiB"),
}

DEFAULT_GPU = "rtx4090"  # the target user has a 24 GB card


def _key(name: str) -> str:
    return re.sub(r"[\s_\-]+", "", name.lower()).removeprefix("nvidia").removeprefix("geforce").removeprefix("rtx")


_ALIASES = {_key(k): k for k in GPUS} | {_key(g.name): k for k, g in GPUS.items()}


def find_gpu(name: str) -> GPU:
    """The GPU for a `--gpu` value, ignoring case, spaces, dashes and 'NVIDIA'/'GeForce'/'RTX' ('4090', 'a100 80gb')."""
    key = _ALIASES.get(_key(name))
    if key is None:
        known = ", ".join(g.name for g in GPUS.values())
        raise MemfitError(f"--gpu: unknown '{name}'; known: {known}")
    return GPUS[key]
