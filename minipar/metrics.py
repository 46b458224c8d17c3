"""What a training run reports as it goes: the step clock, the progress bar, one JSON line per
step, and TensorBoard scalars.

Rank 0 writes, after every step, a line such as
    {"step": 12, "loss": 2.91, "val_loss": 2.95, "lr": 0.003, "grad_norm": 0.84,
     "tokens_per_s": 51200.0, "mfu": 0.18, "step_time": 0.02, "max_memory_mib": 612.4}
(`val_loss` on the steps that evaluate, `grad_norm` when clipping), flushed at once, so a run that
is stopped keeps what it did. With a TensorBoard folder, the same numbers go there as scalars
("train/loss", "val/loss", ...) through torch.utils.tensorboard, which needs the `tensorboard`
package: `train` checks that it is installed before any process starts.
"""
from __future__ import annotations

import importlib.util
import json
import os
import resource
import time

import torch


def check_tensorboard(folder: str | None) -> None:
    """ValueError now, rather than an ImportError on rank 0 later."""
    if folder and importlib.util.find_spec("tensorboard") is None:
        raise ValueError(f"tensorboard={folder!r} needs the tensorboard package: "
                         "pip install tensorboard")


def max_memory_mib(device: str) -> float:
    """This process's peak memory: the CUDA allocator's on a GPU, the resident set on a CPU."""
    if device.startswith("cuda"):
        return torch.cuda.max_memory_allocated(device) / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**10  # KiB on Linux


class MetricsLog:
    """The files of one run (rank 0 opens it; on other ranks every call does nothing)."""

    def __init__(self, jsonl: str | None = None, tensorboard: str | None = None,
                 active: bool = True, append: bool = False):
        """append: a resumed run adds to its file; a new one starts it afresh."""
        self.file = self.writer = None
        if active and jsonl:
            os.makedirs(os.path.dirname(os.path.abspath(jsonl)), exist_ok=True)
            self.file = open(jsonl, "a" if append else "w", encoding="utf-8")
        if active and tensorboard:
            from torch.utils.tensorboard import SummaryWriter  # only where it is used (optional)
            self.writer = SummaryWriter(tensorboard)

    @property
    def active(self) -> bool:
        """Whether anything is written (rank 0, asked for a file or a folder)."""
        return self.file is not None or self.writer is not None

    def write(self, step: int, values: dict) -> None:
        values = {k: v for k, v in values.items() if v is not None}
        if self.file:
            self.file.write(json.dumps({"step": step, **values}) + "\n")
            self.file.flush()
        if self.writer:
            for name, value in values.items():
                tag = "val/loss" if name == "val_loss" else f"train/{name}"
                self.writer.add_scalar(tag, value, step)

    def close(self) -> None:
        if self.file:
            self.file.close()
        if self.writer:
            self.writer.close()


class StepClock:
    """A step's time: CUDA events on a GPU (the device's own clock: what the kernels took, without
    stalling the host inside the step), time.perf_counter on a CPU."""

    def __init__(self, device: str):
        self.cuda = device.startswith("cuda")
        self.begin = None  # the step's start: a CUDA event, or perf_counter seconds

    def start(self) -> None:
        if self.cuda:
            self.begin = torch.cuda.Event(enable_timing=True)
            self.begin.record()
        else:
            self.begin = time.perf_counter()

    def stop(self) -> float:
        if not self.cuda:
            return time.perf_counter() - self.begin
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        end.synchronize()
        return self.begin.elapsed_time(end) / 1e3  # milliseconds -> seconds


class ProgressBar:
    """The caller's progress bar (tqdm, notebook-aware). Local ranks cannot reach it, so rank 0
    prints a tagged line per step (`print_line`) and the launcher hands those lines to `on_line`."""
    TAG = "minipar-progress:"

    def __init__(self, steps: int, show: bool, on_step=None):
        from tqdm.auto import tqdm  # not a minipar module: only where a bar is drawn
        self.bar = tqdm(total=steps, desc="train", mininterval=0.5) if show else None
        self.on_step = on_step

    def update(self, loss: float, tokens_per_s: float) -> None:
        if self.on_step is not None:
            self.on_step(loss, tokens_per_s)
        if self.bar is not None:
            self.bar.update(1)
            self.bar.set_postfix(loss=f"{loss:.3f}", tok_s=f"{tokens_per_s:,.0f}", refresh=False)

    @staticmethod
    def print_line(loss: float, tokens_per_s: float) -> None:
        print(f"{ProgressBar.TAG} {loss} {tokens_per_s}", flush=True)

    def on_line(self, rank: int, line: str) -> bool:
        if not line.startswith(self.TAG):
            return False
        self.update(*map(float, line.split()[1:]))
        return True

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
