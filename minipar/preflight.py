"""What `train` checks before any process starts, so that no work is lost to a mistake it could see.

A bad value in the training settings, a path that cannot be written, a model too large for this
machine's memory, or a checkpoint trained on other data: each is a one-line ValueError naming the
setting (or a warning, where continuing is a choice the user may mean), raised in the caller
before a worker is launched, never at the end of a run.
"""
from __future__ import annotations

import math
import os
import tempfile
import warnings

import torch

from minipar import memory

# the run's settings a checkpoint records: those that choose the data stream must match on resume
# (a different batch, seed or corpus would not continue the same training); the optimizer's may
# change, with a warning
DATA_SETTINGS = ("global_batch", "seed", "data", "tokenizer", "vocab")
OPTIMIZER_SETTINGS = ("lr", "weight_decay", "warmup", "decay", "clip")
PROCESS_BYTES = 380 * 2**20  # a CPU rank's own footprint after init_process_group, measured


def check_settings(*, steps, lr, weight_decay, clip, warmup, decay, eval_every, eval_batches,
                   save_every, timeout, slowdown, stop_file, save) -> None:
    """The loop's numbers, each in its range (ValueError naming the first that is not), and a
    stop_file only with a checkpoint to save."""
    def number(name, value, ok, rule):
        if isinstance(value, bool) or not isinstance(value, (int, float)) or not ok(value):
            raise ValueError(f"{name} must be {rule}, got {value!r}")

    def count(name, value, least):
        if isinstance(value, bool) or not isinstance(value, int) or value < least:
            rule = "a positive integer" if least == 1 else f"an integer >= {least}"
            raise ValueError(f"{name} must be {rule}, got {value!r}")

    count("steps", steps, 1)
    number("lr", lr, lambda v: math.isfinite(v) and v > 0, "a positive number")
    number("weight_decay", weight_decay, lambda v: math.isfinite(v) and v >= 0,
           "a number >= 0")
    number("clip", clip, lambda v: math.isfinite(v) and v >= 0, "a number >= 0 (0: no clipping)")
    number("timeout", timeout, lambda v: v > 0, "positive seconds")
    number("slowdown", slowdown, lambda v: 1 <= v < math.inf, "a number >= 1 (times slower)")
    for name, value in (("warmup", warmup), ("eval_every", eval_every), ("save_every", save_every)):
        count(name, value, 0)
    count("eval_batches", eval_batches, 1)
    if decay not in ("none", "cosine"):
        raise ValueError(f"decay must be 'none' or 'cosine', got {decay!r}")
    if warmup >= steps and warmup:
        raise ValueError(f"warmup ({warmup} steps) must be shorter than the run ({steps} steps)")
    if stop_file and not save:
        raise ValueError("stop_file needs save: a run it stops writes its checkpoint there")


def check_writable(path: str | None, what: str, folder: bool = False) -> None:
    """`path` (a file, or with `folder` a folder) can be written later: not the other kind, and it
    or its nearest existing parent is a folder that takes a file. Tried with a temporary file,
    removed at once: permissions alone do not tell (root may write where the filesystem refuses).
    Nothing is left behind."""
    if not path:
        return
    if os.path.exists(path) and os.path.isdir(path) != folder:
        kind = "a file: give a folder" if folder else "a directory: give a file path"
        raise ValueError(f"{what} {path!r} is {kind}")
    parent = os.path.abspath(path) if folder else os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    try:
        with tempfile.TemporaryFile(dir=parent):
            pass
    except OSError:
        raise ValueError(f"{what} {path!r} cannot be written: {parent!r} is not a writable "
                         "folder") from None


def available_memory(device: str) -> int:
    """Bytes this job can use: the GPU's free memory (one rank per GPU), or the RAM the operating
    system reports available (MemAvailable: free plus what it can reclaim)."""
    if device == "cuda":
        return torch.cuda.mem_get_info()[0]
    try:
        with open("/proc/meminfo") as f:
            kib = next(int(line.split()[1]) for line in f if line.startswith("MemAvailable:"))
        return kib * 1024
    except (OSError, StopIteration):
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_memory(cfg, par, global_batch: int, device: str, model_name: str = "the model") -> None:
    """The layout fits: memory.predict's bytes per rank against what the device has. Local CPU
    ranks share one RAM, so their sum counts (plus one full fp32 copy of the model each: every rank
    builds the whole model before cutting it); a GPU rank has its own memory."""
    ranks = [memory.predict(cfg, par, global_batch, rank=r % par.dp, pp_rank=r // par.dp)
             for r in range(par.dp * par.pp)]
    per_rank = [sum(m.values()) for m in ranks]
    # beyond the layout's own bytes: the full fp32 model each rank builds before cutting it, and
    # on a CPU each process's own footprint (torch and gloo, about 380 MiB after init)
    build = 4 * cfg.num_params if par.world > 1 else 0
    need = max(per_rank) + build if device == "cuda" else \
        (sum(per_rank) * par.tp + (build + PROCESS_BYTES) * par.world)
    have = available_memory(device)
    if need > have:
        where = "free on one GPU" if device == "cuda" else "of RAM available"
        raise ValueError(f"{model_name} needs about {need / 2**30:.1f} GiB (memory.predict for "
                         f"{par.label}, {par.world} rank{'s' * (par.world > 1)}) but this machine "
                         f"has {have / 2**30:.1f} GiB {where}: choose a smaller model, a smaller "
                         "global batch, or ZeRO-3 / more ranks on more devices")


def check_resume(saved: dict | None, settings: dict) -> None:
    """A resumed run continues the saved one: the settings that choose the data must be the same
    (ValueError naming each that differs); a changed optimizer setting is a warning. A checkpoint
    without settings (older) is accepted as it is."""
    if not saved:
        return
    differ = [(k, saved.get(k), settings[k]) for k in settings if saved.get(k) != settings[k]]
    data = [f"{k} {old!r} (this run: {new!r})" for k, old, new in differ if k in DATA_SETTINGS]
    if data:
        raise ValueError("the checkpoint was trained with " + ", ".join(data) + ": resume with "
                         "the same data settings, or start a new run")
    for k, old, new in differ:
        if k in OPTIMIZER_SETTINGS:
            warnings.warn(f"resuming with {k} {new!r}; the checkpoint was trained with {old!r}",
                          stacklevel=3)
