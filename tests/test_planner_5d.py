"""The planner with context and expert parallelism (planner/gpu_time.py's cp_times and ep_time,
predict.py, search.py).

A CP or EP layout's memory is memory.predict's (itself checked to the byte against training in
tests/test_memory.py); its exchanges are the modules' messages timed on the links the grid puts
them on (a CP group across nodes is slower than one on NVLink); an EP layout's all-to-alls are
four a layer a micro-batch; `plan` searches CP for long sequences and EP for mixtures of experts
and picks them where they win; what the planner does not model is refused with a clear message.
torchtitan's published CP sweep is in tests/test_published.py.
"""
import dataclasses

import pytest

from minipar import Cluster, GPTConfig, ParallelConfig, estimate, memory, plan
from minipar.planner import gpu_time

LONG = GPTConfig.preset("llama3-8b", seq_len=65536)
MIXTRAL = GPTConfig.preset("mixtral-8x7b", seq_len=4096)
H100 = Cluster.preset("dgx-h100")


@pytest.mark.parametrize("cfg,par,batch", [
    (LONG, ParallelConfig(dp=4, cp=2, zero=3, precision="bf16", recompute="full"), 4),
    (LONG, ParallelConfig(dp=2, cp=4, cp_method="ulysses", precision="bf16", zero=1,
                          recompute="full"), 2),
    (MIXTRAL, ParallelConfig(dp=2, ep=2, pp=4, precision="bf16", recompute="full"), 16)])
def test_the_memory_is_memory_predicts(cfg, par, batch):
    est = estimate(cfg, par, H100, batch, 1)
    want = [memory.predict(cfg, est.par, batch, pp_rank=r) for r in range(par.pp)]
    assert est.stages == want
    assert est.memory in want


def test_a_context_parallel_group_across_nodes_is_slower_than_on_nvlink():
    par = ParallelConfig(dp=2, cp=4, zero=3, precision="bf16", recompute="full")
    pairs = dataclasses.replace(Cluster.preset("dgx-h100", nodes=4), gpus_per_node=2)
    near, far = (estimate(LONG, par, c, 2, 1) for c in (H100, pairs))
    assert 0 < near.breakdown["cp_comm"] < far.breakdown["cp_comm"]
    assert gpu_time.work_on(pairs, [0], par, 1, "flash").cp_link.bandwidth == \
        pairs.inter_bandwidth
    assert gpu_time.work_on(H100, [0], par, 1, "flash").cp_link.bandwidth == H100.intra_bandwidth


def test_expert_parallel_exchanges_are_four_all_to_alls_a_layer():
    par = ParallelConfig(dp=8, ep=8, pp=4, precision="bf16", recompute="none")
    est = estimate(MIXTRAL, par, Cluster.preset("dgx-h100", nodes=4), 64, 1)
    link = H100.link(range(0, 8))                    # 8 DP ranks tp (1) apart: one node's NVLink
    rows = 1 * MIXTRAL.seq_len * MIXTRAL.top_k * MIXTRAL.d_model * 2   # b s k token-slots, h, bf16
    one_pass = 2 * gpu_time.all_to_all(rows, 8, link) + 7 * link.latency  # dispatch, combine, counts
    layers = MIXTRAL.n_layer // 4
    assert est.breakdown["ep_comm"] == pytest.approx(2 * one_pass * layers * est.par.microbatches)


def test_plan_takes_context_parallelism_for_long_sequences_and_experts_apart():
    long = plan(LONG, H100, 8)
    assert long[0].par.cp > 1
    assert all(e.step_time >= long[0].step_time for e in long if e.par.cp == 1)
    moe = plan(MIXTRAL, Cluster.preset("dgx-h100", nodes=4), 64)
    assert moe[0].par.ep > 1
    short = plan(GPTConfig.preset("llama3-8b"), H100, 8)   # 8K: CP not searched
    assert {e.par.cp for e in short} == {1}


def test_what_the_planner_does_not_model_is_refused():
    par = ParallelConfig(dp=2, cp=2)
    with pytest.raises(ValueError, match="GPUs of one kind with fused attention"):
        estimate(LONG, par, H100, 2, 1, attention="materialized")
    mixed = Cluster.mixed([H100, Cluster.preset("dgx-a100-80g")])
    with pytest.raises(ValueError, match="not yet a mixed cluster"):
        estimate(LONG, par, mixed, 2, 1)
