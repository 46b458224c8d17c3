"""Turn the single-device GPT and a ParallelConfig into this rank's parallel model and optimizer.

`parallelize` applies each technique from outside the model, in this order, and the order matters:

  1. tensor parallelism  cuts every matrix of the full model. It goes first: it replaces modules, and
                         everything after holds references to the modules and parameters it leaves.
  2. pipeline            keeps this rank's chunks of the (already cut) layers and frees the rest, so the
                         steps below see only this rank's parameters.
  3. recomputation       wraps the blocks this rank holds (their forward, or their attention core).
  4. precision, ZeRO, DP cast the parameters to 16 bits and keep fp32 masters, or shard them into flat
                         buffers (ZeRO), or hook their gradients (DP). Last among the model changes: they
                         capture the parameters' final identity and dtype.
  5. pipeline executor   after precision: the messages between stages have the model's dtype.
A checkpoint's weights are loaded into the full model before 1 (the cut is the same as from the seed's
initialisation); its optimizer moments after 4, cut the same way (checkpoint.restore).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from minipar import checkpoint
from minipar.config import ParallelConfig
from minipar.data_parallel import DataParallel
from minipar.mesh import Mesh
from minipar.model import GPT, cross_entropy
from minipar.pipeline import schedule
from minipar.pipeline.runtime import PipelineExecutor, chunks_for_rank, free_unused
from minipar.precision import DTYPES, MixedPrecision
from minipar.recompute import apply_recompute
from minipar.tensor_parallel import TPGroup, apply_tp, vocab_parallel_cross_entropy
from minipar.zero import Zero3, ZeroOptimizer


@dataclass
class Parallel:
    """What one rank trains with. A step: forward and backward (through `pipe` if pp > 1, with
    `loss_fn`), `dp.finish()`, the SP gradient sum if `tp`, then `optimizer.step()` (ZeRO) or
    `mp.step(optimizer, reduce)`."""
    model: torch.nn.Module            # this rank's share of the GPT (names as in GPT)
    optimizer: object                 # AdamW, or a ZeRO optimizer that also reduces the gradients
    mp: MixedPrecision                # autocast, loss scaling, fp32 masters (unless ZeRO keeps them)
    loss_fn: object                   # (logits, targets) -> mean loss; vocab-parallel with tp > 1
    tp: TPGroup | None = None
    dp: DataParallel | None = None    # reduces the model's gradients (dp > 1, no ZeRO)
    masters: DataParallel | None = None  # or the fp32 masters' (mixed precision, reduce_fp32)
    reduce: object = None             # what mp.step calls to reduce the masters' gradients
    pipe: PipelineExecutor | None = None

    def close(self) -> None:
        for sync in (self.dp, self.masters):
            if sync:
                sync.close()
        if isinstance(self.optimizer, Zero3):
            self.optimizer.close()


def make_optimizer(model: torch.nn.Module, lr: float, weight_decay: float) -> torch.optim.Optimizer:
    """AdamW; weight decay on matrices only (not on biases, LayerNorms), as GPT-2 and nanoGPT do."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [dict(params=[p for p in params if p.dim() >= 2], weight_decay=weight_decay),
              dict(params=[p for p in params if p.dim() < 2], weight_decay=0.0)]
    return torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95))


def parallelize(model: GPT, par: ParallelConfig, mesh: Mesh, global_batch: int, lr: float, weight_decay: float,
                resumed: dict | None = None) -> Parallel:
    """This rank's model and optimizer for layout `par`, from the full single-device `model` (cut in
    place), in the order the module docstring gives; `resumed`: a loaded checkpoint to continue."""
    cfg = model.cfg
    if resumed:
        model.load_state_dict(resumed["model"])
    tp, loss_fn = None, cross_entropy
    if par.tp > 1:                                                          # 1. tensor parallelism
        tp = TPGroup.of(mesh.tp_group, par.sequence_parallel, par.collectives)
        model = apply_tp(model, tp)
        loss_fn = lambda logits, targets: vocab_parallel_cross_entropy(logits, targets, tp)  # noqa: E731
    if par.pp > 1:                                                          # 2. pipeline stages
        chunks = chunks_for_rank(model, par.pp, mesh.pp_rank, par.virtual_stages, layers=par.stage_layers)
        free_unused(model, chunks.values())
    apply_recompute(model, par.recompute)                                   # 3. recomputation
    if par.zero:                                                            # 4. ZeRO keeps its own masters
        mixed = par.precision in ("bf16", "fp16")
        shard = dict(collectives=par.collectives, dtype=DTYPES[par.precision], master=mixed)
        optimizer = Zero3(model, mesh.dp_group, lr, weight_decay, **shard) if par.zero == 3 else \
            ZeroOptimizer(model, mesh.dp_group, par.zero, lr, weight_decay, **shard)
        mp = MixedPrecision(model, par.precision, masters=False)  # autocast and loss scale only
        optimizer.scaler = mp.scaler
        run = Parallel(model, optimizer, mp, loss_fn, tp)
    else:                                                                   # 4. precision, then DP
        mp = MixedPrecision(model, par.precision)  # before DataParallel captures the parameters' dtype
        run = Parallel(model, make_optimizer(mp.optimized, lr, weight_decay), mp, loss_fn, tp)
        if par.dp > 1 and (mp.master is None or not par.reduce_fp32):  # the model's own gradients
            run.dp = DataParallel(model, mesh.dp_group, par.dp_mode, int(par.bucket_mb * 2**20), par.collectives)
        elif par.dp > 1:  # mixed precision: the fp32 master gradients, an all-reduce per tensor (naive)
            run.masters = DataParallel(mp.master, mesh.dp_group, "naive", collectives=par.collectives)
            run.reduce = lambda grads: run.masters.finish()  # noqa: E731
    if par.pp > 1:                                                          # 5. the pipeline's executor
        # this DP rank's micro-batch: with uneven dp_shares the replicas' pipelines carry different b
        rows = par.dp_rows(global_batch)[mesh.dp_rank] // par.microbatches
        seq = cfg.seq_len // (par.tp if par.sequence_parallel else 1)
        plan = schedule(par.schedule, par.pp, par.microbatches, par.virtual_stages)
        run.pipe = PipelineExecutor(chunks, plan, (rows, seq, cfg.d_model), mesh.pp_group, loss_fn=loss_fn)
    if resumed:
        checkpoint.restore(resumed, model, run.optimizer, mp, tp)
    return run
