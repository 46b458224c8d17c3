"""Data parallelism equals single-process training, and communicates exactly what its docstring says."""
import pytest
import workers_dp
from reference import assert_same_training

import minipar
from minipar import GPTConfig, ParallelConfig

TINY = GPTConfig.preset("tiny")
STEPS, BATCH = 3, 12           # 12 rows divide by dp in {1, 2, 3, 4} and by dp * 2 micro-batches for dp <= 3
GRAD_BYTES = 4 * TINY.num_params
SMALL_BUCKET = 0.1             # MiB: several buckets for the tiny model (0.83 MiB of gradients)


@pytest.fixture(scope="module")
def reference():
    return minipar.train(TINY, steps=STEPS, global_batch=BATCH, lr=1e-3, weight_decay=0.1, return_state=True)


def variants(dp):
    out = []
    for mode in ("naive", "bucketed"):
        for collectives in ("minipar", "torch"):
            for microbatches in (1, 2):
                if BATCH % (dp * microbatches) == 0:
                    bucket = dict(bucket_mb=SMALL_BUCKET) if mode == "bucketed" else {}
                    out.append(ParallelConfig(dp=dp, dp_mode=mode, collectives=collectives,
                                              microbatches=microbatches, **bucket))
    return out


@pytest.mark.parametrize("dp", [1, 2, 3, 4])
def test_every_variant_equals_the_single_process_run(dp, reference):
    cases = variants(dp)
    ranks = minipar.launch(workers_dp.train_variants, dp, TINY, cases, STEPS, BATCH, timeout=120)
    for i, par in enumerate(cases):
        assert_same_training(ranks[0][i], reference), par
        for rank in ranks:  # every replica holds the same losses
            assert rank[i].losses == ranks[0][i].losses
        if dp > 1 and par.collectives == "minipar":
            # bytes: the ring sends 2(N-1)/N of the gradient bytes per step, whatever the bucketing,
            # up to the uneven split: at most one element per ring step of each all-reduce
            expected = STEPS * 2 * (dp - 1) * GRAD_BYTES / dp
            for rank in ranks:
                remainder = rank[i].calls["all_reduce"] * 2 * (dp - 1) * 4
                assert abs(rank[i].comm["all_reduce"] - expected) <= remainder


def test_collective_counts():
    tensors = len(list(minipar.GPT(TINY).parameters()))
    cases = [ParallelConfig(dp=2, dp_mode="naive"),
             ParallelConfig(dp=2, dp_mode="bucketed", bucket_mb=SMALL_BUCKET),
             ParallelConfig(dp=2, dp_mode="bucketed", bucket_mb=25),             # bigger than the model
             ParallelConfig(dp=2, dp_mode="bucketed", bucket_mb=SMALL_BUCKET, microbatches=3),
             ParallelConfig(dp=2, dp_mode="naive", collectives="torch", microbatches=3)]
    ranks = minipar.launch(workers_dp.train_variants, 2, TINY, cases, STEPS, BATCH, timeout=120)
    calls = [r.calls for r in ranks[0]]
    assert calls[0] == {"all_reduce": STEPS * tensors}                 # one per parameter per step
    buckets = calls[1]["all_reduce"] // STEPS
    assert buckets * SMALL_BUCKET * 2**20 >= GRAD_BYTES > (buckets - 1) * SMALL_BUCKET * 2**20 * 0.5
    assert calls[2] == {"all_reduce": STEPS}                           # one bucket holds the model
    assert calls[3] == {"all_reduce": STEPS * buckets}                 # no all-reduce on micro-steps 1, 2
    assert calls[4] == {"torch_all_reduce": STEPS * tensors}
    for naive, bucketed in ((0, 1), (4, 3)):  # the buckets are the gradients: no second copy
        assert ranks[0][naive].memory["grads"] == ranks[0][bucketed].memory["grads"] == GRAD_BYTES
    largest = max(p.numel() for p in minipar.GPT(TINY).parameters())  # the ring's receive space
    assert ranks[0][0].memory["comm"] == 4 * (2 - 1) * -(-largest // 2)  # for the largest bucket
    assert ranks[0][4].memory["comm"] == 0  # the backend's all-reduce: no receive space of ours


def test_dp_through_train_and_the_cli(tmp_path, capsys):
    res = minipar.train(TINY, ParallelConfig(dp=2), steps=2, global_batch=4)
    assert len(res.peak_memory) == 2 and res.comm_calls[0] == {"all_reduce": 2}
    from minipar.__main__ import main
    main(["train", "--dp", "2", "--steps", "2", "--global-batch", "4", "--plot", str(tmp_path / "l.png"),
          "--sample", "10"])
    assert (tmp_path / "l.png").exists()
    out, err = capsys.readouterr()
    assert "layout: dp=2" in out and "  rank 1: params 0.83 (0.83)" in out  # measured (predicted)
    assert "train: 100%" in err and "minipar-progress" not in out + err  # the bar is drawn by the caller


def test_bad_dp_options():
    with pytest.raises(ValueError, match="dp_mode must be one of"):
        ParallelConfig(dp_mode="fast")
    with pytest.raises(ValueError, match="bucket_mb must be a positive number"):
        ParallelConfig(bucket_mb=0)
    with pytest.raises(ValueError, match="collectives must be one of"):
        ParallelConfig(collectives="nccl")
