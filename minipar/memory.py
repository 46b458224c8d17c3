"""Measured memory per rank, by category: params, grads, optimizer, activations, comm.

Persistent state is counted exactly, as the bytes of the tensors that hold it. Activations are what
autograd saves for the backward pass: `ActivationMeter` watches every tensor saved during forward
(`torch.autograd.graph.saved_tensors_hooks`), counts each storage once and leaves parameters out,
and keeps the peak. On CUDA, `torch.cuda.max_memory_allocated` is the ground truth to compare with;
on CPU there is no allocator statistic, which is why we count.
"""
from __future__ import annotations

import torch

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm")


def tensor_bytes(tensors) -> int:
    """Bytes held by these tensors, each storage counted once."""
    seen = {}
    for t in tensors:
        if isinstance(t, torch.Tensor) and t.numel():
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
    return sum(seen.values())


def optimizer_tensors(optimizer):
    """Every tensor of the optimizer's state (moments, master weights, step counters)."""
    for state in optimizer.state.values():
        yield from (v for v in state.values() if isinstance(v, torch.Tensor))


class ActivationMeter:
    """Peak bytes of tensors saved for backward, over the forwards run inside `with meter:`.

    Call `meter.release()` after a backward: the saved tensors are freed then.
    """

    def __init__(self):
        self.live: set[int] = set()  # storages saved since the last release
        self.current = self.peak = 0
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        base = t if t._base is None else t._base  # a parameter, or a view of one (W.t()), is not an activation
        if not (base.is_leaf and base.requires_grad) and ptr not in self.live:
            self.live.add(ptr)
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        return t

    def release(self) -> None:
        self.live.clear()
        self.current = 0

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


def measure(params, grads, optimizer_state, activations: int = 0, comm: int = 0) -> dict[str, int]:
    """A rank's memory by category, in bytes, from the tensors it holds in each (each storage once)."""
    return {
        "params": tensor_bytes(params),
        "grads": tensor_bytes(grads),
        "optimizer": tensor_bytes(optimizer_state),
        "activations": activations,
        "comm": comm,
    }
