"""Pipeline runtime: cut the GPT into chunks, run any schedule's actions with point-to-point sends.

Pipeline parallelism gives each of p ranks a contiguous chunk of the layers (a stage) and cuts the
batch into m micro-batches; activations travel forward from stage to stage and their gradients
travel back, so that stages work on different micro-batches at once (GPipe; 1F1B; interleaving;
the B/W split: schedules.py cites each). The order of the work is the schedule, which is data
(`minipar.pipeline.schedules`); this file executes any valid one.

    chunk k of p·v lives on pipeline rank k % p        (v = 1:  rank 0 | rank 1 | ... | rank p-1)
    F(k, j): x_j -> chunk k -> send to rank of k+1
    B(k, j): dy from rank of k+1 -> backward -> send dx to rank of k-1

Costs, P parameters, b micro-batch size, s sequence length, h hidden size, 4-byte activations:
    parameters per rank     ~ P/p (the first stage also has the embeddings, the last the head; see
                            `partition` to balance them by measured cost)
    p2p per micro-batch     b·s·h·4 bytes each way across every boundary between chunks on different
                            ranks: per step 2·(p·v-1)·m·b·s·h·4 bytes in all (a rank sends its
                            chunks' outputs forward and its input gradients back); nothing when
                            consecutive chunks share a rank
    activations in flight   the schedule decides: GPipe m micro-batches on every rank, 1F1B at most
                            p-r on rank r (`PipelineExecutor.peak_in_flight` measures it), each
                            holding its chunk's saved activations (Korthikanti et al. 2022:
                            s·b·h·(34 + 5·a·s/h) bytes per layer, 16-bit). A split B/W keeps them
                            longer: until W (see `PipelineExecutor._weight`).

How messages match without tags (NCCL ignores them): every message has one producer action, and the
whole schedule is known on every rank, so each pair of ranks can list the messages between them in
one order both follow: the order in which a dependency-respecting replay produces them
(`message_order`). Sends are non-blocking and posted right after the action that produces them;
receives are posted lazily, when an action needs one, together with every earlier entry of that
pair's list; all sends are waited at the end of the step. On gloo this keeps FIFO matching right; on
NCCL, where the sends and receives of one pair of ranks run in order on one stream, it means both
ranks queue them in the same order, so none waits behind a message the other has not queued yet.
"""
from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist
import torch.nn as nn

from minipar import comm
from minipar.model import GPT, cross_entropy
from minipar.pipeline.schedules import Action, check, replay

# ----------------------------------------------------------------------------- cutting the model


def partition(n_layer: int, chunks: int, costs=None, layers=None) -> list[range]:
    """Contiguous layer ranges, one per chunk: uniform, of given sizes, or of least largest cost.

    costs=None: sizes differ by at most one, the first chunks take the extra layers.
    layers: the sizes themselves, one per chunk (ParallelConfig.stage_layers: a heterogeneous
    plan's split).
    costs: n_layer per-layer costs (seconds, FLOPs...), or n_layer + 2 values [embedding, layer 0,
    ..., layer l-1, head + loss]: the first chunk then also pays the embedding and the last the
    head. The split minimises the maximum chunk cost (dynamic programming over the boundaries,
    O(chunks·l²))."""
    if not isinstance(chunks, int) or chunks < 1:
        raise ValueError(f"chunks must be a positive integer, got {chunks!r}")
    if chunks > n_layer:
        raise ValueError(f"chunks ({chunks}) must not exceed n_layer ({n_layer}): every chunk "
                         "needs a layer")
    if layers is not None:
        if costs is not None:
            raise ValueError("give partition costs or layers, not both")
        if len(layers) != chunks or sum(layers) != n_layer or min(layers) < 1:
            raise ValueError(f"layers {tuple(layers)} must be {chunks} sizes >= 1 summing to "
                             f"n_layer ({n_layer})")
        bounds = [0, *itertools.accumulate(layers)]
        return [range(a, b) for a, b in zip(bounds, bounds[1:])]
    size, extra = divmod(n_layer, chunks)
    bounds = [k * size + min(k, extra) for k in range(chunks + 1)]
    if costs is not None:
        costs = [float(c) for c in costs]
        if len(costs) not in (n_layer, n_layer + 2):
            raise ValueError(f"costs must have n_layer ({n_layer}) or n_layer + 2 values, got "
                             f"{len(costs)}")
        emb, head = (costs.pop(0), costs.pop()) if len(costs) == n_layer + 2 else (0.0, 0.0)
        prefix = [0.0, *itertools.accumulate(costs)]
        cost = lambda a, b: prefix[b] - prefix[a] + emb * (a == 0) + head * (b == n_layer)
        best = {(0, 0): (0.0, 0)}  # (k, i) -> (least max cost of layers [0, i) in k chunks, where
                                   #   the k-th starts)
        for k in range(1, chunks + 1):
            for i in range(k, n_layer + 1):
                best[k, i] = min((max(best[k - 1, j][0], cost(j, i)), j)
                                 for j in range(k - 1, i) if (k - 1, j) in best)
        bounds = [n_layer]
        for k in range(chunks, 0, -1):
            bounds.insert(0, best[k, bounds[0]][1])
    return [range(a, b) for a, b in zip(bounds, bounds[1:])]


class Chunk(nn.Module):
    """Some consecutive layers of a GPT, holding the GPT's own modules (references, not copies).

    forward: idx (B, T) int64 if `first`, else hidden (B, T, h) -> hidden (B, T, h), or logits
    (B, T, V) if `last`. Parameter names are the GPT's ("blocks.2.attn.q.weight"): state dicts
    merge back."""

    def __init__(self, model: GPT, layers: range, first: bool, last: bool):
        super().__init__()
        self.layers, self.first, self.last = layers, first, last
        if first:
            self.tok_emb, self.pos_emb = model.tok_emb, model.pos_emb
        self.blocks = nn.ModuleDict({str(i): model.blocks[i] for i in layers})
        if last:
            self.ln_f, self.head = model.ln_f, model.head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.first:  # (B, T, h), by the same expression as GPT.forward: the same numbers
            x = self.tok_emb(x) + self.pos_emb(torch.arange(x.shape[1], device=x.device))
        for block in self.blocks.values():
            x = block(x)
        return self.head(self.ln_f(x)) if self.last else x


def chunks_for_rank(model: GPT, pp: int, pp_rank: int, virtual_stages: int = 1, costs=None,
                    layers=None) -> dict[int, Chunk]:
    """This rank's chunks {global chunk index: Chunk}: chunk k of pp·virtual_stages lives on rank k
    % pp; their layers as `partition` cuts them (uniform, by costs, or the sizes `layers`)."""
    n = pp * virtual_stages
    layers = partition(model.cfg.n_layer, n, costs, layers)
    return {k: Chunk(model, layers[k], k == 0, k == n - 1) for k in range(pp_rank, n, pp)}


def free_unused(model: GPT, chunks) -> None:
    """Replace the GPT's modules that none of `chunks` uses by nn.Identity, so that their memory
    goes and model.parameters() / model.state_dict() are this rank's share (names unchanged)."""
    kept = {id(m) for chunk in chunks for m in chunk.modules()}
    for i, block in enumerate(model.blocks):
        if id(block) not in kept:
            model.blocks[i] = nn.Identity()
    for name in ("tok_emb", "pos_emb", "ln_f", "head"):
        if id(getattr(model, name)) not in kept:
            setattr(model, name, nn.Identity())


# ----------------------------------------------------------------------------- the messages


def _key(a) -> tuple[str, int, int]:
    return (a.op, a.stage, a.microbatch)


def _ends(key: tuple, p: int) -> tuple[int, int]:
    """(sending rank, receiving rank) of message `key`: F(c) goes to chunk c+1, B(c) to c-1."""
    return key[1] % p, (key[1] + (1 if key[0] == "F" else -1)) % p


def message_order(schedule, chunks: int) -> list[tuple]:
    """Every message of a step, named by the action that produces it (F(c): the activation for chunk
    c+1; B(c): the gradient for chunk c-1), in the order `schedules.replay` produces them: each rank
    runs its next action once its inputs exist. Any such order is causal: all matching needs."""
    p = len(schedule)
    done, stuck = replay([[Action(*_key(a)) for a in ops] for ops in schedule], p, chunks // p)
    if stuck:
        raise ValueError("the schedule deadlocks: " + ", ".join(f"rank {r} at {a} waits for {d}"
                                                                for r, a, d in stuck))
    return [_key(a) for a in done if (a.op == "F" and a.stage < chunks - 1)
            or (a.op == "B" and a.stage > 0)]


# ----------------------------------------------------------------------------- the executor


class PipelineExecutor:
    """Runs this rank's actions of `schedule` (one list of Actions per pipeline rank), step by step.

    chunks: {global chunk index: module} for the chunks on this rank; shape: (b, s, h) of the
    activations between chunks; group: the pipeline group (None: the world, or no process group when
    p = 1). Stages of different TP degrees: `peers` says whom this rank receives from and sends to
    on each pipeline rank (Mesh.pipeline_peers), group is the replica's, and `reports` is False on
    the ranks whose loss a sum over it must not count (TP ranks other than 0). Gradients accumulate
    into the chunks' .grad (sum of loss_j / m over micro-batches j); the caller steps the
    optimizer. With W actions in the schedule, B computes only input gradients (`_weight`).
    stats: counts the messages sent ("p2p"; None: not counted). after_compute(seconds), if given,
    is called after each action with what it took (hardware.throttle). `evaluate` runs
    forward only, without the schedule."""

    def __init__(self, chunks: dict, schedule, shape: tuple, group=None, loss_fn=cross_entropy,
                 stats: comm.CommStats | None = None, after_compute=None, peers=None,
                 reports: bool = True):
        self.p, self.chunks = len(schedule), dict(chunks)
        self.n_chunks = 1 + max(a.stage for rank in schedule for a in rank)
        self.m = 1 + max(a.microbatch for rank in schedule for a in rank)
        self.split = any(a.op == "W" for rank in schedule for a in rank)
        check([[Action(*_key(a)) for a in ops] for ops in schedule], self.p, self.m,
              self.n_chunks // self.p)
        me = dist.get_rank() if dist.is_initialized() else 0
        if peers is None:  # one tp: the group's q-th rank is pipeline rank q, both ways
            ranks = [me] if self.p == 1 else dist.get_process_group_ranks(group) if group else \
                list(range(dist.get_world_size()))
            peers = [(r, [r]) for r in ranks]
        if len(peers) != self.p:
            raise ValueError(f"the schedule has {self.p} ranks, the pipeline group {len(peers)}")
        self.peers, self.reports = peers, reports  # (receive from, send to) on each stage
        self.rank = next(q for q, (src, _) in enumerate(peers) if src == me)  # my own stage's
        if set(self.chunks) != set(range(self.rank, self.n_chunks, self.p)):
            raise ValueError(f"rank {self.rank} holds chunks {sorted(self.chunks)}, the schedule "
                             f"puts {list(range(self.rank, self.n_chunks, self.p))} there")
        self.actions, self.group, self.shape = list(schedule[self.rank]), group, tuple(shape)
        # loss_fn: (logits, targets) -> mean loss; tensor parallelism passes its own
        self.loss_fn, self.stats, self.after_compute = loss_fn, stats, after_compute
        params = [p for c in self.chunks.values() for p in c.parameters()]
        self.device = params[0].device
        self.dtype = next(p.dtype for p in params if p.is_floating_point())  # the messages'
        self.queues = {}  # per global peer, in the order both ends follow: (key, True if we send)
        for key in message_order(schedule, self.n_chunks):
            src, dst = _ends(key, self.p)
            if src != dst and self.rank == src:
                for g in peers[dst][1]:
                    self.queues.setdefault(g, []).append((key, True))
            elif src != dst and self.rank == dst:
                self.queues.setdefault(peers[src][0], []).append((key, False))
        # modules holding parameters, deepest first: in split mode W runs their weight gradients
        # one by one (depth: the chunk 0, its children 1...; a tie would hand the chunk theirs)
        depth = {id(m): len(n.split(".")) if n else 0 for c in self.chunks.values() for n,
                 m in c.named_modules()}
        self.owners = {k: sorted((m for m in c.modules() if any(True for _ in m.parameters())),
                                 key=lambda m: -depth[id(m)]) for k, c in self.chunks.items()}
        # split mode: each F records what those modules output (hooks set once, live only during an
        # F: a recomputed forward in B must not add to it)
        self._captured = None
        if self.split:
            for m in {id(m): m for ms in self.owners.values() for m in ms}.values():
                m.register_forward_hook(self._capture)
        self.peak_in_flight = 0
        self._reset()

    def _reset(self) -> None:
        """A step's state: the loss so far, saved activations, messages in and out, sends."""
        self._loss, self._scale = None, 1.0
        self._saved, self._inbox, self._outbox, self._sends = {}, {}, {}, []
        self._posted = {q: 0 for q in self.queues}

    def _post_until(self, peer: int, key) -> None:
        """Post this pair's messages (`peer`: a global rank) in their agreed order, up to and
        including `key`."""
        queue = self.queues[peer]
        while self._posted[peer] < len(queue):
            k, send = queue[self._posted[peer]]
            assert not send or k in self._outbox, f"message {k} to rank {peer} is due before " \
                f"{key}, not made yet"
            if send:
                t, left = self._outbox.pop(k)
                if left > 1:  # more receivers (a next stage of more TP ranks)
                    self._outbox[k] = (t, left - 1)
                work = comm.isend(t, peer, self.group, "p2p", self.stats, calls=1)
                self._sends.append((work, t))
            else:
                buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                self._inbox[k] = (buf, comm.irecv(buf, peer, self.group))
            self._posted[peer] += 1
            if k == key:
                return

    def _send(self, key, tensor: torch.Tensor) -> None:
        src, dst = _ends(key, self.p)
        if src == dst:
            self._inbox[key] = (tensor, None)
            return
        receivers = self.peers[dst][1]
        if receivers:  # none: the next stage has fewer TP ranks, and another sends its copy
            self._outbox[key] = (tensor.detach().contiguous(), len(receivers))
        for peer in receivers:
            self._post_until(peer, key)

    def _receive(self, key) -> torch.Tensor:
        src, dst = _ends(key, self.p)
        if src != dst and key not in self._inbox:
            self._post_until(self.peers[src][0], key)
        tensor, work = self._inbox.pop(key)
        comm.wait(work)
        return tensor

    def _forward(self, c: int, j: int, inputs, targets) -> float:
        x = inputs[j] if c == 0 else self._receive(("F", c - 1, j)).detach().requires_grad_()
        start, self._captured = time.perf_counter(), [] if self.split else None
        try:
            out = self.chunks[c](x)
        finally:
            captured, self._captured = self._captured or [], None
        if c == self.n_chunks - 1:
            loss = self.loss_fn(out, targets[j]) / self.m
            self._loss += loss.detach()
            out = loss * self._scale if self._scale != 1.0 else loss
        else:
            self._send(("F", c, j), out)
        self._saved[(c, j)] = (x, out, self._assign(c, captured))
        self.peak_in_flight = max(self.peak_in_flight, len(self._saved))
        return start

    def _backward(self, c: int, j: int) -> float:
        dy = None if c == self.n_chunks - 1 else self._receive(("B", c + 1, j))
        start = time.perf_counter()
        x, out, captured = self._saved.pop((c, j))
        if self.split:  # input gradient only; keep the graph and each weight owner's output grad
            wanted = ([x] if c > 0 else []) + [y for _, y, _ in captured]
            grads = torch.autograd.grad(out, wanted, dy, retain_graph=True, allow_unused=True)
            dx, self._saved[(c, j)] = (grads[0] if c > 0 else None), (captured,
                                                                      grads[1 if c > 0 else 0:])
        else:
            torch.autograd.backward(out, dy)
            dx = x.grad
        if c > 0:
            self._send(("B", c, j), dx)
        return start

    def _capture(self, module, inputs, output) -> None:
        if self._captured is not None:
            self._captured.append((module, output))

    def _assign(self, c: int, captured: list) -> list:
        """[(module, output, params)]: each parameter to the deepest module that ran on it. A module
        the forward does not call (tensor parallelism's q, k, v, used through their weights) leaves
        its parameters to the one that did (the attention)."""
        outputs, taken, owned = dict((id(m), y) for m, y in captured), set(), []
        for m in self.owners[c]:
            params = [p for p in m.parameters() if p.requires_grad
                      and id(p) not in taken] if id(m) in outputs else []
            taken.update(id(p) for p in params)
            if params:
                owned.append((m, outputs[id(m)], params))
        return owned

    def _weight(self, c: int, j: int) -> float:
        """W: each weight-owning module's parameter gradients from its output gradient, saved by B.

        One backward per module, from its output to the parameters `_assign` gave it (a single
        backward from all outputs would also flow through later modules into earlier ones and count
        gradients twice). The work is the weight-gradient GEMMs alone; the price is memory: from B
        to W a micro-batch keeps its whole autograd graph (its saved activations, as between F and
        B) plus one output gradient per module that owns weights (~ 12·b·s·h per layer, and b·s·V
        for the head)."""
        start = time.perf_counter()
        captured, grads = self._saved.pop((c, j))
        for (_, y, params), dy in zip(captured, grads):
            if dy is not None:
                # retain_graph: paths share nodes (the attention's to q, k, v passes the proj's);
                # the graph goes with the outputs, at the end of this call. Into .grad, hooks fire
                torch.autograd.backward(y, dy, inputs=params, retain_graph=True)
        return start

    def step(self, inputs=None, targets=None, loss_scale: float = 1.0) -> tuple[float, list]:
        """Run this rank's actions once (the backward on loss · loss_scale). inputs[j] (b, s): the
        token ids of micro-batch j, needed where chunk 0 lives, targets[j] where the last one does.
        Returns (loss, events): loss = sum over j of cross_entropy_j / m as a float on the rank of
        the last chunk and 0.0 elsewhere (a sum over the pipeline group gives it to all); events =
        [(action, start, end)] in time.perf_counter seconds, start: when its inputs had arrived."""
        self._check(inputs, targets)
        self._reset()
        self._loss, self._scale, events = torch.zeros((), device=self.device), float(loss_scale), []
        for a in self.actions:
            op, c, j = _key(a)
            start = self._forward(c, j, inputs, targets) if op == "F" else \
                self._backward(c, j) if op == "B" else self._weight(c, j)
            if self.after_compute:
                self.after_compute(time.perf_counter() - start)
            events.append((a, start, time.perf_counter()))
        comm.wait(*(work for work, _ in self._sends))
        assert not self._saved and not self._inbox and not self._outbox, "a message or " \
            "activation was left over"
        self._sends = []
        return (self._loss.item() if self.n_chunks - 1 in self.chunks and self.reports else 0.0), \
            events

    @torch.no_grad()
    def evaluate(self, inputs=None, targets=None) -> float:
        """Forward only, no gradient, the step's state untouched: the mean loss over the
        micro-batches (inputs, targets as `step`'s) on every rank (summed from the last chunk's).
        No schedule: all ranks walk one order, micro-batch by micro-batch and chunk by chunk, each
        running its own chunks, sending (isend) an output when made and receiving just before use;
        so each pair queues its messages in one order, and the first chunk not run has its input."""
        self._check(inputs, targets)
        total, sends, x = torch.zeros((), dtype=torch.float64, device=self.device), [], None
        for j, c in itertools.product(range(self.m), sorted(self.chunks)):  # this rank's part
            if c == 0:
                x = inputs[j]
            elif (c - 1) % self.p != self.rank:  # else x is chunk c-1's output, made here
                x = torch.empty(self.shape, dtype=self.dtype, device=self.device)
                comm.wait(comm.irecv(x, self.peers[(c - 1) % self.p][0], self.group))
            x = self.chunks[c](x)
            if c == self.n_chunks - 1:
                total += self.loss_fn(x, targets[j]).double() / self.m * self.reports
            elif (c + 1) % self.p != self.rank:
                x = x.contiguous()  # kept with its send until that is waited
                sends += [(comm.isend(x, peer, self.group, "p2p", self.stats, calls=1), x)
                          for peer in self.peers[(c + 1) % self.p][1]]
        comm.wait(*(work for work, _ in sends))
        if self.p > 1:
            dist.all_reduce(total, group=self.group)
        return total.item()

    def _check(self, inputs, targets) -> None:
        if (0 in self.chunks and inputs is None) or (self.n_chunks - 1 in self.chunks
                                                     and targets is None):
            raise ValueError(f"rank {self.rank} needs inputs (chunk 0) and/or targets (last chunk)")
