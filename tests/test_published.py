"""The cost model against every published run of planner/published.py, nothing tuned per row.

Korthikanti et al.'s Table 5 is the calibration's own setting (the A100 ceiling comes from its Table
4): every row within 10%. The others are reported as they come out, and held to what they are now,
so that a change of the model that moves them shows: BLOOM-176B (on Jean Zay's network) comes out
14% fast; Megatron-Turing NLG 530B ran 25-28% slower than this model of Megatron-LM's kernels on the
same A100s (both timed with Megatron-DeepSpeed's pipeline engine); torchtitan's Llama 3 8B runs lie within 5% (128 GPUs) and 16% (8 GPUs) of it.
Its context-parallel sweep (8 GPUs, 32K to 256K tokens, float8 linear layers): within 8% at 32K, 128K
and 256K, 22% slow at 64K (`test_the_context_parallel_sweep` says why that row stays out).
"""
import pytest

from minipar.planner import published

RESULTS = published.compare()
NOW = {"BLOOM-176B 384 GPUs": 0.143, "MT-NLG 530B 2240 GPUs": -0.248, "MT-NLG 530B 2800 GPUs": -0.257,
       "MT-NLG 530B 3360 GPUs": -0.278, "torchtitan Llama 3 8B 8 GPUs": 0.164,
       "torchtitan Llama 3 8B 128 GPUs": 0.053, "torchtitan Llama 3 8B CP 1 32K": -0.074,
       "torchtitan Llama 3 8B CP 2 64K": -0.218, "torchtitan Llama 3 8B CP 4 128K": -0.022,
       "torchtitan Llama 3 8B CP 8 256K": -0.018}


def test_every_run_is_compared():
    assert set(RESULTS) == set(published.RUNS) and set(NOW) | {k for k in RESULTS if k.startswith("Table 5")} \
        == set(RESULTS)
    for name, (got, want, error) in RESULTS.items():
        print(f"{name:<36} predicted {got:10.2f}  published {want:10.2f}  {error:+.1%}")


@pytest.mark.parametrize("name", [k for k in published.RUNS if k.startswith("Table 5")])
def test_korthikanti_table_5_within_10_percent(name):
    assert abs(RESULTS[name][2]) <= 0.10


@pytest.mark.parametrize("name", sorted(NOW))
def test_the_other_runs_stay_where_they_are(name):
    assert RESULTS[name][2] == pytest.approx(NOW[name], abs=0.01)


def test_the_flop_conventions_are_the_sources():
    """BLOOM's 150 TFLOP/s count the recomputed forward (Megatron-DeepSpeed's 4 passes): at the same
    step time, the model-FLOPs rate is 3/4 of it less the head's share."""
    run = published.RUNS["BLOOM-176B 384 GPUs"]
    hfu, est = published.predict(run)
    assert est.par.recompute == "full"
    model = est.model_flops / est.step_time / est.par.world / 1e12
    assert 0.74 < model / hfu < 0.78


def test_each_run_checks_what_it_ran_and_nothing_else():
    """checked_by covers each run's own estimate, and not what shares only a cluster and a layout:
    another shape, precision or attention than the run's."""
    from minipar import Cluster, GPTConfig, ParallelConfig, estimate
    for name, run in published.RUNS.items():
        assert published.checked_by(published.predict(run)[1]) is not None, name
    table_5_like = ParallelConfig(tp=8, sequence_parallel=True, recompute="selective", precision="fp32")
    llama = estimate(GPTConfig.preset("llama3-8b"), table_5_like, Cluster.preset("dgx-a100-80g"), 8, 1)
    small = estimate(GPTConfig.preset("gpt2-small"), ParallelConfig(dp=8, zero=3, recompute="full"),
                     Cluster.preset("dgx-h100"), 8, 1)
    assert published.checked_by(llama) is None and published.checked_by(small) is None


def test_the_context_parallel_sweep():
    """torchtitan's Table 2 (FSDP x CP on 8 GPUs, each GPU 32K tokens of one sequence, full AC,
    float8 linears): within 15% at 32K, 128K and 256K. Not at 64K (22% slow), and no cost that grows
    linearly with the sequence can put it there: the published steps (tokens a GPU / TPS) grow by
    4.5 s from 32K to 64K, then by 8.9 s and 7.3 s per further 32K of sequence."""
    rows = {name: RESULTS[name] for name in published.RUNS if " CP " in name}
    assert len(rows) == 4
    for name, (_, _, error) in rows.items():
        assert abs(error) <= 0.15 or name.endswith("64K"), name
    steps = [32768 / published.RUNS[n].published for n in rows]       # seconds a step
    growth = [(b - a) / (2 ** i) for i, (a, b) in enumerate(zip(steps, steps[1:]))]   # per 32K
    assert growth[0] < 2 / 3 * min(growth[1:])   # 4.5 s, against 8.9 and 7.3
