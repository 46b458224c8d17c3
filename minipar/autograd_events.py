"""Backward as autograd runs it, the facts the step-peak walks (minipar/step_memory.py) rest on:
what each node frees when it ends and which parameters' gradients arrive after it
(`backward_events`), and a pipeline stage's step as its schedule's actions, each with those events
(`stage_ops`). A test records them with hooks on the real model (tests/test_memory.py), for GPT and
Llama shapes, with and without TP and SP.
"""
from __future__ import annotations

from minipar import memory


def backward_events(cfg, b: int, e: int, recompute: str = "none", t: int = 1,
                     sp: bool = False) -> list[tuple[int, list[int]]]:
    """Backward as autograd runs it, node by node, on one of t TP ranks (sequence-parallel if sp):
    (activation bytes the node frees, the indices in chunk_params' order of the parameters whose
    gradients arrive after it, last first). A node frees what it saved as it ends, before the
    gradients it made reach their parameters. A tied head's weight is the embedding's: its gradient
    arrives with the embedding's, last. Selective recomputation of the fused core saves what the
    core itself would: the same events. Full recomputation keeps only a block's input, freed by its
    last node (ln1); what its re-run forward saves lives inside the block's backward, among
    autograd's temporaries (the tracker's count, as measured). The loss saves what
    memory.loss_bytes says (under TP its fp32 softmax shard, turned in place into the logits'
    gradient, which lives on to the head's node), the vocab-parallel embedding its local ids and
    mask (9 s b); TP's f and g operators save nothing. With SP the head's input is the sequence
    shard (tensor_parallel's _GatherThenLinears gathers it again in backward)."""
    s, h, L = cfg.seq_len, cfg.d_model, cfg.n_layer
    x, st, per = s * b * h * e // (t if sp else 1), 2 * s * b * e // (t if sp else 1), \
        len(memory.block_params(cfg))
    top = 2 + per * L  # ln_f's weight
    saved, held = memory.loss_bytes(cfg, b, t, e)  # held: the logits' gradient, under TP
    loss, ids = saved - held, 8 * s * b if t == 1 else 9 * s * b
    head = [top + 2, top + 3] if sp else [top + 3, top + 2]  # (_GatherThenLinears: weight first)
    events = [(loss, []), (x + held, [] if cfg.tie_embeddings else head),
              (x + st, [top, top + 1])]
    for k in reversed(range(L)):  # the head, ln_f, the blocks
        block = block_events(cfg, b, e, 2 + per * k, recompute, t, sp)
        if recompute == "full":  # only its input was kept, freed by its last node (ln1)
            block = [(0, params) for _, params in block[:-1]] + [(x, block[-1][1])]
        events += block
    return events + [(8 * s, [1]), (ids, [0])]


def block_events(cfg, b: int, e: int, o: int, recompute: str = "none", t: int = 1,
                  sp: bool = False) -> list[tuple]:
    """`backward_events` of the block whose first parameter is the o-th: the MLP's nodes (GELU:
    proj, the GELU, fc; SwiGLU: proj, the product, fc, the SiLU, the gate), ln2, the attention's
    (proj, the core, v, k, q) and ln1. ln2's output goes with the last linear that saved it (fc, or
    the gate), ln1's with q. The core saves its fp32 log-sum-exp unless recomputed (selective).
    Under TP what lies between the column- and the row-parallel linears is cut t ways, the
    LayerNorms' inputs and outputs are whole (their sequence shard with SP, where one node,
    _GatherThenLinears, gives q, k and v, or fc and the gate, their gradients together), and a
    row-parallel bias is added after the TP reduction: its gradient comes first, from a node of
    its own."""
    s, h, a = cfg.seq_len, cfg.d_model, cfg.n_head
    x, st = s * b * h * e // (t if sp else 1), 2 * s * b * e // (t if sp else 1)
    kv, f = s * b * cfg.kv_dim * e // t, s * b * cfg.ffn_dim * e // t  # a key (value), an MLP act.
    row = (lambda freed, bias, weight: [(0, [bias]), (freed, [weight])]) if t > 1 else \
        (lambda freed, bias, weight: [(freed, [bias, weight])])  # a row-parallel linear's nodes
    if cfg.mlp == "swiglu":  # (under TP both column-parallel matmuls run before the SiLU)
        mlp = [(f, [o + 13]), (2 * f, [])] + (
            [(0, [o + 12]), (f, []), (x, [o + 11])] if t == 1 else
            [(f, []), (x, [o + 11, o + 12])] if sp else [(f, []), (0, [o + 12]), (x, [o + 11])])
    else:
        mlp = row(f, o + 14, o + 13) + [(f, []), (x, [o + 11, o + 12] if sp else [o + 12, o + 11])]
    lse = 0 if recompute == "selective" else 4 * a * s * b // t
    core = 2 * s * b * h * e // t + 2 * kv + lse  # q, k, v, the log-sum-exp; and its output, which
                                                  #   proj saves too: freed with the core's node
    qkv = [(x, [o + 2, o + 3, o + 6, o + 5, o + 4])] if sp else \
        [(0, [o + 6, o + 5]), (0, [o + 4]), (x, [o + 3, o + 2])]
    return mlp + [(x + st, [o + 9, o + 10])] + row(0, o + 8, o + 7) + \
        [(core, [])] + qkv + [(x + st, [o, o + 1])]



def stage_ops(cfg, par, b: int, pp_rank: int) -> list[tuple[str, list]]:
    """The step of pipeline stage `pp_rank` as [(op, events)]: "F" saves the bytes its chunk's
    `backward_events` free, "B" runs them (parameter indices those of the stage's chunks, in
    order: memory.rank_units). A split backward (zb-h1) keeps the chunk's graph from B to W: its B
    frees only what the loss saved, its W gives every gradient (`weight_order`) and frees the rest
    at its end. Without a pipeline,
    forward then backward, micro-batch after micro-batch. A chunk's events are the model's cut to
    its layers: the loss, head and ln_f on the last chunk only, the embeddings on the first only."""
    e, layers = memory.element_bytes(par.precision), memory.chunk_layers(cfg, par)
    chunks, mine, start, offset = len(layers), range(pp_rank, len(layers), par.pp), 0, {}
    for c in mine:
        offset[c] = start
        start += len(memory.chunk_params(cfg, par.tp, layers[c], c == 0, c == chunks - 1))

    def events(c):  # a node without gradients folds into the next (nothing to check between)
        ev = backward_events(cfg.replace(n_layer=layers[c]), b, e, par.recompute, par.tp,
                              par.sequence_parallel)
        out, carry = [], 0
        for freed, params in ev[:len(ev) - 2 * (c > 0)][3 * (c < chunks - 1):]:
            if params:
                out.append((carry + freed, [offset[c] + i - 2 * (c > 0) for i in params]))
            carry = 0 if params else carry + freed
        return out + [(carry, [])] * (carry > 0)

    of = {(op, c): events(c) for c in mine for op in "FB"}
    for c in mine if par.schedule == "zb-h1" else ():  # B frees the loss's node, W the rest
        loss = backward_events(cfg, b, e, t=par.tp)[0][0] if c == chunks - 1 else 0
        of["B", c] = [(loss, [])]
        of["W", c] = [(0, [offset[c] + i for i in weight_order(cfg, layers[c], c == 0,
                                                                 c == chunks - 1, par.tp,
                                                                 par.sequence_parallel)]),
                      (sum(freed for freed, _ in of["F", c]) - loss, [])]
    return [(op, of[op, c]) for op, c in memory.rank_actions(par, pp_rank)]


def weight_order(cfg, layers: int, first: bool, last: bool, t: int = 1,
                 sp: bool = False) -> list[int]:
    """The order in which a split backward's W (pipeline.runtime.PipelineExecutor._weight) finishes
    the gradients of a chunk of `layers` blocks, as indices in chunk_params' order: one backward per
    module that owns parameters, the deepest first (across all blocks, in modules() order among
    equals), each giving its parameters in autograd's order. In a block: its linears (a bias before
    its weight), then the LayerNorms (weight, bias); under TP the row-parallel linears, then ln1,
    the attention owning q, k, v (which its forward uses through their weights: in reverse, or in
    the order SP's one node gives them: q's weight, k's, v's bias, q's bias, v's weight), ln2 and
    the MLP owning its column-parallel part (likewise). Then the embeddings, ln_f and the head (its
    bias first, but with SP; a tied head, which needs pp = 1, has none). Block-relative indices:
    block_params' order."""
    per, top = len(memory.block_params(cfg)), 2 * first
    gelu = cfg.mlp != "swiglu"
    proj, mlp_proj, mlp = [8, 7], [14, 13] if gelu else [13], [12, 11] if gelu else [11, 12]
    if t == 1:
        deep, shallow = [3, 2, 4, 6, 5] + proj + mlp + mlp_proj, [0, 1, 9, 10]
    else:
        qkv, cols = ([2, 4, 6, 3, 5], [11, 12]) if sp else ([6, 5, 4, 3, 2], [12, 11])
        deep, shallow = proj + mlp_proj, [0, 1] + qkv + [9, 10] + cols
    end = top + per * layers
    head = [end + 2, end + 3] if sp else [end + 3, end + 2]
    return [top + per * k + i for level in (deep, shallow) for k in range(layers) for i in level] \
        + [0, 1] * first + ([end, end + 1] + head * (not cfg.tie_embeddings)) * last
