"""The lessons' exercises: each grader passes the reference answer and catches wrong ones."""
import pytest
import torch

from minipar.lessons import exercises, solutions
from minipar.pipeline import Action, one_f_one_b


def forgets_to_add(tensor, dist):
    """Passes the chunks round the ring but never adds: ends with what the left neighbour sent."""
    rank, n = dist.get_rank(), dist.get_world_size()
    mine = torch.tensor_split(tensor, n)
    ready = mine[(rank - 1) % n].clone()
    for s in range(n - 1):
        incoming = torch.empty_like(mine[(rank - s - 2) % n])
        sending = dist.isend(ready, (rank + 1) % n)
        dist.irecv(incoming, (rank - 1) % n).wait()
        sending.wait()
        ready = incoming
    return ready


def sends_everything(tensor, dist):
    """Right sum, wrong traffic: every rank sends its whole tensor to every other rank."""
    rank, n = dist.get_rank(), dist.get_world_size()
    sends = [dist.isend(tensor, peer) for peer in range(n) if peer != rank]
    total = tensor.clone()
    for peer in range(n):
        if peer != rank:
            got = torch.empty_like(tensor)
            dist.recv(got, peer)
            total += got
    for s in sends:
        s.wait()
    return torch.tensor_split(total, n)[rank]


def receives_first(tensor, dist):
    """Every rank waits for its left neighbour before sending: a deadlock."""
    rank, n = dist.get_rank(), dist.get_world_size()
    got = torch.empty_like(torch.tensor_split(tensor, n)[rank])
    dist.recv(got, (rank - 1) % n)
    return got


def test_the_reduce_scatter_answer_passes_on_threads_and_processes():
    report = exercises.check_reduce_scatter(solutions.ring_reduce_scatter, world=3, numel=10)
    assert "gloo processes" in report and "[4, 3, 3]" in report


@pytest.mark.parametrize("world,numel", [(2, 5), (4, 10), (5, 3)])
def test_the_reduce_scatter_answer_passes_for_other_sizes_on_threads(world, numel):
    exercises.check_reduce_scatter(solutions.ring_reduce_scatter, world, numel, processes=False)


@pytest.mark.parametrize("wrong,message", [(forgets_to_add, "expected the sum"),
                                           (sends_everything, "a ring sends"),
                                           (receives_first, "deadlock")])
def test_wrong_reduce_scatters_are_caught(wrong, message, monkeypatch):
    monkeypatch.setattr(exercises, "WAIT_S", 0.5)
    with pytest.raises(AssertionError, match=message):
        exercises.check_reduce_scatter(wrong, processes=False)


def test_collectives_are_not_allowed_in_the_reduce_scatter():
    def uses_all_reduce(tensor, dist):
        dist.all_reduce(tensor)
        return tensor

    with pytest.raises(AssertionError, match="only point-to-point"):
        exercises.check_reduce_scatter(uses_all_reduce)


def test_the_zb_h1_answer_passes():
    report = exercises.check_zb_h1(solutions.zb_h1_from_1f1b)
    assert report.startswith("ZB-H1 correct") and "p=4 m=8: bubble 0.111" in report


def w_right_after_b(p, m):
    """Split the backward but never defer W: the bubble stays 1F1B's."""
    return [[x for a in ops for x in ([a, Action("W", a.stage, a.microbatch)] if a.op == "B"
                                      else [a])] for ops in one_f_one_b(p, m)]


def w_before_b(p, m):
    return [[x for a in ops for x in ([Action("W", a.stage, a.microbatch), a] if a.op == "B"
                                      else [a])] for ops in one_f_one_b(p, m)]


def every_w_at_the_end(p, m):
    """Defers every W: a small bubble, but all m micro-batches in flight on the last rank."""
    return [ops + [Action("W", a.stage, a.microbatch) for a in ops if a.op == "B"]
            for ops in one_f_one_b(p, m)]


@pytest.mark.parametrize("wrong,message", [(w_right_after_b, "bubble"),
                                           (w_before_b, "pipeline.check refuses"),
                                           (every_w_at_the_end, "in flight"),
                                           (one_f_one_b, "no W actions")])
def test_wrong_zb_h1s_are_caught(wrong, message):
    with pytest.raises(AssertionError, match=message):
        exercises.check_zb_h1(wrong)
