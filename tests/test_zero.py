"""ZeRO stages 1, 2 and 3 equal single-process AdamW, hold the bytes the formulas say, and send
2 Psi (stages 1, 2) or 3 Psi (stage 3)."""
import pytest
import workers_dp
from reference import assert_same_training

import minipar
from minipar import GPTConfig, ParallelConfig, memory

ODD = GPTConfig.preset("tiny", vocab_size=97)  # 216,353 parameters: padding at dp = 2, 3 and 4
STEPS, BATCH = 3, 12


@pytest.fixture(scope="module")
def reference():  # plain torch.optim.AdamW on one process
    return minipar.train(ODD, steps=STEPS, global_batch=BATCH, lr=1e-3, weight_decay=0.1, return_state=True)


@pytest.mark.parametrize("dp", [2, 3, 4])
def test_every_stage_equals_the_single_process_run(dp, reference):
    cases = [ParallelConfig(dp=dp, zero=stage, collectives=c) for stage in (1, 2, 3) for c in ("minipar", "torch")]
    if BATCH % (2 * dp) == 0:
        cases += [ParallelConfig(dp=dp, zero=2, microbatches=2), ParallelConfig(dp=dp, zero=3, microbatches=2)]
    ranks = minipar.launch(workers_dp.train_variants, dp, ODD, cases, STEPS, BATCH, timeout=120)
    for i, par in enumerate(cases):
        assert_same_training(ranks[0][i], reference), par


def shard_bytes(sizes: list[int], n: int, rank: int) -> dict:
    """Bytes of one flat buffer of these parameter sizes, padded and cut in n shards, for `rank`."""
    total = sum(sizes)
    shard = -(-total // n)
    lo, hi = rank * shard, (rank + 1) * shard
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    pieces = sum(1 for s, k in zip(starts, sizes) if max(s, lo) < min(s + k, hi))
    owned = max(0, min(hi, total) - lo)                               # real (not padding) elements
    return {"shard": 4 * shard, "full": 4 * shard * n, "total": 4 * total,
            "optimizer": 8 * owned + 4 * pieces}                      # Adam moments + a step count a piece


def expected(cfg, stage: int, n: int, rank: int) -> dict:
    """Per-rank bytes and traffic a step by the formulas of zero.py's docstring, from the shapes alone."""
    model = minipar.GPT(cfg)
    if stage < 3:  # the default bucket (25 MiB) holds this model: one flat buffer, backward's order
        f = shard_bytes([p.numel() for p in model.parameters()][::-1], n, rank)
        return {"params": f["full"], "grads": f["full"] if stage == 1 else f["shard"],
                "optimizer": f["optimizer"], "reduce_scatter": (n - 1) * f["shard"],
                "all_gather": (n - 1) * f["shard"]}
    units = [model.tok_emb, model.pos_emb, *model.blocks, model.ln_f, model.head]
    fs = [shard_bytes([p.numel() for p in u.parameters()], n, rank) for u in units]
    return {"params": sum(f["shard"] for f in fs), "grads": sum(f["shard"] for f in fs),
            "optimizer": sum(f["optimizer"] for f in fs),
            "reduce_scatter": sum((n - 1) * f["shard"] for f in fs),
            "all_gather": 2 * sum((n - 1) * f["shard"] for f in fs),  # before forward and before backward
            "two_units": sum(sorted(f["full"] for f in fs)[-2:])}


@pytest.mark.parametrize("stage,n", [(1, 3), (2, 3), (2, 4), (1, 2), (3, 2), (3, 3), (3, 4)])
def test_memory_and_traffic_match_the_formulas(stage, n):
    steps = 2
    res = minipar.train(ODD, ParallelConfig(dp=n, zero=stage), steps=steps, global_batch=12)
    persistent = ("params", "grads", "optimizer")
    for rank in range(n):
        want, got, sent = expected(ODD, stage, n, rank), res.peak_memory[rank], res.comm_bytes[rank]
        assert {k: got[k] for k in persistent} == {k: want[k] for k in persistent}
        assert sent == {k: steps * want[k] for k in ("reduce_scatter", "all_gather")}
        if stage == 3:  # gathered parameters: this unit and the prefetched next one, at most
            assert 0 < got["comm"] <= want["two_units"]
    # against the paper's figures: 2 Psi (stages 1, 2) or 3 Psi (stage 3) of traffic, up to padding
    psi = 4 * ODD.num_params * (n - 1) / n
    total = sum(res.comm_bytes[0].values()) / steps
    assert abs(total / ((3 if stage == 3 else 2) * psi) - 1) < 1e-3
    assert max(m["optimizer"] for m in res.peak_memory) < 8 * ODD.num_params / n * 1.01 + 4 * 60




def test_stage_3_really_frees_what_it_gathered():
    """After forward, and after backward, no unit holds its gathered parameters, although autograd
    saved views of the weights (W.t()) in between; and a rank keeps no gradients between steps."""
    import torch

    from minipar.model import cross_entropy
    from minipar.zero3 import Zero3
    torch.manual_seed(0)
    model = minipar.GPT(ODD)
    zero = Zero3(model)  # one process: shards of one, the same gather and free
    held = lambda: sum(u.full.untyped_storage().nbytes() for u in zero.units)  # noqa: E731
    x = torch.randint(0, ODD.vocab_size, (2, ODD.seq_len))
    loss = cross_entropy(model(x), x)
    assert held() == 0
    loss.backward()
    assert held() == 0
    zero.step()
    zero.zero_grad()
    assert sum(g.numel() for g in zero.grad_tensors()) == 0
    assert 0 < zero.peak_gathered_bytes <= 2 * max(u.full.numel() * 4 for u in zero.units)


def test_the_step_peak_shows_what_each_stage_saves():
    """Measured over a whole step (minipar.tracker), not after it: bucketed ZeRO-2 frees each full
    gradient bucket once reduced, so its peak is below ZeRO-1's by at least the paper's gradient term
    (1 - 1/N) G; the simple version (one flat reduce-scatter after backward) holds the full gradient
    through backward and saves nothing at its peak. The persistent states at the peak are the tally's,
    and the activations there memory.predict's, to the byte."""
    n, small = 2, 0.1  # MiB buckets: several of them
    cases = {(z, mode): ParallelConfig(dp=n, zero=z, dp_mode=mode,
                                       **({"bucket_mb": small} if mode == "bucketed" else {}))
             for z in (1, 2) for mode in ("naive", "bucketed")}
    ranks = minipar.launch(workers_dp.train_variants, n, ODD, list(cases.values()), 3, BATCH,
                           timeout=120)
    held = {}
    for key, res in zip(cases, ranks[0]):
        peak, tally = res.step_memory["held"], res.memory
        held[key] = sum(v for c, v in peak.items() if c not in ("temporaries", "phase"))
        assert (peak["params"], peak["optimizer"]) == (tally["params"], tally["optimizer"]), key
        predicted = memory.predict(ODD, cases[key], BATCH)
        if peak["phase"] == "forward":  # the peak at the end of forward: every activation alive
            assert peak["activations"] == predicted["activations"], key
    G = ranks[0][0].memory["grads"]  # ZeRO-1's full gradient, fp32, padded
    assert held[2, "bucketed"] <= held[1, "bucketed"] - (1 - 1 / n) * G
    assert held[2, "naive"] >= held[1, "naive"] - G / n  # no saving at the peak
    assert ranks[0][3].step_memory["held"]["grads"] < G  # a bucket in flight, not the full gradient


def test_zero_holds_no_gradient_copy_and_frees_its_buffers_between_steps():
    """ZeRO-1's reduce-scatter lands in its bucket's own shard (it kept a second copy, G/N, and
    the ring's receive space, where DP with the same buckets holds neither beyond its receive
    space); ZeRO-1 and 2 make the receive space at the step's first reduction and free it after
    the last, and ZeRO-2 frees its gradient shards at zero_grad (FSDP2 holds neither between
    steps): at the watched step's start ZeRO-2 holds no gradient and neither holds a buffer."""
    n, small = 2, 0.1
    cases = [ParallelConfig(dp=n, zero=z, bucket_mb=small) for z in (0, 1, 2)]
    ranks = minipar.launch(workers_dp.train_variants, n, ODD, cases, 3, BATCH, timeout=120)
    dp, zero1 = (res.step_memory["held"] for res in ranks[0][:2])
    assert zero1["grads"] == ranks[0][1].memory["grads"]  # the buckets (padded to N shards) alone
    assert zero1["comm"] <= dp["comm"]  # at most the receive space
    for res, grads in zip(ranks[0][1:], (zero1["grads"], 0)):
        start = res.timeline[0][2]  # (event, phase, {category: bytes}): the step's first sample
        assert (start["grads"], start["comm"]) == (grads, 0), res.timeline[0]


def test_bucketed_zero_reduce_scatters_during_backward():
    """ZeRO-1/2's reduce-scatter ran once, after backward; bucketed, backward's hooks launch each
    bucket's (its spans, as DP's), every micro-batch's in ZeRO-2 (DeepSpeed's stage 2), and the
    first micro-batch's overlaps the second; the flat version's only after backward."""
    cases = [ParallelConfig(dp=2, zero=z, bucket_mb=0.1, microbatches=2) for z in (1, 2)] + \
        [ParallelConfig(dp=2, zero=2, dp_mode="naive")]
    ranks = minipar.launch(workers_dp.train_variants, 2, ODD, cases, 2, BATCH, timeout=120)
    for res, reduced_each in zip(ranks[0], (1, 2, None)):
        backward = [s for s in res.spans if s[0] == "backward"]
        buckets = [s for s in res.spans if s[0].startswith("bucket")]
        first = min(b[1] for b in buckets)  # the first step's first reduce-scatter began...
        if reduced_each is None:  # the flat version: one reduce-scatter a step, after backward
            assert res.calls["reduce_scatter"] == 2 and first > backward[0][2]
            continue
        # ...after the first micro-batch's backward began: launched by its hooks (ZeRO-1: those of
        # the last micro-batch; ZeRO-2 reduces the first's while the second runs)
        assert first > backward[reduced_each % 2][1] and first < backward[1][2]  # in backward
        per_step = res.calls["reduce_scatter"] // 2
        assert per_step == reduced_each * len({b[0] for b in buckets}) > 2
