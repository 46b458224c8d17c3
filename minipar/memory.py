"""Memory per rank by category (params, grads, optimizer, activations, comm): measured, predicted.

Persistent state is counted exactly, as the bytes of the tensors that hold it. Activations are what
autograd saves for the backward pass: `ActivationMeter` watches every tensor saved during forward
(`torch.autograd.graph.saved_tensors_hooks`), counts each storage once and leaves parameters out,
and keeps the peak. On CUDA, `torch.cuda.max_memory_allocated` is the ground truth to compare with;
on CPU there is no allocator statistic, which is why we count.

`predict(cfg, par, global_batch)` gives the same categories from the configuration alone: model
states by the ZeRO paper's formulas (fp32 4 + 4 + 8 bytes a parameter, mixed precision 2 + 2 + 12),
activations by Korthikanti et al.'s per-layer count adjusted to what this GPT saves, communication
buffers by what each technique allocates. `zero_table` recomputes the ZeRO paper's Table I.

Each fact is written once, and the planner (minipar/planner/) counts with the same functions:
`block_params` and `chunk_params` the parameters one TP rank holds of a block and of a model chunk
(every other parameter count is their sum), `rank_states` a rank's model states and communication
buffers as zero.py allocates them, `element_bytes` and `layout_bytes` what an activation and a
parameter's states take.
"""
from __future__ import annotations

import functools

from minipar.activation_bytes import (  # noqa: F401  (memory.*: the predicted activations)
    activations, cp_extra, korthikanti, loss_bytes, moe_activations)
from minipar.activations import (  # noqa: F401  (memory.*: the measured side)
    ActivationMeter, measure, optimizer_tensors, tensor_bytes)
from minipar.comm import receive_numel
from minipar.context_parallel import positions as _positions
from minipar.data_parallel import split
from minipar.mesh import Mesh
from minipar.pipeline.runtime import partition
from minipar.pipeline.schedules import cached_schedule, derived, in_flight
from minipar.zero3 import unit_events

CATEGORIES = ("params", "grads", "optimizer", "activations", "comm")


# ----------------------------------------------------------------------------- predicted
# 
# The analytic model: the same categories, from the configuration alone, for one rank. Model states
# follow the ZeRO paper (Rajbhandari et al. 2020, sec. 3 and 5): Psi parameters at (params, grads,
# optimizer) bytes each, the stage deciding which of the three is divided by N_d. Activations follow
# Korthikanti et al. 2022 (Table 2), adjusted to what minipar's
# GPT really saves (see `activations`).

FP32 = {"params": 4, "grads": 4, "optimizer": 8}     # fp32 weights and grads, two fp32 Adam moments
MIXED = {"params": 2, "grads": 2, "optimizer": 12}   # 16-bit weights and grads; fp32
                                                     #   master + 2 moments
PURE_BF16 = {"params": 2, "grads": 2, "optimizer": 4}  # no master: two bf16 moments
MIXED_FP32_GRADS = {"params": 2, "grads": 4, "optimizer": 12}  # fp32 gradients: Megatron's 18


def layout_bytes(precision: str, fp32_grads: bool = True) -> dict[str, int]:
    """Bytes per parameter of each model state: FP32 for "fp32", PURE_BF16 for "pure-bf16"; for
    "bf16" and "fp16" MIXED_FP32_GRADS (2 + 4 + 12: gradients accumulated and reduced in fp32,
    ParallelConfig.reduce_fp32, minipar's default) or the ZeRO paper's MIXED (2 + 2 + K, K = 12)."""
    mixed = MIXED_FP32_GRADS if fp32_grads else MIXED
    return dict({"fp32": FP32, "pure-bf16": PURE_BF16}.get(precision, mixed))


def element_bytes(precision: str) -> int:
    """Bytes of an activation element: 4 in fp32, 2 for a model held in 16 bits (precision.py's
    MixedPrecision casts the model for "bf16", "fp16" and "pure-bf16")."""
    return 4 if precision == "fp32" else 2


def model_states(psi: float, n_d: int, stage: int,
                 bytes_per_param: dict | None = None) -> dict[str, float]:
    """The ZeRO paper's model states per device, bytes, for Psi parameters over N_d ranks, as the
    paper writes them (no padding; what zero.py allocates, padding included, is `rank_states`):

        stage 0 (DP)  2Psi + 2Psi + K Psi            = 16 Psi             (MIXED: K = 12)
        stage 1       2Psi + 2Psi + K Psi / N_d      = 4 Psi + 12 Psi / N_d
        stage 2       2Psi + (2 + K) Psi / N_d       = 2 Psi + 14 Psi / N_d
        stage 3       (2 + 2 + K) Psi / N_d          = 16 Psi / N_d
    """
    per = bytes_per_param or MIXED
    sharded = {"params": stage >= 3, "grads": stage >= 2, "optimizer": stage >= 1}
    return {c: per[c] * psi / (n_d if sharded[c] else 1) for c in ("params", "grads", "optimizer")}


def zero_table(psi: float, n_d: int, k: int = 12) -> dict[int, float]:
    """The ZeRO paper's Table I: GB (1e9 bytes) of model states per device for stages 0..3, with
    2 + 2 + K bytes per parameter (K = 12 for mixed-precision Adam). {stage: GB}."""
    per = {"params": 2, "grads": 2, "optimizer": k}
    return {stage: sum(model_states(psi, n_d, stage, per).values()) / 1e9 for stage in range(4)}


def block_params(cfg, t: int = 1, ep: int = 1, experts: bool = True) -> list[tuple[int, bool]]:
    """(elements, whole) of each parameter of one block on one of t tensor-parallel ranks, in the
    model's order; whole: one TP leaves whole on every rank (LayerNorms, row-parallel biases; with
    SP their gradients are partial), the others are cut by t. h = d_model, k = kv_dim, f = ffn_dim:

      ln1 (h, h) | q (h^2, h) | k (h k) | v (h k, k) | proj (h^2, h) | ln2 (h, h) |
      gelu: fc (h f, f) | proj (h f, h)       swiglu: gate (h f) | fc (h f) | proj (h f)

    with every matrix and column-parallel bias /t. GPT-2 (k = h, f = 4h): (12 h^2 + 6 h)/t + 6 h.
    A mixture of n experts in place of the MLP, whole on every TP rank (`expert_params`, each /ep
    with expert parallelism; experts=False leaves them out), then its router (n h)."""
    h, k, f, cut, whole = cfg.d_model, cfg.kv_dim, cfg.ffn_dim, False, True
    attn = [(h, whole), (h, whole), (h * h, cut), (h, cut), (h * k, cut), (h * k, cut), (k, cut),
            (h * h, cut), (h, whole), (h, whole), (h, whole)]
    if cfg.n_expert:
        mine = [(n, whole) for n in expert_params(cfg, ep)] if experts else []
        return [(n if whole else n // t, whole) for n, whole in attn] + mine + \
            [(cfg.n_expert * h, whole)]
    mlp = [(h * f, cut)] * 3 if cfg.mlp == "swiglu" else [(h * f, cut), (f, cut), (h * f, cut),
                                                          (h, whole)]
    return [(n if whole else n // t, whole) for n, whole in attn + mlp]


def expert_params(cfg, ep: int = 1) -> list[int]:
    """Elements of each stacked expert weight of a MoE layer on one of ep expert-parallel ranks, in
    the model's order (moe.MoE's parameters): gelu fc (n h f) | proj (n f h) | fc_bias (n f) |
    proj_bias (n h); swiglu gate | fc | proj (n h f each); n = n_expert / ep."""
    n, h, f = cfg.n_expert // ep, cfg.d_model, cfg.ffn_dim
    return [n * h * f] * 3 if cfg.mlp == "swiglu" else [n * h * f, n * f * h, n * f, n * h]


def chunk_params(cfg, t: int, layers: int, first: bool, last: bool, ep: int = 1,
                 experts: bool = True) -> list[int]:
    """Elements of each parameter one of t tensor-parallel ranks holds of a model chunk of `layers`
    blocks, in the model's order (named_parameters: a tied head weight is the embedding's, not
    counted again): tok_emb V h/t | pos_emb s h | `block_params` each block | ln_f (h, h) | head
    (V h/t, V/t; untied). Data parallelism's buckets are cut from them (data_parallel.split). The
    one parameter formula: every count is a sum of these (t = 1, the whole model:
    cfg.num_params). ep, experts: `block_params`'."""
    h, V, s = cfg.d_model, cfg.vocab_size, cfg.seq_len
    head = [] if cfg.tie_embeddings else [V * h // t, V // t]
    block = [n for n, _ in block_params(cfg, t, ep, experts)]
    return ([V * h // t, s * h] if first else []) + block * layers + ([h, h] + head if last else [])


def chunk_units(cfg, t: int, layers: int, first: bool, last: bool) -> list[int]:
    """The parameters of each ZeRO-3 unit `zero.Zero3` cuts a chunk into: `unit_params` summed."""
    return [sum(unit) for unit in unit_params(cfg, t, layers, first, last)]


def unit_params(cfg, t: int, layers: int, first: bool, last: bool) -> list[list[int]]:
    """`chunk_params` cut into ZeRO-3's units, in forward order: tok_emb | pos_emb | each block |
    ln_f | head (untied)."""
    sizes = chunk_params(cfg, t, layers, first, last)
    counts = [1, 1] * first + [len(block_params(cfg))] * layers + \
        ([2] if cfg.tie_embeddings else [2, 2]) * last
    bounds = [sum(counts[:i]) for i in range(len(counts) + 1)]
    return [sizes[a:b] for a, b in zip(bounds, bounds[1:])]


def replicated_params(cfg, layers: int, first: bool, last: bool) -> int:
    """Elements of a chunk that TP leaves whole (its partial gradients with SP): `block_params`'
    whole ones, the positions on the first chunk, ln_f on the last. GPT-2: 6 l h + s h + 2 h."""
    block = sum(n for n, whole in block_params(cfg) if whole)
    return layers * block + cfg.seq_len * cfg.d_model * first + 2 * cfg.d_model * last


def chunk_layers(cfg, par) -> list[int]:
    """Layers of each of the pp * virtual_stages model chunks, as pipeline.runtime.partition cuts
    them (or as par.stage_layers says)."""
    chunks = partition(cfg.n_layer, par.pp * par.virtual_stages, layers=par.stage_layers)
    return [len(c) for c in chunks]


def rank_units(cfg, t: int, layers: list[int], pp: int, pp_rank: int, of=None) -> list[int]:
    """The units (`chunk_units`; of=chunk_params: the parameters) of every chunk pipeline rank
    `pp_rank` holds: chunk k of len(layers), with layers[k] blocks, lives on rank k % pp
    (pipeline.rank_of)."""
    n, of = len(layers), of or chunk_units
    mine = range(pp_rank, n, pp)
    return [u for c in mine for u in of(cfg, t, layers[c], c == 0, c == n - 1)]


def rank_actions(par, pp_rank: int = 0) -> list[tuple[str, int]]:
    """(op, chunk) of stage pp_rank's step: its schedule's actions, or each micro-batch's F, B."""
    if par.pp == 1:
        return [(op, 0) for _ in range(par.microbatches) for op in "FB"]
    return [(a.op, a.stage) for a in cached_schedule(par.schedule, par.pp, par.microbatches,
                                                     par.virtual_stages)[pp_rank]]


def zero3_gathered(cfg, par, pp_rank: int = 0, layers: list[int] | None = None) -> int:
    """Elements ZeRO-3 holds gathered at most on a rank of stage pp_rank (`layers` per chunk, as
    `chunk_layers`), each unit padded to N shards: a unit and the next, prefetched; with interleaved
    1F1B a prefetch into another chunk may keep a third (zero3.unit_events over the step)."""
    layers, full, spans, gathered, most = layers or chunk_layers(cfg, par), [], {}, set(), 0
    for c in range(pp_rank, len(layers), par.pp):
        units = chunk_units(cfg, par.tp, layers[c], c == 0, c == len(layers) - 1)
        spans[c] = range(len(full), len(full) + len(units))
        full += [par.dp * flat_shard(unit, par.dp, 0)[0] for unit in units]
    for op, c in rank_actions(par, pp_rank):
        for _ in unit_events(spans, op, c, gathered):
            most = max(most, sum(full[i] for i in gathered))
    return most


def flat_shard(total: int, n: int, rank: int) -> tuple[int, int]:
    """(shard length, real elements `rank` owns) of a flat buffer padded to n shards (zero.py)."""
    shard = -(-total // n)
    return shard, max(0, min(total, (rank + 1) * shard) - rank * shard)


def tp_params(cfg, t: int = 1) -> int:
    """Parameters each of t tensor-parallel ranks holds, the sum of the whole model's `chunk_params`
    (GPT-2: (12 l h^2 + 6 l h + 2 V h + V) / t + 6 l h + s h + 2 h; t = 1: cfg.num_params)."""
    return sum(chunk_params(cfg, t, cfg.n_layer, True, True))


def predict(cfg, par, global_batch: int, bytes_per_param: dict | None = None, *, rank: int = 0,
            pp_rank: int = 0, cp_rank: int = 0) -> dict[str, int]:
    """Predicted memory of DP rank `rank` (default 0, the fullest) of pipeline stage `pp_rank`,
    {category: bytes}, as `train(...).peak_memory` tallies it: model states and buffers after the
    step, activations at their peak. Psi = the parameters a rank holds (`tp_params`, or
    `stage_params` with pp > 1), N = par.dp, bytes per parameter (p, g, k) = `bytes_per_param` or
    `layout_bytes(par.precision, par.reduce_fp32)`: (4, 4, 8) fp32, (2, 4, 12) mixed with fp32
    gradients, (2, 2, 12) with 16-bit ones.

      params     p Psi (stage 0) | p Psi_pad (1, 2: every rank holds the padded flat buffers)
                 | p Psi_pad/N (3)
      grads      g Psi (0: the buckets are the .grad) | g Psi_pad (1: the full buffers) |
                 g Psi_pad/N (2, 3)
      optimizer  k Psi (0) | k times the real (not padding) elements of the rank's shard (1, 2, 3),
                 but for the fp32 master shard of mixed precision, 4 bytes a padding element too
      activations  `activations(cfg, b)`, b = global_batch / (dp * microbatches) (with dp_shares:
                 this rank's share / microbatches), e = 4 in fp32 and 2 in 16-bit (a model held in
                 16 bits, as precision.MixedPrecision makes it); with pp > 1 the schedule's peak
                 over the micro-batches in flight (`stage_activations`)
      comm       stage 0: the ring's receive space (collectives "minipar", N > 1), g (N-1)
                 ceil(B/N) for the largest bucket of B elements (naive: the largest parameter) |
                 stages 1, 2: none (they reduce-scatter in place, into the bucket's own shard,
                 and free the receive space once the step's reductions are done) | stage 3: the
                 gathered units at their most, p (full_i + full_{i+1}) at the largest adjacent
                 pair, or with interleaved chunks up to three (`zero3_gathered`)
    Context parallelism (cp_rank: the rank's place in its CP group): its ranks are replicas of the
    weights, so N = dp x cp and this rank is shard `rank` cp + cp_rank; activations for the tokens
    it holds (`activations`' cp). Expert parallelism: Psi counts this rank's n / ep experts, and
    the experts' buckets are reduced over dp / ep ranks (their receive space by that N).
    Psi_pad is Psi with each flat buffer padded to a multiple of N: stages 1, 2 one per bucket
    (data_parallel.split; dp_mode "naive": one), stage 3 one per unit. Not counted, as the tally
    does not count them: the optimizer's step counters (4 bytes for each parameter, or piece of one,
    that a rank updates) and what lives only within the step: stage 2's full gradient buffers (all
    of them through backward with dp_mode "naive", at most two with "bucketed"), a unit's full
    gradients in stage 3, autograd's temporaries.
    """
    par.check(cfg, global_batch)
    par = par.at_stage(pp_rank)  # stage_tp: this stage's own tp
    per = bytes_per_param or layout_bytes(par.precision, par.reduce_fp32)
    layers = chunk_layers(cfg, par)
    params = rank_units(cfg, par.tp, layers, par.pp, pp_rank,
                        of=functools.partial(chunk_params, ep=par.ep, experts=par.ep == 1))
    experts = expert_params(cfg, par.ep) * sum(layers[pp_rank::par.pp]) if par.ep > 1 else []
    units = rank_units(cfg, par.tp, layers, par.pp, pp_rank) if par.zero == 3 else \
        params + experts
    b = par.dp_rows(global_batch)[rank] // par.microbatches  # this DP rank's micro-batch, dp_shares
    cp = (par.cp_method, len(_positions(cfg.seq_len, par.cp, cp_rank))) if par.cp > 1 else None
    activations = stage_activations(cfg, par, b, element_bytes(par.precision), pp_rank, cp)
    gathered = zero3_gathered(cfg, par, pp_rank) if par.zero == 3 else None
    replicas = par.replace(dp=par.dp * par.cp, cp=1, dp_shares=None) if par.cp > 1 else par
    return by_category(rank_states(replicas, units, per, rank * par.cp + cp_rank, params,
                                   gathered, experts), activations)


def rank_states(par, sizes: list[int], per: dict, dp_rank: int = 0,
                params: list[int] | None = None, gathered: int | None = None,
                experts: list[int] = ()) -> dict[str, int]:
    """Model states and communication buffers after a step, bytes {params, grads, optimizer, comm},
    of DP rank `dp_rank` holding the units `sizes` (`rank_units`) at `per` bytes a parameter, as
    zero.py, zero3.py and data_parallel.py allocate them (`predict` gives the formulas). ZeRO-3 pads
    each unit on its own; stages 1-2 each gradient bucket (data_parallel.split of `params`, the
    parameters' sizes, model order; None: one flat buffer of their sum, the planner's
    approximation). ZeRO-3's gathered units: `gathered` elements (zero3_gathered), else a unit and
    the next. experts: with expert parallelism, the sizes of the expert weights, bucketed apart
    (data_parallel._apart) and reduced over dp / ep ranks; `params` are then the others. predict
    and the planner's stages count with it."""
    n, stage, psi, g = par.dp, par.zero, sum(sizes), per["grads"]
    # a sharded optimizer: the fp32 master shard (mixed precision) has the padding too, the
    # moments only the real elements
    master = 4 if par.precision in ("bf16", "fp16") else 0
    optimizer = lambda shard, owned: master * shard + (per["optimizer"] - master) * owned  # noqa
    if stage == 3:  # (the scratch is freed after the step)
        shards = [flat_shard(size, n, dp_rank) for size in sizes]
        full = [n * s for s, _ in shards]
        shard, owned = sum(s for s, _ in shards), sum(o for _, o in shards)
        gathered = gathered or max([x + y for x, y in zip(full, full[1:])] or full)
        return {"params": per["params"] * shard, "grads": g * shard,
                "optimizer": optimizer(shard, owned), "comm": per["params"] * gathered}
    params = params or [psi]
    naive = par.dp_mode == "naive"
    buckets = _bucket_sizes(params, par, g)
    if stage == 0:  # the buckets are the gradients (naive: one per parameter), and the ring's
        # receive space for the largest (the experts' over their own dp / ep ranks)
        reduced = [(size, n) for size in buckets] + \
            [(size, n // par.ep) for size in (_bucket_sizes(experts, par, g) if experts else [])]
        space = max(receive_numel(size, m) if m > 1 else 0 for size, m in reduced)
        return {"params": per["params"] * psi, "grads": g * psi,
                "optimizer": per["optimizer"] * psi,
                "comm": g * space if par.collectives == "minipar" else 0}
    shards = [flat_shard(size, n, dp_rank) for size in ([psi] if naive else buckets)]
    shard, owned = sum(s for s, _ in shards), sum(o for _, o in shards)
    # stage 1 keeps the full gradient buffers (each reduce-scatter lands in the bucket's own
    # shard); stage 2 the shards as its gradients (the full buffers are freed once reduced); the
    # receive space is freed with the step's last reduction (step_memory counts it)
    return {"params": per["params"] * n * shard, "grads": g * (n * shard if stage == 1 else shard),
            "optimizer": optimizer(shard, owned), "comm": 0}


def _bucket_sizes(params: list[int], par, g: int) -> list[int]:
    """Elements of each gradient bucket of these parameters (naive: one each)."""
    return [sum(params[i] for i in b) for b in split(params, par.bucket_bytes, g)]


def by_category(states: dict, activations: int) -> dict[str, int]:
    """A rank's memory in CATEGORIES order: `rank_states`' states and buffers, its activations."""
    return {c: activations if c == "activations" else states[c] for c in CATEGORIES}


def stage_params(cfg, par, pp_rank: int = 0) -> int:
    """Parameters of one rank of pipeline stage `pp_rank`: the sum of its `rank_units` (its chunks,
    layers cut as `chunk_layers` says; the embeddings on the first chunk, ln_f and the head on the
    last), each cut by tp (`tp_params` when pp = 1)."""
    return sum(rank_units(cfg, par.tp, chunk_layers(cfg, par), par.pp, pp_rank))


def stage_activations(cfg, par, micro_batch: int, element_bytes: int, pp_rank: int = 0,
                      cp: tuple | None = None) -> int:
    """Peak bytes saved for backward on a rank of stage `pp_rank` (`pipeline_activations`); cp:
    `activations`'."""
    return pipeline_activations(cfg, par, micro_batch, element_bytes, cp=cp)[pp_rank]


def pipeline_activations(cfg, par, micro_batch: int, element_bytes: int,
                         layers: list[int] | None = None, actions: tuple | None = None,
                         extra_per_layer: int = 0, ranks=None, cp: tuple | None = None
                         ) -> list[int]:
    """Peak bytes saved for backward on each pipeline rank. One process: `activations`. A pipeline:
    walk each rank's actions in the schedule's order; each F adds its chunk's activations of one
    micro-batch (its layers; the ids and positions on the first chunk, ln_f, the loss and the
    targets on the last), which stay until that micro-batch's backward (its W, if the schedule
    splits backward: B keeps the graph for W). The peak is the schedule's memory, in bytes. layers:
    layers per chunk (default `chunk_layers`); actions: the schedule's (default par's,
    `pipeline.cached_schedule`); extra_per_layer: bytes a layer saves besides (the planner's
    materialised attention matrix); ranks: those to size (default all), in their order; cp: a
    context-parallel rank's (`activations`), whose tokens are s_r of each sequence's."""
    parts = activations(cfg.replace(n_layer=1), micro_batch, element_bytes, par.tp,
                        par.sequence_parallel, par.recompute, cp)
    per_layer = parts["layers"] + extra_per_layer
    if par.pp == 1:
        return [per_layer * cfg.n_layer + parts["head"] + parts["tokens"]]
    cfg = cfg.replace(seq_len=cp[1]) if cp else cfg   # (below: the tokens this rank holds)
    chunks, sb, t = par.pp * par.virtual_stages, cfg.seq_len * micro_batch, par.tp
    layers = layers or chunk_layers(cfg, par)
    actions = actions or cached_schedule(par.schedule, par.pp, par.microbatches, par.virtual_stages)
    ids, targets = (8 * sb, 8 * sb) if t == 1 else (parts["tokens"] - 8 * cfg.seq_len, 0)
    saved, kept = loss_bytes(cfg, micro_batch, t, element_bytes)
    loss = saved - kept  # what B frees when W comes later
    held = [layers[k] * per_layer + (ids + 8 * cfg.seq_len) * (k == 0)
            + (parts["head"] + targets) * (k == chunks - 1) for k in range(chunks)]
    flight = derived(in_flight, actions, chunks)
    return [max(sum(n * held[k] for k, n in zip(mine, counts)) - past_b * loss
                for counts, past_b in states)
            for mine, states in (flight[r] for r in (range(par.pp) if ranks is None else ranks))]


def predict_ranks(cfg, par, global_batch: int) -> list[dict]:
    """`predict` for every rank of the layout, in rank order (ZeRO's shard: its DP rank's; the DP
    axis holds dp x cp replicas, cp innermost)."""
    grid = [Mesh(par.dp * par.cp, par.tp, par.pp, rank=r, stage_tp=par.stage_tp).coords()
            for r in range(par.world)]
    return [predict(cfg, par, global_batch, rank=c.dp_rank // par.cp, pp_rank=c.pp_rank,
                    cp_rank=c.dp_rank % par.cp) for c in grid]
