"""The variants bench/zero.py compares: how each is built, its step, and the memory of one steady
step, measured the same way for every variant: by minipar.tracker.Tracker (ops on DTensors left to
DTensor, which it sees run on the local shards), or as a check by PyTorch's MemTracker."""
from __future__ import annotations

import contextlib
import gc
import time
import weakref

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from minipar.config import ParallelConfig
from minipar.model import GPT, cross_entropy
from minipar.parallelize import parallelize
from minipar.tracker import Tracker
from minipar.train import make_optimizer

LR, WEIGHT_DECAY, BETAS = 1e-3, 0.1, (0.9, 0.95)
# set: (peer, its variants; a floor "local*" without any communication first, the peer last)
SETS = {
    "zero3": ("fsdp2", ("local", "zero3/minipar", "zero3/torch", "fsdp2")),
    "zero2": ("fsdp2-noreshard", ("local", "zero2/bucketed", "zero2/naive", "fsdp2-noreshard")),
    "zero1": ("ddp+zero-r", ("local", "zero1/bucketed", "zero1/naive", "ddp+zero-r")),
    "bf16": ("ddp-bf16", ("local-bf16", "dp-bf16/minipar", "ddp-bf16")),
    "zero2-bf16": ("fsdp2-bf16", ("local-bf16", "zero2-bf16/minipar", "fsdp2-bf16")),
}
# the ParallelConfig (less dp) of each minipar variant, built through minipar.parallelize
MINIPAR = {
    "zero3/minipar": dict(zero=3), "zero3/torch": dict(zero=3, collectives="torch"),
    "zero2/bucketed": dict(zero=2, bucketed=True), "zero2/naive": dict(zero=2, dp_mode="naive"),
    "zero1/bucketed": dict(zero=1, bucketed=True), "zero1/naive": dict(zero=1, dp_mode="naive"),
    "dp-bf16/minipar": dict(precision="bf16", bucketed=True),
    "zero2-bf16/minipar": dict(zero=2, precision="bf16", bucketed=True),
}
STEADY = ("forward", "backward", "step")  # the tracker's phases of the measured step


def variants(sets) -> tuple[str, ...]:
    """Every variant of these sets, once, in set order."""
    return tuple(dict.fromkeys(v for s in sets for v in SETS[s][1]))


def batch_of(name: str, batch: int, bf16_batch: int) -> int:
    """Sequences per rank of a variant: bf16's matmuls are slow on CPUs without bf16 units."""
    return bf16_batch if "bf16" in name else batch


def peer_of(name: str, sets) -> str:
    """The peer a variant is compared with: its set's (a floor's: the first set's it is in)."""
    return next(SETS[s][0] for s in sets if name in SETS[s][1])


class Run:
    """One variant, built on this rank: `forward(x, y)` -> loss, `backward(loss)`, `step()` =
    gradient sync left over, optimizer step, zero_grad. mesh: minipar's Mesh (dp = world);
    device_mesh: torch's, for FSDP2; bucket_mb: minipar's buckets and DDP's bucket_cap_mb."""

    def __init__(self, name: str, cfg, mesh, device_mesh, bucket_mb: float, batch: int):
        torch.manual_seed(0)
        self.model = self.module = GPT(cfg)
        self.par = self.optimizer = None
        self.bf16 = name.endswith("-bf16") and not name.startswith("fsdp2")  # autocast on CPU
        if name in MINIPAR:
            config = dict(MINIPAR[name])
            if config.pop("bucketed", False):
                config.update(dp_mode="bucketed", bucket_mb=bucket_mb)
            self.par = parallelize(self.model, ParallelConfig(dp=mesh.dp, **config), mesh,
                                   global_batch=batch * mesh.dp, lr=LR, weight_decay=WEIGHT_DECAY)
            self.optimizer = self.par.optimizer
        elif name.startswith("fsdp2"):
            self._fsdp2(name, device_mesh)
        elif name in ("ddp+zero-r", "ddp-bf16"):
            from torch.nn.parallel import DistributedDataParallel
            self.module = DistributedDataParallel(self.model, bucket_cap_mb=bucket_mb)
            self.optimizer = make_optimizer(self.model, LR, WEIGHT_DECAY)
            if name == "ddp+zero-r":
                self.optimizer = _zero_redundancy(self.optimizer)
        elif name in ("local", "local-bf16"):
            self.optimizer = make_optimizer(self.model, LR, WEIGHT_DECAY)
        else:
            raise ValueError(f"unknown variant {name!r}")

    def _fsdp2(self, name: str, device_mesh) -> None:
        """fully_shard on each block, then the root; fsdp2: ZeRO-3 (resharded after forward),
        -noreshard: ZeRO-2 (kept gathered until backward is done), -bf16: -noreshard computing
        in bf16 with fp32 gradient reduce-scatters (MixedPrecisionPolicy)."""
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        options = dict(mesh=device_mesh, reshard_after_forward=name == "fsdp2")
        if name == "fsdp2-bf16":
            options["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                        reduce_dtype=torch.float32)
        for block in self.model.blocks:
            fully_shard(block, **options)
        fully_shard(self.model, **options)
        self.optimizer = make_optimizer(self.model, LR, WEIGHT_DECAY)

    def forward(self, x, y) -> torch.Tensor:
        if self.par:
            with self.par.mp.autocast():
                return self.par.loss_fn(self.par.model(x), y)
        if self.bf16:
            with torch.autocast("cpu", dtype=torch.bfloat16):
                return cross_entropy(self.module(x), y)
        return cross_entropy(self.module(x), y)

    def backward(self, loss) -> None:
        (self.par.mp.scale(loss) if self.par else loss).backward()

    def step(self) -> None:
        if self.par:
            self.par.sync_and_step()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()

    def close(self) -> None:
        if self.par:
            self.par.close()


def _zero_redundancy(adamw: torch.optim.Optimizer):
    """torch's ZeroRedundancyOptimizer around AdamW, with `adamw`'s parameter groups."""
    from torch.distributed.optim import ZeroRedundancyOptimizer
    return ZeroRedundancyOptimizer(
        [dict(params=g["params"], weight_decay=g["weight_decay"]) for g in adamw.param_groups],
        optimizer_class=torch.optim.AdamW, lr=LR, betas=BETAS)


class _Tracker(Tracker):
    """minipar.tracker.Tracker (it leaves DTensor ops to DTensor, seeing their local shards); the
    steady step's peak from its timeline."""

    def total(self) -> int:
        return sum(self.current.values())

    def steady_peak(self) -> tuple[int, bool]:
        """The largest total among the samples of the measured step's phases (every peak is a
        sample), and whether it is the region's peak (exact then)."""
        peak = max(sum(live.values()) for _, phase, live in self.timeline if phase in STEADY)
        return peak, peak == sum(self.peak_total.values())


class _MemTracker:
    """PyTorch's MemTracker behind the same face (its peaks reset when the measured step
    begins; its module statistics after every step, or it refuses the next forward)."""

    def __init__(self):
        from torch.distributed._tools.mem_tracker import MemTracker
        self.mt = MemTracker()

    def __enter__(self):
        self.mt.__enter__()
        return self

    def __exit__(self, *exc):
        self.mt.__exit__(*exc)

    @contextlib.contextmanager
    def phase(self, name: str):
        if name == STEADY[0]:
            self.mt._peak_mem.clear(), self.mt._peak_mem_snap.clear()
        yield
        if name not in STEADY[:2]:  # (not between forward and backward)
            self.mt.reset_mod_stats()

    def _sum(self, kind: str) -> int:
        return sum(snap["Total"] for snap in self.mt.get_tracker_snapshot(kind).values())

    def total(self) -> int:
        return self._sum("current")

    def steady_peak(self) -> tuple[int, bool]:
        return self._sum("peak"), True


def measure_memory(build, x, y, tool: str = "tracker", warm: int = 2) -> dict:
    """This rank's tensor bytes in a steady step of the variant build() makes inside the memory
    tracker (`tool`: "tracker", minipar's, or "memtracker", PyTorch's): {"peak", "after_forward",
    "between", "gathered", "exact"} (see zero.py)."""
    gc.collect()
    started = time.perf_counter()
    tracker = _Tracker() if tool == "tracker" else _MemTracker()
    with tracker:
        with tracker.phase("build"):
            run = build()
        for _ in range(warm):  # the optimizer state is made; DDP rebuilds its buckets
            with tracker.phase("warm-up"):
                run.backward(run.forward(x, y))
                run.step()
        storages, hooks = _watch_parameter_storages(run.model)
        with tracker.phase("forward"):
            loss = run.forward(x, y)
        after_forward = tracker.total()
        gathered = sum(st.nbytes() for st in (ref() for ref in storages.values()) if st is not None)
        with tracker.phase("backward"):
            run.backward(loss)
            del loss
        with tracker.phase("step"):
            run.step()
        time.sleep(0.05)  # gloo's worker thread drops its reference to a finished collective's
        dist.barrier()    # tensors a moment after the caller's wait returns
        between = tracker.total()
    for hook in hooks:
        hook.remove()
    run.close()
    del run
    gc.collect()
    peak, exact = tracker.steady_peak()
    return dict(peak=peak, after_forward=after_forward, between=between, gathered=gathered,
                exact=exact, seconds=time.perf_counter() - started)


def _watch_parameter_storages(model):
    """Weak references to the storages every module's parameters have while it runs its forward.

    Read after forward: the full parameters still held then (gathered ones that were not freed, or
    were freed in name only, and any that are never sharded), whatever the implementation."""
    storages = {}

    def note(module, args):
        for p in module.parameters(recurse=False):
            st = (p.to_local() if isinstance(p, DTensor) else p).untyped_storage()
            if st.nbytes():
                storages.setdefault(st.data_ptr(), weakref.ref(st))

    hooks = [m.register_forward_pre_hook(note) for m in model.modules()
             if any(True for _ in m.parameters(False))]
    return storages, hooks
