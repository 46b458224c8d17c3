"""Workers for test_context_parallel: each rank computes single-device attention of the whole
sequence locally (same seed), then its context-parallel share, and returns how far apart."""
import torch
import torch.nn.functional as F
from reference import rel_diff

from minipar import comm
from minipar import context_parallel as cpm


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
    errors = {"output": rel_diff(got, part(out))}
    for name, a, b in zip(("dq", "dk", "dv"), mine, ref):
        errors[name] = rel_diff(a.grad, part(b.grad))
    return errors, dict(stats.bytes_sent), dict(stats.calls)


def torch_context_parallel(math: bool = False):
    """PyTorch's own context parallelism on this rank's CPU: what it raises (None if it runs)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor.experimental import context_parallel
    from torch.nn.attention import SDPBackend, sdpa_kernel

    torch.manual_seed(0)
    q, k, v = (torch.randn(2, 4, 16, 8) for _ in range(3))
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    try:
        with context_parallel(mesh, buffers=[q, k, v], buffer_seq_dims=[2, 2, 2]), \
                sdpa_kernel(SDPBackend.MATH if math else SDPBackend.FLASH_ATTENTION):
            F.scaled_dot_product_attention(q, k, v, is_causal=True)
    except (NotImplementedError, RuntimeError) as e:
        return f"{type(e).__name__}: {e}"
    return None
