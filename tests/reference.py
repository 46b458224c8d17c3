"""How layout invariance is judged: against the single-process run, per tensor, in relative norm.

Elementwise relative error is the wrong yardstick after a few Adam steps: an element near zero can
differ by 1e-4 of itself purely from summation order. The norm of the difference over the norm of
the tensor is what "equal to 1e-5" means here (and in the tests of every technique).
"""
import torch


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double(), b.double()
    return ((a - b).norm() / b.norm().clamp_min(1e-30)).item()


def assert_same_training(res, ref, rtol: float = 1e-5):
    """Same losses (each step) and the same final weights (each tensor) as the reference run."""
    losses = torch.tensor(res.losses, dtype=torch.float64)
    expected = torch.tensor(ref.losses, dtype=torch.float64)
    assert losses.shape == expected.shape
    assert ((losses - expected).abs() / expected.abs()).max() <= rtol, (res.losses, ref.losses)
    assert res.state_dict.keys() == ref.state_dict.keys()
    worst = max(ref.state_dict, key=lambda k: rel_diff(res.state_dict[k], ref.state_dict[k]))
    assert rel_diff(res.state_dict[worst], ref.state_dict[worst]) <= rtol, worst
