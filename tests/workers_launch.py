"""Worker functions for test_launch (workers import them by name)."""
import os
import signal
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist


def note_pid(folder):
    """Leave this worker's pid for the test to check, once every rank has started."""
    Path(folder, f"{dist.get_rank()}.pid").write_text(str(os.getpid()))
    dist.barrier()


def hello(x):
    print(f"hello from rank {dist.get_rank()} of {dist.get_world_size()}")
    print(f"to stderr from rank {dist.get_rank()}", file=sys.stderr)
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t)
    return dist.get_rank() * x, t.item()


def fail_on(bad_rank, folder):
    note_pid(folder)
    if dist.get_rank() == bad_rank:
        raise ValueError(f"rank {bad_rank} failed on purpose")
    dist.barrier()   # the others wait for a rank that never comes
    time.sleep(60)


def fail_just_before_the_watchdog(bad_rank, folder, timeout):
    """Rank bad_rank shows progress (a heartbeat), then raises 0.4 s before launch's watchdog
    would fire; the others wait quietly."""
    from minipar.launch import heartbeat
    note_pid(folder)
    if dist.get_rank() == bad_rank:
        heartbeat()
        time.sleep(timeout - 0.4)
        raise ValueError(f"rank {bad_rank} failed late")
    time.sleep(60)


def die_on(bad_rank, folder, last_words=None):
    note_pid(folder)
    if dist.get_rank() == bad_rank:
        if last_words:
            print(last_words, flush=True)
        os._exit(3)
    time.sleep(60)


def kill_self_on(bad_rank, folder):
    note_pid(folder)
    if dist.get_rank() == bad_rank:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(60)


def hang_on(bad_rank, folder):
    note_pid(folder)
    if dist.get_rank() == bad_rank:
        time.sleep(600)   # a rank stuck in its own code
    dist.barrier()


def silent_but_alive(seconds, every):
    """Run `seconds` without printing a line, saying heartbeat() every `every` seconds."""
    from minipar.launch import heartbeat
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        heartbeat()
        time.sleep(every)
    return dist.get_rank()


def backend_and_threads():
    return dist.get_backend(), torch.get_num_threads()


def threads_and_cores():
    return torch.get_num_threads(), sorted(os.sched_getaffinity(0))


def mesh_groups(dp, tp, pp):
    """This rank's coordinates and the global ranks of its three groups."""
    from minipar import Mesh
    mesh = Mesh.build(dp, tp, pp)
    ranks = {axis: dist.get_process_group_ranks(getattr(mesh, f"{axis}_group")) for axis in ("dp", "tp", "pp")}
    t = torch.tensor([float(dist.get_rank())])
    dist.all_reduce(t, group=mesh.tp_group)  # the groups work
    return mesh.coords(), ranks, t.item()


def first_optimizer_imports():
    """Modules a worker imports to build and step its first AdamW (the forkserver's preload should
    already hold them)."""
    before = set(sys.modules)
    p = torch.nn.Parameter(torch.ones(3))
    p.grad = torch.ones(3)
    torch.optim.AdamW([p]).step()
    return sorted(set(sys.modules) - before)
