"""minipar.comm's from-scratch collectives against torch.distributed's, and their bytes against the formulas.

One launch per world size runs every case (workers_comm.run_all) and returns numbers; the tests here
assert on them. The ring schedule is also checked as pure data, without processes.
"""
import math

import pytest
import torch
import workers_comm

import minipar
from minipar import comm

WORLDS = [2, 3, 4, 5]
LENGTHS = [1, 7, 1000, 2**20]
SHAPES = lambda n: [(3, 5), (2 * n + 1, 3, 4), (3 * n, 2), (1, 6)]  # noqa: E731 (multi-dim cases)
SUBGROUPS = {4: [[0, 2], [1, 3]], 5: [[0, 2, 4], [1, 3]]}
TOL = {"fp32": 1e-6, "bf16": 0.0}  # relative; bf16 inputs are small integers, so sums are exact
ESIZE = {"fp32": 4, "bf16": 2}
_cache = {}


def results(n: int) -> list[dict]:
    """Every case at world size n, by rank (one launch per n, shared by all tests)."""
    if n not in _cache:
        try:
            _cache[n] = minipar.launch(workers_comm.run_all, n, LENGTHS, SUBGROUPS.get(n, []), timeout=60)
        except Exception as e:  # noqa: BLE001 (report the same failure to every test of this world)
            _cache[n] = e
    if isinstance(_cache[n], Exception):
        raise _cache[n]
    return _cache[n]


def split_sizes(shape, n: int) -> list[int]:
    """Elements in each part of torch.tensor_split along dim 0."""
    return [c.numel() for c in torch.tensor_split(torch.empty(shape), n)]


def ring_elems(sizes: list[int], rank: int, phases) -> int:
    """Elements `rank` sends over the ring phases, summed step by step from ring_schedule."""
    return sum(sizes[step[rank][0]] for phase in phases for step in comm.ring_schedule(len(sizes), phase))


def check(res: dict, dname: str, op: str, nbytes: int | None = None):
    """Values equal torch's and the exact answer; one call; only `op` bytes, nbytes of them if given."""
    assert res["vs_torch"] <= TOL[dname], res
    assert res["vs_exact"] <= TOL[dname], res
    assert res["calls"] == {op: 1}, res
    assert {k for k, v in res["bytes"].items() if v} <= {op}, res
    if nbytes is not None:
        assert res["bytes"].get(op, 0) == nbytes, (res, nbytes)


# ----------------------------------------------------------------------------- values and bytes


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("n", WORLDS)
def test_all_reduce(n, length, dname):
    sizes = split_sizes((length,), n)
    for r, out in enumerate(results(n)):
        res = out["all_reduce", dname, length]
        elems = ring_elems(sizes, r, ["reduce-scatter", "all-gather"])
        check(res, dname, "all_reduce", elems * ESIZE[dname])
        assert abs(elems - 2 * (n - 1) / n * length) <= 2 * (n - 1)
        assert res["in_place"]


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("n", WORLDS)
def test_broadcast(n, length, dname):
    srcs = range(n) if length < 2**20 else [n - 1]
    for src in srcs:
        for r, out in enumerate(results(n)):
            last = (src - 1) % n  # the chain follows the ring from src and ends at src - 1
            res = out["broadcast", dname, length, src]
            check(res, dname, "broadcast", 0 if r == last else length * ESIZE[dname])
            assert res["in_place"]


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("n", WORLDS)
def test_all_gather(n, length, dname):
    for out in results(n):
        res = out["all_gather", dname, length]
        check(res, dname, "all_gather", (n - 1) * length * ESIZE[dname])  # (N-1)/N of the output
        assert res["input_kept"]


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("n", WORLDS)
def test_reduce_scatter(n, length, dname):
    sizes = split_sizes((length,), n)
    for r, out in enumerate(results(n)):
        res = out["reduce_scatter", dname, length]
        elems = ring_elems(sizes, r, ["reduce-scatter"])
        check(res, dname, "reduce_scatter", elems * ESIZE[dname])
        assert abs(elems - (n - 1) / n * length) <= n - 1
        assert res["input_kept"]


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("n", WORLDS)
def test_multidim(n, dname):
    """all_gather concatenates on dim 0; reduce_scatter returns tensor_split(sum, n)[rank] on dim 0."""
    for r, out in enumerate(results(n)):
        for shape in SHAPES(n):
            check(out["all_gather", dname, shape], dname, "all_gather",
                  (n - 1) * math.prod(shape) * ESIZE[dname])
            elems = ring_elems(split_sizes(shape, n), r, ["reduce-scatter"])
            check(out["reduce_scatter", dname, shape], dname, "reduce_scatter", elems * ESIZE[dname])
        check(out["all_gather", dname, ()], dname, "all_gather", (n - 1) * ESIZE[dname])  # 0-dim -> (n,)


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("n", WORLDS)
def test_all_reduce_non_contiguous(n, dname):
    for out in results(n):
        res = out["all_reduce_strided", dname, (7, 9)]
        check(res, dname, "all_reduce")
        assert not res["contiguous"] and res["in_place"] and res["untouched"], res


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("n", sorted(SUBGROUPS))
def test_subgroups(n, dname):
    """Groups made by dist.new_group run side by side; broadcast's src is a global, non-zero rank."""
    out = results(n)
    for ranks in SUBGROUPS[n]:
        g = len(ranks)
        for i, rank in enumerate(ranks):
            for length in (7, 1000):
                sizes = split_sizes((length,), g)
                check(out[rank]["sub_all_reduce", dname, length], dname, "all_reduce",
                      ring_elems(sizes, i, ["reduce-scatter", "all-gather"]) * ESIZE[dname])
                last = i == len(ranks) - 2  # the chain starts at ranks[-1] and ends just before it
                check(out[rank]["sub_broadcast", dname, length], dname, "broadcast",
                      0 if last else length * ESIZE[dname])
                check(out[rank]["sub_all_gather", dname, length], dname, "all_gather",
                      (g - 1) * length * ESIZE[dname])
                check(out[rank]["sub_reduce_scatter", dname, length], dname, "reduce_scatter",
                      ring_elems(sizes, i, ["reduce-scatter"]) * ESIZE[dname])


@pytest.mark.parametrize("dname", ["fp32", "bf16"])
@pytest.mark.parametrize("n", WORLDS)
def test_grouped_path(n, dname):
    """Without receives posted ahead (NCCL's path: each step's send and receive as one group)."""
    for r, out in enumerate(results(n)):
        for length in (7, 1000):
            sizes = split_sizes((length,), n)
            check(out["grouped_all_reduce", dname, length], dname, "all_reduce",
                  ring_elems(sizes, r, ["reduce-scatter", "all-gather"]) * ESIZE[dname])
            check(out["grouped_broadcast", dname, length], dname, "broadcast",
                  0 if r == n - 2 else length * ESIZE[dname])
            check(out["grouped_all_gather", dname, length], dname, "all_gather", (n - 1) * length * ESIZE[dname])
            check(out["grouped_reduce_scatter", dname, length], dname, "reduce_scatter",
                  ring_elems(sizes, r, ["reduce-scatter"]) * ESIZE[dname])


# ----------------------------------------------------------------------------- the ring as data


@pytest.mark.parametrize("n", range(1, 9))
def test_ring_schedule(n):
    rs, ag = comm.ring_schedule(n, "reduce-scatter"), comm.ring_schedule(n, "all-gather")
    assert len(rs) == len(ag) == n - 1
    for sched in (rs, ag):
        for step in sched:
            assert sorted(s for s, _ in step) == list(range(n))  # each chunk sent once per step
            assert all(step[r][1] == step[(r - 1) % n][0] for r in range(n))  # recv what left sends
    if n > 1:
        assert [rs[-1][r][1] for r in range(n)] == list(range(n))  # rank r gets chunk r last
        assert [ag[0][r][0] for r in range(n)] == list(range(n))  # and starts the gather with it

    # Simulate which ranks' contributions each rank's copy of each chunk holds.
    holds = [[{r} for _ in range(n)] for r in range(n)]  # holds[rank][chunk]
    for step in rs:
        sent = [set(holds[(r - 1) % n][step[(r - 1) % n][0]]) for r in range(n)]
        for r in range(n):
            holds[r][step[r][1]] |= sent[r]
    assert all(holds[r][r] == set(range(n)) for r in range(n))  # reduce-scatter: chunk r complete
    for step in ag:
        sent = [set(holds[(r - 1) % n][step[(r - 1) % n][0]]) for r in range(n)]
        for r in range(n):
            holds[r][step[r][1]] = sent[r]
    assert all(h == set(range(n)) for row in holds for h in row)  # all-gather: everything complete


def test_ring_schedule_rejects_unknown_phase():
    with pytest.raises(ValueError, match="phase"):
        comm.ring_schedule(4, "all-to-all")


# ----------------------------------------------------------------------------- the ring, observed


def check_trace(by_rank: list[dict], n: int, length: int) -> None:
    """demos.ring_trace's record, by rank, against the schedule and an exact simulation: each rank's
    observer saw 2(N-1) steps, each the chunk ring_schedule says arrives, holding the sum of the
    ranks the simulation says (rank r contributes 2**r, so a sum is a bit mask of its ranks); the
    last state is the all-reduce's result, every element 2**n - 1."""
    sizes = split_sizes((length,), n)
    plan = [(phase, s, step) for phase in ("reduce-scatter", "all-gather")
            for s, step in enumerate(comm.ring_schedule(n, phase), start=1)]
    masks = [[2**r] * n for r in range(n)]  # masks[rank][chunk]: the simulated sum
    want = [[[[m] * k for m, k in zip(row, sizes)] for row in masks]]
    for phase, _, step in plan:
        sent = [masks[(r - 1) % n][step[r][1]] for r in range(n)]  # what the left one holds
        for r in range(n):
            masks[r][step[r][1]] = sent[r] | masks[r][step[r][1]] if phase == "reduce-scatter" \
                else sent[r]
        want.append([[[m] * k for m, k in zip(row, sizes)] for row in masks])
    for r, trace in enumerate(by_rank):
        assert len(trace["steps"]) == 2 * (n - 1), trace["steps"]
        assert trace["steps"] == [(phase, s, step[r][1]) for phase, s, step in plan]
        assert [state[r] for state in want] == trace["states"], r
        final = [v for chunk in trace["states"][-1] for v in chunk]
        assert final == trace["all_reduce"] == [2**n - 1] * length


@pytest.mark.parametrize("n", [2, 3, 4])
def test_ring_observer_sees_comms_own_ring(n):
    """comm.all_reduce's observer (through the lesson's worker) sees every step of the real ring."""
    from minipar.lessons import demos
    length = 2 * n + 1  # uneven chunks
    by_rank = minipar.launch(demos.ring_trace, n, length, timeout=60)
    check_trace(by_rank, n, length)
    wrong = [dict(t, states=list(t["states"])) for t in by_rank]  # planted: one step's sum too full
    wrong[0]["states"][1] = [[2**n - 1] * len(c) for c in wrong[0]["states"][1]]
    with pytest.raises(AssertionError):
        check_trace(wrong, n, length)
    short = [dict(t, steps=t["steps"][:-1]) for t in by_rank]  # planted: a step missing
    with pytest.raises(AssertionError):
        check_trace(short, n, length)
