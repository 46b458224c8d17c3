"""How layout invariance is judged: against the single-process run, in relative norm.

Elementwise relative error is the wrong yardstick after a few Adam steps: an element whose gradient
is a near-cancellation gets an update of about lr * sign(g) whatever its size, so summation order
alone can move it by 1e-4 of itself. So the check has two levels:
  - the whole model: ||w - w_ref|| / ||w_ref|| over all weights together <= rtol (1e-5 in fp32);
  - each tensor: the same ratio <= 10 * rtol, which still catches a wrong shard, slice or layer
    (those differ by 1e-3 and more) while allowing a small tensor its share of rounding noise;
    or, for a tensor so small that rounding alone passes that ratio (a LayerNorm bias whose
    gradients nearly cancel), no element further from the reference than 1% of one Adam step (lr):
    summation order moves such elements by up to about 0.5% of lr, a wrong update by a whole lr.
"""
import torch


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def flat(state: dict) -> torch.Tensor:
    """Every tensor of a state dict, in name order, as one float64 vector."""
    return torch.cat([state[k].double().flatten() for k in sorted(state)])


def assert_same_training(res, ref, rtol: float = 1e-5, lr: float = 1e-3):
    """Same losses (each step) and the same final weights as the reference run (see above)."""
    losses = torch.tensor(res.losses, dtype=torch.float64)
    expected = torch.tensor(ref.losses, dtype=torch.float64)
    assert losses.shape == expected.shape
    assert ((losses - expected).abs() / expected.abs()).max() <= rtol, (res.losses, ref.losses)
    assert res.state_dict.keys() == ref.state_dict.keys()
    assert rel_diff(flat(res.state_dict), flat(ref.state_dict)) <= rtol
    worst = max(ref.state_dict, key=lambda k: rel_diff(res.state_dict[k], ref.state_dict[k]))
    a, b = res.state_dict[worst].double(), ref.state_dict[worst].double()
    assert rel_diff(a, b) <= 10 * rtol or (a - b).abs().max() <= 0.01 * lr, worst
