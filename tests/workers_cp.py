"""Workers for test_context_parallel: each rank computes single-device attention of the whole
sequence locally (same seed), then its context-parallel share, and returns how far apart."""
import torch
import torch.nn.functional as F

from minipar import comm
from minipar import context_parallel as cpm


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def attention_errors(method, seq_len, hq, hk, balanced=True, batch=2, d=8):
    """{output, dq, dk, dv: relative difference} on this rank, and the bytes it sent by kind."""
    torch.set_num_threads(1)
    rank, cp, _ = comm._group_info(None)
    torch.manual_seed(0)
    q, k, v = (torch.randn(batch, h, seq_len, d, dtype=torch.float64) for h in (hq, hk, hk))
    up = torch.randn(batch, hq, seq_len, d, dtype=torch.float64)
    ref = [t.clone().requires_grad_() for t in (q, k, v)]
    out = F.scaled_dot_product_attention(*ref, is_causal=True, enable_gqa=hq != hk)
    (out * up).sum().backward()
    mine = [cpm.shard(t, cp, rank, 2, balanced).requires_grad_() for t in (q, k, v)]
    stats = comm.CommStats()
    got = cpm.attention(*mine, seq_len, None, method, balanced, stats)
    (got * cpm.shard(up, cp, rank, 2, balanced)).sum().backward()
    part = lambda t: cpm.shard(t, cp, rank, 2, balanced)   # noqa: E731
    errors = {"output": _rel(got, part(out))}
    for name, a, b in zip(("dq", "dk", "dv"), mine, ref):
        errors[name] = _rel(a.grad, part(b.grad))
    return errors, dict(stats.bytes_sent), dict(stats.calls)
