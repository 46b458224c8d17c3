"""The simulator reproduces the published bubbles and memory of each schedule; the timeline draws and traces."""
import json

import matplotlib
import pytest

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

from minipar.lessons import viz_pipeline  # noqa: E402
from minipar.pipeline import Action, Timeline, schedule, simulate, to_chrome_trace  # noqa: E402

UNIT = {"F": 1.0, "B": 1.0}  # no W: B is the whole backward, as long as the forward


@pytest.mark.parametrize("name", ["gpipe", "1f1b"])
def test_gpipe_and_1f1b_bubble_is_p_minus_1_over_m_plus_p_minus_1(name):
    for p in range(1, 9):
        for m in range(1, 17):
            tl = simulate(schedule(name, p, m), p, m, cost=UNIT)
            assert tl.bubble == (p - 1) / (m + p - 1), (p, m)  # exact: integer times
            assert tl.makespan == 2 * (m + p - 1)


def test_interleaved_bubble_is_p_minus_1_over_v_m():
    # each chunk is 1/v of the rank's layers, so its F and B cost 1/v: ideal time 2m per rank, bubble
    # time 2(p-1)/v, i.e. (p-1)/(v·m) of the ideal time and (p-1)/(v·m + p-1) of the step
    for p in range(1, 9):
        for v in (1, 2, 3):
            for m in range(p, 17, p):
                tl = simulate(schedule("interleaved-1f1b", p, m, v), p, m, v, cost={"F": 1 / v, "B": 1 / v})
                assert tl.bubble == pytest.approx((p - 1) / (v * m + p - 1), abs=1e-12), (p, m, v)
                assert sum(tl.idle) / p / (2 * m) == pytest.approx((p - 1) / (v * m), abs=1e-12)


def test_zb_h1_bubble_per_rank_is_p_minus_1_times_f_plus_b_minus_w():
    for tf, tb, tw in ((1, 1, 1), (1.0, 1.5, 0.5), (2, 2, 1)):
        cost = {"F": tf, "B": tb, "W": tw}
        for p in range(1, 9):
            for m in range(p, 17):
                zb = simulate(schedule("zb-h1", p, m), p, m, cost=cost)
                assert zb.idle == pytest.approx([(p - 1) * (tf + tb - tw)] * p), (p, m, cost)
                one = simulate(schedule("1f1b", p, m), p, m, cost=cost)  # B there is the whole backward
                assert one.idle == pytest.approx([(p - 1) * (tf + tb + tw)] * p)
                assert zb.peak_in_flight[0] == one.peak_in_flight[0] == p
                assert max(zb.peak_in_flight) == p  # same peak memory p·M_B as 1F1B


def test_peak_in_flight():
    for p in range(1, 9):
        for m in range(1, 17):
            assert simulate(schedule("gpipe", p, m), p, m).peak_in_flight == [m] * p
            assert simulate(schedule("1f1b", p, m), p, m).peak_in_flight == [min(p - r, m) for r in range(p)]
    # interleaving: rank 0 holds (v+1)p-1 chunk-micro-batches of 1/v of its layers each, that is
    # 1 + (p-1)/(p·v) times 1F1B's p micro-batches (Korthikanti et al. 2022 §4.2.3, their m being v)
    for p, v, m in ((2, 2, 4), (4, 2, 8), (4, 3, 12), (8, 2, 16)):
        peak = simulate(schedule("interleaved-1f1b", p, m, v), p, m, v).peak_in_flight[0]
        assert peak / v == pytest.approx(p * (1 + (p - 1) / (p * v)))


def test_cost_per_chunk_and_latency():
    plan = schedule("gpipe", 2, 1)
    tl = simulate(plan, 2, 1, cost={"F": [1, 3], "B": [2, 4]}, latency=0.5)
    # F0 on rank 0 [0, 1], +0.5 -> rank 1 [1.5, 4.5], B [4.5, 8.5], +0.5 -> rank 0 B [9, 11]
    assert [(s, e) for _, s, e in tl.events[0]] == [(0, 1), (9, 11)]
    assert [(s, e) for _, s, e in tl.events[1]] == [(1.5, 4.5), (4.5, 8.5)]
    assert tl.makespan == 11 and tl.busy == [3, 7] and tl.idle == [8, 4]
    with pytest.raises(ValueError, match=r"one per chunk \(2\)"):
        simulate(plan, 2, 1, cost={"F": [1, 2, 3]})
    with pytest.raises(ValueError, match=r"cost keys"):
        simulate(plan, 2, 1, cost={"X": 1})


def test_timeline_from_measured_events():
    t = 100.0  # perf_counter seconds, tuples as the runtime records them
    events = [[(("F", 0, 0), t, t + 1), (("B", 0, 0), t + 3, t + 4)], [(("F", 1, 0), t + 1, t + 2),
                                                                        (("B", 1, 0), t + 2, t + 3)]]
    tl = Timeline.from_events(events)
    assert tl.events[0][0] == (Action("F", 0, 0), 0.0, 1.0)
    assert tl.makespan == 4 and tl.bubble == 0.5 and tl.peak_in_flight == [1, 1]
    assert tl.bubble == simulate(schedule("gpipe", 2, 1), 2, 1, cost=UNIT).bubble


@pytest.mark.parametrize("name, p, m, v", [("gpipe", 4, 6, 1), ("1f1b", 4, 8, 1), ("interleaved-1f1b", 4, 8, 2),
                                           ("zb-h1", 4, 8, 1), ("1f1b", 1, 1, 1)])
def test_gantt_and_chrome_trace(name, p, m, v, tmp_path):
    tl = simulate(schedule(name, p, m, v), p, m, v)
    fig = viz_pipeline.gantt(tl)
    fig.savefig(tmp_path / "g.png")
    plt.close(fig)
    fig, ax = plt.subplots()
    assert viz_pipeline.gantt(tl, ax=ax, title="x") is fig
    plt.close(fig)
    trace = to_chrome_trace(tl, tmp_path / "t.json")
    xs = [e for e in trace["traceEvents"] if e["ph"] == "X"]
    assert len(xs) == sum(map(len, tl.events))
    assert {e["tid"] for e in xs} == set(range(p))
    names = {e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "thread_name"}
    assert names == {f"pp rank {r}" for r in range(p)}
    assert xs[0]["name"] == "F0" and xs[0]["pid"] == 0
    assert json.loads((tmp_path / "t.json").read_text()) == json.loads(json.dumps(trace))
