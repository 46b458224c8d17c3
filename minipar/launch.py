"""Start N worker processes with torch.distributed initialised, and bring back what they return.

`launch(fn, world_size, *args)` runs `fn(*args)` on every rank and returns the results by rank.
Notebooks, scripts and tests call it, so it takes care of what makes multi-process code painful:

- backend: gloo on CPU, NCCL when there is one GPU per rank;
- cores: the ranks run on the cores the caller may run on (`cores()`: a job pinned by taskset stays
  there), each with max(1, cores // world) intra-op threads, so that ranks do not oversubscribe;
- rendezvous: the caller hosts the TCPStore on a free port of 127.0.0.1 (no port race);
- output: each rank's stdout and stderr (C-level writes too) come back line by line as
  "[rank r] ...", printed by the caller, so a notebook cell shows them;
- failure: when a rank raises, the others are stopped and the caller gets a `WorkerError` that
  carries that rank's traceback;
- hangs: `timeout` is a watchdog, not a deadline. A job may run for days; it is stopped only when
  no rank has shown progress (printed a line, returned, or called `heartbeat()`) for `timeout`
  seconds. Then every rank dumps its Python stack (faulthandler), is killed, and the caller gets a
  `WorkerTimeout` with the stacks. `timeout` also bounds one rendezvous or one collective;
- scripts: workers re-import the caller's script, so a script that launches outside
  `if __name__ == "__main__":`, or launches a function defined inside that block, gets a
  ValueError before any process starts (it would otherwise die in every worker, silently);
- cleanup: no process outlives the call, and a worker whose caller dies exits on its own;
- exit: a rank whose fn returned waits, on the caller's store, until every rank's fn has returned
  before it exits. gloo connects ranks pair by pair inside init_process_group and new_group, and
  a rank's side of a pair can be done before its peer's: one that left then (its fn did no
  collective) failed a slower peer still connecting ("Gloo connectFullMesh failed ... Connection
  closed by peer"; 1 launch in 200 of 2 ranks on a busy 2-core machine). A rank that raised does
  not wait: the caller stops the others;
- torchrun: when RANK and WORLD_SIZE are set, this process is already one rank of a job, so it
  joins that job, runs fn once, and returns every rank's result (gathered as objects).

Workers are started by a forkserver that has imported torch once (and torch._dynamo, which the
first optimizer imports: server.py), so a launch costs a fork rather than a fresh interpreter
(spawn: ~1 s a rank on a 2-core machine) and a worker's first training step imports nothing more
of note.
"""
from __future__ import annotations

import atexit
import collections
import datetime
import faulthandler
import multiprocessing as mp
import multiprocessing.connection
import os
import pickle
import signal
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist

from minipar import server
from minipar.script_check import check_script

WORKER_NAME = "minipar-rank"  # a launched worker's process name starts so: it knows it is one
HEARTBEAT = "minipar-heartbeat"  # the line heartbeat() writes; the caller consumes it unprinted


class WorkerError(RuntimeError):
    """A rank raised; the message carries its traceback."""


class WorkerTimeout(TimeoutError):
    """No rank showed progress for `timeout` s; the message says where each unfinished rank was."""


def heartbeat() -> None:
    """Say "this rank is still alive" to the launcher's watchdog without printing anything.

    A worker whose loop prints nothing for longer than launch's `timeout` calls it (once a training
    step, say). It writes a tagged line that the caller consumes; outside a worker that `launch`
    started (one process, a torchrun rank) it does nothing."""
    if mp.current_process().name.startswith(WORKER_NAME):
        # fd 1 is the pipe to the caller: written whole, never inside a line Python has buffered
        os.write(1, f"{HEARTBEAT}\n".encode())


def cores() -> list[int]:
    """The CPU cores this process may run on: its affinity (taskset, os.sched_setaffinity, a
    container's cpuset) where the system keeps one (Linux), else all of them."""
    if hasattr(os, "sched_getaffinity"):
        return sorted(os.sched_getaffinity(0))
    return list(range(os.cpu_count() or 1))


def pick_backend(backend: str, world_size: int) -> str:
    """"gloo" or "nccl" for `backend` ("auto", "gloo", "nccl") and `world_size` local ranks."""
    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if backend == "auto":
        return "nccl" if gpus >= world_size else "gloo"
    if backend == "nccl" and gpus < world_size:
        raise ValueError(f"backend='nccl' needs one GPU per rank: world_size={world_size}, "
                         f"GPUs={gpus}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'auto', 'gloo' or 'nccl', got {backend!r}")
    return backend


def launch(fn, world_size: int, *args, backend: str = "auto", timeout: float = 60.0, on_line=None,
           **kwargs) -> list:
    """Run fn(*args, **kwargs) on `world_size` fresh ranks; return fn's results, by rank.

    timeout: seconds without progress (no rank printed, returned or called `heartbeat()`) after
    which the job is stopped with a WorkerTimeout; also the limit of one rendezvous or collective.
    on_line(rank, line) -> bool, if given, sees each line of rank output first; True means it was
    handled (a progress report, say) and is not printed.
    """
    if not (isinstance(world_size, int) and not isinstance(world_size, bool) and world_size >= 1):
        raise ValueError(f"world_size must be a positive integer, got {world_size!r}")
    if not timeout > 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout!r}")
    if server.torchrun_rank() is not None:
        return _join_torchrun(fn, world_size, args, kwargs, backend, timeout)
    check_script(fn)
    backend = pick_backend(backend, world_size)
    ctx = server.context()
    store = dist.TCPStore("127.0.0.1", 0, world_size + 1, is_master=True,
                          timeout=datetime.timedelta(seconds=timeout), wait_for_workers=False)
    mine = cores()  # set in each worker: the server they fork from may have other cores
    threads = max(1, len(mine) // world_size)
    procs, results, outputs = [], {}, {}
    try:
        for rank in range(world_size):
            result_r, result_w = ctx.Pipe(duplex=False)
            out_r, out_w = ctx.Pipe(duplex=False)
            p = ctx.Process(target=_worker, name=f"{WORKER_NAME}{rank}", daemon=True,
                            args=(fn, args, kwargs, rank, world_size, backend, store.port, timeout,
                                  mine, threads, os.getpid(), result_w, out_w))
            p.start()
            result_w.close(), out_w.close()
            procs.append(p)
            results[result_r] = rank
            outputs[rank] = _Output(rank, out_r, on_line)
        return _collect(procs, results, outputs, timeout)
    finally:
        _stop(procs)
        for out in outputs.values():
            out.conn.close()
        for conn in results:
            conn.close()


def _collect(procs, results: dict, outputs: dict, timeout: float, grace: float = 0.5) -> list:
    """Wait for every rank's result, echoing output; stop at the first failure, or when no rank has
    shown progress (output, a heartbeat, a result) for `timeout` seconds.

    When one rank fails, the others often fail a moment later because their peer hung up. Failures
    that arrive within `grace` seconds are gathered, and the cause is reported: the first failure
    that is not a lost connection (a death is only seen when its pipe closes, so time alone can
    put an echo first).
    """
    returned = time.monotonic()  # the last progress that is not output: the start, a result
    done, failed = {}, {}  # rank -> result; rank -> (wall time of the failure, what happened)
    first_failure = None  # when the first failure arrived (monotonic seconds)
    pending = dict(results)
    while len(done) < len(procs):
        quiet = time.monotonic() - max([returned] + [o.heard for o in outputs.values()])
        # a failure already in is the cause, also when the watchdog would fire now
        if failed and (not pending or time.monotonic() > first_failure + grace or
                       quiet >= timeout):
            rank, (_, what) = min(failed.items(),
                                  key=lambda item: (_peer_lost(item[1][1]), item[1][0]))
            _drain(outputs)
            raise WorkerError(f"rank {rank} of {len(procs)} {what}\n"
                              f"({_the_others(rank, failed, done, len(procs))})")
        if quiet >= timeout:
            unfinished = [r for r in range(len(procs)) if r not in done]
            _dump_stacks(procs, unfinished, outputs)
            stacks = "\n".join(f"--- rank {r} ---\n" + "\n".join(outputs[r].tail)
                               for r in unfinished)
            raise WorkerTimeout(f"no progress for {timeout:g} s (no rank printed, returned or "
                                f"called heartbeat()); ranks {unfinished} were still running, "
                                f"their last output and stacks:\n{stacks}")
        for obj in _wait(pending, outputs, timeout=min(timeout - quiet, grace if failed else 1.0)):
            rank = pending.pop(obj)
            try:
                status, payload, when = pickle.loads(obj.recv_bytes())
            except EOFError:  # the pipe closed without a result: the rank died
                status, when, payload = "died", time.time(), _death(procs[rank], outputs, rank)
            if status == "ok":
                done[rank], returned = payload, time.monotonic()
                continue
            first_failure = first_failure if failed else time.monotonic()
            failed[rank] = (when, f"{'raised' if status == 'error' else 'died'}:\n{payload}")
    _drain(outputs)
    return [done[r] for r in range(len(procs))]


def _the_others(rank: int, failed: dict, done: dict, world: int) -> str:
    """The last line of a WorkerError: what became of the ranks besides the one reported."""
    also = sorted(set(failed) - {rank})
    stopped = [r for r in range(world) if r not in failed and r not in done]
    named = lambda ranks: f"rank{'s' * (len(ranks) > 1)} {', '.join(map(str, ranks))}"
    said = [f"{named(also)} failed too, not shown"] if also else []
    said += [f"{named(stopped)} {'were' if len(stopped) > 1 else 'was'} stopped"] if stopped else []
    return "; ".join(said) or "the others had finished"


def _death(proc, outputs: dict, rank: int) -> str:
    """What to say of a rank that died: its exit code and last output, or why it has none."""
    proc.join(1.0)
    _drain(outputs)
    out = outputs[rank]
    said = ("its last output:\n" + "\n".join(out.tail) if out.tail else
            "it printed nothing (it had started: killed from outside?)" if out.spoke else
            "the worker printed nothing: it may have failed while starting, see this terminal's "
            "stderr")
    code = proc.exitcode
    how = f"killed by {signal.Signals(-code).name}" if code is not None and code < 0 and \
        -code in signal.valid_signals() else "killed, or os._exit"
    return f"exit code {code} ({how}); {said}"


def _peer_lost(text: str) -> bool:
    """Whether a failure reads as the echo of another rank's: its connection to a peer went away."""
    return any(sign in text
               for sign in ("Connection closed by peer", "Connection reset by peer", "Broken pipe"))


class _Output:
    """One rank's output pipe and the partial line read from it so far."""

    def __init__(self, rank: int, conn, on_line=None):
        self.rank, self.conn, self.partial, self.open, self.on_line = rank, conn, b"", True, on_line
        self.tail = collections.deque(maxlen=60)  # the last lines, for error messages
        self.heard = 0.0  # when bytes last arrived (monotonic seconds): the watchdog's progress
        self.spoke = False  # whether any did: a rank that dies silently died while starting

    def echo(self) -> None:
        """Print the complete lines waiting in the pipe (at end of file, the rest too)."""
        try:
            chunk = os.read(self.conn.fileno(), 1 << 16)
        except OSError:
            chunk = b""
        *lines, self.partial = (self.partial + chunk).split(b"\n")
        if chunk:
            self.heard, self.spoke = time.monotonic(), True
        else:
            self.open = False
            lines, self.partial = [*lines, self.partial] if self.partial else lines, b""
        for line in map(lambda b: b.decode(errors="replace"), lines):
            if line == HEARTBEAT or self.on_line and self.on_line(self.rank, line):
                continue
            self.tail.append(line)
            print(f"[rank {self.rank}] {line}", flush=True)


def _wait(conns: dict, outputs: dict, timeout: float) -> list:
    """Wait on result pipes and open output pipes; echo the output that comes; return results."""
    live = {o.conn: o for o in outputs.values() if o.open}
    ready = mp.connection.wait([*conns, *live], timeout=timeout)
    for conn in ready:
        if conn in live:
            live[conn].echo()
    return [c for c in ready if c in conns]


def _drain(outputs: dict, wait: float = 0.2) -> None:
    """Echo what the ranks still have to say, for up to `wait` s (a failing rank's last words)."""
    end = time.monotonic() + wait
    while any(o.open for o in outputs.values()) and time.monotonic() < end:
        _wait({}, outputs, end - time.monotonic())


def _dump_stacks(procs, ranks: list[int], outputs: dict) -> None:
    """Ask these ranks to print their Python stacks (SIGUSR1 -> faulthandler), then echo them."""
    for rank in ranks:
        if procs[rank].is_alive():
            os.kill(procs[rank].pid, signal.SIGUSR1)
    _drain(outputs, wait=1.0)


def _stop(procs, grace: float = 2.0) -> None:
    """Terminate, then kill, every worker still running, and reap them all."""
    for p in procs:
        if p.is_alive():
            p.terminate()
    end = time.monotonic() + grace
    for p in procs:
        p.join(max(0.0, end - time.monotonic()))
        if p.is_alive():
            p.kill()
            p.join()


# ----------------------------------------------------------------------------- inside a worker


def _worker(fn, args, kwargs, rank, world_size, backend, port, timeout, affinity, threads, caller,
            result_w, out_w):
    os.dup2(out_w.fileno(), 1)
    os.dup2(out_w.fileno(), 2)
    sys.stdout = open(1, "w", buffering=1, closefd=False)
    sys.stderr = open(2, "w", buffering=1, closefd=False)
    faulthandler.register(signal.SIGUSR1, all_threads=False)
    threading.Thread(target=_exit_with_caller, args=(caller,), daemon=True).start()
    if hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, affinity)
    torch.set_num_threads(threads)
    if backend == "nccl":
        torch.cuda.set_device(rank)
    try:
        store = dist.TCPStore("127.0.0.1", port, world_size + 1, is_master=False,
                              timeout=datetime.timedelta(seconds=timeout))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size,
                                timeout=datetime.timedelta(seconds=timeout))
        message = ("ok", fn(*args, **kwargs), time.time())
    except BaseException:
        message = ("error", traceback.format_exc(), time.time())
    sys.stdout.flush(), sys.stderr.flush()
    try:
        result_w.send_bytes(pickle.dumps(message))
    except Exception:
        result_w.send_bytes(pickle.dumps(("error", traceback.format_exc(), time.time())))
    if message[0] == "ok":
        _wait_for_every_rank(store, rank, world_size)
        dist.destroy_process_group()
    os._exit(0 if message[0] == "ok" else 1)


def _wait_for_every_rank(store, rank: int, world_size: int) -> None:
    """Say on the store that this rank's fn returned, and wait until every rank's has (at most the
    store's timeout, launch's `timeout`). A barrier on the store rather than the process group: it
    needs no healthy connection, and with NCCL it creates no communicator.

    Until every fn has returned, a peer may still be completing a connection to this rank (see the
    module docstring); once it has, every connection has been made. A rank that raised never comes:
    the caller stops this one when it reports."""
    store.set(f"minipar/returned/{rank}", b"1")
    try:
        store.wait([f"minipar/returned/{r}" for r in range(world_size)])
    except dist.DistError:  # timed out (a rank ran on for `timeout` s), or the caller is gone
        pass


def _exit_with_caller(caller: int) -> None:
    """End this worker if the process that launched it is gone (a killed notebook kernel, say)."""
    while True:
        time.sleep(1.0)
        try:
            os.kill(caller, 0)
        except ProcessLookupError:
            os._exit(1)


def _join_torchrun(fn, world_size, args, kwargs, backend, timeout):
    """Under torchrun this process is one rank: join the job, run fn, gather every rank's result."""
    env_world = int(os.environ["WORLD_SIZE"])
    if world_size != env_world:
        raise ValueError(f"world_size={world_size} but torchrun started WORLD_SIZE={env_world} "
                         "processes")
    local = int(os.environ.get("LOCAL_RANK", 0))
    local_world = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    backend = pick_backend(backend, local_world)
    if backend == "nccl":
        torch.cuda.set_device(local)
    if not dist.is_initialized():
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout))
        atexit.register(dist.destroy_process_group)  # an undestroyed group aborts the exit
    results = [None] * world_size
    dist.all_gather_object(results, fn(*args, **kwargs))
    return results
