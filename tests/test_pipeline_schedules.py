"""Pipeline schedules as data: every generated schedule passes `check`, broken ones are named, `validate`'s rules."""
from functools import partial

import pytest

from minipar.pipeline import Action, check, rank_of, schedule, stage_of, validate

F, B, W = (partial(Action, op) for op in "FBW")  # F(stage, microbatch)


def _cases():
    for name in ("gpipe", "1f1b", "zb-h1"):
        for p in range(1, 9):
            for m in range(1, 17):
                yield name, p, m, 1
    for p in range(1, 9):
        for v in (1, 2, 3):
            for m in range(p, 17, p):
                yield "interleaved-1f1b", p, m, v


def test_every_generated_schedule_passes_check():
    n = 0
    for name, p, m, v in _cases():
        plan = schedule(name, p, m, v)
        check(plan, p, m, v)
        assert len(plan) == p
        ops = "FBW" if name == "zb-h1" else "FB"
        assert sum(map(len, plan)) == len(ops) * p * v * m, (name, p, m, v)
        n += 1
    assert n > 400


def test_placement_helpers():
    assert [rank_of(k, 4) for k in range(8)] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert [stage_of(1, j, 4) for j in range(2)] == [1, 5]
    assert {a.stage for a in schedule("interleaved-1f1b", 4, 8, 2)[1]} == {1, 5}


def test_small_schedules_read_as_in_the_papers():
    assert schedule("gpipe", 2, 2) == [[F(0, 0), F(0, 1), B(0, 0), B(0, 1)], [F(1, 0), F(1, 1), B(1, 0), B(1, 1)]]
    assert schedule("1f1b", 2, 3) == [[F(0, 0), F(0, 1), B(0, 0), F(0, 2), B(0, 1), B(0, 2)],
                                      [F(1, 0), B(1, 0), F(1, 1), B(1, 1), F(1, 2), B(1, 2)]]
    # ZB-H1: rank 0 runs W right after B; the last rank defers up to p-1 Ws into its cool-down
    assert schedule("zb-h1", 2, 2) == [[F(0, 0), F(0, 1), B(0, 0), W(0, 0), B(0, 1), W(0, 1)],
                                       [F(1, 0), B(1, 0), F(1, 1), B(1, 1), W(1, 0), W(1, 1)]]
    assert schedule("interleaved-1f1b", 3, 6, 1) == schedule("1f1b", 3, 6)
    # interleaved, p = 2, v = 2: rank 0 runs chunk 0 on micro-batches 0, 1, then chunk 2 on them
    assert schedule("interleaved-1f1b", 2, 4, 2)[0][:4] == [F(0, 0), F(0, 1), F(2, 0), F(2, 1)]


def test_fewer_microbatches_than_stages_are_supported():
    for name in ("gpipe", "1f1b", "zb-h1"):
        check(schedule(name, 6, 2), 6, 2)


# ----------------------------------------------------------------------------- broken schedules are named


def _broken(plan, p, m, v=1, match=""):
    with pytest.raises(ValueError, match=match):
        check(plan, p, m, v)


def test_check_names_a_missing_action():
    plan = schedule("1f1b", 2, 3)
    del plan[1][3]  # B(1, 1)
    _broken(plan, 2, 3, match=r"rank 1: missing Action\(op='B', stage=1, microbatch=1\)")


def test_check_names_a_duplicate():
    plan = schedule("gpipe", 2, 2)
    plan[0].append(B(0, 1))
    _broken(plan, 2, 2, match=r"rank 0, action 4 .*duplicate")


def test_check_names_a_backward_before_its_forward():
    plan = schedule("1f1b", 2, 2)
    plan[1] = [B(1, 0), F(1, 0), F(1, 1), B(1, 1)]
    _broken(plan, 2, 2, match=r"rank 1, action 0 .*needs F0 of chunk 1, which must come earlier on the same rank")


def test_check_names_an_action_on_the_wrong_rank():
    plan = schedule("interleaved-1f1b", 2, 2, 2)
    plan[0][1] = F(1, 1)  # chunk 1 lives on rank 1
    _broken(plan, 2, 2, 2, match=r"rank 0, action 1 .*chunk 1 lives on rank 1")


def test_check_names_a_weight_gradient_before_its_backward():
    plan = schedule("zb-h1", 2, 2)
    plan[0][2], plan[0][3] = plan[0][3], plan[0][2]  # W0 before B0 on rank 0
    _broken(plan, 2, 2, match=r"rank 0, action 2 .*W0 of chunk 0 needs B0 of chunk 0")


def test_check_wants_weight_gradients_for_all_or_none():
    plan = schedule("1f1b", 2, 2)
    plan[1].append(W(1, 0))
    _broken(plan, 2, 2, match=r"missing Action\(op='W', stage=0, microbatch=0\) \(W for every")


def test_check_names_invalid_actions_and_rank_count():
    _broken([[Action("X", 0, 0)]], 1, 1, match=r"not a valid action")
    _broken([[F(0, 5)]], 1, 1, match=r"not a valid action")
    _broken([[]], 2, 1, match=r"one action list per pipeline rank \(2\)")


def test_check_names_a_deadlock():
    # rank 0 waits for B0 from rank 1 before it sends F1; rank 1 wants F1 before it runs B0
    plan = [[F(0, 0), B(0, 0), F(0, 1), B(0, 1)], [F(1, 0), F(1, 1), B(1, 0), B(1, 1)]]
    _broken(plan, 2, 2, match=r"deadlock: rank 0 at B0 of chunk 0 waits for B0 of chunk 1 \(rank 1\); "
                              r"rank 1 at F1 of chunk 1 waits for F1 of chunk 0 \(rank 0\)")


def test_check_names_same_rank_chunk_order():
    # one rank, two chunks: F of chunk 1 needs F of chunk 0 first
    plan = [[F(1, 0), F(0, 0), B(1, 0), B(0, 0)]]
    _broken(plan, 1, 1, 2, match=r"F0 of chunk 1 needs F0 of chunk 0")


# ----------------------------------------------------------------------------- validate


@pytest.mark.parametrize("args, match", [
    (("pipedream", 2, 2, 1), r"schedule must be one of"),
    (("1f1b", 0, 2, 1), r"stages must be a positive integer, got 0"),
    (("1f1b", 2, -1, 1), r"microbatches must be a positive integer"),
    (("1f1b", 2, 2.0, 1), r"microbatches must be a positive integer"),
    (("interleaved-1f1b", 2, 4, 0), r"virtual_stages must be a positive integer"),
    (("1f1b", 2, True, 1), r"microbatches must be a positive integer"),
    (("1f1b", 2, 4, 2), r"virtual_stages=2 needs schedule 'interleaved-1f1b'"),
    (("zb-h1", 2, 4, 2), r"virtual_stages=2 needs schedule 'interleaved-1f1b'"),
    (("interleaved-1f1b", 4, 6, 2), r"microbatches \(6\) to be a multiple of stages \(4\)"),
])
def test_validate_rules(args, match):
    with pytest.raises(ValueError, match=match):
        validate(*args)
    with pytest.raises(ValueError, match=match):
        schedule(*args)
