"""Clusters of islands: scale-up domains of different sizes and kinds joined by a scale-out network
(Cluster.mixed), and what the planner may place across them. No processes: arithmetic only."""
import dataclasses

import pytest

from minipar.mesh import grid_ranks
from minipar.model import GPTConfig
from minipar.config import ParallelConfig
from minipar.planner import candidates, estimate, explain, plan
from minipar import memory
from minipar.planner.search import _lower_bound, placements, regrouped
from minipar.planner.cluster import Cluster, Link
from minipar.planner.gpu_time import all_reduce

CFG = GPTConfig(n_layer=8, n_head=16, d_model=2048, vocab_size=32000, seq_len=2048)
A100 = Cluster.preset("dgx-a100-80g")
# a made-up kind whose scale-up domain is 16 chips wide (as a Trainium2 instance's is): half an
# H100's speed, its own fabric
WIDE = dataclasses.replace(Cluster.preset("dgx-h100"), gpus_per_node=16, peak_flops=500e12,
                           intra_bandwidth=100e9, intra_latency=2e-6, inter_bandwidth=40e9,
                           name="wide-16")


def test_islands_of_different_sizes_tile_by_their_common_divisor():
    mixed = Cluster.mixed([Cluster.preset("dgx-a100-80g", nodes=2), WIDE])
    assert (mixed.world, mixed.gpus_per_node, mixed.nodes) == (32, 8, 4)
    assert [mixed.island(r) for r in (0, 7, 8, 15, 16, 31)] == [(0, 0), (0, 0), (0, 1), (0, 1),
                                                               (1, 0), (1, 0)]
    assert mixed.link(range(16, 32)) == Link(WIDE.intra_bandwidth, WIDE.intra_latency)  # one island
    assert mixed.link(range(0, 8)) == Link(A100.intra_bandwidth, A100.intra_latency)
    for across in ((7, 8), (15, 16)):  # two A100 nodes; an A100 and the wide island
        assert mixed.link(across) == Link(min(A100.inter_bandwidth, WIDE.inter_bandwidth),
                                          max(A100.inter_latency, WIDE.inter_latency))
    assert mixed.device(16).name == "wide-16" and mixed.device(15).name == "dgx-a100-80g"


def test_no_tp_group_spans_two_islands():
    """TP's all-reduces sit between dependent matmuls, and no collective library runs across
    vendors: every TP group `plan` considers lies inside one island, on islands of 8 and 12."""
    twelve = dataclasses.replace(WIDE, gpus_per_node=12, name="wide-12")
    mixed = Cluster.mixed([A100, twelve, A100])
    assert mixed.gpus_per_node == 4 and mixed.world == 28
    tps = set()
    for par, _ in candidates(CFG, mixed, global_batch=56):
        tps.add(par.tp)
        for g in range(par.world // par.tp):
            group = grid_ranks(par.dp, par.tp, par.pp, dp_rank=g % par.dp, pp_rank=g // par.dp)
            assert len({mixed.island(r) for r in group}) == 1, (par.label, group)
    assert tps == {1, 2, 4}


def test_a_plan_on_islands_of_two_sizes_uses_every_chip_and_its_fabric():
    mixed = Cluster.mixed([A100, WIDE])
    best = plan(CFG, mixed, global_batch=24, micro_batches=(1,))[0]
    assert best.fits and best.par.world == 24 and best.par.tp <= 8
    # the same layout with the wide island's fabric as slow as the NICs is slower
    slow = Cluster.mixed([A100, dataclasses.replace(WIDE, intra_bandwidth=WIDE.inter_bandwidth)])
    assert best.par.tp > 1 and estimate(CFG, best.par, slow, 24, 1).step_time > best.step_time


@pytest.mark.parametrize("bad", [0, -1])
def test_an_island_must_hold_a_chip(bad):
    with pytest.raises(ValueError, match="gpus_per_node"):
        dataclasses.replace(WIDE, gpus_per_node=bad)


@pytest.mark.parametrize("name", sorted(Cluster.PRESETS))
def test_every_catalogue_kind_stays_under_its_peaks(name):
    """One 8-chip layout (dp 2, tp 4: a TP group inside any island) of a 1.3B model on each kind:
    no faster than its matmul ceiling allows; an all-reduce no faster than the fabric's line rate
    inside an island and the NICs' across two; fitting exactly when the fullest chip is within
    its usable HBM."""
    kind, d = Cluster.preset(name), Cluster.PRESETS[name]
    assert (kind.peak_flops, kind.memory_per_gpu, kind.world) == (d.peak, d.hbm, d.domain)
    cfg = GPTConfig(n_layer=24, n_head=16, d_model=2048, vocab_size=32000, seq_len=2048)
    par = ParallelConfig(dp=2, tp=4, sequence_parallel=True, precision="bf16", recompute="selective")
    est = estimate(cfg, par, kind, global_batch=8, micro_batch=1)
    assert 0 < est.mfu < kind.efficiency <= 1
    assert est.step_time > est.model_flops / (par.world * d.peak * d.ceiling)
    two = Cluster.preset(name, nodes=2)
    inside, across = range(8), (0, d.domain)
    assert all_reduce(1e9, 8, two.link(inside)) > 2 * 7 / 8 * 1e9 / d.scale_up
    assert all_reduce(1e9, 2, two.link(across)) > 1e9 / d.scale_out
    assert two.link(across).bandwidth <= two.link(inside).bandwidth   # the NICs are the slower
    assert est.fits == (est.peak_memory <= kind.usable * d.hbm)


def _kind(name, speed, gib, per_node=2, nodes=1):   # small islands of a made-up kind
    return dataclasses.replace(Cluster.preset("dgx-h100"), gpus_per_node=per_node, nodes=nodes,
                               peak_flops=speed * 1e15, memory_per_gpu=gib * 2 ** 30, name=name)


def test_placements_are_every_distinct_order_of_the_parts():
    a, b, c = _kind("a", 1, 80), _kind("b", 0.5, 40), _kind("c", 0.25, 24)
    assert placements(A100) == [A100]
    assert len(placements(Cluster.mixed([a, b]))) == 2
    orders = [p.name for p in placements(Cluster.mixed([a, b, c]))]
    assert len(orders) == 6 == len(set(orders)) and orders[0] == "1xa+1xb+1xc"
    assert len(placements(Cluster.mixed([a, b, a]))) == 3   # a, b, a: three distinct orders


def test_the_plan_is_the_best_of_every_order_and_layout_by_brute_force():
    """Three kinds of 2-GPU islands: the plan's winner against every order of the parts times
    every layout and recomputation that fits, each estimated on its own (estimate: its split
    searched); the winner's explanation weighs it against the even split."""
    cfg = GPTConfig(n_layer=6, n_head=8, d_model=1024, vocab_size=32000, seq_len=1024)
    mixed = Cluster.mixed([_kind("a", 1, 80), _kind("b", 0.5, 40), _kind("c", 0.25, 24)])
    best = plan(cfg, mixed, 12, micro_batches=(1,))[0]
    every = []
    for order in placements(mixed):
        for par, b in candidates(cfg, order, 12, micro_batches=(1,)):
            for rc in ("none", "selective", "full"):
                e = estimate(cfg, par.replace(recompute=rc), order, 12, b)
                if e.fits:
                    every.append(e)
                    break
    assert best.step_time == pytest.approx(min(e.step_time for e in every), rel=1e-9)
    assert len({e.cluster.name for e in every if e.par.pp > 1}) == 6
    if best.par.pp > 1:
        assert best.label.endswith(f"on {best.cluster.name}")
    assert "as if all chips were alike" in explain([best])


def test_a_collective_runs_at_the_slowest_level_it_crosses():
    """Levels: an island's fabric, a pod's NICs at full bandwidth, and across pods the NICs' share
    above them (Llama 3's clusters: pods of 3,072 GPUs, 1:7 above) with the spine's latency."""
    h100 = Cluster.preset("dgx-h100")
    pods = Cluster.preset("dgx-h100", nodes=4, pod=2, oversubscription=7.0, spine_latency=2e-6)
    assert pods.link(range(8)) == Link(h100.intra_bandwidth, h100.intra_latency)
    assert pods.link([0, 15]) == Link(h100.inter_bandwidth, h100.inter_latency)       # one pod
    assert pods.link([8, 16]) == Link(h100.inter_bandwidth / 7, h100.inter_latency + 2e-6)
    assert [pods.pod_of(r) for r in (0, 15, 16, 31)] == [(0, 0), (0, 0), (0, 1), (0, 1)]
    flat = Cluster.preset("dgx-h100", nodes=4)
    assert flat.link([0, 31]) == Link(h100.inter_bandwidth, h100.inter_latency)      # one pod: pod=0
    mixed = Cluster.mixed([pods, A100])   # kinds are pods of their own, joined above their switches
    assert mixed.link([0, 8]) == Link(A100.inter_bandwidth, h100.inter_latency)
    assert mixed.link([0, 32]) == Link(A100.inter_bandwidth / 7, h100.inter_latency + 2e-6)
    with pytest.raises(ValueError, match="oversubscription must be >= 1"):
        Cluster.preset("dgx-h100", oversubscription=0.5)
    with pytest.raises(ValueError, match="takes pod, oversubscription and spine_latency"):
        Cluster.preset("dgx-h100", nodes=2, peak_flops=1.0)


def test_an_oversubscribed_spine_keeps_data_parallel_groups_inside_a_pod():
    """Two pods at 1:7: the planner's winner keeps each stage's DP group inside a pod (pipeline
    stages, outermost, cross the spine with one activation a micro-batch); with a non-blocking
    spine the winner is a plain DP layout whose gradient all-reduce spans both pods."""
    cfg = GPTConfig.preset("llama3-8b")
    flat = plan(cfg, Cluster.preset("dgx-h100", nodes=16), 256)[0]
    pods = Cluster.preset("dgx-h100", nodes=16, pod=8, oversubscription=7.0, spine_latency=2e-6)
    best = plan(cfg, pods, 256)[0]
    assert flat.par.pp == 1 and best.par.pp > 1
    par = best.par
    for r in range(par.pp):
        dp_group = grid_ranks(par.dp, par.tp, par.pp, pp_rank=r)
        assert len({pods.pod_of(x) for x in dp_group}) == 1
    assert estimate(cfg, flat.par, pods, 256, flat.micro_batch).breakdown["dp_comm"] > \
        2 * flat.breakdown["dp_comm"]


def test_on_a_full_mesh_a_group_drives_only_the_links_among_its_chips():
    """An MI300X board is a full mesh of 7 Infinity Fabric links a GPU (a Gaudi 3 board of 3 ports to
    each peer): a ring among k of its 8 GPUs has k - 1 links a GPU, an NVSwitch board the whole fabric."""
    mi, h100 = Cluster.preset("mi300x"), Cluster.preset("dgx-h100")
    assert mi.intra_mesh and not h100.intra_mesh
    assert mi.link([0, 1]).bandwidth == pytest.approx(mi.intra_bandwidth / 7)
    assert mi.link(range(4)).bandwidth == pytest.approx(mi.intra_bandwidth * 3 / 7)
    assert mi.link(range(8)).bandwidth == mi.intra_bandwidth
    assert h100.link([0, 1]) == h100.link(range(8))
    cfg = GPTConfig.preset("llama3-8b")   # TP's time, MI300X over H100 (fabrics of 448 and 450 GB/s)
    ratio = {t: [estimate(cfg, ParallelConfig(dp=8 // t, tp=t, sequence_parallel=True, precision="bf16"), c, 8)
                 .breakdown["tp_comm"] for c in (mi, h100)] for t in (2, 8)}
    assert ratio[2][0] > 5 * ratio[2][1] and ratio[8][0] < 1.1 * ratio[8][1]   # 7x the time in pairs, ~1x in eights


def test_no_tp_degree_that_would_straddle_two_islands_is_tried():
    """12 heads allow tp 3 and 6, which divide 24 chips but not an 8-chip island: a group of 3 would
    hold ranks 6, 7 and 8, two kinds (a reviewer found such groups ranked by the plan)."""
    mixed = Cluster.mixed([Cluster.preset("dgx-h100"), Cluster.preset("mi300x"), Cluster.preset("gaudi3")])
    cfg = GPTConfig.preset("gpt2-small")
    assert {par.tp for par, _ in candidates(cfg, mixed, 24)} == {1, 2, 4}   # 12 heads: 8 does not divide
    for e in plan(cfg, mixed, 24, micro_batches=(1,), schedules=("1f1b",), zero=(0,))[:20]:
        for j in range(e.par.dp):
            for r in range(e.par.pp):
                assert len({mixed.island(x) for x in grid_ranks(e.par.dp, e.par.tp, e.par.pp, r, j)}) == 1


def test_stages_of_different_tp_are_searched_and_found_by_brute_force():
    """A fast kind with little memory (16 GiB, 4-chip islands) and twice its chips of a kind 0.3x as
    fast: the plan's winner gives each kind's stage a TP degree of its own (ParallelConfig.stage_tp,
    search.regrouped), one stage each instead of a uniform grid's three, and brute force over every
    order, layout and each one's regroupings, each estimated on its own, finds none faster."""
    cfg = GPTConfig(n_layer=6, n_head=8, d_model=1024, vocab_size=32000, seq_len=1024)
    mixed = Cluster.mixed([_kind("a", 1, 16, per_node=4), _kind("b", 0.3, 80, per_node=4, nodes=2)])
    best = plan(cfg, mixed, 16, micro_batches=(1, 2))[0]
    every = []
    for order in placements(mixed):
        for par, b in candidates(cfg, order, 16, micro_batches=(1, 2)):
            for rc in ("none", "selective", "full"):
                e = estimate(cfg, par.replace(recompute=rc), order, 16, b)
                if e.fits:
                    every += [e] + [estimate(cfg, g.par.replace(stage_layers=None), g.cluster, 16, b)
                                    for g in regrouped(cfg, e)]
                    break
    assert best.par.stage_tp == (1, 2) and best.label.startswith("dp4 tp(1,2) pp2")
    assert best.step_time == pytest.approx(min(e.step_time for e in every if e.fits), rel=1e-9)
    uniform = min(e.step_time for e in every if e.fits and not e.par.stage_tp)
    assert best.step_time < 0.995 * uniform
    # the bound that lets plan skip a regrouping holds for every one
    for e in every:
        if e.par.stage_tp:
            assert _lower_bound(cfg, e.par, e.cluster, e.micro_batch, e.attention) <= e.step_time


def test_a_stage_of_its_own_tp_holds_what_memory_predict_says():
    cfg = GPTConfig(n_layer=6, n_head=8, d_model=1024, vocab_size=32000, seq_len=1024)
    par = ParallelConfig(dp=2, tp=4, pp=3, stage_tp=(1, 4, 2), microbatches=4, precision="bf16")
    est = estimate(cfg, par, Cluster.preset("dgx-h100", nodes=2), 16, 2)
    assert est.label.startswith("dp2 tp(1,4,2) pp3") and est.par.world == 14
    for r in range(3):   # the planner's stage sizing is memory.predict's, stage by stage
        assert est.stages[r] == memory.predict(cfg, est.par, 16, pp_rank=r)
    assert est.stages[0]["params"] > 3 * est.stages[1]["params"]   # one TP rank against four
