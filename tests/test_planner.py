"""The cost model and planner against published figures (docs/references.md), and the planner's rules.

No processes: everything here is arithmetic and the pipeline simulator.
"""
import dataclasses
import math
import re

import pytest

from minipar import memory
from minipar.config import ParallelConfig
from minipar.model import GPTConfig
from minipar.planner import TERMS, NoFeasiblePlan, candidates, estimate, explain, format_table, plan
from minipar.planner.cluster import Cluster, GiB
from minipar.planner.gpu_time import Work, ceiling_of, fit_efficiency, layer_cost, matmul
from minipar.step_memory import zero0_peak

A100 = "dgx-a100-80g"


# ----------------------------------------------------------------------------- ZeRO, Table I

ZERO_TABLE_I = {  # N_d: GB per device for stages 1, 2, 3 (7.5B parameters, K = 12)
    1: (120, 120, 120), 4: (52.5, 41.3, 30), 16: (35.6, 21.6, 7.5), 64: (31.4, 16.6, 1.88),
    1024: (30.1, 15.1, 0.12)}


@pytest.mark.parametrize("n_d", sorted(ZERO_TABLE_I))
def test_zero_paper_table_1(n_d):
    table = memory.zero_table(7.5e9, n_d)
    for stage, published in zip((1, 2, 3), ZERO_TABLE_I[n_d]):
        half = 0.005 if published < 2 else 0.05  # the table rounds to its last digit (41.25 -> 41.3)
        assert abs(table[stage] - published) <= half + 1e-9
        # the planner's model states (zero.py's padding included) give the same figures
        par = ParallelConfig(dp=n_d, zero=stage, precision="bf16")
        states = memory.rank_states(par, [7_500_000_000], memory.layout_bytes("bf16", False))
        assert abs(sum(states[k] for k in ("params", "grads", "optimizer")) / 1e9 - published) <= half + 1e-9


@pytest.mark.parametrize("dp,tp", [(1, 1), (2, 1), (4, 1), (3, 1), (2, 2), (1, 4), (4, 2)])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_estimate_memory_equals_memory_predict(dp, tp, precision):
    cfg, cluster = GPTConfig.preset("tiny"), Cluster.preset(A100)
    for zero in range(4 if tp == 1 else 3):
        if zero and dp == 1:
            continue
        for recompute in ("none", "selective", "full"):
            par = ParallelConfig(dp=dp, tp=tp, zero=zero, microbatches=2, precision=precision, recompute=recompute,
                                 sequence_parallel=tp > 1)
            est = estimate(cfg, par, cluster, global_batch=dp * 2 * 3, micro_batch=3)
            assert est.memory == pytest.approx(memory.predict(cfg, par, dp * 2 * 3), rel=0, abs=0), par.label


@pytest.mark.parametrize("dp,tp,pp,zero", [(3, 1, 1, 0), (3, 1, 1, 1), (2, 1, 1, 2), (3, 1, 1, 3),
                                           (2, 1, 2, 0), (2, 2, 2, 1), (2, 1, 4, 2)])
def test_planner_stages_and_memory_predict_are_one_functions_output(dp, tp, pp, zero):
    """The planner's memory of each stage and memory.predict's are memory.rank_states of the units
    the rank holds (memory.rank_units), plus the activations: one formula, not two copies."""
    cfg, m, b = GPTConfig.preset("tiny"), 4, 2
    par = ParallelConfig(dp=dp, tp=tp, pp=pp, zero=zero, microbatches=m, precision="bf16",
                         sequence_parallel=tp > 1)
    est = estimate(cfg, par, Cluster.preset(A100), global_batch=dp * m * b, micro_batch=b)
    assert list(est.layers) == memory.chunk_layers(cfg, est.par)
    for r in range(pp):
        states = memory.rank_states(est.par, memory.rank_units(cfg, tp, list(est.layers), pp, r),
                                    memory.layout_bytes("bf16"))
        for got in (est.stages[r], memory.predict(cfg, est.par, dp * m * b, pp_rank=r)):
            assert {c: got[c] for c in states} == states and set(got) == set(memory.CATEGORIES)
        assert est.stages[r] == memory.predict(cfg, est.par, dp * m * b, pp_rank=r)



@pytest.mark.parametrize("zero", [1, 3])
@pytest.mark.parametrize("layers", [(1, 2, 3, 2), (3, 2, 1, 2)])
def test_planner_stage_memory_follows_each_chunks_own_layers(zero, layers):
    """Interleaved, chunks of different sizes on one rank (chunk 0 holds the embeddings, chunk 3 the
    head): each stage's states are rank_states of its own chunks' units, as the full split cuts
    them (the planner caches them per rank)."""
    from minipar.planner.predict import sized

    cfg = GPTConfig.preset("tiny", n_layer=sum(layers))
    par = ParallelConfig(dp=2, pp=2, zero=zero, schedule="interleaved-1f1b", virtual_stages=2,
                         microbatches=2, precision="bf16")
    est = sized(cfg, par, Cluster.preset(A100), 8, 2, list(layers), (2, 2))
    for r in range(2):
        mine = lambda of: memory.rank_units(cfg, 1, list(layers), 2, r, of=of)  # noqa: E731
        gathered = memory.zero3_gathered(cfg, par, r, list(layers)) if zero == 3 else None
        states = memory.rank_states(par, mine(memory.chunk_units), memory.layout_bytes("bf16"), 0,
                                    mine(memory.chunk_params), gathered)
        assert {c: est.stages[r][c] for c in states} == states, r

# ----------------------------------------------------------------------------- Korthikanti et al. 2022

# name: (heads, hidden, layers, pp, GPUs, global batch, micro-batch, virtual stages,
#        published step with SP + selective, with full recompute, published MFU (selective))
TABLE_5 = {
    "22B": (64, 6144, 48, 1, 8, 4, 4, 1, 1.10, 1.42, 0.415),
    "175B": (96, 12288, 96, 8, 64, 64, 1, 2, 13.75, 18.13, 0.514),  # "interleaved": v not given; v = 2
    "530B": (128, 20480, 105, 35, 280, 280, 1, 1, 37.83, 49.05, 0.560),
    "1T": (160, 25600, 128, 64, 512, 512, 1, 1, 71.49, 94.42, 0.563),
}


def table_5_estimate(name, recompute):
    a, h, l, pp, gpus, B, b, v, *_ = TABLE_5[name]
    cfg = GPTConfig(n_layer=l, n_head=a, d_model=h, vocab_size=51200, seq_len=2048)
    par = ParallelConfig(dp=1, tp=8, pp=pp, schedule="interleaved-1f1b" if v > 1 else "1f1b", virtual_stages=v,
                         sequence_parallel=True, precision="bf16", recompute=recompute)
    # Megatron-LM in 2022 wrote the attention matrix to memory (Korthikanti's 5 a s^2 b): "materialized"
    return estimate(cfg, par, Cluster.preset(A100, nodes=gpus // 8), global_batch=B, micro_batch=b,
                    attention="materialized")


@pytest.mark.parametrize("name", sorted(TABLE_5))
def test_korthikanti_table_5_step_times_within_10_percent(name):
    *_, selective, full, mfu = TABLE_5[name]
    sel = table_5_estimate(name, "selective")
    assert sel.step_time == pytest.approx(selective, rel=0.10)
    assert sel.mfu == pytest.approx(mfu, rel=0.10)
    assert sum(sel.breakdown.values()) == pytest.approx(sel.step_time)
    assert table_5_estimate(name, "full").step_time == pytest.approx(full, rel=0.10)


def test_a100_efficiency_is_korthikanti_table_4_not_fitted_to_table_5():
    """One number for every row, from the Table 4 row whose setting Table 5 shares (sequence
    parallelism, 7.2 + 11.8 ms; it was taken from 7.7 + 11.9 ms, the row without SP, modelled with
    SP); the table's other rows, with and without SP, then come out within 10%."""
    cfg = GPTConfig(n_layer=1, n_head=64, d_model=6144, vocab_size=51200, seq_len=2048)
    cluster = Cluster.preset(A100)
    fitted = fit_efficiency(cfg, 7.2e-3 + 11.8e-3, 4, 8, cluster, materialized=True)
    assert cluster.efficiency == round(fitted, 2)
    rows = [(True, "none", 7.2e-3, 11.8e-3), (True, "selective", 7.2e-3, 13.1e-3),
            (False, "none", 7.7e-3, 11.9e-3), (False, "selective", 7.7e-3, 13.2e-3),
            (False, "full", 7.7e-3, 19.5e-3)]
    for sp, recompute, forward, backward in rows:
        w = Work(4, 8, sp, recompute, 2, cluster.peak_flops * cluster.efficiency, cluster.memory_bandwidth,
                 cluster.link(range(8)), False, True)
        cost = layer_cost(cfg, w)
        assert sum(cost["F"].values()) == pytest.approx(forward, rel=0.10), (sp, recompute)
        assert sum(cost["B"].values()) == pytest.approx(backward, rel=0.10), (sp, recompute)


def test_the_hopper_ceiling_is_the_measured_matmul_with_its_last_wave_counted():
    """790 of 989 TFLOP/s for an 8192^3 bf16 matmul on one H200: 4096 tiles on 132 SMs fill 31.03
    waves, so the ceiling of a full wave is higher than 790/989, and the model gives the
    measurement back."""
    h200 = Cluster.preset("h200")
    assert h200.efficiency == round(ceiling_of(790e12, 8192, h200), 2) > 790 / 989
    w = Work(1, 1, False, "none", 2, h200.peak_flops * h200.efficiency, h200.memory_bandwidth,
             h200.link([0]), False, False, h200.sms)
    assert 2 * 8192 ** 3 / matmul(8192, 8192, 8192, w) == pytest.approx(790e12, rel=0.005)


def test_compute_efficiency_moves_with_the_shapes():
    """The matmuls' efficiency (model FLOPs over time, over the ceiling) is not one constant: a
    wide TP split, a narrow model or a small micro-batch of short sequences runs below it."""
    cluster = Cluster.preset(A100)

    def efficiency(cfg, b, t):
        w = Work(b, t, True, "none", 2, cluster.peak_flops * cluster.efficiency,
                 cluster.memory_bandwidth, cluster.link(range(t)), False, False, cluster.sms)
        cost = layer_cost(cfg, w)
        flops = 3 * (2 * cfg.layer_matrices * b * cfg.seq_len + 4 * b * cfg.seq_len ** 2 * cfg.d_model) / t
        return flops / (cost["F"]["compute"] + cost["B"]["compute"]) / (cluster.peak_flops * cluster.efficiency)
    big = GPTConfig(n_layer=1, n_head=64, d_model=6144, seq_len=2048)
    assert 0.9 < efficiency(big, 4, 8) <= 1.0
    assert efficiency(big, 4, 8) > efficiency(big, 4, 64)  # h/t = 96: 0.75 of a tile wide
    small = GPTConfig(n_layer=1, n_head=8, d_model=512, seq_len=256)
    assert efficiency(small, 1, 1) < 0.5 * efficiency(small, 16, 1) <= 0.5 * 1.0  # memory-bound
    assert efficiency(GPTConfig(n_layer=1, n_head=32, d_model=4096, seq_len=2048), 1, 1) > \
        efficiency(GPTConfig(n_layer=1, n_head=32, d_model=4160, seq_len=2048), 1, 1)  # 4160 = 32.5 tiles


def test_table_5_errors_average_under_10_percent():
    """The issue's proof for published runs: each row within 15% (here 10%, above), the mean within
    10%, nothing tuned per row."""
    errors = [abs(table_5_estimate(name, rc).step_time / TABLE_5[name][8 + (rc == "full")] - 1)
              for name in TABLE_5 for rc in ("selective", "full")]
    assert max(errors) <= 0.10 and sum(errors) / len(errors) <= 0.10


# ----------------------------------------------------------------------------- the estimate's rules

CFG = GPTConfig(n_layer=24, n_head=16, d_model=2048, vocab_size=50304, seq_len=2048)


def test_estimate_terms_flops_and_mfu():
    par = ParallelConfig(dp=2, tp=2, pp=2, sequence_parallel=True, precision="bf16", zero=1, microbatches=4)
    est = estimate(CFG, par, Cluster.preset(A100, nodes=2), global_batch=64, micro_batch=2)  # 8 of 16 GPUs
    assert est.par.microbatches == 16 and set(est.breakdown) == set(TERMS)  # 64 / (dp * micro_batch)
    assert sum(est.breakdown.values()) == pytest.approx(est.step_time)
    assert est.model_flops == 64 * CFG.seq_len * CFG.flops_per_token  # model FLOPs: Korthikanti eq. 7
    assert est.mfu == pytest.approx(est.tflops_per_gpu * 1e12 / 312e12)
    assert all(v >= 0 for v in est.breakdown.values())


def test_schedules_memory_and_bubble():
    """GPipe keeps m micro-batches alive on the first stage, 1F1B p; interleaving shrinks the bubble."""
    cluster, base = Cluster.preset(A100), ParallelConfig(dp=1, tp=2, pp=4, precision="bf16", sequence_parallel=True)
    est = {s: estimate(CFG, base.replace(schedule=s, virtual_stages=2 if s.startswith("inter") else 1), cluster,
                       global_batch=16, micro_batch=1) for s in ("gpipe", "1f1b", "interleaved-1f1b")}
    first = {s: e.stages[0]["activations"] for s, e in est.items()}
    assert first["gpipe"] == pytest.approx(16 / 4 * first["1f1b"])
    assert first["1f1b"] < first["interleaved-1f1b"] < 1.5 * first["1f1b"]  # x (1 + (p-1)/(p v)) at most
    assert est["gpipe"].breakdown["bubble"] == pytest.approx(est["1f1b"].breakdown["bubble"], rel=0.01)
    assert est["interleaved-1f1b"].breakdown["bubble"] < 0.7 * est["1f1b"].breakdown["bubble"]
    assert est["1f1b"].breakdown["pp_p2p"] > 0 and est["1f1b"].breakdown["dp_comm"] == 0


def test_links_dp_across_nodes_is_slower():
    one, two = Cluster.preset(A100), Cluster.preset(A100, nodes=2)
    par = ParallelConfig(dp=8, precision="bf16")
    within = estimate(CFG, par, one, global_batch=64, micro_batch=1).breakdown["dp_comm"]
    across = estimate(CFG, par.replace(dp=16), two, global_batch=64, micro_batch=1).breakdown["dp_comm"]
    assert across > 5 * within > 0


@pytest.mark.parametrize("par,gb,b,rule", [
    (ParallelConfig(dp=16), 64, 1, "cluster has 8"),
    (ParallelConfig(dp=2), 6, 2, "must divide by dp"),
    (ParallelConfig(tp=3), 6, 1, "n_head"),
    (ParallelConfig(pp=2, schedule="interleaved-1f1b", virtual_stages=2), 3, 1, "multiple of stages"),
])
def test_estimate_rejects_impossible_layouts(par, gb, b, rule):
    with pytest.raises(ValueError, match=rule):
        estimate(CFG, par, Cluster.preset(A100), global_batch=gb, micro_batch=b)


# ----------------------------------------------------------------------------- the planner


def test_plan_ranks_only_what_fits_fastest_first():
    small = Cluster(gpus_per_node=8, nodes=1, memory_per_gpu=12 * GiB, peak_flops=312e12, efficiency=0.69,
                    intra_bandwidth=240e9, intra_latency=1e-6, inter_bandwidth=25e9, inter_latency=5e-6)
    ests = plan(CFG, small, global_batch=32, micro_batches=(1, 2), schedules=("1f1b", "interleaved-1f1b"))
    assert ests and all(e.fits and e.par.world == 8 for e in ests)
    from minipar.planner.search import NEGLIGIBLE_TIME  # ties (float noise) rank by memory
    times = [e.step_time for e in ests]
    assert all(a <= (1 + NEGLIGIBLE_TIME) * b for i, a in enumerate(times) for b in times[i:])
    layouts = {(e.par.dp, e.par.tp, e.par.pp, e.par.zero) for e in ests}
    assert (8, 1, 1, 0) not in layouts  # 16 bytes a parameter of 1.2B on every GPU: 19 GiB > 12
    assert len(ests) < len(list(candidates(CFG, small, 32, (1, 2), ("1f1b", "interleaved-1f1b"))))
    assert "#1" in explain(ests) and any(t in explain(ests) for t in TERMS)
    table = format_table(ests, top=3)
    assert len(table.splitlines()) == 4 and ests[0].label in table


def test_plan_that_cannot_fit_says_what_would():
    tiny_gpus = Cluster(gpus_per_node=2, nodes=1, memory_per_gpu=2 * GiB, peak_flops=312e12, efficiency=0.69,
                        intra_bandwidth=240e9, intra_latency=1e-6, inter_bandwidth=25e9, inter_latency=5e-6)
    with pytest.raises(NoFeasiblePlan, match=r"needs .* GiB.*With \d+ GPUs .* it fits"):
        plan(CFG, tiny_gpus, global_batch=32, micro_batches=(4,), recompute=("none",))
    mixed = Cluster.mixed([tiny_gpus, dataclasses.replace(tiny_gpus, memory_per_gpu=3 * GiB, name="bigger")])
    with pytest.raises(NoFeasiblePlan) as e:   # each kind's memory named, not the smallest's alone
        plan(CFG, mixed, global_batch=32, micro_batches=(4,), recompute=("none",))
    assert "custom: 2 GiB a GPU" in str(e.value) and "bigger: 3 GiB a GPU" in str(e.value)
    assert re.search(r"With \d+ GPUs of 2 GiB, the smallest kind's, it fits", str(e.value)), str(e.value)


def test_heterogeneous_cluster_splits_layers_and_batch_by_search():
    """The split was a fixed rule, layers and micro-batches in proportion to each GPU kind's matmul
    rate, and not optimal under the planner's own model (here TP's all-reduces, as long on either
    kind, dominate). Now the layers are split by dynamic programming (partition.min_max) and both
    splits searched (`predict.refine`): as fast as the best of every split of the layers, faster
    than the rule, no one-layer or one-share move makes it faster, and the faster GPUs take more."""
    from minipar.planner.predict import _proportional, sized, split_layout, time_layout
    mixed = Cluster.mixed([Cluster.preset(A100), Cluster.preset("dgx-h100")])
    assert mixed.world == 16 and mixed.device(3).name == A100 and mixed.device(12).name == "dgx-h100"
    par = ParallelConfig(tp=8, pp=2, sequence_parallel=True, precision="bf16")
    for layout in (par, par.replace(dp=2, pp=1)):
        est = estimate(CFG, layout, mixed, global_batch=32, micro_batch=1)
        rule = split_layout(CFG, layout, mixed, 32, 1)
        rule = time_layout(CFG, sized(CFG, rule.par, mixed, 32, 1, *((_proportional(24, [1, 989 / 312]), (32,))
                                      if layout.pp > 1 else (rule.layers, _proportional(32, [1, 989 / 312])))))
        assert est.step_time < rule.step_time and sum(est.shares) == 32
        assert est.layers[-1] > est.layers[0] if layout.pp > 1 else est.shares[1] > est.shares[0]
        for layers, shares in (((est.layers[0] + d, est.layers[1] - d), est.shares) if layout.pp > 1
                               else (est.layers, (est.shares[0] + d, est.shares[1] - d))
                               for d in (-1, 1)):
            moved = time_layout(CFG, sized(CFG, est.par, mixed, 32, 1, layers, shares, "flash"))
            assert moved.step_time >= (1 - 1e-4) * est.step_time, (layers, shares)
    pipelined = estimate(CFG, par, mixed, global_batch=32, micro_batch=1)
    every = min(time_layout(CFG, sized(CFG, pipelined.par, mixed, 32, 1, (n, 24 - n), (32,))).step_time
                for n in range(1, 24))
    assert pipelined.step_time == pytest.approx(every, rel=1e-9)  # the best of all 23 splits
    slow = estimate(CFG, par.replace(dp=2, pp=1), Cluster.preset(A100, nodes=2), global_batch=32, micro_batch=1)
    assert estimate(CFG, par.replace(dp=2, pp=1), mixed, 32, 1).step_time < slow.step_time
    assert plan(CFG, mixed, global_batch=32, micro_batches=(1,))[0].fits
    assert math.isfinite(pipelined.mfu)


def test_the_layer_split_is_the_min_max_one_that_brute_force_finds():
    """partition.min_max against every composition of the layers, on chunks of random speeds."""
    import itertools
    import random

    from minipar.planner.partition import min_max
    rng = random.Random(0)
    for n_layer, chunks in ((7, 3), (9, 4), (6, 6), (10, 2)):
        layer, emb, head = ([rng.uniform(0.5, 3) for _ in range(chunks)] for _ in range(3))
        cost = lambda sizes: max(n * layer[c] + emb[c] * (c == 0) + head[c] * (c == chunks - 1)  # noqa: E731
                                 for c, n in enumerate(sizes))
        every = [s for s in itertools.product(range(1, n_layer + 1), repeat=chunks) if sum(s) == n_layer]
        best = min_max(n_layer, layer, emb, head)
        assert sum(best) == n_layer and min(best) >= 1 and cost(best) == pytest.approx(min(map(cost, every)))


def test_heterogeneous_layers_move_out_of_a_stage_that_overflows():
    big = GPTConfig(n_layer=48, n_head=64, d_model=6144, vocab_size=51200, seq_len=2048)
    small_h100 = dataclasses.replace(Cluster.preset("dgx-h100"), memory_per_gpu=20 * GiB, name="h100-20g")
    par = ParallelConfig(tp=8, pp=2, sequence_parallel=True, precision="bf16", recompute="full")
    roomy = estimate(big, par, Cluster.mixed([Cluster.preset(A100), Cluster.preset("dgx-h100")]), 32, 1)
    tight = estimate(big, par, Cluster.mixed([Cluster.preset(A100), small_h100]), 32, 1)
    assert roomy.layers[1] > 2 * roomy.layers[0]            # by speed: the H100s take most layers
    assert tight.fits and tight.layers[1] < tight.layers[0]  # by memory: 20 GiB holds fewer
    assert sum(tight.stages[1].values()) <= 20 * GiB


def _variant(best, slower: float = 0.0, more_gib: float = 0.0, **terms):
    """best, `slower` seconds slower (split over `terms`: {term: seconds}) with `more_gib` GiB more."""
    return dataclasses.replace(best, step_time=best.step_time + slower,
                               breakdown={k: v + terms.get(k, 0.0) for k, v in best.breakdown.items()},
                               memory={**best.memory, "params": best.memory["params"] + more_gib * GiB},
                               peak=None)  # its memory is the tally's


def test_explain_says_nothing_of_float_noise_and_calls_less_memory_less():
    best = estimate(CFG, ParallelConfig(dp=8), Cluster.preset(A100), global_batch=32, micro_batch=1)
    step = best.step_time
    lines = explain([best,
                     _variant(best, 1e-16, -10.2, bubble=1e-16),          # a tie, in less memory
                     _variant(best, 0.0, 0.01),                           # a tie, as big
                     _variant(best, 0.01 * step, 2.0, dp_comm=0.01 * step + 8.88e-16,
                              bubble=-8.88e-16),                          # noise in the saving
                     _variant(best, 0.01 * step, dp_comm=0.02 * step, bubble=-0.01 * step)],
                    top=5).splitlines()
    assert lines[1].endswith(": as fast, with 10.2 GiB less")
    assert lines[2].endswith(": as fast, with the same memory")
    assert lines[3].endswith(f"mostly dp_comm (+{0.01 * step + 8.88e-16:.3g} s)")  # no "saves 8.88e-16 s"
    assert lines[4].endswith(f"though it saves {0.01 * step:.3g} s of bubble")


def test_the_ranking_breaks_ties_by_memory_then_simplicity_not_float_noise():
    """plan sorted by (step time, memory): a layout 1e-16 s slower ranked behind an equally fast
    one that needs 10 GiB more, and its memory tie-break never triggered. Ties are step times
    within NEGLIGIBLE_TIME of the fastest of their run; among them less memory, then the simpler
    layout; a layout slower by more than that still ranks behind."""
    from minipar.planner import search
    best = estimate(CFG, ParallelConfig(dp=8), Cluster.preset(A100), global_batch=32, micro_batch=1)
    step = best.step_time
    small = _variant(best, 1e-16, -2.5)                                  # as fast, less memory
    pipelined = dataclasses.replace(_variant(best, -1e-16, -2.5), par=ParallelConfig(dp=4, pp=2))
    slower = _variant(best, 0.01 * step, -5.0)                           # really slower, smallest
    ranked = search.rank([best, slower, pipelined, small])
    assert ranked == [small, pipelined, best, slower]


@pytest.mark.parametrize("top", [0, -3, 2.5])
def test_the_table_and_explanation_refuse_a_top_below_one(top):
    ests = [estimate(CFG, ParallelConfig(dp=8), Cluster.preset(A100), global_batch=32, micro_batch=1)]
    for show in (format_table, explain):
        with pytest.raises(ValueError, match=f"^top must be a positive integer .*got {top}$"):
            show(ests, top=top)


@pytest.mark.parametrize("global_batch", [0, -8])
def test_plan_refuses_a_global_batch_below_one_by_name(global_batch):
    with pytest.raises(ValueError, match=f"^global_batch must be a positive integer .*got {global_batch}$"):
        plan(CFG, Cluster.preset(A100), global_batch)


def test_bucketed_zero_2_pays_for_a_reduction_every_micro_batch():
    """Bucketed ZeRO-2 reduce-scatters each micro-batch's gradients (data_parallel.GradBuckets
    frees them once reduced): on a slow link the reductions before the last cost what exceeds a
    micro-batch's compute each, where ZeRO-1 reduces once; on a fast one they hide, and cost only
    the slowdown of the compute they hide under (gpu_time.SLOWDOWN)."""
    from minipar.planner.cluster import Link
    from minipar.planner.gpu_time import SLOWDOWN, dp_time
    per, psi = memory.layout_bytes("bf16"), 10**9
    for bandwidth in (1e9, 1e13):
        link = Link(bandwidth, 1e-6)
        times = {zero: dp_time(ParallelConfig(dp=8, zero=zero, microbatches=4), psi, per, link,
                               window=0.1, compute_mb=0.3, units=1) for zero in (1, 2)}
        rs = 7 / 8 * 4 * psi / bandwidth + 7e-6  # a reduce-scatter of 4 GB of fp32 gradients
        hidden = min(rs, 0.3)                   # three earlier ones, each under 0.3 s of compute
        assert times[2] - times[1] == pytest.approx(3 * (rs - hidden + (SLOWDOWN - 1) * hidden),
                                                    rel=1e-6)


def test_production_overlaps_the_parameter_gather_minipar_waits_for():
    """minipar's ZeRO-1/2 all-gather the new weights after the step and wait for them; Megatron's
    distributed optimizer (--overlap-param-gather) gathers them under the next forward. The estimate
    says whose overlaps it timed."""
    cfg, par = GPTConfig.preset("llama3-8b"), ParallelConfig(dp=16, zero=1, precision="bf16")
    two = Cluster.preset(A100, nodes=2)
    ours, theirs = (estimate(cfg, par, two, 64, 1, overlap=o) for o in ("minipar", "production"))
    assert theirs.breakdown["dp_comm"] < ours.breakdown["dp_comm"]
    assert {k: v for k, v in theirs.breakdown.items() if k != "dp_comm"} == \
        {k: v for k, v in ours.breakdown.items() if k != "dp_comm"}
    assert "Megatron-LM's overlaps" in repr(theirs) and "minipar's overlaps" in repr(ours)
    with pytest.raises(ValueError, match="overlap must be one of"):
        estimate(cfg, par, two, 64, 1, overlap="megatron-lm")


def test_deepspeeds_pipeline_blocks_on_its_messages_and_reduces_after_the_flush():
    """Megatron-DeepSpeed's pipeline engine: p2p.send/recv block (a stage's step waits for its two
    transfers with a neighbour), each TP rank sends 1/t of a message (gathered where it arrives, as
    Megatron's scatter-gather), and the gradients are reduced after the flush, not under the last
    backward. The terms still sum to the step; ZeRO-2 or another schedule than 1F1B with a
    pipeline is refused (its engine runs TrainSchedule with ZeRO 0 or 1). Without a pipeline its
    defaults reduce after backward too (overlap_comm is off for ZeRO-1/2)."""
    cfg = GPTConfig.preset("gpt2-xl", n_head=24, d_model=1536)
    two = Cluster.preset(A100, nodes=2)
    par = ParallelConfig(dp=2, tp=2, pp=4, precision="bf16")
    ours, megatron, ds = (estimate(cfg, par, two, 64, 1, overlap=o)
                          for o in ("minipar", "production", "deepspeed"))
    for e in (ours, megatron, ds):
        assert sum(e.breakdown.values()) == pytest.approx(e.step_time)
        assert all(v >= 0 for v in e.breakdown.values())
    assert megatron.breakdown["pp_p2p"] < ours.breakdown["pp_p2p"]   # 1/t of each message
    assert ds.breakdown["pp_p2p"] > megatron.breakdown["pp_p2p"]     # blocking, same bytes
    # after the flush, as minipar's pipeline (its step in no_sync); Megatron's under the backward
    assert ds.breakdown["dp_comm"] == ours.breakdown["dp_comm"] > megatron.breakdown["dp_comm"]
    assert ds.step_time > megatron.step_time
    assert "DeepSpeed's overlaps" in repr(ds)
    for bad in (par.replace(zero=2), par.replace(schedule="zb-h1")):
        with pytest.raises(ValueError, match="DeepSpeed's pipeline engine runs 1F1B with ZeRO 0"):
            estimate(cfg, bad, two, 64, 1, overlap="deepspeed")
    for zero in (0, 1, 2):
        alone = ParallelConfig(dp=16, zero=zero, precision="bf16")
        assert estimate(cfg, alone, two, 64, 1, overlap="deepspeed").breakdown["dp_comm"] > \
            estimate(cfg, alone, two, 64, 1).breakdown["dp_comm"]


def test_fits_keeps_the_allocators_reserve_and_counts_the_steps_transients():
    """A layout fits when the step's peak with its transients (step_memory.predict_peak, for ZeRO
    without a pipeline) stays within Cluster.usable of the GPU's memory: 80%, the ZeRO paper's measured
    share; at 100% a plan would choose layouts that run out of memory."""
    from minipar.step_memory import predict_peak
    cfg, cluster = GPTConfig.preset("gpt2-xl"), Cluster.preset(A100)
    est = estimate(cfg, ParallelConfig(dp=8, zero=2, precision="bf16"), cluster, 64, 8)
    want = predict_peak(cfg, est.par.replace(microbatches=1), 64)
    assert {k: v for k, v in est.peak.items()} == want and est.peak_memory >= est.total_memory
    assert est.capacity == 0.8 * cluster.memory_per_gpu
    edge = dataclasses.replace(cluster, memory_per_gpu=est.peak_memory / 0.9)  # 90% full
    assert not estimate(cfg, est.par, edge, 64, 8).fits
    assert estimate(cfg, est.par, dataclasses.replace(edge, usable=1.0), 64, 8).fits
    llama = GPTConfig.preset("llama3-8b")   # ZeRO with TP and SP: its peak too
    tp = estimate(llama, ParallelConfig(dp=2, tp=4, zero=1, sequence_parallel=True,
                                        precision="bf16"), cluster, 16, 2)
    assert tp.peak == predict_peak(llama, tp.par.replace(microbatches=3), 2 * 3 * 2)
    assert tp.peak["phase"] == "forward" and tp.peak_memory > tp.total_memory


@pytest.mark.parametrize("schedule,v", [("1f1b", 1), ("interleaved-1f1b", 2), ("zb-h1", 1)])
def test_a_pipelines_steady_state_stands_for_any_number_of_micro_batches(schedule, v):
    """The planner walks a ZeRO pipeline stage's step peak over pp (2 v + 1) micro-batches at
    most (predict._step_peaks): after warm-up 1F1B, interleaved 1F1B and ZB-H1 repeat themselves, and
    every gradient bucket has been reduced once. The full walk gives the same peak for more."""
    from minipar.step_memory import predict_peak
    cfg = GPTConfig.preset("llama-tiny", n_layer=8, vocab_size=98)
    for pp, zero, mode in ((2, 2, {"bucket_mb": 0.05}), (4, 2, {}), (4, 1, {"dp_mode": "naive"}),
                           (2, 3, {})):
        cap = pp * (2 * v + 1)
        for m in (cap + pp, 3 * cap) if (zero, schedule) != (3, "zb-h1") else ():
            par = ParallelConfig(dp=2, pp=pp, zero=zero, microbatches=m, schedule=schedule,
                                 virtual_stages=v, recompute="full", **mode)
            for r in range(pp):
                assert predict_peak(cfg, par, 2 * m, pp_rank=r) == \
                    predict_peak(cfg, par.replace(microbatches=cap), 2 * cap, pp_rank=r)


def test_the_peak_without_zero_is_measured_to_the_byte_in_any_layout():
    """Without ZeRO the step's held peak (measured from tensor lifetimes) is the planner's
    Estimate.peak to the byte in every layout: TP with and without SP, pipelines of every schedule,
    recomputation, DP x TP, TP x PP, DP x PP, fp32 and bf16 with fp32 or 16-bit gradients; the
    fullest rank against the fullest stage (step_memory.zero0_peak)."""
    import workers_dp

    import minipar
    cfg, batch, h100 = GPTConfig.preset("tiny", vocab_size=98), 8, Cluster.preset("dgx-h100")
    cases = {2: [ParallelConfig(tp=2), ParallelConfig(pp=2, microbatches=4),
                 ParallelConfig(tp=2, sequence_parallel=True, recompute="selective"),
                 ParallelConfig(tp=2, recompute="full", precision="bf16", reduce_fp32=False),
                 ParallelConfig(dp=2, recompute="full", precision="bf16"),
                 ParallelConfig(pp=2, microbatches=4, schedule="zb-h1", precision="bf16",
                                reduce_fp32=False),
                 ParallelConfig(pp=2, microbatches=4, schedule="interleaved-1f1b",
                                virtual_stages=2, recompute="full")],
             4: [ParallelConfig(dp=2, tp=2, precision="bf16", microbatches=2),
                 ParallelConfig(tp=2, pp=2, microbatches=4, sequence_parallel=True),
                 ParallelConfig(dp=2, pp=2, microbatches=2, precision="bf16", reduce_fp32=False,
                                recompute="selective")]}
    for world, pars in cases.items():
        ranks = minipar.launch(workers_dp.train_variants, world, cfg, pars, 2, batch, timeout=300)
        for i, par in enumerate(pars):
            want = estimate(cfg, par, h100, batch, batch // (par.dp * par.microbatches)).peak
            want = {k: v for k, v in want.items() if k != "phase"}
            held = [{k: ranks[r][i].step_memory["held"][k] for k in want} for r in range(world)]
            assert max(held, key=lambda x: sum(x.values())) == want, par.label
    # the fullest stage is the one fullest at its peak: here stage 0 (its fp32 master gradients at
    # the step), though stage 1 holds more between steps
    par = ParallelConfig(dp=4, pp=2, recompute="full", precision="bf16", reduce_fp32=False)
    est = estimate(GPTConfig.preset("llama3-8b"), par, h100, 64, 1)
    assert sum(est.stages[1].values()) > sum(est.stages[0].values())
    assert est.peak_memory == max(sum(v for k, v in zero0_peak(est.stages[r], est.par, memory.rank_units(
        est.cfg, 1, list(est.layers), 2, r, of=memory.chunk_params)).items() if k != "phase") for r in (0, 1))


def test_a_small_machine_is_shown_in_units_that_say_something():
    """On this machine's scale format_table printed "0" TFLOP/s and "0.0" GiB in every row and the
    per-stage plot drew MiB-sized bars on a GiB axis: a CPU does GFLOP/s and a tiny model needs MiB."""
    from minipar.lessons import viz_planner
    cpu = Cluster(gpus_per_node=2, nodes=1, memory_per_gpu=8 * GiB, peak_flops=1e11, efficiency=0.5,
                  intra_bandwidth=1e9, intra_latency=1e-5, inter_bandwidth=1e9, inter_latency=1e-5)
    est = estimate(GPTConfig.preset("tiny"), ParallelConfig(dp=2), cpu, global_batch=8, micro_batch=4)
    head, row = format_table([est]).splitlines()
    assert "GFLOP/s" in head and "MiB" in head and "TFLOP/s" not in head
    shown = [k for k in TERMS if f"{k} s" in head]   # (no cp_comm, ep_comm: none here)
    step, flops, mfu, mib = row.split()[-len(shown) - 4:][:4]  # the columns after the label
    assert float(flops) > 0 and float(mib) > 1
    assert "GFLOP/s" in repr(est) and "MiB" in repr(est)
    ax = viz_planner.memory_stages(est).axes[0]
    assert ax.get_ylabel() == "MiB per GPU" and ax.get_ylim()[1] > 1


LLAMA_SMALL = GPTConfig.preset("llama3-8b", n_layer=8, seq_len=2048)  # Llama's shapes, a plan's size


@pytest.mark.parametrize("preset", ["dgx-a100-80g", "dgx-h100", "h200"])
@pytest.mark.parametrize("cfg", [CFG, LLAMA_SMALL], ids=["gpt", "llama"])
def test_no_plan_runs_faster_than_its_hardware(preset, cfg):
    """A throughput above peak is a bug, not a result: for every layout plan searches, the model's
    FLOP/s stay under the GPUs' peak (MFU <= 1, compute no faster than the peak allows); a GPU's
    matmuls take at least the time its HBM needs to read the weights they use once a micro-batch;
    and a step without a pipeline lasts at least as long as its DP collectives take on their link."""
    from minipar import traffic
    from minipar.mesh import rank_at
    cluster = Cluster.preset(preset, nodes=2)
    ests = plan(cfg, cluster, global_batch=32, micro_batches=(1, 2), recompute=("none", "full"))
    assert len(ests) > 20
    for e in ests:
        assert 0 < e.mfu <= 1, e.label
        assert e.breakdown["compute"] >= e.model_flops / cluster.peak_total * (1 - 1e-9), e.label
        weights = max(sum(memory.rank_units(cfg, e.par.tp, list(e.layers), e.par.pp, r))
                      for r in range(e.par.pp))  # the fullest stage's, each read for its matmuls
        reads = max(e.shares) * 2 * weights / cluster.memory_bandwidth
        assert e.breakdown["compute"] + e.breakdown["recompute"] >= reads * (1 - 1e-9), e.label
        if e.par.pp == 1 and e.par.dp > 1:
            link = cluster.link([rank_at(e.par.dp, e.par.tp, j, 0, 0) for j in range(e.par.dp)])
            sent = sum(traffic.dp(cfg, e.par).values())
            assert e.step_time >= sent / link.bandwidth * (1 - 1e-9), e.label


def test_the_search_skips_no_transient_of_a_layout_that_fits():
    """plan walks a step's transients only where the counted tensors fit (exact=False): what it
    returns is what `estimate` gives each layout, peak included, and a layout it skipped overflows
    on its count alone."""
    from minipar.planner.predict import split_layout
    cfg, cluster = GPTConfig(n_layer=8, n_head=16, d_model=2048, vocab_size=32000, seq_len=2048), \
        dataclasses.replace(Cluster.preset(A100), memory_per_gpu=12 * GiB)
    ranked = plan(cfg, cluster, 16, micro_batches=(1, 2))
    for e in ranked[:8]:
        full = estimate(cfg, e.par, cluster, 16, e.micro_batch)
        assert e.peak is not None and (e.peak, e.memory, e.step_time) == (full.peak, full.memory, full.step_time)
    par = ParallelConfig(dp=8, zero=0, precision="bf16")   # whole model states on every GPU: overflows
    skipped = split_layout(cfg, par, cluster, 16, 2, exact=False)
    assert skipped.peak is None and not skipped.fits and sum(skipped.memory.values()) > skipped.capacity
    assert split_layout(cfg, par, cluster, 16, 2).peak is not None


def test_recomputation_is_tried_most_first_and_named_before_any_search():
    tiny, board = GPTConfig.preset("tiny"), Cluster.preset("dgx-h100")
    with pytest.raises(ValueError, match=r"recompute must be some of \('none', 'selective', 'full'\)"):
        plan(tiny, board, 8, recompute=("some",))
    assert plan(tiny, board, 8, recompute=("full", "none"))[0].par.recompute == "full"  # the first that fits
    assert plan(tiny, board, 8)[0].par.recompute == "none"
