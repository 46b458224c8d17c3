"""The mixture-of-experts layer (moe.py) against its definition, token by token.

Dropless routing equals the sum over each token's k experts of gate x expert(token), outputs and
every gradient (float64); one expert, top 1, is the dense MLP; capacity keeps the first C slots of
each expert and drops the rest; an expert that receives no token works and gets zero gradients;
Switch's loss is its formula, alpha at uniform scores and alpha n when one expert takes everything;
DeepSeek-V3's bias rule evens out a skewed router.
"""
import math

import pytest
import torch

from minipar.model import MLP, GPTConfig
from minipar.moe import MoE

H, F_ = 8, 16


def layer(n=4, k=2, seed=0, **kw):
    torch.manual_seed(seed)
    return MoE(H, F_, n, k, **kw).double()


def tokens(n=15, seed=1):
    torch.manual_seed(seed)
    return torch.randn(n, H, dtype=torch.float64, requires_grad=True)


def by_definition(moe, x, routing):
    """sum over a token's kept slots of gate x expert(token), one token at a time."""
    rows = []
    for t in range(len(x)):
        row = torch.zeros(H, dtype=x.dtype)
        for j in range(moe.top_k):
            if routing.kept[t, j]:
                e = int(routing.experts[t, j])
                row = row + routing.gates[t, j] * moe.expert(e, x[t:t + 1])[0]
        rows.append(row)
    return torch.stack(rows)


def grads(moe, x, out):
    moe.zero_grad()
    x.grad = None
    (out * torch.arange(out.numel(), dtype=out.dtype).view_as(out).cos()).sum().backward()
    return [x.grad.clone()] + [p.grad.clone() for p in moe.parameters()]


@pytest.mark.parametrize("n,k,capacity", [(4, 2, None), (5, 1, None), (3, 3, None), (4, 2, 1.0),
                                          (6, 2, 0.5)])
def test_outputs_and_gradients_are_the_definitions(n, k, capacity):
    moe, x = layer(n, k, capacity_factor=capacity), tokens()
    y, routing = moe(x)
    ref = by_definition(moe, x, moe.route(x))
    assert torch.allclose(y, ref, rtol=0, atol=1e-14)
    for a, b in zip(grads(moe, x, y), grads(moe, x, by_definition(moe, x, moe.route(x)))):
        assert torch.allclose(a, b, rtol=0, atol=1e-13)


def test_one_expert_top_one_is_the_dense_mlp():
    moe, x = layer(1, 1), tokens()
    mlp = MLP(GPTConfig(d_model=H, n_head=1, ffn_hidden=F_)).double()
    with torch.no_grad():
        mlp.fc.weight.copy_(moe.fc[0].T)
        mlp.fc.bias.copy_(moe.fc_bias[0])
        mlp.proj.weight.copy_(moe.proj[0].T)
        mlp.proj.bias.copy_(moe.proj_bias[0])
    assert torch.allclose(moe(x)[0], mlp(x), rtol=0, atol=1e-14)


def test_capacity_keeps_the_first_slots_of_each_expert_and_drops_the_rest():
    moe, x = layer(4, 2, capacity_factor=0.5), tokens(40)
    routing = moe.route(x)
    cap = moe.capacity(40)
    assert cap == math.ceil(0.5 * 40 * 2 / 4) == 10
    routed = torch.bincount(routing.experts.flatten(), minlength=4)
    assert routing.counts.tolist() == [min(int(r), cap) for r in routed]
    assert routing.dropped == 80 - int(routing.counts.sum()) > 0
    for e in range(4):   # kept slots of expert e are its earliest ones, in token order
        slots = (routing.experts.flatten() == e).nonzero()[:, 0]
        assert routing.kept.flatten()[slots].tolist() == [i < cap for i in range(len(slots))]
    assert (routing.gates[~routing.kept] == 0).all()


def test_an_expert_that_receives_no_token_works_and_learns_nothing():
    moe, x = layer(4, 2), tokens()
    moe.select_bias[2] = -10.0   # never among the top 2
    y, routing = moe(x)
    (y.sum() + routing.balance_loss).backward()
    assert routing.counts[2] == 0 and routing.counts.sum() == 30
    for p in (moe.fc, moe.fc_bias, moe.proj, moe.proj_bias):
        assert p.grad[2].abs().max() == 0 and p.grad[[0, 1, 3]].abs().max() > 0


def test_switch_balance_loss_is_its_formula_alpha_uniform_and_alpha_n_concentrated():
    moe, x = layer(4, 2, alpha=0.01), tokens(64)
    routing = moe.route(x)
    scores = torch.softmax(moe.router(x), -1)
    f = torch.bincount(routing.experts.flatten(), minlength=4) / 128
    formula = 0.01 * 4 * (f * scores.mean(0)).sum().item()
    assert routing.balance_loss.item() == pytest.approx(formula)
    one = layer(4, 1, alpha=0.01)
    with torch.no_grad():
        one.router.weight.zero_()
    assert one.route(x).balance_loss.item() == pytest.approx(0.01)        # P uniform: alpha
    with torch.no_grad():
        one.router.weight[0] = 0.0
        one.router.weight[0, 0] = 1e3   # expert 0 takes the tokens with x_0 > 0, at score ~1
    x = x.detach().abs()
    assert one.route(x).balance_loss.item() == pytest.approx(0.01 * 4, rel=1e-3)


def test_the_bias_rule_evens_out_a_skewed_router():
    moe, x = layer(4, 1, bias_speed=0.01), tokens(400).detach()
    x[:, 0] = x[:, 0].abs() + 0.5
    with torch.no_grad():
        moe.router.weight[0, 0] = 0.5   # expert 0 favoured
    start = moe.route(x).counts
    for _ in range(300):
        moe.update_bias(moe.route(x).counts)
    end = moe.route(x).counts
    spread = lambda c: int(c.max() - c.min())   # noqa: E731
    assert spread(start) > 100 and spread(end) < 0.25 * spread(start)


def test_a_layer_that_cannot_route_is_refused():
    with pytest.raises(ValueError, match="top_k"):
        MoE(H, F_, 2, 3)
    with pytest.raises(ValueError, match="capacity_factor"):
        MoE(H, F_, 4, 2, capacity_factor=0.0)
