"""Peak FLOP/s and MFU.

MFU always uses the dense BF16 datasheet peak of the detected GPU (low-precision runs too). For a
device not in the table (the CPU included), the peak is *measured* with a calibration GEMM and
labelled as measured, so nobody mistakes it for a datasheet figure. The peak used is printed with
every result.

- Local MFU = model FLOPs / (compute time on one rank x peak), at the job's local batch.
- Scaling Ratio = per-GPU throughput of the N-GPU job / single-GPU throughput at the same local batch.
- E2E MFU = global FLOPs / (N x step time x peak) = Local MFU x Scaling Ratio.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

# Dense BF16 tensor-core TFLOP/s (no sparsity), vendor datasheets. Matched by substring of
# torch.cuda.get_device_name(), first match wins, so specific names come first.
PEAK_BF16_TFLOPS: list[tuple[str, float]] = [
    ("GB200", 2500.0),
    ("B200", 2250.0),
    ("B100", 1750.0),
    ("H200 NVL", 835.0),
    ("H200", 989.0),  # H200 SXM
    ("H100 NVL", 835.0),
    ("H100 PCIe", 756.0),
    ("H100", 989.0),  # H100 SXM
    ("H20", 148.0),
    ("H800", 989.0),
    ("A100", 312.0),
    ("A800", 312.0),
    ("L40S", 362.0),
    ("L4", 121.0),
    ("A10G", 70.0),
    ("A10", 125.0),
]


@dataclass(frozen=True)
class Peak:
    tflops: float
    source: str  # "datasheet <name>", "config metrics.peak_tflops" or "measured ..."

    def describe(self) -> str:
        value = f"{self.tflops:,.1f}" if self.tflops >= 10 else f"{self.tflops:#.3g}"  # a CPU's 0.0512, not 0.1
        return f"{value} TFLOP/s ({self.source})"


def lookup_peak(device_name: str) -> float | None:
    for key, value in PEAK_BF16_TFLOPS:
        if key in device_name:
            return value
    return None


def measure_gemm_tflops(device: torch.device, size: int | None = None, repeats: int = 8) -> tuple[float, str]:
    """Best-of-``repeats`` TFLOP/s of a square GEMM (bf16 on CUDA, fp32 on CPU).

    Best-of rather than mean: a shared CPU is often busy for a moment, and the peak is the rate
    the machine can reach, not what it happened to give once (1024^3 varied 3x run to run on a
    2-core CI machine; 1536^3, best of 8, within ~10%).
    """
    if device.type == "cuda":
        dtype, size = torch.bfloat16, size or 8192
    else:
        dtype, size = torch.float32, size or 1536
    gen = torch.Generator(device="cpu").manual_seed(0)
    a = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=gen).to(device=device, dtype=dtype)
    best = float("inf")
    for _ in range(repeats + 1):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        a @ b
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - t0)
    dtype_name = str(dtype).replace("torch.", "")
    return 2 * size**3 / best / 1e12, f"measured {dtype_name} GEMM {size}^3"


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    import platform

    return f"CPU {platform.processor() or platform.machine()} ({torch.get_num_threads()} threads)"


def resolve_peak(device: torch.device, override: float | None = None) -> Peak:
    if override is not None:
        return Peak(float(override), "config metrics.peak_tflops")
    name = device_name(device)
    if device.type == "cuda":
        value = lookup_peak(name)
        if value is not None:
            return Peak(value, f"datasheet dense bf16, {name}")
    tflops, how = measure_gemm_tflops(device)
    return Peak(tflops, f"{how} on {name}; not a datasheet peak")


def mfu(flops: float, seconds: float, peak: Peak) -> float:
    return flops / seconds / (peak.tflops * 1e12) if seconds > 0 else 0.0


def e2e_mfu(global_flops: float, world_size: int, step_seconds: float, peak: Peak) -> float:
    return global_flops / (world_size * step_seconds * peak.tflops * 1e12)


def scaling_ratio(per_gpu_throughput_n: float, single_gpu_throughput: float) -> float:
    return per_gpu_throughput_n / single_gpu_throughput
