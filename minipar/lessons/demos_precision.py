"""Lesson 02's measurements: what mixed precision buys on this machine, in one process (no launch).

    MODES                      how the GPT is run: "fp32", "bf16" (minipar: 16-bit weights, fp32
                               masters, autocast) and "amp" (torch's AMP: fp32 weights cast by
                               autocast at each use)
    step_times(cfg, batch)     whole training steps, fp32 and bf16 timed in turns
    kernel_times(cfg, batch)   the step's Linear matmuls and attention timed alone, per dtype
    predict_step(...)          the bf16 step predicted from those (Amdahl)
    saved_bytes(cfg, batch)    bytes autograd saves for backward, by dtype (each storage once)
    op_dtypes(cfg, batch)      each aten op's output dtype in a forward, counted
    cpu_bf16()                 what this CPU offers for bf16
"""
from __future__ import annotations

import collections
import contextlib
import statistics
import time

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from minipar import GPT, data
from minipar.model import cross_entropy
from minipar.precision import MixedPrecision
from minipar.train import make_optimizer

MODES = ("fp32", "bf16", "amp")


def build(cfg, mode: str, batch: int, device: str = "cpu", seed: int = 0):
    """A fresh GPT(cfg) run as `mode` (MODES): (model, mp, forward context factory, x, y). "bf16"
    is MixedPrecision(model, "bf16"); "amp" keeps the fp32 model and wraps its forward in
    torch.autocast(bf16), as torch's AMP recipe does."""
    torch.manual_seed(seed)
    model = GPT(cfg).to(device)
    mp = MixedPrecision(model, "fp32" if mode == "amp" else mode)
    ctx = ((lambda: torch.autocast(torch.device(device).type, dtype=torch.bfloat16))
           if mode == "amp" else mp.autocast)
    x, y = (t.to(device) for t in data.global_batch("shakespeare", 0, batch, cfg.seq_len,
                                                    cfg.vocab_size))
    return model, mp, ctx, x, y


def spread(times: list[float]) -> tuple[float, float, float]:
    """(median, min, max) of a list of timings."""
    return statistics.median(times), min(times), max(times)


def step_times(cfg, batch: int, modes=("fp32", "bf16"), warmup: int = 2, steps: int = 5,
               device: str = "cpu") -> dict[str, list[float]]:
    """Seconds of each training step (forward, backward, optimizer step) in each mode, after
    `warmup` untimed steps. The modes take turns, step by step, in an order that alternates, so
    a machine that gets busier or quieter during the measurement weighs on all of them alike."""
    runs = {}
    for mode in modes:
        model, mp, ctx, x, y = build(cfg, mode, batch, device)
        runs[mode] = (model, mp, ctx, x, y, make_optimizer(mp.optimized, 1e-3, weight_decay=0.0))
    times = {mode: [] for mode in modes}
    for i in range(warmup + steps):
        for mode in (modes if i % 2 == 0 else modes[::-1]):
            model, mp, ctx, x, y, optimizer = runs[mode]
            start = time.perf_counter()
            with ctx():
                loss = cross_entropy(model(x), y)
            mp.scale(loss).backward()
            mp.step(optimizer)
            optimizer.zero_grad()
            if device != "cpu":
                torch.cuda.synchronize()
            if i >= warmup:
                times[mode].append(time.perf_counter() - start)
    return times


def matmul_shapes(cfg, batch: int) -> collections.Counter:
    """{(m, k, n): count} of the matmuls a training step runs in the GPT's Linear layers (the
    attention's own products, inside scaled_dot_product_attention, left out): each Linear of in ->
    out on M = batch * seq_len tokens runs (M, in) @ (in, out) forward, and in backward (M, out) @
    (out, in) for its input's gradient and (out, M) @ (M, in) for its weight's."""
    tokens, shapes = batch * cfg.seq_len, collections.Counter()
    for module in GPT(cfg).modules():
        if isinstance(module, torch.nn.Linear):
            k, n = module.in_features, module.out_features
            shapes.update([(tokens, k, n), (tokens, n, k), (n, tokens, k)])
    return shapes


def _timed(fn, reps: int, device: str) -> float:
    """Median seconds of fn() over `reps` calls after one untimed warm-up call."""
    seen = []
    for i in range(reps + 1):
        start = time.perf_counter()
        fn()
        if device != "cpu":
            torch.cuda.synchronize()
        if i:
            seen.append(time.perf_counter() - start)
    return statistics.median(seen)


def kernel_times(cfg, batch: int, dtypes=(torch.float32, torch.bfloat16), reps: int = 5,
                 device: str = "cpu") -> dict[str, dict[torch.dtype, float]]:
    """Seconds a training step spends in its two kinds of heavy kernels, each timed alone in each
    dtype (median of `reps`), times how often the step runs it:
        "Linear matmuls"   the `matmul_shapes`, each shape on random matrices
        "attention"        scaled_dot_product_attention (causal) forward and backward on
                           (batch, n_head, seq_len, head_dim) q, k, v, once per layer"""
    times = {"Linear matmuls": dict.fromkeys(dtypes, 0.0), "attention": {}}
    for (m, k, n), count in matmul_shapes(cfg, batch).items():
        for dt in dtypes:
            a, b = (torch.randn(shape, device=device).to(dt) for shape in ((m, k), (k, n)))
            times["Linear matmuls"][dt] += count * _timed(lambda: torch.mm(a, b), reps, device)
    shape = (batch, cfg.n_head, cfg.seq_len, cfg.d_model // cfg.n_head)
    for dt in dtypes:
        q, k, v = (torch.randn(shape, device=device).to(dt).requires_grad_() for _ in range(3))
        grad = torch.randn(shape, device=device).to(dt)
        attend = lambda: torch.nn.functional.scaled_dot_product_attention(
            q, k, v, is_causal=True).backward(grad)
        times["attention"][dt] = cfg.n_layer * _timed(attend, reps, device)
    return times


def predict_step(fp32_step: float, kernels: dict[str, dict[torch.dtype, float]]) -> float:
    """The bf16 step predicted from the fp32 one (Amdahl): each kernel of `kernel_times` changes
    by what it changed alone, fp32 step - sum(its fp32 time - its bf16 time); the rest of the
    step is taken to cost what it did in fp32 (it leaves out the casts, the fp32 master update
    and its copy back into the bf16 weights)."""
    return fp32_step - sum(t[torch.float32] - t[torch.bfloat16] for t in kernels.values())


def saved_bytes(cfg, batch: int, mode: str, device: str = "cpu") -> dict[str, int]:
    """Bytes autograd saves for backward in one forward of `mode`, by dtype: a
    saved_tensors_hooks pack hook sees every saved tensor and counts its storage once; parameters
    (and views of them, W.t()) are the model, not activations, and are left out (as
    minipar.activations.ActivationMeter does)."""
    model, mp, ctx, x, y = build(cfg, mode, batch, device)
    storages: dict[int, tuple[str, int]] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        base = t if t._base is None else t._base
        if not isinstance(base, torch.nn.Parameter):
            storage = t.untyped_storage()
            storages[storage.data_ptr()] = (str(t.dtype).removeprefix("torch."), storage.nbytes())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), ctx():
        loss = cross_entropy(model(x), y)
    del loss  # the graph goes; the count stays
    by_dtype = collections.Counter()
    for dtype, nbytes in storages.values():
        by_dtype[dtype] += nbytes
    return dict(by_dtype)


class _OutputDtypes(TorchDispatchMode):
    """Counts (aten op, dtypes of its outputs) for every op run inside it. It sits below autocast,
    so it sees the ops autocast has already chosen a dtype for, and the casts it inserted."""

    def __init__(self):
        super().__init__()
        self.counts = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        dtypes = sorted({str(o.dtype).removeprefix("torch.") for o in outs
                         if isinstance(o, torch.Tensor)})
        self.counts[func.overloadpacket.__name__, "+".join(dtypes)] += 1
        return out


def op_dtypes(cfg, batch: int, mode: str, device: str = "cpu") -> collections.Counter:
    """{(aten op, output dtypes): count} over one forward and the loss, run as `mode`."""
    model, mp, ctx, x, y = build(cfg, mode, batch, device)
    with _OutputDtypes() as recorder, ctx():
        cross_entropy(model(x), y)
    return recorder.counts


def op_table(by_mode: dict[str, collections.Counter]) -> str:
    """The op_dtypes of several modes side by side: one row per aten op, each mode's column
    'dtype xcount' (fp32, bf16, fp16 short; views and other shape-only ops left out: they keep
    their input's dtype)."""
    shape_only = {"view", "_unsafe_view", "t", "permute", "detach", "transpose", "expand",
                  "reshape", "arange"}
    short = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
    ops = sorted({op for counts in by_mode.values() for op, _ in counts} - shape_only)
    name = lambda dtypes: "+".join(short.get(dt, dt) for dt in dtypes.split("+"))
    cells = {(mode, op): ", ".join(f"{name(dt)} x{n}" for (o, dt), n in sorted(counts.items())
                                   if o == op) or "-"
             for mode, counts in by_mode.items() for op in ops}
    width = {mode: 2 + max(len(mode), *(len(cells[mode, op]) for op in ops)) for mode in by_mode}
    first = 2 + max(map(len, ops))
    lines = [f"{'aten op':<{first}}" + "".join(f"{mode:<{width[mode]}}" for mode in by_mode)]
    lines += [f"{op:<{first}}" + "".join(f"{cells[mode, op]:<{width[mode]}}" for mode in by_mode)
              for op in ops]
    return "\n".join(line.rstrip() for line in lines)


def cpu_bf16() -> dict:
    """What this machine offers for bf16: the CPU's bf16 instruction flags from /proc/cpuinfo
    (Linux; None elsewhere) and the vector instruction set PyTorch's CPU kernels use."""
    flags = None
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        line = next((line for line in f if line.startswith("flags")), None)
        flags = set(line.split(":", 1)[1].split()) if line else None
    found = {flag: (flag in flags if flags is not None else None)
             for flag in ("avx512_bf16", "amx_bf16")}
    return {**found, "torch capability": torch.backends.cpu.get_cpu_capability()}
