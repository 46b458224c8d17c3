"""Workers for test_clip: train through `parallelize`, `set_lr` before each step and
`sync_and_step(max_norm)` after its backward, evaluating between steps, one layout after another in
one launch; and the single-process run they are compared with (clip_grad_norm_ and AdamW).

Every run evaluates before each step and after the last on one held-out batch (EVAL_STEP), so a run
returns steps + 1 evaluations; each DP rank evaluates its own rows of that batch.
"""
import contextlib
import math
from types import SimpleNamespace

import torch
import torch.distributed as dist

from minipar import data as dataset
from minipar.comm import CommStats
from minipar.mesh import Mesh
from minipar.model import GPT, cross_entropy
from minipar.parallelize import make_optimizer, parallelize
from minipar.checkpoint import gather_stages
from minipar.checkpoint import full_state_dict
from minipar.zero import ZeroOptimizer
from minipar.zero3 import Zero3

EVAL_STEP = 1000  # the held-out batch: a step no run trains on
WEIGHT_DECAY = 0.1


def single_process(cfg, steps, batch, max_norm, lrs):
    """The reference: full batch, AdamW, clip_grad_norm_ before each step; lrs[k] at step k."""
    torch.manual_seed(0)
    model = GPT(cfg)
    optimizer = make_optimizer(model, lrs[0], WEIGHT_DECAY)
    xe, ye = dataset.global_batch("synthetic", EVAL_STEP, batch, cfg.seq_len, cfg.vocab_size)
    losses, norms, evals = [], [], []
    for step in range(steps):
        with torch.no_grad():
            evals.append(cross_entropy(model(xe), ye).item())
        for group in optimizer.param_groups:
            group["lr"] = lrs[step]
        x, y = dataset.global_batch("synthetic", step, batch, cfg.seq_len, cfg.vocab_size)
        loss = cross_entropy(model(x), y)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm).item())
        assert max_norm / (norms[-1] + 1e-6) < 1, "clipping must be active at every step"
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item())
    with torch.no_grad():
        evals.append(cross_entropy(model(xe), ye).item())
    state = {k: v.detach().clone() for k, v in model.state_dict().items()}
    return SimpleNamespace(losses=losses, norms=norms, evals=evals, state_dict=state)


def layouts(cases: list[dict], steps: int, batch: int, lrs: list) -> list:
    """train(**case) for each case (cfg, par, max_norm, evaluate), in this one launch."""
    return [train(**case, steps=steps, batch=batch, lrs=lrs) for case in cases]


def train(cfg, par, max_norm, steps, batch, lrs, evaluate=True):
    """This rank's run of layout `par`: losses (the global mean), norms (sync_and_step's), evals
    (this rank's evaluate, and whether it left gradients and ZeRO-3's gathers as they were), the
    grad-norm all-reduces made, and on rank 0 the single-device weights."""
    mesh, stats = Mesh.build(par.dp, par.tp, par.pp), CommStats()
    torch.manual_seed(0)
    run = parallelize(GPT(cfg), par, mesh, global_batch=batch, lr=lrs[0],
                      weight_decay=WEIGHT_DECAY, stats=stats)
    count = par.dp_rows(batch)[mesh.dp_rank]
    rows = (mesh.dp_rank * count, count)
    losses, norms, evals, clean = [], [], [], []
    for step in range(steps + 1):
        if evaluate:
            loss, unchanged = _evaluate(run, cfg, par, batch, rows)
            evals.append(loss)
            clean.append(unchanged)
        if step == steps:
            break
        run.set_lr(lrs[step])
        x, y = dataset.global_batch("synthetic", step, batch, cfg.seq_len, cfg.vocab_size)
        loss = _forward_backward(run, par, x, y, rows)
        norms.append(run.sync_and_step(max_norm))
        run.optimizer.zero_grad()
        total = torch.tensor([loss], dtype=torch.float64)  # last stages hold it, tp times each
        dist.all_reduce(total)
        losses.append(total.item() / (par.dp * par.tp))
    state = _final_weights(run, mesh)
    run.close()
    return SimpleNamespace(losses=losses, norms=norms, evals=evals, clean=clean, rows=count,
                           calls=stats.calls.get("grad_norm", 0), dp_rank=mesh.dp_rank,
                           state_dict=state if mesh.rank == 0 else None)


def _micro(t, par, rows):
    return [dataset.shard_rows(t, *rows, mb, par.microbatches) for mb in range(par.microbatches)]


def _forward_backward(run, par, x, y, rows) -> float:
    """This rank's micro-batches' forward and backward, as minipar.train runs them (fp32: no
    scaling); returns the summed loss (0.0 on pipeline ranks without the last chunk)."""
    inputs, targets = _micro(x, par, rows), _micro(y, par, rows)
    if run.pipe:
        with run.dp.no_sync() if run.dp else contextlib.nullcontext():
            return run.pipe.step(inputs, targets)[0]
    total = 0.0
    for mb, (xb, yb) in enumerate(zip(inputs, targets)):
        with run.mp.autocast():
            loss = run.loss_fn(run.model(xb), yb) / par.microbatches
        last = mb == par.microbatches - 1
        with run.dp.no_sync() if run.dp and not last else contextlib.nullcontext():
            loss.backward()
        total += loss.item()
    return total


def _held(run) -> list:
    """Every gradient this rank holds: the model's and a ZeRO optimizer's shards."""
    grads = [p.grad for p in run.model.parameters()]
    if isinstance(run.optimizer, (ZeroOptimizer, Zero3)):
        grads += list(run.optimizer.grad_tensors())
    return [None if g is None else g.clone() for g in grads]


def _evaluate(run, cfg, par, batch, rows) -> tuple[float, bool]:
    """run.evaluate on this rank's rows of the held-out batch; and whether no gradient was made or
    changed, (ZeRO-3) every unit is freed again, no gather or reduction left in flight, and (pp)
    the wrong number of micro-batches was refused."""
    xe, ye = dataset.global_batch("synthetic", EVAL_STEP, batch, cfg.seq_len, cfg.vocab_size)
    before = _held(run)
    inputs, targets = _micro(xe, par, rows), _micro(ye, par, rows)
    if run.pipe:  # the pipeline's micro-batches or none: refused before any message
        try:
            run.evaluate(inputs + inputs[:1], targets + targets[:1])
            return math.nan, False
        except ValueError:
            pass
    loss = run.evaluate(inputs, targets)
    after = _held(run)
    clean = len(before) == len(after) and all(
        (a is None and b is None) or (a is not None and b is not None and torch.equal(a, b))
        for a, b in zip(before, after))
    if isinstance(run.optimizer, Zero3):
        clean = clean and run.optimizer.gathered_bytes == 0 and not run.optimizer.pending \
            and all(not u.gathered and u.gathering is None and u.grads_in == 0
                    and u.full.untyped_storage().nbytes() == 0 for u in run.optimizer.units)
    return loss, clean


def _final_weights(run, mesh) -> dict:
    """The single-device weights (collective), as minipar.train gathers them."""
    if isinstance(run.optimizer, Zero3):
        run.optimizer.gather_all()
    state = full_state_dict(run.model, run.tp) if run.tp else \
        {k: v.detach().cpu().clone() for k, v in run.model.state_dict().items()}
    return {k: v for share in gather_stages(state, mesh.pp_group) for k, v in share.items()}
