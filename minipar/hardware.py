"""What the device can do: its peak FLOP/s, the denominator of MFU.

GPUs: the vendor's dense peak for the dtype (docs/references.md, "Accelerators and links"). CPUs
publish no useful peak, so we measure one, once per process, with a square matmul (the best case for
a CPU, as for a GPU).
"""
from __future__ import annotations

import functools
import time

import torch

GPU_PEAKS = {  # dense tensor-core peaks, FLOP/s, for bf16/fp16 (fp32 runs as TF32: half of it)
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
}


@functools.lru_cache(maxsize=None)
def peak_flops(device: str = "cpu", dtype: torch.dtype = torch.float32) -> float:
    """Peak FLOP/s of one `device` ("cpu" or "cuda") for matmuls in
    `dtype`: published, else measured."""
    if device == "cuda":
        name = torch.cuda.get_device_name()
        for key, peak in GPU_PEAKS.items():
            if key in name:
                return peak if dtype in (torch.bfloat16, torch.float16) else peak / 2
    return measured_matmul_flops(device, dtype)


def measured_matmul_flops(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024,
                          reps: int = 10) -> float:
    """FLOP/s of an n x n x n matmul on `device`, best of `reps` (2 n^3 FLOPs each)."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    best = float("inf")
    for _ in range(reps + 1):  # one more: the first pays for the warm-up
        start = time.perf_counter()
        a @ b
        if device.startswith("cuda"):
            torch.cuda.synchronize(device)
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best
