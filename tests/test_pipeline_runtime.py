"""The pipeline runtime equals single-process training, for any schedule, and sends what its docstring says."""
import collections

import pytest
import torch
import workers_pp
from reference import rel_diff

import minipar
from minipar.model import GPT, GPTConfig, cross_entropy
from minipar.pipeline.runtime import Chunk, PipelineExecutor, free_unused, message_order, partition
from minipar.train import make_optimizer

A = collections.namedtuple("A", "op stage microbatch")  # any object with .op .stage .microbatch will do
TINY = GPTConfig.preset("tiny", seq_len=32)              # 4 layers: 3 stages split them 2 + 1 + 1
STEPS, BATCH, M = 2, 8, 4                                 # micro-batches of 2 rows


def gpipe(p, m, v=1, split=False):
    """All forwards (local chunks in order), then all backwards (reverse), then all Ws if split."""
    plan = []
    for r in range(p):
        mine = list(range(r, p * v, p))
        ops = [A("F", c, j) for c in mine for j in range(m)] + [A("B", c, j) for c in mine[::-1] for j in range(m)]
        plan.append(ops + ([A("W", c, j) for c in mine for j in range(m)] if split else []))
    return plan


def one_f_one_b(p, m, w_delay=None):
    """PipeDream-Flush; with w_delay(r), B and W split and rank r runs W(j) after B(j + w_delay(r))."""
    plan = []
    for r in range(p):
        warm = min(p - 1 - r, m)
        ops = [A("F", r, j) for j in range(warm)]
        for j in range(m - warm):
            ops += [A("F", r, warm + j), A("B", r, j)]
        ops += [A("B", r, j) for j in range(m - warm, m)]
        if w_delay is not None:
            out, pending = [], []
            for a in ops:
                out.append(a)
                if a.op == "B":
                    pending.append(A("W", r, a.microbatch))
                    if len(pending) > w_delay(r):
                        out.append(pending.pop(0))
            ops = out + pending
        plan.append(ops)
    return plan


try:  # the real schedules, where that module is there; the hand-written lists above cover the runtime anyway
    from minipar.pipeline.schedules import schedule
except ImportError:
    schedule = None


def reference(steps=STEPS, optim="adamw", cfg=TINY):
    """The single-process run: whole batch, one backward; (losses, grads of step 0, final state)."""
    torch.manual_seed(0)
    model = GPT(cfg)
    opt = workers_pp.make_opt(model, optim, 1e-3)
    losses, grads = [], None
    for step in range(steps):
        x, y = minipar.data.global_batch("synthetic", step, BATCH, cfg.seq_len, cfg.vocab_size, 0)
        loss = cross_entropy(model(x), y)
        loss.backward()
        grads = grads or {k: p.grad.clone() for k, p in model.named_parameters()}
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses, grads, model.state_dict()


REF = {}


def assert_same(ranks, optim="adamw", rtol=1e-5):
    if optim not in REF:
        REF[optim] = reference(optim=optim)
    losses, grads, state = REF[optim]
    got = ranks[-1]["losses"]  # the last chunk lives on the last rank
    assert max(abs(a - b) / b for a, b in zip(got, losses)) <= rtol, (got, losses)
    assert all(r["losses"] == [0.0] * STEPS for r in ranks[:-1])
    for ref, key in ((grads, "grads"), (state, "state")):
        merged = {k: v for r in ranks for k, v in r[key].items()}
        assert merged.keys() == ref.keys()
        flat = lambda d: torch.cat([d[k].flatten() for k in sorted(d)])  # noqa: E731
        assert rel_diff(flat(merged), flat(ref)) <= rtol, key
        worst = max(ref, key=lambda k: rel_diff(merged[k], ref[k]))
        assert rel_diff(merged[worst], ref[worst]) <= 10 * rtol, (key, worst)


def assert_traffic(ranks, plan, n_chunks):
    """One event per action, in order; p2p bytes 2 (n-1) m b s h 4 per step in all."""
    p, act = len(plan), (BATCH // M) * TINY.seq_len * TINY.d_model * 4
    for r, rank in enumerate(ranks):
        for events in rank["events"]:
            assert [a for a, _, _ in events] == list(plan[r])
            assert all(s <= e for _, s, e in events) and all(e0 <= s1 for (_, _, e0), (_, s1, _)
                                                               in zip(events, events[1:]))
        mine = range(r, n_chunks, p)
        sends = 0 if p == 1 else sum((k < n_chunks - 1) + (k > 0) for k in mine)  # out forward, grad back
        assert rank["bytes"] == STEPS * sends * M * act and rank["calls"] == STEPS * sends * M
    if p > 1:
        assert sum(r["bytes"] for r in ranks) == STEPS * 2 * (n_chunks - 1) * M * act


def cases_for(p):
    cases = [(gpipe(p, M), 1, "adamw"), (one_f_one_b(p, M), 1, "adamw"),
             (one_f_one_b(p, M, w_delay=lambda r: r), 1, "adamw"), (gpipe(p, M, split=True), 1, "sgd")]
    if p == 2:  # virtual stages: 4 chunks of one layer, two per rank
        cases += [(gpipe(p, M, v=2), 2, "adamw"), (gpipe(p, M, v=2, split=True), 2, "adamw")]
    if schedule is not None:
        cases += [(schedule("zb-h1", p, M), 1, "adamw"), (schedule("1f1b", p, M), 1, "sgd")]
        cases += [(schedule("interleaved-1f1b", p, M, 2), 2, "adamw")] if p == 2 else []
    return cases


@pytest.mark.parametrize("p", [2, 3, 4])
def test_pipeline_equals_single_process(p):
    cases = cases_for(p)
    results = minipar.launch(workers_pp.pipeline_cases, p, TINY, cases, STEPS, BATCH, timeout=60)
    for i, (plan, v, optim) in enumerate(cases):
        ranks = [r[i] for r in results]
        assert_same(ranks, optim)
        assert_traffic(ranks, plan, p * v)
    gp, fb = [r[0]["peak"] for r in results], [r[1]["peak"] for r in results]
    assert gp == [M] * p                                   # GPipe keeps every micro-batch
    assert fb == [min(p - r, M) for r in range(p)]         # 1F1B at most p - r on rank r


@pytest.mark.parametrize("plan,v", [(gpipe(1, M), 1), (gpipe(1, M, v=2), 2), (gpipe(1, M, v=4, split=True), 4),
                                    (one_f_one_b(1, M, w_delay=lambda r: 2), 1)])
def test_one_rank_many_chunks_is_local(plan, v):
    rank = workers_pp.train_pipeline(TINY, plan, v, STEPS, BATCH)  # no process group: all in this process
    assert_same([rank])
    assert_traffic([rank], plan, v)


def test_partition():
    assert partition(4, 3) == [range(0, 2), range(2, 3), range(3, 4)]
    assert [len(r) for r in partition(12, 5)] == [3, 3, 2, 2, 2]
    assert partition(4, 4) == [range(i, i + 1) for i in range(4)]
    assert partition(6, 2, costs=[1] * 6) == [range(0, 3), range(3, 6)]
    assert partition(4, 2, costs=[1, 1, 1, 5]) == [range(0, 3), range(3, 4)]
    # the head (last value) costs 4 layers: the last chunk takes one layer, the first five
    assert partition(6, 2, costs=[0, 1, 1, 1, 1, 1, 1, 4]) == [range(0, 5), range(5, 6)]
    with pytest.raises(ValueError, match="must not exceed n_layer"):
        partition(4, 5)
    with pytest.raises(ValueError, match="costs"):
        partition(4, 2, costs=[1, 2, 3])


def test_chunks_hold_the_gpt_modules_and_compose_to_it():
    torch.manual_seed(0)
    model = GPT(TINY)
    idx = torch.randint(0, TINY.vocab_size, (2, TINY.seq_len))
    expected = model(idx)
    layers = partition(TINY.n_layer, 3)
    chunks = [Chunk(model, r, k == 0, k == 2) for k, r in enumerate(layers)]
    x = idx
    for chunk in chunks:
        x = chunk(x)
    assert torch.equal(x, expected)
    names = dict(model.named_parameters())
    for chunk in chunks:  # the same tensors under the same names
        assert all(p is names[k] for k, p in chunk.named_parameters())
    free_unused(model, chunks[1:2])
    assert set(dict(model.named_parameters())) == set(dict(chunks[1].named_parameters())) == \
        {k for k in names if k.startswith("blocks.2.")}


def test_bad_schedules_are_refused():
    with pytest.raises(ValueError, match="deadlocks"):  # rank 1 runs B of micro-batch 0 before its F
        message_order([[A("F", 0, 0), A("B", 0, 0)], [A("B", 1, 0), A("F", 1, 0)]], 2)
    torch.manual_seed(0)
    model = GPT(TINY)
    chunks = {0: Chunk(model, range(4), True, True)}
    with pytest.raises(ValueError, match="every F and B"):
        PipelineExecutor(chunks, [[A("F", 0, 0)]], (1, TINY.seq_len, TINY.d_model))
    with pytest.raises(ValueError, match="holds chunks"):
        PipelineExecutor(chunks, gpipe(1, 2, v=2), (1, TINY.seq_len, TINY.d_model))
    opt = make_optimizer(model, 1e-3, 0.0)  # and a valid one runs: loss of an untrained model ~ ln V
    loss, _ = PipelineExecutor(chunks, gpipe(1, 2), (1, TINY.seq_len, TINY.d_model)).step(
        [torch.zeros(1, TINY.seq_len, dtype=torch.long)] * 2, [torch.zeros(1, TINY.seq_len, dtype=torch.long)] * 2)
    opt.step()
    assert abs(loss - torch.log(torch.tensor(96.0)).item()) < 0.5
