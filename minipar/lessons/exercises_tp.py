"""Exercises of lessons 04 (tensor parallelism) and 06 (3D parallelism), and their graders, in the
style of `minipar.lessons.exercises` (a grader returns a short report on a right answer and raises
AssertionError, saying what went wrong, on a wrong one; reference answers: `solutions`).

    check_row_parallel(fn)   lesson 04: the forward of a row-parallel linear, run on t threads
    check_coords(fn)         lesson 06: rank -> (dp_rank, tp_rank, pp_rank), against minipar.mesh
    block_calls(cfg, t, sp)  lesson 04: the collectives one tensor-parallel block calls, forward and
                             backward, counted on t threads (no processes)

Threads, not processes, for the reason exercises.py gives (a function defined in a notebook cell
cannot be imported by a worker process). The ranks meet through `Meeting`: each hands in its
tensor and gets every rank's back, in rank order, so every rank adds them in the same order.
`ThreadTPGroup` is a `TPGroup` whose collectives meet that way, so minipar's own
RowParallelLinear, ParallelAttention and ParallelMLP run on the threads unchanged, beside the
learner's answer.
"""
from __future__ import annotations

import queue
import threading
from dataclasses import dataclass, field

import torch
import torch.nn as nn

from minipar import comm
from minipar.lessons.exercises import WAIT_S, Abandoned, ThreadDist, on_threads
from minipar.mesh import Mesh
from minipar.tensor_parallel import ParallelAttention, ParallelMLP, RowParallelLinear, TPGroup


class Meeting:
    """Where `world` threads meet for a collective: `exchange(rank, x)` returns every rank's x, in
    rank order, once all have arrived. `abort()` (a rank raised) frees the others at once."""

    def __init__(self, world: int):
        self.slots, self.barrier = [None] * world, threading.Barrier(world, timeout=WAIT_S)

    def _wait(self, rank: int) -> None:
        try:
            self.barrier.wait()
        except threading.BrokenBarrierError:
            raise Abandoned(f"rank {rank} waited {WAIT_S:.0f} s in a collective that another "
                            "rank never joined: every rank must call it, as many times, in "
                            "the same order") from None

    def abort(self) -> None:
        self.barrier.abort()

    def exchange(self, rank: int, x: torch.Tensor) -> list[torch.Tensor]:
        self.slots[rank] = x.detach().clone()
        self._wait(rank)
        every = list(self.slots)
        self._wait(rank)  # nobody overwrites a slot before all have read them
        return every


def _sum(parts: list[torch.Tensor]) -> torch.Tensor:
    total = parts[0].clone()
    for p in parts[1:]:
        total += p
    return total


class CollectiveDist(ThreadDist):
    """ThreadDist (get_rank, get_world_size, point-to-point) plus torch.distributed's
    `all_reduce(tensor)`: the sum over the threads, in place. Counts its calls."""

    def __init__(self, rank: int, world: int, boxes: dict, meeting: Meeting):
        super().__init__(rank, world, boxes)
        self.meeting, self.all_reduces = meeting, 0

    def all_reduce(self, tensor: torch.Tensor, op=None, group=None, async_op: bool = False):
        self.all_reduces += 1
        tensor.copy_(_sum(self.meeting.exchange(self.rank, tensor)))


@dataclass(frozen=True)
class ThreadTPGroup(TPGroup):
    """A TPGroup of threads: its collectives meet at `meeting`, and each call is counted in `stats`
    (calls only: no ring runs here, so no bytes)."""
    meeting: Meeting | None = field(default=None, compare=False, repr=False)

    @property
    def ops(self) -> comm.Collectives:
        def met(kind, finish):
            def call(x, group=None):
                if self.stats is not None:
                    self.stats.record(kind, calls=1)
                return finish(x, self.meeting.exchange(self.rank, x))
            return call
        return comm.Collectives(
            met("all_reduce", lambda x, parts: x.copy_(_sum(parts))),
            met("reduce_scatter", lambda x, parts: _sum(parts).tensor_split(self.size)[self.rank]),
            met("all_gather", lambda x, parts: torch.cat(parts)))


# ----------------------------------------------------------------------------- lesson 04


ROW_CASES = ((2, 8, 6), (3, 10, 7), (4, 6, 5))  # (t, in features, out features): 10 and 6 split
                                               #   unevenly, as tensor_split cuts them


def _row_ranks(fn, t: int, linear: nn.Linear, x: torch.Tensor) -> list[dict]:
    """fn on t threads, rank r given x's r-th block of input features, the full weight and bias."""
    meeting = Meeting(t)
    boxes = {(s, d): queue.Queue() for s in range(t) for d in range(t) if s != d}

    def body(r):
        dist = CollectiveDist(r, t, boxes, meeting)
        y = fn(x.tensor_split(t, -1)[r].clone(), linear.weight.detach().clone(),
               linear.bias.detach().clone(), dist)
        return {"y": y, "all_reduces": dist.all_reduces}
    return on_threads(t, body, meeting.abort)


def _minipar_row(t: int, linear: nn.Linear, x: torch.Tensor) -> list[torch.Tensor]:
    """minipar's RowParallelLinear on t threads, each fed its block of x."""
    meeting = Meeting(t)
    with torch.no_grad():
        return on_threads(t, lambda r: RowParallelLinear(
            linear, ThreadTPGroup(None, t, r, meeting=meeting))(x.tensor_split(t, -1)[r]),
            meeting.abort)


def check_row_parallel(fn, cases=ROW_CASES) -> str:
    """Grade a learner's `fn(x_shard, weight, bias, dist) -> y`: the forward of a row-parallel
    linear. x_shard is rank r's block of the input's last dimension (what a column-parallel layer
    hands on, `x.tensor_split(t, -1)[r]`), weight and bias nn.Linear's, whole: fn takes its own
    block of the weight, and must return the full output x W^T + b on every rank. `dist` offers
    get_rank, get_world_size and all_reduce (in place, a sum). Each case (t, in, out) runs fn on t
    threads, against nn.Linear and against minipar's RowParallelLinear on the same threads."""
    rows = []
    for t, n_in, n_out in cases:
        torch.manual_seed(t)
        linear, x = nn.Linear(n_in, n_out), torch.randn(2, 3, n_in)
        with torch.no_grad():
            want = linear(x)
            w_blocks = linear.weight.tensor_split(t, 1)
            partials = [x.tensor_split(t, -1)[r] @ w_blocks[r].T for r in range(t)]
        where = f"t={t}, in={n_in}, out={n_out}"
        try:
            runs = _row_ranks(fn, t, linear, x)
        except AssertionError as e:
            hint = (" — nn.Linear's weight is (out, in): rank r's block is its input-feature "
                    f"columns, weight.tensor_split(t, dim=1)[r], of shape ({n_out}, in/t)"
                    if "shape" in str(e) else "")
            raise AssertionError(f"{where}: {e}{hint}") from e
        for r, run in enumerate(runs):
            y = run["y"]
            assert isinstance(y, torch.Tensor), f"{where}: rank {r} returned {type(y).__name__}"
            assert y.shape == want.shape, (
                f"{where}: rank {r} returned shape {tuple(y.shape)}, expected the full output "
                f"{tuple(want.shape)} on every rank")
            if torch.allclose(y, want, atol=1e-5):
                continue
            if any(torch.allclose(y, p + extra, atol=1e-5)
                   for p in partials for extra in (0, linear.bias)):
                raise AssertionError(f"{where}: rank {r} returned its own partial product x_r W_r^T"
                                     " (+ b): the sum over ranks is missing: all-reduce it (g)")
            if torch.allclose(y, want + (t - 1) * linear.bias, atol=1e-5):
                raise AssertionError(f"{where}: rank {r}'s output holds the bias {t} times: each "
                                     "rank added b before the all-reduce summed them; add it once,"
                                     " after the sum")
            raise AssertionError(f"{where}: rank {r}'s output is off by up to "
                                 f"{(y - want).abs().max():.3g} from nn.Linear's (its weight is "
                                 "(out, in); rank r's block: weight.tensor_split(t, dim=1)[r])")
        calls = [run["all_reduces"] for run in runs]
        assert calls == [1] * t, (f"{where}: all-reduces by rank {calls}: the forward of a "
                                  "row-parallel linear needs exactly one, on its output (g)")
        ref = _minipar_row(t, linear, x)
        assert all(torch.allclose(a, run["y"], atol=1e-5) for a, run in zip(ref, runs))
        rows.append(f"t={t}: in {n_in} as {[b.shape[1] for b in w_blocks]} columns a rank, "
                    f"out {n_out}")
    return ("row-parallel forward correct (= nn.Linear and minipar's RowParallelLinear on the same "
            "threads, one all-reduce a rank):\n  " + "\n  ".join(rows))


def block_calls(cfg, t: int, sequence_parallel: bool, batch: int = 1) -> dict:
    """{"forward", "backward": {collective: calls}} of one transformer block of cfg whose attention
    and MLP are minipar's tensor-parallel ones (`ParallelAttention`, `ParallelMLP`), run on t
    threads (rank 0's counts; every rank's are the same). With SP the block's input is the rank's
    sequence shard, as between two SP layers."""
    from minipar.model import Block
    meeting = Meeting(t)
    torch.manual_seed(0)
    full, x = Block(cfg), torch.randn(batch, cfg.seq_len, cfg.d_model)

    def body(r):
        stats = comm.CommStats()
        tp = ThreadTPGroup(None, t, r, sequence_parallel, stats=stats, meeting=meeting)
        block = Block(cfg)
        block.load_state_dict(full.state_dict())
        block.attn, block.mlp = ParallelAttention(block.attn, tp), ParallelMLP(block.mlp, tp)
        mine = (x.tensor_split(t, 1)[r] if sequence_parallel else x).clone().requires_grad_()
        y = block(mine)
        forward = dict(stats.calls)
        stats.calls.clear()
        y.backward(torch.ones_like(y))
        return {"forward": forward, "backward": dict(stats.calls)}
    return on_threads(t, body, meeting.abort)[0]


# ----------------------------------------------------------------------------- lesson 06


COORD_SHAPES = ((2, 2, 2), (8, 1, 1), (1, 8, 1), (1, 1, 8), (2, 4, 1), (4, 1, 2), (1, 2, 4),
                (3, 2, 2))  # (dp, tp, pp)


def check_coords(fn, shapes=COORD_SHAPES) -> str:
    """Grade a learner's `fn(rank, dp, tp, pp) -> (dp_rank, tp_rank, pp_rank)`: where global rank
    `rank` sits in minipar's grid, against `Mesh(dp, tp, pp).coords(rank)` for every rank of each
    shape."""
    for dp, tp, pp in shapes:
        mesh = Mesh(dp, tp, pp)
        got = [tuple(fn(r, dp, tp, pp)) for r in range(mesh.world)]
        want = [(c.dp_rank, c.tp_rank, c.pp_rank) for c in map(mesh.coords, range(mesh.world))]
        for r, (g, w) in enumerate(zip(got, want)):
            if g != w:
                tp_group = [got[i] for i in mesh.axis_groups("tp")[0]]
                wrong = [name for name, i in (("dp_rank", 0), ("tp_rank", 1), ("pp_rank", 2))
                         if g[i] != w[i]]
                where = (f"consecutive ranks 0..{tp - 1} are one TP group (your answer places "
                         f"them at {tp_group})" if "tp_rank" in wrong else
                         f"your {' and '.join(wrong)} {'is' if len(wrong) == 1 else 'are'} off")
                raise AssertionError(
                    f"dp={dp}, tp={tp}, pp={pp}: rank {r} -> {g}, minipar's grid has it at "
                    f"(dp_rank, tp_rank, pp_rank) = {w}. minipar puts tp innermost, then dp, then "
                    f"pp: {where}; rank = (pp_rank·dp + dp_rank)·tp + tp_rank")
    return (f"coords correct for {len(shapes)} shapes (dp, tp, pp): {list(shapes)}, every rank "
            "where minipar.mesh.Mesh puts it")
