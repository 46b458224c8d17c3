"""The strategy explorer (minipar.lessons.explorer) without a browser: its controls move the estimate it shows.

test_browser.py drives the same dashboard in JupyterLab and Voila; here each control's `value` is set as
the browser would set it, and what the dashboard shows is read back: the summary's JSON (`data-estimate`),
the error box, the A/B table, the plots, the Run-here button's state."""
import html
import json
import re

import pytest

from minipar import Cluster, GPTConfig, ParallelConfig, estimate
from minipar.lessons import explorer_html
from minipar.lessons.explorer import KNOBS, explorer
from minipar.planner import cpu_time, this_machine
from minipar.planner.search import placements


def shown(ex) -> dict:
    """The estimate the summary shows, as its data-estimate JSON."""
    found = re.search(r"data-estimate='([^']*)'", ex.summary.value)
    return json.loads(html.unescape(found.group(1))) if found else {}


@pytest.fixture(scope="module")
def ex():
    return explorer("gpt2-xl", "dgx-a100-80g", 1, 64, "bf16", search="quick")


def test_it_starts_at_the_winner_and_shows_its_estimate(ex):
    winner, data = ex.estimates[0], shown(ex)
    assert data["label"] == winner.label and data["step_time"] == winner.step_time
    assert data["memory"] == winner.peak_memory and data["mfu"] == pytest.approx(winner.mfu)
    assert all(data[k] == getattr(winner.par, k) for k in ("dp", "tp", "pp", "zero"))
    assert ex.error_box.value == "" and len(ex.plots.outputs) == 3 and "layouts fit" in ex.ranking.outputs[0]["text"]
    assert ex.run_button.disabled  # a GPU cluster: nothing to run here


def test_the_sweep_is_the_planners_and_unchecked_combinations_are_marked(ex):
    """The third figure: the knobs' layout against one knob (planner.sweep); "none" leaves it out. The
    summary says which measurement has checked such a prediction, or that none has."""
    from minipar.planner import published, sweep
    ex.load(1)
    points = ex.sweep("micro_batch")
    want = sweep(ex.config(), ex.current.par, ex.cluster(), 64, ex.current.micro_batch, "micro_batch")
    assert [(v, e.step_time) for v, e in points] == [(v, e.step_time) for v, e in want]
    assert [v for v, _ in points] == [1, 2, 4, 8] and len(ex.plots.outputs) == 3  # 64 rows on dp 8
    ex.sweep_knob.value = "none"
    assert len(ex.plots.outputs) == 2
    ex.sweep_knob.value = "tp"  # gpt2-xl's 25 heads admit none of tp 2, 4, 8: listed under the plot
    assert [v for v, e in ex.sweep("tp") if isinstance(e, str)] == [2, 4, 8]
    assert "tp=8: ParallelConfig.tp (8) must divide the model's n_head (25)" in ex.plots.outputs[-1]["text"]
    assert shown(ex)["checked"] is None and "unchecked" in ex.summary.value  # ZeRO on one DGX A100
    table_5 = published.predict(published.RUNS["Table 5 22B selective"])[1]
    assert published.checked_by(table_5).startswith("Korthikanti")
    assert "unchecked" not in explorer_html.summary(table_5, None)


def test_each_control_moves_the_estimate_as_estimate_says(ex):
    ex.load(1)
    cfg, cluster = GPTConfig.preset("gpt2-xl"), Cluster.preset("dgx-a100-80g")
    before = [o["data"]["image/png"] for o in ex.plots.outputs if "data" in o]
    ex.knobs["dp"].value, ex.knobs["zero"].value = 4, 1
    ex.knobs["pp"].value = 2   # each change redraws; the last one is a valid layout
    ex.knobs["schedule"].value = "gpipe"
    data, b = shown(ex), ex.knobs["micro_batch"].value
    par = ParallelConfig(dp=4, pp=2, zero=1, schedule="gpipe", precision="bf16", microbatches=64 // (4 * b),
                         **{k: ex.knobs[k].value for k in ("tp", "recompute")})
    want = estimate(cfg, par, cluster, 64, b)
    assert (data["pp"], data["schedule"]) == (2, "gpipe") and data["step_time"] == want.step_time
    assert data["breakdown"]["bubble"] == want.breakdown["bubble"] > 0
    assert [o["data"]["image/png"] for o in ex.plots.outputs if "data" in o] != before
    assert set(KNOBS) - {"micro_batch"} <= set(data)


def test_a_broken_rule_shows_its_message_and_no_estimate(ex):
    ex.load(1)
    ex.knobs["virtual_stages"].value = 2  # without the interleaved schedule
    assert ex.current is None and shown(ex) == {} and ex.plots.outputs == ()
    assert "ValueError: ParallelConfig.virtual_stages=2 needs schedule=" in html.unescape(ex.error_box.value)
    ex.knobs["micro_batch"].value = 3   # 64 rows do not split into dp x 3
    assert "must be a multiple of dp x micro-batch" in ex.error
    ex.load(1)
    ex.refresh()
    assert ex.error is None and ex.error_box.value == ""


def test_pinned_a_stays_beside_b(ex):
    ex.load(1)
    ex.pin_button.click()
    a = ex.pinned
    ex.load(2)
    ex.refresh()
    assert a is not None and a.label in ex.ab.value and ex.current.label in ex.ab.value and "B / A" in ex.ab.value
    ratio = re.search(r"<td>step s</td><td>[^<]*</td><td>[^<]*</td><td>([^<]*)</td>", ex.ab.value).group(1)
    assert float(ratio) == pytest.approx(ex.current.step_time / a.step_time, rel=1e-3)


def test_a_cluster_change_plans_again_and_loads_the_winner(ex):
    ex.kind2.value = "dgx-h100"
    try:
        assert ex.cluster().world == 16 and shown(ex)["label"] == ex.estimates[0].label
        # on the winner's placement: the order of the kinds it was timed in (search.placements)
        assert shown(ex)["cluster"] == ex.estimates[0].cluster.name
        assert shown(ex)["cluster"] in [c.name for c in placements(ex.cluster())]
    finally:
        ex.kind2.value = "none"


def test_this_machine_refuses_a_model_it_cannot_time():
    ex = explorer("gpt2-xl", "this machine", 2, 8, "fp32")
    assert "at most 30M parameters" in ex.plan_error and "at most 30M parameters" in ex.error
    with pytest.raises(ValueError, match="cannot run here: the layout breaks a rule"):
        ex.run_here()
    with pytest.raises(ValueError, match="cluster one of"):
        explorer("gpt2-xl", "a cloud")


def test_the_cpu_pipeline_drawn_is_the_one_timed():
    cluster, cfg = this_machine(world=2), GPTConfig.preset("tiny")
    est = estimate(cfg, ParallelConfig(pp=2, microbatches=4), cluster, 8, 2)
    tl = est.timeline  # cpu_time's replay, carried by the estimate it timed
    assert tl.makespan + est.breakdown["dp_comm"] + est.breakdown["optimizer"] == pytest.approx(est.step_time)
    assert [len(rank) for rank in tl.events] == [8, 8] and tl == cpu_time.step_time(cfg, est)[2]


def test_run_here_trains_and_draws_measured_beside_predicted():
    ex = explorer("tiny", "this machine", 2, 8, "fp32")
    ex.set(dp=1, tp=1, pp=2, schedule="1f1b", virtual_stages=1, zero=0, micro_batch=2)
    ex.refresh()
    assert ex.why_not_run() is None and not ex.run_button.disabled
    ex.run_here(steps=2, wait=True)
    assert ex.run_error is None and ex.progress.value == 2 and len(ex.result.losses) == 2
    kinds = [o["output_type"] for o in ex.measured.outputs]
    assert kinds == ["stream", "display_data", "display_data"]  # the numbers, memory per rank, the two Gantts
    assert "predicted" in ex.measured.outputs[0]["text"] and "measured" in ex.measured.outputs[0]["text"]


# ----------------------------------------------------------------------------- the lessons' widgets
# minipar.lessons.widgets: one control per lesson (02, 03, 04, 06), no processes; each pure function's
# numbers against minipar's formulas, and each widget redraws when a control moves.

def _png(box) -> list:
    return [o["data"]["image/png"] for o in box.out.outputs if "data" in o]


def test_fp16_fates_are_torchs_casts():
    import torch

    from minipar.lessons.widgets import fp16_fates
    g = torch.tensor([2.0**-30, 2.0**-20, 2.0**-10, 1.0, 2.0**10])
    unscaled, scaled = fp16_fates(g, 0), fp16_fates(g, 6)   # 2^-30 -> 0; x 2^6: 2^16 -> inf
    assert [round(unscaled[k], 6) for k in ("zero", "subnormal", "normal", "overflow")] == [0.2, 0.2, 0.6, 0]
    assert [round(scaled[k], 6) for k in ("zero", "subnormal", "normal", "overflow")] == [0, 0.2, 0.6, 0.2]
    edges = torch.tensor([2.0**-25, 1.5 * 2.0**-25, 65504.0, 65519.0, 65520.0])   # lesson 02's edges
    fates = fp16_fates(edges, 0)
    assert (fates["zero"], fates["overflow"]) == (pytest.approx(0.2), pytest.approx(0.2))


def test_zero_memory_is_the_papers_table():
    from minipar import memory
    from minipar.lessons.widgets import zero_memory
    assert sum(zero_memory().values()) == pytest.approx(1.875e9)   # 7.5B on 64 GPUs, ZeRO-3
    for stage, gb in memory.zero_table(7.5e9, 64).items():
        assert sum(zero_memory(7.5e9, 64, stage).values()) / 1e9 == pytest.approx(gb)
    fp32 = zero_memory(1e9, 8, 2, "fp32")
    assert fp32 == memory.model_states(1e9, 8, 2, memory.FP32) == {"params": 4e9, "grads": 5e8, "optimizer": 1e9}
    assert sum(zero_memory(1e9, 1, 0, "bf16, fp32 grads").values()) == 18e9   # Megatron's 18 bytes


def test_tp_layer_is_the_lessons_formula_and_traffic_tp():
    from minipar.lessons.widgets import ACHIEVED, tp_layer
    got = tp_layer()   # GPT-3 175B, t = 8, over NVLink: lesson 04's 14%
    h, s, w = 12288, 2048, 450e9
    assert got["ratio"] == pytest.approx(2 * 7 * ACHIEVED / (9 * h * w * (1 + s / (6 * h)))) and got["ratio"] < 0.15
    assert tp_layer(bandwidth=50)["ratio"] > 1 and tp_layer(t=1)["sent"] == 0
    cfg = lambda n_layer: GPTConfig(n_layer=n_layer, n_head=8, d_model=256, vocab_size=128, seq_len=64)
    par = ParallelConfig(tp=4, precision="bf16")
    from minipar import traffic
    per_layer = traffic.tp(cfg(3), par, 2)["all_reduce"] - traffic.tp(cfg(2), par, 2)["all_reduce"]
    assert tp_layer(4, 256, 64, 2, 1.0)["sent"] == pytest.approx(per_layer)   # 8 b s h e (t-1)/t


def test_layout_3d_is_the_meshs():
    from minipar import Mesh
    from minipar.lessons.widgets import factorisations, layout_3d
    assert len(factorisations(8)) == 10 and all(d * t * p == 8 for d, t, p in factorisations(8))
    assert len(factorisations(12)) == 18 and (2, 3, 2) in factorisations(12)
    got, mesh = layout_3d(2, 4, 2), Mesh(2, 4, 2)
    assert got["coords"] == [(c.dp_rank, c.tp_rank, c.pp_rank) for c in map(mesh.coords, range(16))]
    assert got["groups"]["tp"] == [[0, 1, 2, 3], [4, 5, 6, 7], [8, 9, 10, 11], [12, 13, 14, 15]]
    assert got["groups"]["pp"][0] == [0, 8] and got["member"]["dp"][5] == 1


def test_each_lesson_widget_redraws_when_a_control_moves():
    import torch

    from minipar.lessons import widgets
    g = torch.logspace(-30, 10, 200, base=2.0)
    box = widgets.loss_scale({"some": g, "others": g / 8})
    before = _png(box)
    box.controls["log2_scale"].value = 20
    assert _png(box) != before and "scale 2^20" in box.out.outputs[-1]["text"]
    box = widgets.zero_memory_widget()
    assert box.controls["psi"].value == 7.5e9 and "total 1.875 GB" in box.out.outputs[-1]["text"]
    box.controls["stage"].value = 0
    assert "total 120 GB" in box.out.outputs[-1]["text"]
    box = widgets.tp_comm()
    before = _png(box)
    box.children[-2].value = 50.0   # the InfiniBand preset sets the bandwidth
    assert box.controls["bandwidth"].value == 50.0 and "comm / compute 1.218" in box.out.outputs[-1]["text"]
    assert _png(box) != before
    box = widgets.layout_3d_widget()
    box.controls["layout"].value = (1, 8, 1)
    assert "rank  7: dp 0, tp 7, pp 0" in box.out.outputs[-1]["text"]
    box.controls["world"].value = 4   # only 4's factorisations are offered, the most even drawn
    assert [v for _, v in box.controls["layout"].options] == [(1, 1, 4), (1, 2, 2), (1, 4, 1), (2, 1, 2),
                                                              (2, 2, 1), (4, 1, 1)]
    assert box.controls["layout"].value == (1, 2, 2) and "rank  3: dp 0, tp 1, pp 1" in box.out.outputs[-1]["text"]


def test_bucket_overlap_draws_the_prediction_of_demos_dp():
    """Lesson 01's widget: data_parallel.split's buckets, demos_dp.predict_exposed's timeline, drawn
    as backward's pieces and each all-reduce (its exposed part apart), the total in the title."""
    import matplotlib.pyplot as plt

    from minipar.lessons import demos_dp, widgets
    numels, arrivals = [100, 200, 300, 400], [4e-3, 3e-3, 2e-3, 1e-3]   # model order; backward: last first
    rows = widgets.bucket_timeline(numels, arrivals, 2000 / 2**20, 1e-4, 1e9, n=2)
    assert [r["params"] for r in rows] == [[3], [2, 1], [0]]             # 1600 B, 2000 B (exactly), 400 B
    want = demos_dp.predict_exposed([1600, 2000, 400], [1e-3, 2e-3, 1e-3], 1e-4, 1e9, 2)
    assert [{k: v for k, v in r.items() if k != "params"} for r in rows] == want
    assert want[0]["all_reduce"] == pytest.approx(2e-4 + 1600 / 1e9)      # 2(N-1) alpha + 2(N-1)/N S / beta
    assert want[-1]["start"] == 4e-3 and want[-1]["exposed"] == pytest.approx(want[-1]["all_reduce"])
    assert want[0]["exposed"] == 0 and sum(r["exposed"] for r in want) == pytest.approx(want[-1]["end"] - 4e-3)
    shown = []
    real_png = widgets.png
    widgets.png = lambda fig: shown.append(fig) or real_png(fig)
    try:
        outputs = widgets._bucket_draw(numels, arrivals, 2, 4, 2000 / 2**20, 1.0, 100.0)
    finally:
        widgets.png = real_png
    ax = shown[0].axes[0]
    from matplotlib.colors import to_rgba
    red = [p.get_width() for p in ax.patches if p.get_facecolor() == to_rgba("tab:red")]
    assert len(ax.patches) == 3 + 2 * 3   # 3 pieces of backward; each all-reduce: hidden, then exposed
    assert sum(red) == pytest.approx(sum(r["exposed"] for r in want) * 1e3)   # ms
    assert "3 buckets" in ax.get_title() and f"exposed {want[-1]['exposed'] * 1e3:.2f} ms" in ax.get_title()
    assert ax.get_xlabel().endswith("(ms)") and "exposed" in outputs[-1]["text"]
    plt.close("all")
    box = widgets.bucket_overlap(numels, arrivals, 1e-4, 1e9)
    before = _png(box)
    box.controls["bucket_mb"].value = 2.0**-12                          # 256 B: every tensor alone
    assert _png(box) != before and "4 buckets" in box.out.outputs[-1]["text"]


def test_the_schedule_widget_draws_the_simulators_result():
    """Lesson 10's widget: a trace, a cluster mix and a policy picked; what it prints is
    scheduler.simulate's Result for them (a made-up throughput matrix: no planner runs), a mix a
    job cannot run on says why, and a Result already simulated is drawn, not simulated again."""
    import numpy as np

    from minipar import scheduler
    from minipar.lessons import viz_scheduler, widgets

    speed = {"dgx-h100": 2.0, "dgx-a100-80g": 1.0, "tpu-v5e": 0.5}   # (the trace's reference: A100)
    rate = lambda job_type, kind, n: speed[kind] * n   # noqa: E731
    traces = {"gen": scheduler.generate(8, 20, seed=0, rate=rate),
              "other": scheduler.generate(6, 20, seed=1, rate=rate)}
    clusters = {"mix": {"dgx-h100": 8, "tpu-v5e": 8}, "tiny": {"dgx-h100": 1}}

    def want(trace, cluster, policy):
        jobs, caps = traces[trace], clusters[cluster]
        return scheduler.simulate(jobs, caps, policy,
                                  rates=scheduler.throughput_matrix(jobs, caps, rate=rate))

    box = widgets.schedule(traces, clusters, policy="las", rate=rate)
    assert box.out.outputs[-1]["text"].strip() == viz_scheduler.metrics(want("gen", "mix", "las"))
    before = _png(box)
    box.controls["policy"].value = "fifo"
    assert box.out.outputs[-1]["text"].strip() == viz_scheduler.metrics(want("gen", "mix", "fifo"))
    assert _png(box) != before
    box.controls["trace"].value = "other"
    assert "fifo: average JCT" in box.out.outputs[-1]["text"]
    box.controls["cluster"].value = "tiny"   # a job asks for more than 1 chip
    assert "fits on no kind" in box.out.outputs[-1]["text"] and not _png(box)
    seeded = widgets.schedule(traces, clusters, policy="las", rate=rate,
                              done={("gen", "mix", "las"): want("gen", "mix", "minipar")})
    assert seeded.out.outputs[-1]["text"].startswith("minipar: average JCT")
    # what the occupancy panel draws adds up to the utilisation the Result reports
    res = want("gen", "mix", "minipar")
    times = np.unique([0.0, *(s[3] for s in res.segments), *(s[4] for s in res.segments)])
    chip_s = sum(float(np.sum(viz_scheduler.held(res.segments, k, times[:-1]) * np.diff(times)))
                 for k in res.capacity)
    assert chip_s == pytest.approx(res.utilization * 16 * res.makespan, rel=1e-9)
