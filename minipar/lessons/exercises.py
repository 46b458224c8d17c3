"""Exercises the lessons set, and the graders that check a learner's answer with minipar's own
machinery (in the style of srush/LLM-Training-Puzzles and Stanford CS336's assignments).

Each grader returns a short report on a right answer and raises AssertionError, with a message
that says what went wrong, on a wrong one. Reference answers: `minipar.lessons.solutions`.

    check_reduce_scatter(fn)   lesson 00: a ring reduce-scatter from point-to-point messages
    check_zb_h1(build)         lesson 05: ZB-H1 from 1F1B (split each backward, defer the W)

Reduce-scatter, and why the answer takes `dist` as an argument: `minipar.launch` starts worker
processes, which can only run a function they can import; a function defined in a notebook cell
cannot be (`script_check` refuses it). So the learner writes `fn(tensor, dist) -> my part`, where
`dist` offers torch.distributed's point-to-point calls (`get_rank`, `get_world_size`, `isend`,
`irecv`, `send`, `recv`, with global ranks) and nothing else. The grader always runs `fn` on N
threads of this process with a stand-in `dist` that passes messages through queues (no processes:
works in a notebook, under nbval, on any CPU); a function defined in a module (a .py file) also
runs on N real gloo ranks with `torch.distributed` itself behind the same calls, next to
`minipar.comm.reduce_scatter`.
"""
from __future__ import annotations

import importlib
import queue
import threading

import torch

from minipar import comm, pipeline

P2P = ("get_rank", "get_world_size", "isend", "irecv", "send", "recv")
WAIT_S = 10.0  # how long a receive waits on the threads before the grader calls it a deadlock


# ----------------------------------------------------------------------------- reduce-scatter


def rank_input(rank: int, numel: int) -> torch.Tensor:
    """Rank r's tensor in the reduce-scatter exercise: whole numbers (every sum is exact in fp32),
    different on every rank and at every position, so a missing term or a wrong part shows."""
    return torch.arange(numel, dtype=torch.float32) * (rank + 1) + 100 * rank


def expected_part(rank: int, world: int, numel: int) -> torch.Tensor:
    """What rank `rank` must end with: its part of the sum, cut as minipar.comm cuts it
    (`torch.tensor_split(sum, world)[rank]`: the first numel % world parts one element longer)."""
    total = sum(rank_input(r, numel) for r in range(world))
    return torch.tensor_split(total, world)[rank]


class _Done:
    """The Work of a send on the threads: the message is already queued."""

    def wait(self, *args) -> bool:
        return True

    def is_completed(self) -> bool:
        return True


class _Receive:
    """The Work of a receive on the threads: wait() takes the next message from `src` into the
    buffer (messages between two ranks arrive in the order they were sent, as with gloo)."""

    def __init__(self, box: queue.Queue, tensor: torch.Tensor, src: int, dst: int):
        self.box, self.tensor, self.src, self.dst, self.done = box, tensor, src, dst, False

    def wait(self, *args) -> bool:
        if self.done:
            return True
        try:
            message = self.box.get(timeout=WAIT_S)
        except queue.Empty:
            raise AssertionError(f"rank {self.dst} waited {WAIT_S:.0f} s for a message from rank "
                                 f"{self.src} that never came: a deadlock (every rank receiving "
                                 "before anyone sends?) or a send to the wrong rank") from None
        if message.numel() != self.tensor.numel():
            raise AssertionError(f"rank {self.dst} posted a receive of {self.tensor.numel()} "
                                 f"elements, but rank {self.src} sent {message.numel()}: the two "
                                 "ranks disagree on which chunk moves at this step")
        self.tensor.copy_(message.view_as(self.tensor))
        self.done = True
        return True

    def is_completed(self) -> bool:
        return self.done


class ThreadDist:
    """torch.distributed's point-to-point calls for one of `world` threads; `boxes[(src, dst)]`
    carries the messages from src to dst. Counts the bytes and messages this rank sends."""

    def __init__(self, rank: int, world: int, boxes: dict):
        self.rank, self.world, self.boxes = rank, world, boxes
        self.bytes_sent = self.messages = 0

    def get_rank(self, group=None) -> int:
        return self.rank

    def get_world_size(self, group=None) -> int:
        return self.world

    def _box(self, src: int, dst: int) -> queue.Queue:
        who, peer = ("dst", dst) if src == self.rank else ("src", src)
        if not (isinstance(peer, int) and 0 <= peer < self.world) or peer == self.rank:
            raise AssertionError(f"rank {self.rank}: {who}={peer!r} is not another rank of "
                                 f"0 .. {self.world - 1}")
        return self.boxes[(src, dst)]

    def isend(self, tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> _Done:
        box = self._box(self.rank, dst)
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.messages += 1
        box.put(tensor.detach().clone())  # what a later change of `tensor` cannot reach
        return _Done()

    def irecv(self, tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> _Receive:
        return _Receive(self._box(src, self.rank), tensor, src, self.rank)

    def send(self, tensor: torch.Tensor, dst: int, group=None, tag: int = 0) -> None:
        self.isend(tensor, dst)

    def recv(self, tensor: torch.Tensor, src: int, group=None, tag: int = 0) -> int:
        self.irecv(tensor, src).wait()
        return src

    def __getattr__(self, name):
        raise AssertionError(f"dist.{name}: this exercise allows only point-to-point calls {P2P}")


class CountingDist:
    """torch.distributed itself, reduced to the point-to-point calls, counting what this rank
    sends (the real-process twin of ThreadDist)."""

    def __init__(self):
        import torch.distributed as dist
        self.dist, self.bytes_sent, self.messages = dist, 0, 0

    def get_rank(self, group=None) -> int:
        return self.dist.get_rank()

    def get_world_size(self, group=None) -> int:
        return self.dist.get_world_size()

    def isend(self, tensor, dst, group=None, tag=0):
        self.bytes_sent += tensor.numel() * tensor.element_size()
        self.messages += 1
        return self.dist.isend(tensor, dst)

    def irecv(self, tensor, src, group=None, tag=0):
        return self.dist.irecv(tensor, src)

    def send(self, tensor, dst, group=None, tag=0):
        self.isend(tensor, dst).wait()

    def recv(self, tensor, src, group=None, tag=0):
        return self.dist.recv(tensor, src)

    def __getattr__(self, name):
        raise AttributeError(f"dist.{name}: this exercise allows only point-to-point calls {P2P}")


class Abandoned(AssertionError):
    """A rank left waiting in a collective: another rank raised, or never came."""


def on_threads(world: int, body, abort=None) -> list:
    """[body(rank) for every rank], each on its own thread. AssertionError if a rank raised (an
    AssertionError as it is, another error with its rank) or hung; a rank that raises calls
    `abort()`, which frees the ranks waiting for it (they raise Abandoned), and its error is the
    one reported."""
    results, errors = [None] * world, [None] * world

    def main(r: int) -> None:
        try:
            results[r] = body(r)
        except BaseException as e:  # reported below, with the rank
            errors[r] = e
            if abort is not None and not isinstance(e, Abandoned):
                abort()

    threads = [threading.Thread(target=main, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=3 * WAIT_S)
    for r, t in enumerate(threads):
        assert not t.is_alive(), f"rank {r} is still running after {3 * WAIT_S:.0f} s: a hang"
    # the cause first, then who waited for it
    for r, e in sorted(enumerate(errors), key=lambda re: isinstance(re[1], Abandoned)):
        if isinstance(e, AssertionError):
            raise e
        if e is not None:
            raise AssertionError(f"rank {r} raised {type(e).__name__}: {e}") from e
    return results


def run_on_threads(fn, world: int, numel: int) -> list[dict]:
    """fn(rank_input(r, numel), ThreadDist) on `world` threads; per rank {"out", "bytes",
    "messages"}. AssertionError if a rank raised (its error first) or hung."""
    boxes = {(s, d): queue.Queue() for s in range(world) for d in range(world) if s != d}
    dists = [ThreadDist(r, world, boxes) for r in range(world)]
    results = on_threads(world, lambda r: fn(rank_input(r, numel), dists[r]))
    return [{"out": results[r], "bytes": d.bytes_sent, "messages": d.messages}
            for r, d in enumerate(dists)]


def rank_worker(module: str, qualname: str, numel: int) -> dict:
    """One gloo rank of the process check (launched by `check_reduce_scatter`): the learner's
    function, imported by name, and minipar.comm.reduce_scatter on the same input."""
    import torch.distributed as dist
    fn = importlib.import_module(module)
    for part in qualname.split("."):
        fn = getattr(fn, part)
    counting = CountingDist()
    x = rank_input(dist.get_rank(), numel)
    out = fn(x.clone(), counting)
    return {"out": out, "bytes": counting.bytes_sent, "messages": counting.messages,
            "minipar": comm.reduce_scatter(x)}


def _importable(fn) -> bool:
    """Whether worker processes could import fn: defined at the top level of a module."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    return module not in (None, "__main__") and "<" not in name


def _check_parts(runs: list[dict], world: int, numel: int, where: str) -> None:
    """AssertionError unless every rank holds its part of the sum and sent what a ring sends."""
    for r, run in enumerate(runs):
        want, got = expected_part(r, world, numel), run["out"]
        assert isinstance(got, torch.Tensor), f"{where}: rank {r} returned {type(got).__name__}, " \
            "not a tensor"
        assert got.shape == want.shape, (
            f"{where}: rank {r} returned shape {tuple(got.shape)}, expected {tuple(want.shape)}: "
            f"chunk {r} of torch.tensor_split(tensor, {world}) (the first {numel % world} chunks "
            "are one element longer)")
        if not torch.equal(got.float(), want):
            own = torch.tensor_split(rank_input(r, numel), world)[r]
            hint = (" (that is this rank's own chunk: nothing was added to it)"
                    if torch.equal(got.float(), own) else "")
            raise AssertionError(f"{where}: rank {r} returned {got.tolist()}, expected the sum "
                                 f"over ranks of chunk {r}: {want.tolist()}{hint}")
        if "minipar" in run:
            assert torch.equal(run["minipar"], want), "minipar.comm.reduce_scatter disagrees"
    total = sum(run["bytes"] for run in runs)
    assert total == (world - 1) * 4 * numel, (
        f"{where}: the ranks sent {total} bytes together, a ring sends (N-1)·S = "
        f"{(world - 1) * 4 * numel}: each rank sends every chunk but its own once, never the "
        f"whole tensor (by rank: {[run['bytes'] for run in runs]})")
    for r, run in enumerate(runs):
        assert run["messages"] == world - 1, (
            f"{where}: rank {r} sent {run['messages']} messages, a ring's rank sends N-1 = "
            f"{world - 1}, one chunk a step to its right neighbour")


def check_reduce_scatter(fn, world: int = 3, numel: int = 10, processes: str | bool = "auto",
                         timeout: float = 60.0) -> str:
    """Grade a learner's ring reduce-scatter `fn(tensor, dist) -> this rank's part of the sum`.

    Runs it on `world` threads (a stand-in dist), and, if `processes` (default: when fn is defined
    in a module, which workers can import), on `world` gloo ranks launched by minipar.launch,
    where it is compared with minipar.comm.reduce_scatter too. numel: the tensor's length, by
    default 10 on 3 ranks so that the parts differ in length (4, 3, 3). Returns a short report."""
    from minipar.launch import launch
    if world < 2:
        raise ValueError(f"world must be at least 2, got {world}")
    runs = run_on_threads(fn, world, numel)
    _check_parts(runs, world, numel, "on threads")
    done = f"on {world} threads"
    if processes == "auto":
        processes = _importable(fn)
    if processes:
        if not _importable(fn):
            raise ValueError(f"{fn!r} is not defined at the top level of a module: worker "
                             "processes cannot import it (processes=False runs threads only)")
        runs = launch(rank_worker, world, fn.__module__, fn.__qualname__, numel, timeout=timeout)
        _check_parts(runs, world, numel, f"on {world} gloo processes")
        done += f" and on {world} gloo processes (= minipar.comm.reduce_scatter)"
    sizes = [t.numel() for t in torch.tensor_split(torch.empty(numel), world)]
    return (f"reduce-scatter correct {done}: {numel} elements over {world} ranks, parts of "
            f"{sizes}; bytes sent by rank {[run['bytes'] for run in runs]}: (N-1)/N·S a rank, "
            f"(N-1)·S = {(world - 1) * 4 * numel} overall (S = {4 * numel} bytes, {world} ranks)")


# ----------------------------------------------------------------------------- ZB-H1


ZB_CASES = ((2, 4), (3, 5), (4, 4), (4, 8), (5, 12))  # (p, m) pairs check_zb_h1 tries
UNIT = {"F": 1.0, "B": 1.0, "W": 1.0}


def check_zb_h1(build, cases=ZB_CASES) -> str:
    """Grade a learner's `build(p, m) -> list[list[Action]]`, ZB-H1 made from 1F1B.

    For each (p, m): `pipeline.check` must accept it (every F, B and W once, on the right rank, in
    a dependency order, no deadlock); simulated at T_F = T_B = T_W = 1 its bubble must be no more
    than minipar's `schedule("zb-h1", p, m)` (the formula's, tests/test_pipeline_simulate.py), with
    no rank holding more than p micro-batches in flight. Returns a short report."""
    rows = []
    for p, m in cases:
        plan = build(p, m)
        try:
            tl = pipeline.simulate(plan, p, m, cost=UNIT)  # checks the plan first
        except ValueError as e:
            raise AssertionError(f"p={p}, m={m}: pipeline.check refuses the schedule: {e}") from e
        assert any(a.op == "W" for ops in plan for a in ops), \
            f"p={p}, m={m}: no W actions: ZB-H1 splits each backward into B and W"
        ref = pipeline.simulate(pipeline.schedule("zb-h1", p, m), p, m, cost=UNIT)
        one = pipeline.simulate(pipeline.schedule("1f1b", p, m), p, m, cost=UNIT)
        peaks = tl.peak_in_flight
        assert max(peaks) <= p, (
            f"p={p}, m={m}: in flight by rank {peaks}, more than p={p} on some rank: deferring "
            "a W keeps its micro-batch's activations, defer at most r of them on rank r")
        assert tl.bubble <= ref.bubble + 1e-9, (
            f"p={p}, m={m}: bubble {tl.bubble:.4f}, ZB-H1's is {ref.bubble:.4f} (1F1B's "
            f"{one.bubble:.4f}): a W that runs right after its B still makes the previous rank "
            "wait; defer up to r Ws on rank r to the cool-down, where 1F1B idles")
        rows.append(f"p={p} m={m}: bubble {tl.bubble:.3f} (1F1B {one.bubble:.3f}), "
                    f"in flight {peaks}")
    return "ZB-H1 correct:\n  " + "\n  ".join(rows)
