"""Checkpoints that any layout can resume: one file in the single-device form, written atomically.

A checkpoint holds what the single-process run would hold: the full fp32 weights under the GPT's
names, AdamW's two moments and step count for each of them, the number of steps done (the data
position: batches are a function of the step) and the model's configuration; `write`, the
training loop's save, adds the run's settings (`run`: batch, seed, data, learning rate...; a resume
must keep the data's), the data and its tokenizer (`data`: a data.Dataset as a dict, so `sample`
decodes as training encoded) and fp16's loss scaler (`scaler`). Saving gathers the pieces
(tensor-parallel blocks along their cut, pipeline stages' layers) to rank 0, which writes;
resuming loads the full weights before the layout cuts the model, then cuts the moments the same
way. So a run saved at dp2 tp2 pp2 resumes at tp4 or on one process and continues the same training.

Writes are atomic: the file is written beside the target, flushed to disk, then renamed over it
(`os.replace`), so a crash during a save leaves the previous checkpoint whole. Loading uses
`torch.load(weights_only=True)` (no code runs from the file) and checks the model before use.

Cost: the file is 4 P (weights) + 8 P (moments) bytes for P parameters; saving sends each rank's
share to rank 0 once, loading reads the whole file on every rank.
"""
from __future__ import annotations

import contextlib
import dataclasses
import glob
import os

import torch
import torch.distributed as dist
import torch.nn as nn

from minipar.tensor_parallel import TPGroup
from minipar.zero import ZeroOptimizer
from minipar.zero3 import Zero3

FORMAT = 1


def _sources(model, mp):
    """(name, model parameter, the fp32 tensor the optimizer steps:
    the master or the parameter itself)."""
    masters = list(mp.master) if mp is not None and mp.master is not None else None
    for i, (name, p) in enumerate(model.named_parameters()):
        yield name, p, masters[i] if masters else p


def gather_stages(share, group) -> list:
    """Every stage's `share` (picklable), in order, on the group's first rank; [] on the others."""
    if group is None or dist.get_world_size(group) == 1:
        return [share]
    first, shares = dist.get_global_rank(group, 0), [None] * dist.get_world_size(group)
    dist.gather_object(share, shares if dist.get_rank() == first else None, first, group)
    return shares if dist.get_rank() == first else []


def gather(model, optimizer, mp, tp, pp_group, steps_done: int, cfg) -> dict | None:
    """Every rank calls it; rank 0 (of the world) gets the whole checkpoint, the others None."""
    pieces, steps = [], {}  # (name, key, this rank's tensor, its parameter); moments' step counts
    # flat shards
    zero = _zero_full_state(optimizer) if isinstance(optimizer, (ZeroOptimizer, Zero3)) else None
    for name, p, source in _sources(model, mp):
        if zero:
            mine = zero[id(p)]
            state = {k: v for k, v in mine.items() if k != "weight"} if mine["step"] else {}
            pieces.append((name, "weight", mine["weight"], p))
        else:
            state = optimizer.state.get(source, {})
            pieces.append((name, "weight", source.float(), p))
        if state:
            pieces += [(name, k, state[k], p) for k in ("exp_avg", "exp_avg_sq")]
            steps[name] = float(state["step"])
    full = gather_blocks([t for _, _, t, _ in pieces], [p for *_, p in pieces], tp)
    weights, moments = {}, {name: {"step": step} for name, step in steps.items()}
    for (name, key, _, _), tensor in zip(pieces, full):
        if key == "weight":
            weights[name] = tensor
        else:
            moments[name][key] = tensor
    weights.update(_buffers(model))
    shares = gather_stages((weights, moments), pp_group)  # each stage holds some layers
    if dist.is_initialized() and dist.get_rank() != 0:
        return None
    return dict(format=FORMAT, model={k: v for w, _ in shares for k, v in w.items()},
                optimizer={k: v for _, m in shares for k, v in m.items()}, steps_done=steps_done,
                config=dataclasses.asdict(cfg))


def write(run, mesh, cfg, steps_done: int, path: str, data, settings: dict) -> None:
    """The training loop's save: gather the checkpoint of `run` (a parallelize.Parallel) after
    `steps_done` steps (a collective) and write it (rank 0), with what a resume needs beyond the
    weights: the run's settings (preflight.check_resume), the data and its tokenizer, and fp16's
    loss scale."""
    state = gather(run.model, run.optimizer, run.mp, run.tp, mesh.pp_group, steps_done, cfg)
    if state:  # rank 0
        state.update(run=settings, data=dataclasses.asdict(data), scaler=run.scaler_state())
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        save(state, path)


def final_weights(run, mesh) -> dict:
    """The single-device weights of `run` (a parallelize.Parallel), whole on the first rank of each
    pipeline group, {} on the others (a collective: with tp > 1 every rank of the group takes part,
    with ZeRO-3 every rank gathers; every stage sends its share)."""
    if isinstance(run.optimizer, Zero3):
        run.optimizer.gather_all()  # every rank takes part; rank 0 keeps the weights
    state = {**full_state_dict(run.model, run.tp), **_buffers(run.model)}
    return {k: v for share in gather_stages(state, mesh.pp_group) for k, v in share.items()}


def save(checkpoint: dict, path: str) -> None:
    """Write atomically: to a temporary file beside `path`, flushed, then renamed over it. A save
    that was killed half-way left its temporary file behind: it is removed here."""
    _remove_stale_tmps(path)
    tmp = f"{path}.tmp-{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            torch.save(checkpoint, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


def _remove_stale_tmps(path: str) -> None:
    """Remove `<path>.tmp-<pid>` files whose writer is dead (a SIGKILL mid-save); a live pid's file
    is another save under way, and stays."""
    for tmp in glob.glob(f"{glob.escape(path)}.tmp-*"):
        pid = tmp.rsplit("-", 1)[1]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue  # not a save's (no pid), or this process's own: this save rewrites it
        try:
            os.kill(int(pid), 0)  # signal 0: only asks whether the process exists
        except ProcessLookupError:
            with contextlib.suppress(FileNotFoundError):  # another saver removed it first
                os.remove(tmp)
        except PermissionError:  # alive, another user's
            pass


def load(path: str, cfg=None) -> dict:
    """Read a checkpoint (for model `cfg`, if given); ValueError if it is not one, or of another
    model."""
    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True)
    except FileNotFoundError:
        raise ValueError(f"no checkpoint at {path!r}") from None
    except Exception as e:  # an unpickling error, a truncated file...
        raise ValueError(f"{path!r} is not a readable minipar checkpoint: {e}") from None
    if not isinstance(checkpoint, dict) or checkpoint.get("format") != FORMAT:
        raise ValueError(f"{path!r} is not a minipar checkpoint (format {FORMAT})")
    # (fields added since a checkpoint was written have their defaults there)
    defaults = {f.name: f.default for f in dataclasses.fields(cfg)} if cfg is not None else {}
    saved = {**defaults, **checkpoint["config"]}
    if cfg is not None and saved != dataclasses.asdict(cfg):
        differ = {k: (v, saved.get(k)) for k, v in dataclasses.asdict(cfg).items()
                  if saved.get(k) != v}
        raise ValueError(f"{path!r} holds another model: (this run, checkpoint) differ in {differ}")
    return checkpoint


def restore(checkpoint: dict, model, optimizer, mp, tp) -> int:
    """Fill this rank's optimizer state from the checkpoint's full moments, cut as the rank's
    parameters are; returns the steps done. (The weights were
    loaded into the full model already.)"""
    cut = {}
    for name, p, source in _sources(model, mp):
        saved = checkpoint["optimizer"].get(name)
        cut[name] = saved and {"step": saved["step"],
                               **{k: block_of(saved[k], p, tp).to(source.device).clone()
                                                         for k in ("exp_avg", "exp_avg_sq")}}
    if isinstance(optimizer, (ZeroOptimizer, Zero3)):  # ZeRO: flattened into its shards
        _zero_load(optimizer, {id(p): cut[name] for name, p in model.named_parameters()})
        return checkpoint["steps_done"]
    for name, p, source in _sources(model, mp):
        if cut[name]:
            optimizer.state[source] = {"step": torch.tensor(cut[name]["step"], dtype=torch.float32),
                                       **{k: cut[name][k].to(source.dtype)
                                          for k in ("exp_avg", "exp_avg_sq")}}
    return checkpoint["steps_done"]


# ----------------------------------------------------------------------------- ZeRO's flat shards
# 
# ZeRO-1/2 keep one flat buffer (or one per bucket), ZeRO-3 one per unit (module); each rank holds
# a shard of each, its fp32 master (mixed precision) and AdamW's moments for the pieces of
# parameters that fall in the shard.


def _flats(zero) -> list:
    """(layout, shard) of each flat buffer: ZeRO-1/2's buckets (in backward's order), ZeRO-3's
    units (in the model's)."""
    if isinstance(zero, Zero3):
        return [(unit.layout, unit.mine) for unit in zero.units]
    return [(layout, mine) for layout, _, mine in zero.flats]


def _zero_full_state(zero) -> dict:
    """Each parameter's fp32 weight and AdamW state, whole, by id(parameter) (a collective: the
    shards are gathered with the backend's all-gather, not counted as training traffic)."""
    states = {}
    for layout, mine in _flats(zero):
        shards = {"weight": (mine.master if mine.master is not None else mine.params).float()}
        for key in ("exp_avg", "exp_avg_sq"):
            shards[key] = torch.zeros_like(shards["weight"])
            for piece, a, b in mine.pieces:
                if piece in mine.optimizer.state:
                    shards[key][a:b] = mine.optimizer.state[piece][key]
        step = torch.tensor([max([float(s["step"]) for s in mine.optimizer.state.values()]
                                 or [0.0])])
        full = {}
        for key, shard in shards.items():
            full[key] = shard.clone()
            if zero.size > 1:
                full[key] = torch.empty(zero.size * shard.numel(), dtype=shard.dtype,
                                        device=shard.device)
                # torch < 2.13
                gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
                gather(full[key], shard.contiguous(), group=zero.group)
        if zero.size > 1:  # a rank whose shard is all padding has no state
            dist.all_reduce(step, op=dist.ReduceOp.MAX, group=zero.group)
        states.update({id(p): {**{k: v[a:b].view(shape) for k, v in full.items()},
                               "step": step.item()}
                       for p, shape, (a, b) in zip(layout.params, layout.shapes, layout.ranges)})
    return states


def _zero_load(zero, moments: dict) -> None:
    """AdamW's state from each parameter's whole moments ({id(parameter): moments or None, no
    state yet})."""
    if not any(moments.values()):
        return
    step = next(m["step"] for m in moments.values() if m)
    for layout, mine in _flats(zero):
        mine_moments = [moments[id(p)] for p in layout.params]
        flat = {k: layout.flatten([m[k] if m else None for m in mine_moments],
                                  torch.float32)[layout.lo:layout.hi]
                for k in ("exp_avg", "exp_avg_sq")}
        for piece, a, b in mine.pieces:
            mine.optimizer.state[piece] = {"step": torch.tensor(step, dtype=torch.float32),
                                           **{k: v[a:b].clone().to(piece.dtype) for k,
                                              v in flat.items()}}


def _buffers(model: nn.Module) -> dict[str, torch.Tensor]:
    """The saved state that is not a parameter (a MoE layer's selection bias), on the CPU."""
    params = dict(model.named_parameters(remove_duplicate=False))
    return {k: v.detach().cpu().clone() for k, v in model.state_dict().items() if k not in params}


def block_of(full: torch.Tensor, param: torch.Tensor, tp: TPGroup | None) -> torch.Tensor:
    """The part of a full tensor (a weight, an Adam moment) that `param` holds: its TP block, its
    experts (cut by expert parallelism: `.ep`), or all of it."""
    if hasattr(param, "ep"):
        return full.tensor_split(dist.get_world_size(param.ep))[dist.get_rank(param.ep)]
    return full.tensor_split(tp.size, param.tp_dim)[tp.rank] if tp and hasattr(param,
                                                                               "tp_dim") else full


def gather_blocks(tensors: list, params: list, tp: TPGroup | None) -> list:
    """The full tensors from every rank's blocks of them, each cut as its parameter is (TP blocks,
    experts), on the CPU: one all-gather of all the TP-cut ones per dtype (a collective), not one
    per tensor, since every collective costs a meeting of the group's ranks; then each expert
    weight's over its EP group. Every rank's block of a tensor has the same
    shape (ParallelConfig.check allows only even TP cuts)."""
    out = [t.detach().cpu().clone() if tp is None or not hasattr(p, "tp_dim") else None
           for t, p in zip(tensors, params)]
    cut = [i for i, x in enumerate(out) if x is None]
    for dtype in dict.fromkeys(tensors[i].dtype for i in cut):  # the same order on every rank
        mine = [i for i in cut if tensors[i].dtype == dtype]
        flat = torch.cat([tensors[i].detach().reshape(-1) for i in mine])
        parts = [torch.empty_like(flat) for _ in range(tp.size)]
        dist.all_gather(parts, flat, group=tp.group)
        at = 0
        for i in mine:  # every rank's block has this rank's shape
            n, shape = tensors[i].numel(), tensors[i].shape
            out[i] = torch.cat([x[at:at + n].view(shape) for x in parts], params[i].tp_dim).cpu()
            at += n
    for i, p in enumerate(params):  # experts cut by expert parallelism, one tensor at a time
        if hasattr(p, "ep"):
            parts = [torch.empty_like(tensors[i]) for _ in range(dist.get_world_size(p.ep))]
            dist.all_gather(parts, tensors[i].detach().contiguous(), group=p.ep)
            out[i] = torch.cat(parts).cpu()
    return out


def full_state_dict(model: nn.Module, tp: TPGroup | None) -> dict[str, torch.Tensor]:
    """The single-device weights, blocks gathered from every rank of the group (a collective),
    under every name GPT.state_dict gives them (a tied weight under both)."""
    names, params = zip(*model.named_parameters(remove_duplicate=False))
    return dict(zip(names, gather_blocks(list(params), list(params), tp)))
