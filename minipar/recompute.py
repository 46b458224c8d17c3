"""Activation recomputation: keep less for backward, compute it again there.

Chen et al. 2016 ("Training deep nets with sublinear memory cost") keep only some activations and
recompute the rest in backward; Korthikanti et al. 2022 choose what to recompute by cost:

    "none"       every layer keeps what its backward needs
                     memory: s b h (34 + 5 a s/h) bytes a layer, 16-bit
    "full"       a layer keeps only its input; backward first runs its forward again
                     memory: 2 s b h a layer; compute: + one forward (~ +33% FLOPs)
    "selective"  recompute the attention core, softmax(q k^T) v: its a s^2 b-sized matrices are
                 most of the memory and little of the FLOPs
                     memory: s b h 34 a layer; compute: + 2 a s^2 b h... FLOPs (a few %)

With F.scaled_dot_product_attention's fused kernel (FlashAttention, Dao et al. 2022, and its CPU
version), the attention matrix is never stored: the kernel already recomputes it in backward. So in
minipar "selective" saves only the kernel's output and log-sum-exp
(4 a s b bytes a layer, fp32) — the
lesson: fused attention is selective recomputation built in. Both modes use
`torch.utils.checkpoint` (non-reentrant): the wrapped function's inputs are saved, its inside is
not. Per rank and layer, with e bytes an element and t tensor-parallel ranks (cut by t with SP):
    full: s b h e (the layer's input)       selective: "none" less the attention's log-sum-exp
"""
from __future__ import annotations

from functools import partial

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

MODES = ("none", "selective", "full")


def apply_recompute(model: nn.Module, mode: str) -> nn.Module:
    """Make each block of `model` (a GPT, possibly tensor-parallel or a pipeline rank's share)
    recompute in backward: "full" the whole block, "selective" its attention core. In place."""
    if mode not in MODES:
        raise ValueError(f"recompute must be one of {MODES}, got {mode!r}")
    for block in model.blocks:
        if not isinstance(block, nn.Module) or not hasattr(block, "attn"):
            continue  # a block another pipeline rank holds (nn.Identity here)
        if mode == "full":  # an instance attribute shadows the method: module
                            #   hooks still run around it
            block.forward = partial(checkpoint, type(block).forward.__get__(block),
                                    use_reentrant=False)
        elif mode == "selective":
            block.attn.core = partial(checkpoint, block.attn.core, use_reentrant=False)
    return model
