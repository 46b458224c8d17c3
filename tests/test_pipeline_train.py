"""Pipeline parallelism through minipar.train: every schedule equals the single-process run.

pp 2, 3, 4 with each schedule (GPipe, 1F1B, interleaved 1F1B with 2 virtual stages, ZB-H1), layers
that do not divide evenly, and pp composed with dp and with tp + sequence parallelism: the same losses
and final weights (fp32, 1e-5). The point-to-point bytes are the formula's; 1F1B holds fewer
activations than GPipe; layouts that cannot run fail before any process starts.
"""
import pytest
from reference import assert_same_training

import minipar
from minipar.config import ParallelConfig

CFG = minipar.GPTConfig.preset("tiny", n_layer=8)   # 8 layers: 4 ranks x 2 virtual stages fit
STEPS, BATCH = 3, 12
KW = dict(steps=STEPS, global_batch=BATCH, lr=1e-3, weight_decay=0.1, seed=0, return_state=True)
SCHEDULES = ["gpipe", "1f1b", "interleaved-1f1b", "zb-h1"]


@pytest.fixture(scope="module")
def reference():
    return minipar.train(CFG, ParallelConfig(), **KW)


def _layout(pp, schedule, **more):
    virtual = 2 if schedule == "interleaved-1f1b" else 1
    return ParallelConfig(pp=pp, schedule=schedule, virtual_stages=virtual, microbatches=pp, **more)


CASES = [_layout(pp, s) for pp in (2, 3, 4) for s in SCHEDULES] + [
    _layout(2, "1f1b", dp=2), _layout(2, "1f1b", tp=2, sequence_parallel=True)]


@pytest.mark.parametrize("par", CASES, ids=[par.label for par in CASES])
def test_every_schedule_equals_the_single_process_run(par, reference):
    res = minipar.train(CFG, par, **KW)
    assert_same_training(res, reference)
    # p2p: each boundary between chunks on different ranks carries b s h 4 bytes per micro-batch, each way
    b, s, h = BATCH // (par.dp * par.microbatches), CFG.seq_len // (par.tp if par.sequence_parallel else 1), CFG.d_model
    boundaries = par.pp * par.virtual_stages - 1
    total = sum(r.get("p2p", 0) for r in res.comm_bytes) / (par.dp * par.tp)
    assert total == STEPS * 2 * boundaries * par.microbatches * b * s * h * 4
    assert {len(t) for t in res.spans} == {2 * par.microbatches * par.virtual_stages * (1 + (par.schedule == "zb-h1") / 2)}
    for predicted, measured in zip(res.predicted_memory, res.peak_memory):  # each stage's share, the
        extra = measured.pop("optimizer") - predicted.pop("optimizer")    # schedule's activation peak
        assert predicted == measured and 0 <= extra <= 8 * len(res.state_dict)  # + Adam's step counters


def test_1f1b_holds_fewer_activations_than_gpipe():
    """GPipe keeps all m micro-batches' activations on stage 0, 1F1B at most p of them; ZB-H1 as 1F1B."""
    peak = {s: minipar.train(CFG, ParallelConfig(pp=2, microbatches=6, schedule=s), steps=1,
                             global_batch=12).peak_memory[0]["activations"] for s in ("gpipe", "1f1b", "zb-h1")}
    assert peak["1f1b"] < 0.5 * peak["gpipe"] and peak["zb-h1"] == peak["1f1b"]


def test_layouts_that_cannot_run_fail_before_any_process():
    with pytest.raises(ValueError, match=r"microbatches \(3\) to be a multiple of stages \(2\)"):
        minipar.train(CFG, ParallelConfig(pp=2, microbatches=3, schedule="interleaved-1f1b", virtual_stages=2),
                      global_batch=12)
    with pytest.raises(ValueError, match="must not exceed the model's n_layer"):
        minipar.train(CFG, ParallelConfig(pp=3, microbatches=3, schedule="interleaved-1f1b", virtual_stages=3),
                      global_batch=12)
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved-1f1b'"):
        ParallelConfig(pp=2, virtual_stages=2)


def test_zero_2_and_3_on_a_pipeline_equal_the_single_process_run(reference):
    """ZeRO-2 reduce-scatters each micro-batch's gradients on a stage, ZeRO-3 gathers and frees
    each unit around every F and B: with every schedule each allows (dp 2 x pp 2, one launch), the
    same training as one process."""
    from minipar.lessons import demos_3d
    layouts = [_layout(2, s, dp=2, zero=z) for z in (2, 3) for s in SCHEDULES
               if (z, s) != (3, "zb-h1")]
    ranks = minipar.launch(demos_3d.layouts, 4, CFG, layouts, STEPS, BATCH, 1e-3, 0.1, None, True,
                           timeout=300)
    for par, run in zip(layouts, ranks[0]):
        try:
            assert_same_training(run, reference)
        except AssertionError as e:
            raise AssertionError(f"{par.label}: {e}") from None
