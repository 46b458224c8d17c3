"""Mixed precision: compute in 16 bits, update in 32 (Micikevicius et al. 2018, "Mixed Precision
Training").

Forward and backward run on 16-bit weights (bf16 or fp16: half the bytes to move, the fast matmul
units), while the optimizer updates an fp32 *master* copy of every weight, because an update much
smaller than its weight is rounded away when it is added in 16 bits. fp16 also needs *loss scaling*:
its range is narrow (largest 65504, smallest 2^-24), so the loss is multiplied by a scale S before
backward to lift small gradients out of underflow, and the gradients are divided by S in fp32.

    model (16-bit) --forward/backward under autocast--> 16-bit grads
         ^                                              | grads_to_master: fp32, / S, inf check
         | master_to_model: round to 16 bits            v
    fp32 master weights  <---- optimizer.step() (fp32 Adam moments) ---- fp32 master grads

Modes: "fp32" (nothing changes), "bf16" and "fp16" (the recipe above; only fp16 scales the loss),
"pure-bf16" (the model in bf16 and NO master: the optimizer steps the bf16 weights, moments in bf16,
the contrast that shows why master weights matter).

Memory per parameter with Adam, Psi parameters (plus a 4-byte step counter per tensor):
    fp32                4 params + 4 grads + 8 (two fp32 moments)                          = 16 Psi
    bf16 / fp16 mixed   2 params + 2 grads + 12 (fp32 master 4 + two fp32 moments 8)       = 16 Psi
                        (the ZeRO paper's 2 Psi + 2 Psi + K Psi with K = 12)
    pure bf16           2 params + 2 grads + 4 (two bf16 moments)                          =  8 Psi
With Adam, mixed precision saves no persistent memory: it moves 4 bytes from the weights and grads
into the optimizer state. What it halves is the activations and the bytes each matmul moves.
Transient: this naive step converts the 16-bit grads into fp32 master grads (4 Psi) for the update
and frees them right after it, as DeepSpeed's FP16_Optimizer does (a fused optimizer that reads the
16-bit grads directly avoids even that).

Gradient accumulation and data parallelism (parallelize.py): by default the gradients accumulate
in fp32, in data_parallel.GradBuckets' buffers, which become the masters' .grad (the paper's third
trick: 16-bit products summed into fp32; Megatron-LM's fp32 "main grads"), and are all-reduced there
(2(N-1)/N * 4 Psi bytes per rank); grads are then 4 Psi, not 2 Psi (Megatron's 2 + 4 + 12 = 18
bytes a parameter). The option (reduce_fp32=False) accumulates and all-reduces 16-bit grads
(2(N-1)/N * 2 Psi) and copies them to the masters here. Either way an fp16 overflow on one rank
reaches every rank through the sum, so all skip the step.
"""
from __future__ import annotations

import contextlib

import torch
import torch.nn as nn

from minipar import memory
from minipar.config import PRECISIONS  # ("fp32", "bf16", "fp16", "pure-bf16")

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16,
          "pure-bf16": torch.bfloat16}


class LossScaler:
    """Dynamic loss scaling with torch.amp.GradScaler's defaults: multiply the loss by `scale`; on
    an overflow skip the step and multiply the scale by `backoff`, after `growth_interval` good
    steps in a row multiply it by `growth`. The scale settles just below
    the largest one that does not overflow."""

    def __init__(self, scale: float = 2.0**16, growth: float = 2.0, backoff: float = 0.5,
                 growth_interval: int = 2000):
        self.scale, self.growth, self.backoff = scale, growth, backoff
        self.growth_interval = growth_interval
        self.good_steps = 0  # steps without overflow since the scale last changed

    def update(self, overflow: bool) -> None:
        if overflow:
            self.scale *= self.backoff
            self.good_steps = 0
        else:
            self.good_steps += 1
            if self.good_steps == self.growth_interval:
                self.scale *= self.growth
                self.good_steps = 0

    def state_dict(self) -> dict:
        """What a checkpoint keeps, so that a resumed run scales as the uninterrupted one would."""
        return {"scale": self.scale, "good_steps": self.good_steps}

    def load_state_dict(self, state: dict) -> None:
        scale, good = state.get("scale"), state.get("good_steps")
        if not isinstance(scale, (int, float)) or not 0 < scale < float("inf"):
            raise ValueError(f"the loss scaler state's scale must be a positive number, got "
                             f"{scale!r}")
        if not isinstance(good, int) or good < 0:
            raise ValueError(f"the loss scaler state's good_steps must be a non-negative integer, "
                             f"got {good!r}")
        self.scale, self.good_steps = float(scale), good


class MixedPrecision:
    """Puts `model` in `precision` (in place) and keeps what the
    optimizer steps; see the module docstring.

    A training step:
        mp = MixedPrecision(model, "bf16")
        optimizer = make_optimizer(mp.optimized, lr, weight_decay)   # fp32 masters, or the model
        itself with mp.autocast():
            loss = cross_entropy(model(x), y)
        mp.scale(loss).backward()
        took_step = mp.step(optimizer)        # grads_to_master, optimizer.step(), master_to_model
    """

    def __init__(self, model: nn.Module, precision: str = "bf16", *, init_scale: float = 2.0**16,
                 growth_interval: int = 2000, masters: bool = True,
                 scaler: LossScaler | None = None):
        """masters=False: someone else keeps the fp32 masters (ZeRO's shards); scaler: fp16's loss
        scaler when it is shared with such an optimizer (else one is made
        from init_scale and growth_interval)."""
        if precision not in PRECISIONS:
            raise ValueError(f"precision must be one of {PRECISIONS}, got {precision!r}")
        self.model, self.precision, self.dtype = model, precision, DTYPES[precision]
        self.params = list(model.parameters())
        self.device_type = self.params[0].device.type
        mixed = precision in ("bf16", "fp16") and masters  # masters=False: someone else
                                                           #   keeps them (ZeRO)
        # fp32 copies made before the cast, so the masters start from the exact fp32 initialisation
        self.master = nn.ParameterList(nn.Parameter(p.detach().to(torch.float32, copy=True))
                                       for p in self.params) if mixed else None
        for p in self.params:
            p.data = p.data.to(self.dtype)  # the model now holds 16-bit weights (no-op for fp32)
        # what to build the optimizer on
        self.optimized: nn.Module = self.master if mixed else model
        if precision != "fp16":
            self.scaler = None
        else:
            self.scaler = scaler or LossScaler(init_scale, growth_interval=growth_interval)
        self.grad_bytes = 0  # bytes of the model's grads at the last grads_to_master (their peak)
        self.tracker = None  # a minipar.tracker.Tracker watching the step: told what it allocates

    def autocast(self):
        """The forward's context: torch.autocast in the 16-bit dtype (ops autocast keeps in fp32
        stay there), nothing for fp32. The loss (minipar's cross_entropy)
        is computed in fp32 either way."""
        if self.precision == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """The loss to call backward on: times the loss scale in fp16, unchanged otherwise."""
        return loss * self.scaler.scale if self.scaler else loss

    def grads_to_master(self, reduce=None) -> bool:
        """Move the model's grads to the fp32 masters (freeing the 16-bit ones; a master whose grad
        data_parallel.GradBuckets accumulated in fp32 already keeps it), then
        `reduce(grads)` if given (the data-parallel all-reduce, in place, on the fp32 grads), then
        in fp16 unscale and check for inf/nan. Returns whether to take the step: False only on an
        fp16 overflow, which also backs the scale off. fp32 and pure-bf16 keep their grads on the
        model (reduce runs on those)."""
        self.grad_bytes = memory.tensor_bytes(p.grad for p in self.params)
        if self.master is None:
            if reduce:
                reduce([p.grad for p in self.params if p.grad is not None])
            return True
        for p, m in zip(self.params, self.master):
            if p.grad is not None:  # else the master's grad is there already: DP's fp32 buckets
                m.grad = p.grad.float()  # an fp32 copy
                p.grad = None
                if self.tracker:  # a Tracker watches this step
                    self.tracker.declare("grads", m.grad)
        grads = [m.grad for m in self.master if m.grad is not None]
        if reduce:
            reduce(grads)
        if self.scaler is None:  # bf16 has fp32's range: an overflow would be real, as in fp32
            return True
        for g in grads:
            g.mul_(1.0 / self.scaler.scale)
        overflow = any(not torch.isfinite(g).all() for g in grads)
        self.scaler.update(overflow)
        return not overflow

    @torch.no_grad()
    def master_to_model(self) -> None:
        """Round the updated fp32 masters into the 16-bit model weights
        (to nearest, ties to even)."""
        for p, m in zip(self.params, self.master):
            p.copy_(m)

    def step(self, optimizer, reduce=None, clip=None) -> bool:
        """grads_to_master(reduce), optimizer.step() unless fp16 overflowed, master_to_model;
        returns whether it stepped. The fp32 master grads are freed after the update: only the
        model's persist. clip: a ClipGradNorm, which scales the grads the optimizer steps (the
        masters', unscaled) by the global norm before the update (its `norm` says what it was)."""
        took = self.grads_to_master(reduce)
        if clip is not None:  # measured even on an overflow: its all-reduces run on every rank
            holders = self.master if self.master is not None else self.params
            grads = [(h.grad, p) for h, p in zip(holders, self.params)]
            coefficient = clip.coefficient(grads, self.params[0].device)
            if took and coefficient < 1.0:
                for g in (g for g, _ in grads if g is not None):
                    g.mul_(coefficient)
        if took:
            optimizer.step()
        if self.master is not None:
            for m in self.master:
                m.grad = None
            if took:
                self.master_to_model()
        return took

    # ----------------------------------------------------------------------------- accounting

    def param_tensors(self) -> list[torch.Tensor]:
        """The model's weights: 16-bit, except in fp32 ("params")."""
        return list(self.params)

    def grad_tensors(self) -> list[torch.Tensor]:
        """The model's grads held now: 16-bit, except in fp32 ("grads";
        after backward, before a step)."""
        return [p.grad for p in self.params if p.grad is not None]

    def master_tensors(self) -> list[torch.Tensor]:
        """The fp32 master weights; none in fp32 and pure-bf16 (counted as "optimizer")."""
        return list(self.master) if self.master is not None else []

    def measure(self, optimizer) -> dict[str, int]:
        """Bytes by category after a step: params, grads (at their peak, recorded by
        grads_to_master), optimizer (master weights, moments and step counters)."""
        optimizer_state = [*self.master_tensors(), *memory.optimizer_tensors(optimizer)]
        return {"params": memory.tensor_bytes(self.params), "grads": self.grad_bytes,
                "optimizer": memory.tensor_bytes(optimizer_state)}
