"""ZeRO stages 1 and 2 equal single-process AdamW, hold the bytes the formulas say, and send 2 Psi."""
import pytest

import minipar
from minipar import GPTConfig, ParallelConfig
from reference import assert_same_training
import workers_dp
from test_data_parallel import Run

ODD = GPTConfig.preset("tiny", vocab_size=97)  # 216,353 parameters: padding at dp = 2, 3 and 4
STEPS, BATCH = 3, 12


@pytest.fixture(scope="module")
def reference():  # plain torch.optim.AdamW on one process
    return minipar.train(ODD, steps=STEPS, global_batch=BATCH, lr=1e-3, weight_decay=0.1, return_state=True)


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_stages_1_and_2_equal_the_single_process_run(dp, reference):
    cases = [ParallelConfig(dp=dp, zero=stage, collectives=c) for stage in (1, 2) for c in ("minipar", "torch")]
    if BATCH % (2 * dp) == 0:
        cases.append(ParallelConfig(dp=dp, zero=2, microbatches=2))
    ranks = minipar.launch(workers_dp.train_variants, dp, ODD, cases, STEPS, BATCH, timeout=120)
    for i, par in enumerate(cases):
        assert_same_training(Run(ranks[0][i]), reference), par


def expected_bytes(cfg, stage, n, rank):
    """Per-rank bytes by the formulas of zero.py's docstring, computed from the parameter shapes."""
    sizes = [p.numel() for p in minipar.GPT(cfg).parameters()]
    total = sum(sizes)
    shard = -(-total // n)
    lo, hi = rank * shard, (rank + 1) * shard
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = sum(1 for s, k in zip(starts, sizes) if max(s, lo) < min(s + k, hi))
    owned = max(0, min(hi, total) - lo)  # real (not padding) elements of my shard
    return {"params": 4 * shard * n,                                  # the padded flat buffer
            "grads": 4 * total if stage == 1 else 4 * shard,
            "optimizer": 8 * owned + 4 * pieces,                      # Adam moments + a step count a piece
            "sent": 2 * (n - 1) * 4 * shard}                          # reduce-scatter + all-gather


@pytest.mark.parametrize("stage,n", [(1, 3), (2, 3), (2, 4), (1, 2)])
def test_memory_and_traffic_match_the_formulas(stage, n):
    res = minipar.train(ODD, ParallelConfig(dp=n, zero=stage), steps=2, global_batch=12)
    for rank in range(n):
        want, got = expected_bytes(ODD, stage, n, rank), res.peak_memory[rank]
        persistent = ("params", "grads", "optimizer")
        assert {k: got[k] for k in persistent} == {k: want[k] for k in persistent}
        sent = res.comm_bytes[rank]
        assert sent["reduce_scatter"] == sent["all_gather"] == 2 * want["sent"] / 2  # per step, two steps
        # the ZeRO paper's 2 Psi: the same traffic as data parallelism's all-reduce of the gradients
        assert abs(sent["reduce_scatter"] + sent["all_gather"] - 2 * 2 * (n - 1) / n * 4 * ODD.num_params) \
            <= 2 * 2 * (n - 1) * 4 * n
    dp_opt = 8 * ODD.num_params
    assert max(m["optimizer"] for m in res.peak_memory) < dp_opt / n * 1.01 + 4 * 60


def test_zero_3_is_refused_for_now():
    with pytest.raises(NotImplementedError, match="zero=3"):
        minipar.train(ODD, ParallelConfig(dp=2, zero=3), global_batch=4)
