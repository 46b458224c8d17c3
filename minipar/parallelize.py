"""Turn the single-device GPT and a ParallelConfig into this rank's parallel model and optimizer.

`parallelize` applies each technique from outside the model, in this order, and the order matters:

  1. tensor parallelism  cuts every matrix of the full model. It goes first: it replaces
                         modules, and everything after holds references to the modules and
                         parameters it leaves (a MoE layer stays whole on every TP rank). Context
                         parallelism then gives the model this rank's tokens and attention its
                         ring (or all-gather, or all-to-all); its ranks hold the same weights, so
                         DP and ZeRO below run over dp x cp ranks. Expert parallelism cuts each MoE
                         layer's experts over ep ranks of the DP group; DP then reduces the experts
                         over the ranks that hold the same ones.
  2. pipeline            keeps this rank's chunks of the (already cut) layers and frees the rest,
                         so the steps below see only this rank's parameters.
  3. recomputation       wraps the blocks this rank holds (their forward, or their attention core).
  4. ZeRO or DP, and    with ZeRO: `apply_zero` shards the parameters into flat buffers (its own
     precision           fp32 masters and 16-bit copies), then `apply_precision` only autocasts;
                         without: `apply_precision` casts to 16 bits and keeps fp32 masters, then
                         `apply_dp` hooks the gradients. Last among the model changes: they capture
                         the parameters' final identity and dtype (why this order: at each call).
  5. pipeline executor   after precision: the messages between stages have the model's dtype.
A checkpoint's weights are loaded into the full model before 1 (the cut is the same as from the
seed's initialisation); its optimizer moments after 4, cut the same way (checkpoint.restore), and
fp16's loss scale with them.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from minipar import checkpoint, context_parallel, expert_parallel, memory, moe
from minipar.clip import ClipGradNorm
from minipar.comm import CommStats
from minipar.config import ParallelConfig
from minipar.data_parallel import DataParallelBucket, DataParallelNaive, GradBuckets
from minipar.mesh import Mesh
from minipar.model import GPT, cross_entropy
from minipar.pipeline import schedule
from minipar.pipeline.runtime import PipelineExecutor, chunks_for_rank, free_unused
from minipar.precision import DTYPES, LossScaler, MixedPrecision
from minipar.recompute import apply_recompute
from minipar.tensor_parallel import (TPGroup, apply_tp, sequence_partial,
                                     sync_sequence_parallel_grads,
                                     vocab_parallel_cross_entropy)
from minipar.zero import ZeroOptimizer
from minipar.zero3 import Zero3


@dataclass
class Parallel:
    """What one rank trains with. A step: forward and backward (through `pipe` if pp > 1, with
    `loss_fn`), then `sync_and_step(max_norm)`; `set_lr` before it for a schedule, `evaluate` for a
    held-out loss, `scaler_state` for a checkpoint."""
    model: torch.nn.Module            # this rank's share of the GPT (names as in GPT)
    optimizer: object                 # AdamW, or a ZeRO optimizer that also reduces the gradients
    mp: MixedPrecision                # autocast, loss scaling, fp32 masters
                                      #   (unless ZeRO keeps them)
    loss_fn: object                   # (logits, targets) -> mean loss; vocab-parallel with tp > 1
    tp: TPGroup | None = None
    dp: GradBuckets | None = None     # accumulates and reduces the gradients (apply_dp; ZeRO-1/2's)
    pipe: PipelineExecutor | None = None
    stats: CommStats | None = None            # where clipping counts its all-reduces
    parts: tuple = ()                 # the groups whose ranks hold different parts of the model
                                      #   (tp, pp; a replica's with stage_tp): clipping sums there
    replicas: object = None           # the DP group: MoE layers sum their loads over it

    def sync_and_step(self, max_norm: float = 0.0) -> float | None:
        """After backward: average the gradients over DP, sum SP's partial ones over TP, then step
        the optimizer (ZeRO's reduces its gradients itself; MixedPrecision's moves the grads to the
        fp32 masters, reduces those, steps and rounds back).

        max_norm > 0: first clip the gradients the optimizer steps by their global norm, as
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm) on one process, and return
        that norm (before clipping; inf or nan on an fp16 overflow, whose step is skipped). 0: no
        clipping, no communication for it, None returned. See clip.py."""
        clip = None
        if max_norm != 0:  # the pp and tp ranks hold different parts; ZeRO adds its DP group
            clip = ClipGradNorm(max_norm, self.parts, self.tp.rank if self.tp else 0, self.stats)
        sp = self.tp if self.tp and self.tp.sequence_parallel else None
        if isinstance(self.optimizer, (ZeroOptimizer, Zero3)):
            self.optimizer.step(clip=clip, sp=sp)  # ZeRO-1/2 wait for their buckets
        else:
            if self.dp:
                self.dp.finish()
            if sp:  # after DP's, which writes the gradients back
                grads = [self.dp.grad(p) if self.dp else p.grad for p in self.model.parameters()
                         if sequence_partial(p)]
                sync_sequence_parallel_grads(grads, sp)
            self.mp.step(self.optimizer, clip=clip)
        moe.balance_step(self.model, self.replicas)  # DeepSeek-V3's biases, where used
        return clip.norm if clip else None

    def memory_tensors(self) -> dict[str, list]:
        """The tensors this rank holds now, by category: params, grads, optimizer (fp32 masters,
        moments, step counters), comm (buffers) — what a minipar.tracker.Tracker knows at entry."""
        opt = self.optimizer
        if isinstance(opt, (ZeroOptimizer, Zero3)):
            return {"params": list(opt.param_tensors()), "grads": list(opt.grad_tensors()),
                    "optimizer": list(opt.state_tensors()), "comm": list(opt.comm_tensors())}
        return {"params": self.mp.param_tensors(),
                "grads": self.dp.buffers() if self.dp else self.mp.grad_tensors(),
                "optimizer": [*self.mp.master_tensors(), *memory.optimizer_tensors(opt)],
                "comm": list(self.dp.scratch.buffers.values()) if self.dp else []}

    def tally(self) -> dict[str, int]:
        """This rank's model states and buffers now, {category: bytes} (activations 0): the
        tally after a step that memory.predict predicts."""
        opt = self.optimizer
        if isinstance(opt, (ZeroOptimizer, Zero3)):
            return memory.measure(opt.param_tensors(), opt.grad_tensors(), opt.state_tensors(),
                                  comm=opt.comm_bytes)
        states = self.mp.measure(opt)
        if self.dp:  # the gradients are its buffers (the .grad are views of them)
            states["grads"] = memory.tensor_bytes(self.dp.buffers())
        return {**states, "activations": 0, "comm": self.dp.comm_buffer_bytes if self.dp else 0}

    def track(self, tracker) -> None:
        """Have what allocates during a step (gradient buckets, ZeRO-3's units, fp32 copies of
        16-bit gradients) declare it to `tracker` (a minipar.tracker.Tracker; None: stop)."""
        for owner in (self.dp, self.optimizer, self.mp):
            if hasattr(owner, "tracker"):
                owner.tracker = tracker

    def set_lr(self, lr: float) -> None:
        """The learning rate of every optimizer this rank steps, from the next step on (AdamW's
        groups; ZeRO's shard optimizers, one per unit in stage 3): a warmup or decay schedule."""
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not 0 <= lr < math.inf:
            raise ValueError(f"lr must be a non-negative number, got {lr!r}")
        for group in self.optimizer.param_groups:
            group["lr"] = float(lr)

    def evaluate(self, inputs: list, targets: list) -> float:
        """The mean loss over this rank's micro-batches (inputs[j], targets[j]: (b, s) token ids on
        the device), forward only: no gradient made or changed, no activation kept, in eval mode.
        With pp > 1 through the pipeline, every rank getting the result. The DP ranks' results
        differ (their rows do): average them, weighted by rows, for the global batch's."""
        if not inputs or len(inputs) != len(targets):
            raise ValueError(f"evaluate needs as many targets as inputs, at least one: got "
                             f"{len(inputs)} inputs and {len(targets)} targets")
        if self.pipe and (len(inputs) != self.pipe.m or {x.shape[0] for x in inputs}
                          != {self.pipe.shape[0]}):
            raise ValueError(f"with pp > 1 evaluate takes the pipeline's {self.pipe.m} micro-"
                             f"batches of {self.pipe.shape[0]} rows (the training step's), got "
                             f"{[x.shape[0] for x in inputs]}")
        training = self.model.training
        self.model.eval()  # no dropout
        try:
            with torch.no_grad(), self.mp.autocast():
                if self.pipe:
                    return self.pipe.evaluate(inputs, targets)
                losses = [self.loss_fn(self.model(x), y).double() for x, y in zip(inputs, targets)]
                return (sum(losses) / len(losses)).item()
        finally:
            self.model.train(training)

    def scaler_state(self) -> dict | None:
        """fp16's loss scaler state, for a checkpoint ({"scale", "good_steps"}; `parallelize(...,
        resumed=...)` restores its "scaler"); None in the other precisions."""
        return self.mp.scaler.state_dict() if self.mp.scaler else None

    def close(self) -> None:
        if self.dp:
            self.dp.close()
        if isinstance(self.optimizer, Zero3):
            self.optimizer.close()


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on biases, LayerNorms), as nanoGPT does."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def apply_precision(model: torch.nn.Module, par: ParallelConfig, masters: bool = True,
                    scaler: LossScaler | None = None) -> MixedPrecision:
    """Cast `model` to par.precision in place, keeping fp32 masters unless `masters` is False (ZeRO
    keeps them); `scaler`: fp16's loss scaler, shared with ZeRO."""
    return MixedPrecision(model, par.precision, masters=masters, scaler=scaler)


def grad_dtype(par: ParallelConfig) -> torch.dtype:
    """The dtype gradients accumulate and are reduced in: fp32 under mixed precision unless
    par.reduce_fp32 is False (then 16 bits), else the model's."""
    mixed = par.precision in ("bf16", "fp16")
    return torch.float32 if mixed and par.reduce_fp32 else DTYPES[par.precision]


def apply_zero(model: torch.nn.Module, par: ParallelConfig, mesh: Mesh, lr: float,
               weight_decay: float, scaler: LossScaler | None, stats: CommStats | None):
    """ZeRO stage par.zero over the DP group: shards `model`'s parameters (fp32 masters of the shard
    under mixed precision) and returns the optimizer that reduces the gradients and steps."""
    shard = dict(collectives=par.collectives, dtype=DTYPES[par.precision],
                 master=par.precision in ("bf16", "fp16"), scaler=scaler, stats=stats,
                 grad_dtype=grad_dtype(par))
    if par.zero == 3:
        return Zero3(model, mesh.dp_group, lr, weight_decay, **shard)
    return ZeroOptimizer(model, mesh.dp_group, par.zero, lr, weight_decay, **shard,
                         bucket_bytes=par.bucket_bytes)


def apply_dp(model: torch.nn.Module, mp: MixedPrecision, par: ParallelConfig, mesh: Mesh,
             stats: CommStats | None, experts=None) -> DataParallelNaive | None:
    """What accumulates the gradients and averages them over the DP group (par.dp_mode:
    DataParallelNaive or DataParallelBucket): for par.dp > 1, and under mixed precision with
    par.reduce_fp32 on one rank too, where its fp32 buffers are the masters' .grad (fp32
    accumulation). None: autograd's own .grad is all there is. experts: with ep > 1, the group of
    the ranks that hold this rank's experts (their gradients are summed there, over dp)."""
    fp32_grads = mp.master is not None and par.reduce_fp32
    if par.dp * par.cp == 1 and not fp32_grads:
        return None
    sync = dict(collectives=par.collectives, stats=stats, dtype=grad_dtype(par),
                holders=list(mp.master) if fp32_grads else None,
                experts=(experts, par.dp) if par.ep > 1 else None)
    if par.dp_mode == "naive":
        return DataParallelNaive(model, mesh.dp_group, **sync)
    return DataParallelBucket(model, mesh.dp_group, par.bucket_bytes, **sync)


def apply_cp_and_ep(model: GPT, loss_fn, par: ParallelConfig, mesh: Mesh,
                    stats: CommStats | None):
    """Context parallelism (this rank's tokens, its attention's method, the loss weighted) and
    expert parallelism (this rank's experts) on the TP-cut model, in place; returns (the loss
    function, the DP group of this rank's experts or None, the CP pre-hook that takes the token
    ids to this rank's or None)."""
    take = None
    if par.cp > 1:
        cp_group, _ = context_parallel.group_of(mesh, par.cp)
        loss_fn, take = context_parallel.apply_cp(model, loss_fn, cp_group, par.cp_method, stats)
    experts = None
    if par.ep > 1:
        ep_group, experts = expert_parallel.groups_of(mesh, par.ep)
        expert_parallel.apply_ep(model, ep_group, stats)
    return loss_fn, experts, take


def parallelize(model: GPT, par: ParallelConfig, mesh: Mesh, *, global_batch: int, lr: float,
                weight_decay: float, stats: CommStats | None = None, after_compute=None,
                resumed: dict | None = None) -> Parallel:
    """This rank's model and optimizer for layout `par`, from the full single-device `model` (cut in
    place), in the order the module docstring gives. stats: the CommStats every technique counts its
    messages in; after_compute: the pipeline's per-action hook (PipelineExecutor); `resumed`: a
    loaded checkpoint to continue."""
    cfg = model.cfg
    if resumed:
        model.load_state_dict(resumed["model"])
    tp, loss_fn = None, cross_entropy
    if par.tp_at(mesh.pp_rank) > 1:                                         # 1. tensor parallelism
        tp = TPGroup.of(mesh.tp_group, par.sequence_parallel, par.collectives, stats)
        model = apply_tp(model, tp)
        loss_fn = lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, tp)
    loss_fn, experts, take = apply_cp_and_ep(model, loss_fn, par, mesh, stats)   # 1b. CP, EP
    if par.pp > 1:                                                          # 2. pipeline stages
        chunks = chunks_for_rank(model, par.pp, mesh.pp_rank, par.virtual_stages,
                                 layers=par.stage_layers)
        free_unused(model, chunks.values())
        if take and 0 in chunks:  # CP: the first chunk embeds this rank's tokens only
            chunks[0].register_forward_pre_hook(take)
    apply_recompute(model, par.recompute)                                   # 3. recomputation
    dp = None                                                               # 4. precision, ZeRO, DP
    if par.zero:
        # ZeRO before precision: its fp32 master shards are cut from the fp32 initialisation and it
        # casts its flat buffers itself; precision then only autocasts, and scales the loss with the
        # scaler ZeRO unscales by
        scaler = LossScaler() if par.precision == "fp16" else None
        optimizer = apply_zero(model, par, mesh, lr, weight_decay, scaler, stats)
        mp = apply_precision(model, par, masters=False, scaler=scaler)
        dp = getattr(optimizer, "grads", None)  # ZeRO-1/2's buckets: no_sync and their spans
    else:
        # precision before DP: the masters copy the fp32 weights before the cast, and DP's buckets
        # take the dtype of the gradients they will hold
        mp = apply_precision(model, par)
        optimizer = make_optimizer(mp.optimized, lr, weight_decay)
        dp = apply_dp(model, mp, par, mesh, stats, experts)  # last: hooks on the final params
    pipe = None
    # 5. the pipeline's executor
    if par.pp > 1:
        # this DP rank's micro-batch: with uneven dp_shares the
        # replicas' pipelines carry different b
        rows = par.dp_rows(global_batch)[mesh.dp_rank // par.cp] // par.microbatches
        tokens = len(context_parallel.positions(cfg.seq_len, par.cp, mesh.dp_rank % par.cp))
        seq = tokens // (par.tp if par.sequence_parallel else 1)
        plan = schedule(par.schedule, par.pp, par.microbatches, par.virtual_stages)
        # stages of different tp: messages by Mesh.pipeline_peers, sums over the replica
        links = dict(group=mesh.replica_group, peers=mesh.pipeline_peers(),
                     reports=mesh.tp_rank == 0) if par.stage_tp else dict(group=mesh.pp_group)
        pipe = PipelineExecutor(chunks, plan, (rows, seq, cfg.d_model), loss_fn=loss_fn,
                                stats=stats, after_compute=after_compute, **links)
    if resumed:
        checkpoint.restore(resumed, model, optimizer, mp, tp)
        if resumed.get("scaler") and mp.scaler:  # another precision's run has none, or ignores it
            mp.scaler.load_state_dict(resumed["scaler"])
    parts = (mesh.replica_group,) if par.stage_tp else \
        tuple(g for g, on in ((mesh.tp_group, tp), (mesh.pp_group, pipe)) if on)
    return Parallel(model, optimizer, mp, loss_fn, tp, dp, pipe, stats, parts, mesh.dp_group)
