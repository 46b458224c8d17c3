"""What the device can do: its peak FLOP/s (the denominator of MFU), and where that number is from.

GPUs: the vendor's dense peak for the dtype (docs/references.md, "Accelerators and links"). CPUs
publish no useful peak, so we measure one with square fp32 matmuls (the best case for a CPU, as
for a GPU) on all of this process's threads; fp32 whatever the precision trained in, since a CPU
without matrix units runs 16-bit matmuls slower than fp32 ones. One short matmul is not enough: on
a loaded machine it read 38 GFLOP/s for a peak of ~370, and MFU read 3.5x too high. So the
measurement is the best of many trials spread over ~1.5 s (a quiet moment among them is enough),
and it is kept in a file, $XDG_CACHE_HOME/minipar/peak.json (default ~/.cache), under the
device, dtype, thread count and CPU model, with its date and the load average it was taken at:
every later run divides by the same number, and `peak(...).source` says which. `calibrate_peak()`
measures again, and so does the next run after one measured while the cores were busy, once the
load has halved.

A slower kind of device, emulated: `throttle(factor)` is the training loop's after_compute hook
(`train(slowdown=...)`) that, after each micro-batch's forward and backward or each pipeline
action, sleeps (factor - 1) times what that compute took, so the rank computes like a device
`factor` times slower. It is stated and synthetic: what is slowed is the forward and backward (with
the TP or ZeRO-3 collectives inside them, if any), not the DP all-reduce or the pipeline's sends,
and sleeping frees the core, so the other ranks are not slowed. Fewer intra-op threads would be the
other way to slow a rank, but on a machine with as many cores as ranks each has one thread already.
"""
from __future__ import annotations

import dataclasses
import datetime
import json
import math
import os
import platform
import time
from pathlib import Path

import torch

GPU_PEAKS = {  # dense tensor-core peaks, FLOP/s, for bf16/fp16 (fp32 runs as TF32: half of it)
    "A100": 312e12,
    "H100": 989e12,
    "H200": 989e12,
}
BUSY = 0.5  # load average per core above which a measurement is said to be taken on a busy machine
SHORT = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}


@dataclasses.dataclass(frozen=True)
class Peak:
    flops: float  # FLOP/s of one device
    source: str   # where the number comes from, for a summary: "H100 dense bf16, published"


def peak(device: str = "cpu", dtype: torch.dtype = torch.float32,
         recalibrate: bool = False) -> Peak:
    """The peak of one `device` ("cpu", "cuda", "cuda:1") for matmuls in `dtype`: published, else
    measured once and cached (recalibrate: measure again, and cache that)."""
    kind = device.split(":")[0]
    if kind == "cuda":
        published = published_peak(torch.cuda.get_device_name(device), dtype)
        if published is not None:
            return published
    else:  # a CPU without matrix units runs 16-bit matmuls slower than fp32 ones (here bf16 read
        # 0.95 GFLOP/s at 1024^3, below the model's own small bf16 matmuls, and MFU over 100%):
        # its peak is fp32's, whatever the precision trained in
        dtype = torch.float32
    return _measured(device, dtype, recalibrate)


def peak_flops(device: str = "cpu", dtype: torch.dtype = torch.float32,
               recalibrate: bool = False) -> float:
    """peak(...).flops: the FLOP/s alone."""
    return peak(device, dtype, recalibrate).flops


def calibrate_peak(device: str = "cpu", dtype: torch.dtype = torch.float32) -> Peak:
    """Measure the peak again (after a hardware or load change) and cache the new value."""
    return peak(device, dtype, recalibrate=True)


def published_peak(gpu_name: str, dtype: torch.dtype) -> Peak | None:
    """The vendor's dense peak of a GPU named `gpu_name` for `dtype`, None for a GPU not listed."""
    for key, flops in GPU_PEAKS.items():
        if key in gpu_name:
            if dtype in (torch.bfloat16, torch.float16):
                return Peak(flops, f"{key} dense {_short(dtype)}, published")
            return Peak(flops / 2, f"{key} dense TF32 (half the bf16 peak) for {_short(dtype)}, "
                                   "published")
    return None


def throttle(factor: float):
    """The after_compute hook of a device `factor` (>= 1) times slower (module docstring): sleep
    (factor - 1) times the compute just done. None for factor 1: no hook."""
    if not 1.0 <= factor < math.inf:
        raise ValueError(f"a slowdown must be a number >= 1 (times slower), got {factor!r}")
    if factor == 1.0:
        return None
    return lambda seconds: time.sleep((factor - 1.0) * seconds)


def measured_matmul_flops(device: str = "cpu", dtype: torch.dtype = torch.float32, n: int = 1024,
                          seconds: float = 1.5, trials: int = 5, clock=time.perf_counter) -> float:
    """FLOP/s of an n x n x n matmul (2 n^3 FLOPs) on `device`: the best trial of at least `trials`,
    run until `seconds` have passed. clock: the timer, an argument so that a test can drive it."""
    a = torch.randn(n, n, device=device).to(dtype)
    b = torch.randn(n, n, device=device).to(dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.startswith("cuda") else (lambda: None)
    a @ b  # the first pays for allocation and waking the threads
    sync()
    best, done = 0.0, 0
    start = last = clock()
    while done < trials or last - start < seconds:
        begin = clock()
        a @ b
        sync()
        last = clock()
        best, done = max(best, 2 * n ** 3 / max(last - begin, 1e-12)), done + 1
    return best


def cache_path() -> Path:
    """Where measured peaks are kept: $XDG_CACHE_HOME/minipar/peak.json, ~/.cache by default."""
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache", "minipar", "peak.json")


def cache_key(device: str, dtype: torch.dtype) -> str:
    """What a measurement depends on: the device and its model, the dtype, the thread count."""
    kind = device.split(":")[0]
    model = torch.cuda.get_device_name(device) if kind == "cuda" else _cpu_model()
    return f"{kind} {_short(dtype)} threads={torch.get_num_threads()} {model}"


def _measured(device: str, dtype: torch.dtype, recalibrate: bool) -> Peak:
    """The cached measurement for this device, dtype, thread count and CPU; made and cached when
    there is none, or on request."""
    path, key = cache_path(), cache_key(device, dtype)
    entry = _read(path).get(key)
    where = f"cached in {_shown(path)}; --recalibrate-peak to redo"
    cores = os.cpu_count() or 1
    # a measurement taken while the cores were busy reads low: redo it once the machine is quieter
    busy_then = _valid(entry) and entry["load"] > BUSY * cores and _load() < entry["load"] / 2
    if recalibrate or not _valid(entry) or busy_then:
        load = _load()  # before measuring: the measurement adds its own
        n = 4096 if device.startswith("cuda") else 1024  # a GPU needs a bigger matmul to fill it
        entry = dict(flops=measured_matmul_flops(device, dtype, n),
                     date=datetime.date.today().isoformat(), load=round(load, 2))
        try:
            _write(path, {**_read(path), key: entry})  # read again: another run may have written
        except OSError as e:
            where = f"not cached: {path.parent}: {e.strerror}"
    what = torch.cuda.get_device_name(device) if device.startswith("cuda") else "CPU"
    if entry["load"] > BUSY * cores:  # other processes had the cores: the best trial may be low
        where = f"{cores} cores were busy, it may read low; {where}"
    return Peak(entry["flops"], f"{what} {_short(dtype)} matmul, measured {entry['date']} at load "
                                f"{entry['load']:.1f} ({where})")


def _valid(entry) -> bool:
    return (isinstance(entry, dict) and isinstance(entry.get("flops"), (int, float))
            and entry["flops"] > 0 and isinstance(entry.get("date"), str)
            and isinstance(entry.get("load"), (int, float)))


def _read(path: Path) -> dict:
    """The cache file's entries; none when it is missing or not one (then it is rewritten)."""
    try:
        cache = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    return cache if isinstance(cache, dict) else {}


def _write(path: Path, cache: dict) -> None:
    """Replace the file whole (a run reading it at the same time sees the old or the new one)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    tmp.write_text(json.dumps(cache, indent=1, sort_keys=True) + "\n")
    os.replace(tmp, path)


def _load() -> float:
    """The 1-minute load average: how busy the machine was (NaN where the OS does not say)."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return float("nan")


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _short(dtype: torch.dtype) -> str:
    return SHORT.get(dtype, str(dtype).removeprefix("torch."))


def _shown(path: Path) -> str:
    """The path with the home directory as ~, as a user would type it."""
    home = str(Path.home())
    return "~" + str(path)[len(home):] if str(path).startswith(home + os.sep) else str(path)
