"""The worker server that `launch` forks its ranks from, and `prestart`, which starts it early.

Nothing here imports torch: a lesson calls `minipar.prestart()` first thing, and the server imports
torch on one core while the lesson imports it (and the rest) on the other.
"""
from __future__ import annotations

import multiprocessing as mp
import multiprocessing.forkserver
import os
import threading

# what a worker imports, loaded once by the server: torch._dynamo too, since the first torch.optim
# optimizer a process builds imports it (about 800 modules, sympy among them; 2 s of CPU a rank
# on a 2-core machine), and every training worker builds one; minipar.train brings the rest of
# minipar (parallelize, the model, the techniques). With them a worker's first training step
# imports nothing the server lacks but two modules of a few ms (einops' torch backend,
# torch.profiler's CUPTI check).
PRELOAD = ["torch", "torch.distributed", "torch._dynamo", "minipar.launch", "minipar.train"]


def torchrun_rank() -> int | None:
    """This process's rank in a torchrun job (torchrun sets RANK and WORLD_SIZE), else None."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["RANK"])
    return None


def context():
    """multiprocessing's forkserver context (it keeps the one server a process has), told to preload
    PRELOAD: every launch after the first forks from a server that has imported it."""
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def prestart() -> None:
    """Start the worker server in a background thread and return at once: its imports, a few
    seconds of one core, then overlap what the caller does meanwhile (importing torch itself, a
    lesson's planning), and the first `launch` forks without waiting for them. Idempotent; nothing
    under torchrun, which starts the ranks itself."""
    if torchrun_rank() is None:
        threading.Thread(target=lambda: (context(), mp.forkserver.ensure_running()),
                         name="minipar-prestart", daemon=True).start()
