"""Memory measured: the bytes tensors hold (`measure`, each storage once) and the bytes autograd
saves for backward, as they come and go (`ActivationMeter`).

A saved tensor is seen by a `torch.autograd.graph.saved_tensors_hooks` pack hook during forward and
counted once per storage; parameters (and views of them, W.t()) are not activations. memory.py
predicts what this measures.
"""
from __future__ import annotations

import weakref

import torch


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


def measure(params, grads, optimizer_state, activations: int = 0, comm: int = 0) -> dict[str, int]:
    """A rank's memory by category, in bytes, from the tensors it holds (each storage once)."""
    return {"params": tensor_bytes(params), "grads": tensor_bytes(grads),
            "optimizer": tensor_bytes(optimizer_state), "activations": activations, "comm": comm}


class ActivationMeter:
    """Peak bytes of tensors saved for backward, over the forwards run inside `with meter:`.

    A saved tensor counts from its forward until autograd drops it (after its backward: a weakref
    sees it go), so a pipeline's micro-batches in flight are counted as they come and go. Call
    `meter.release()` after a backward to start afresh.
    """

    def __init__(self):
        self.live: dict[int, list[int]] = {}  # storage -> [saved tensors holding it, bytes]
        self.current = self.peak = 0
        self.generation = 0  # a release forgets what was saved before it
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t)

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        ptr = storage.data_ptr()
        base = t if t._base is None else t._base  # a parameter, or a view of one (W.t()),
                                                  #   is not an activation
        if isinstance(base, torch.nn.Parameter):  # (a pipeline stage's input is a leaf,
                                                  #   and an activation)
            return t
        if ptr not in self.live:
            self.live[ptr] = [0, storage.nbytes()]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        self.live[ptr][0] += 1
        # autograd keeps what we return; a detached alias (same storage) holds no reference to the
        # node saving it, where `t` itself, saved as its own node's output, would make a cycle that
        # a retained graph (a pipeline's split backward) never frees
        saved = t.detach()
        weakref.finalize(saved, self._dropped, ptr, self.generation)
        return saved

    def _dropped(self, ptr: int, generation: int) -> None:
        if generation != self.generation or ptr not in self.live:
            return
        self.live[ptr][0] -= 1
        if not self.live[ptr][0]:
            self.current -= self.live.pop(ptr)[1]

    def release(self) -> None:
        self.live.clear()
        self.current = 0
        self.generation += 1

    def __enter__(self):
        self._hooks.__enter__()
        return self

    def __exit__(self, *exc):
        self._hooks.__exit__(*exc)


class Unmetered:
    """An ActivationMeter's stand-in for a step that a minipar.tracker.Tracker watches: the meter's
    saved-tensor hooks, inside the tracker's, would hide the activations from it."""
    peak = 0

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass

    def release(self) -> None:
        pass
