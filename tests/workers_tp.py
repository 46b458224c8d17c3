"""Workers for test_tensor_parallel: each parallel layer against the single-device layer, on every rank.

Every rank builds the full layer from the same seed (the single-device reference, computed locally),
cuts its own parallel version from it, runs both on the same input and the same upstream gradient,
and returns the relative differences of the output and of the input and weight gradients, each
compared with the part of the reference this rank holds.
"""
import torch
import torch.distributed as dist
import torch.nn as nn
from torch.utils._python_dispatch import TorchDispatchMode

from minipar import tensor_parallel as tpm
from minipar.model import GPT, MLP, CausalSelfAttention, GPTConfig, cross_entropy


def _rel(a, b):
    return ((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30)).item()


def _run(module, x, upstream):
    """Output, input gradient and {name: weight gradient} of module(x) under the loss sum(out * upstream)."""
    x = x.detach().clone().requires_grad_(x.is_floating_point())
    out = module(x)
    (out * upstream).sum().backward()
    return out.detach(), x.grad, {n: p.grad for n, p in module.named_parameters()}


def layer_errors(kind: str, sequence_parallel: bool = False) -> dict[str, float]:
    """Worst relative difference of output, input gradient and weight gradients for one layer kind."""
    torch.set_num_threads(1)
    tp = tpm.TPGroup.of(None, sequence_parallel)
    t, r = tp.size, tp.rank
    cfg = GPTConfig(n_layer=1, n_head=12, d_model=48, vocab_size=96, seq_len=12)  # divides by 2, 3 and 4
    torch.manual_seed(0)
    h, T = cfg.d_model, cfg.seq_len
    seq = (lambda a: a.tensor_split(t, 1)[r]) if sequence_parallel else (lambda a: a)  # this rank's tokens
    feat = lambda a: a.tensor_split(t, -1)[r]  # noqa: E731  this rank's features
    x = torch.randn(2, T, h)
    if kind == "column":
        full = nn.Linear(h, 3 * h)
        par, inp, out_part, in_part = tpm.ColumnParallelLinear(full, tp), seq(x), feat, seq
    elif kind == "row":
        full = nn.Linear(3 * h, h)
        x = torch.randn(2, T, 3 * h)
        par, inp, out_part, in_part = tpm.RowParallelLinear(full, tp), feat(x), seq, feat
    elif kind == "attention":
        full = CausalSelfAttention(cfg)
        par, inp, out_part, in_part = tpm.ParallelAttention(full, tp), seq(x), seq, seq
    elif kind == "mlp":
        full = MLP(cfg)
        par = MLP(cfg)
        par.fc, par.proj = tpm.ColumnParallelLinear(full.fc, tp), tpm.RowParallelLinear(full.proj, tp)
        inp, out_part, in_part = seq(x), seq, seq
    elif kind == "embedding":
        full = nn.Embedding(cfg.vocab_size, h)
        x = torch.randint(0, cfg.vocab_size, (2, T))
        par, inp, out_part, in_part = tpm.VocabParallelEmbedding(full, tp), x, seq, lambda a: a
    else:
        raise ValueError(kind)
    ref_out, ref_in, ref_w = _run(full, x, upstream := torch.randn_like(full(x)))
    out, grad_in, grad_w = _run(par, inp, out_part(upstream))
    errors = {"output": _rel(out, out_part(ref_out))}
    if ref_in is not None:
        errors["input grad"] = _rel(grad_in, in_part(ref_in))
    for name, g in grad_w.items():
        p = dict(par.named_parameters())[name]
        ref = ref_w[name].tensor_split(t, p.tp_dim)[r] if hasattr(p, "tp_dim") else ref_w[name]
        if getattr(p, "sequence_partial", False):  # summed over the group after backward, as training does
            dist.all_reduce(g)
        errors[f"{name} grad"] = _rel(g, ref)
    return errors


class _Shapes(TorchDispatchMode):
    """Records the last dimension of every tensor any operation produces."""

    def __init__(self):
        super().__init__()
        self.sizes = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else [out]:
            if isinstance(t, torch.Tensor) and t.dim():
                self.sizes.add(t.shape[-1])
        return out


def all_layer_errors() -> dict[str, float]:
    """layer_errors of every kind, with and without sequence parallelism, as {"kind sp: what": error}."""
    return {f"{kind} sp={sp}: {what}": err for kind in ("column", "row", "attention", "mlp", "embedding")
            for sp in (False, True) for what, err in layer_errors(kind, sp).items()}


def cross_entropy_check(vocab: int = 96) -> dict:
    """Vocab-parallel loss and logit gradients against the full-vocab ones; and the last dimension of
    every tensor made by a whole tensor-parallel model's forward, loss and backward."""
    torch.set_num_threads(1)
    tp = tpm.TPGroup.of(None)
    torch.manual_seed(0)
    logits = (3 * torch.randn(2, 10, vocab)).requires_grad_()
    targets = torch.randint(0, vocab, (2, 10))
    cross_entropy(logits, targets).backward()
    part = logits.detach().tensor_split(tp.size, -1)[tp.rank].clone().requires_grad_()
    loss = tpm.vocab_parallel_cross_entropy(part, targets, tp)
    loss.backward()
    model = tpm.apply_tp(GPT(GPTConfig(n_layer=1, n_head=12, d_model=36, vocab_size=vocab, seq_len=16)), tp)
    with _Shapes() as shapes:
        tpm.vocab_parallel_cross_entropy(model(targets), targets, tp).backward()
    return dict(loss=loss.item(), ref=cross_entropy(logits, targets).item(),
                grad=_rel(part.grad, logits.grad.tensor_split(tp.size, -1)[tp.rank]), widths=shapes.sizes)
