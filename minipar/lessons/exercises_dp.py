"""Lesson 01's implement-it exercise and its grader (the style of `minipar.lessons.exercises`: a
right answer gets a short report, a wrong one an AssertionError that says what went wrong).

    backward_grads(cfg)      the exercise's input: (name, numel, bytes an element) of each
                             gradient, in the order minipar's buckets take them (model order
                             reversed: the order backward produces them)
    real_buckets(cfg, cap)   the buckets (lists of names) GradBuckets forms at that cap
    check_pack(pack)         lesson 01: pack gradients into buckets as GradBuckets does

The rule the learner must find in `data_parallel.split`: take the gradients in the order given,
add each to the current bucket, and start a new bucket first when the next gradient would take the
current one *past* `bucket_bytes` (a bucket may fill it exactly). So a gradient larger than the
cap ends up alone: the bucket before is closed for it, and the next one cannot join it. Reference
answer: `minipar.lessons.solutions.pack_buckets`.
"""
from __future__ import annotations

import torch

from minipar.data_parallel import DataParallelBucket
from minipar.model import GPT, GPTConfig


def _model(cfg) -> GPT:
    torch.manual_seed(0)
    return GPT(GPTConfig.preset(cfg) if isinstance(cfg, str) else cfg)


def backward_grads(cfg="tiny") -> list[tuple[str, int, int]]:
    """(name, elements, bytes an element) of each gradient of `cfg`'s GPT (fp32), model order
    reversed: the order minipar's buckets take them in, backward's."""
    return [(name, p.numel(), p.element_size())
            for name, p in reversed(list(_model(cfg).named_parameters()))]


def real_buckets(cfg, bucket_bytes: int) -> list[list[str]]:
    """The names in each bucket of a real `DataParallelBucket` at `bucket_bytes`, in the order
    the buckets are sent (built on a group of one: no processes, nothing sent)."""
    model = _model(cfg)
    names = {id(p): name for name, p in model.named_parameters()}
    sync = DataParallelBucket(model, None, bucket_bytes)
    try:
        return [[names[id(p)] for p in bucket.params] for bucket in sync.buckets]
    finally:
        sync.close()


def grader_caps(grads: list[tuple[str, int, int]]) -> dict[str, int]:
    """The bucket sizes (bytes) the grader tries, by what each tests: 0 (every gradient alone); a
    cap that the first four gradients fill exactly; one smaller than the largest gradient; 0.1
    MiB (the lesson's); and one above all the gradients together (a single bucket)."""
    sizes = [numel * nbytes for _, numel, nbytes in grads]
    return {"0: one bucket per gradient": 0,
            "filled exactly by the first four": sum(sizes[:4]),
            "below the largest gradient": max(sizes) * 3 // 4,
            "0.1 MiB": int(0.1 * 2**20),
            "above all of them": sum(sizes) + 1}


def _diagnose(got: list[list[str]], want: list[list[str]], grads, cap: int, what: str) -> str:
    """Why `got` is not `want`, at cap `cap`: the first rule it breaks."""
    size = {name: numel * nbytes for name, numel, nbytes in grads}
    at = f"at bucket_bytes = {cap:,} ({what})"
    flat, order = [n for b in got for n in b], [name for name, _, _ in grads]
    missing, extra = set(order) - set(flat), [n for n in flat if n not in size]
    if missing or extra or len(flat) != len(set(flat)):
        twice = sorted({n for n in flat if flat.count(n) > 1})
        return (f"{at}: every gradient must be in exactly one bucket; missing "
                f"{sorted(missing)[:3]}, unknown {extra[:3]}, more than once {twice[:3]}")
    if flat != order:
        if flat == order[::-1]:
            return (f"{at}: your buckets take the gradients in model (forward) order, starting "
                    f"with {flat[0]}; backward produces them in the order given, {order[0]} first, "
                    "and a bucket can only go on the wire once all of its gradients are in")
        k = next(i for i, (a, b) in enumerate(zip(flat, order)) if a != b)
        return (f"{at}: the gradients must stay in the order given: position {k} holds {flat[k]}, "
                f"expected {order[k]}")
    for k, bucket in enumerate(got):
        big = [n for n in bucket if size[n] > cap]
        if big and len(bucket) > 1:
            return (f"{at}: bucket {k} puts {big[0]} ({size[big[0]]:,} B, larger than the cap) "
                    f"with {len(bucket) - 1} other gradient(s); a gradient larger than the cap "
                    "must be alone in its bucket")
        total = sum(size[n] for n in bucket)
        if total > cap and len(bucket) > 1:
            return (f"{at}: bucket {k} holds {total:,} B in {len(bucket)} gradients, past the "
                    f"cap; start a new bucket when the next gradient would take this one past "
                    f"{cap:,} B")
        if k + 1 < len(got) and total + size[got[k + 1][0]] <= cap:
            nxt = got[k + 1][0]
            return (f"{at}: bucket {k} ({total:,} B) was closed too early: {nxt} "
                    f"({size[nxt]:,} B) still fits ({total + size[nxt]:,} <= {cap:,} B); a new "
                    "bucket starts only when the next gradient would take it past the cap")
    k = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
    return (f"{at}: {len(got)} buckets, GradBuckets forms {len(want)}; the first that differs, "
            f"bucket {k}: yours {got[k] if k < len(got) else None}, "
            f"GradBuckets' {want[k] if k < len(want) else None}")


def check_pack(pack, cfg="tiny") -> str:
    """Grade `pack(grads, bucket_bytes) -> [[names] per bucket]`: at each of `grader_caps`, on
    `cfg`'s GPT, its buckets must be the ones a real DataParallelBucket forms (`real_buckets`).
    Returns a report; raises AssertionError on the first cap where they differ, saying why."""
    grads = backward_grads(cfg)
    counts = []
    for what, cap in grader_caps(grads).items():
        got = pack(list(grads), cap)
        ok = isinstance(got, (list, tuple)) and all(isinstance(b, (list, tuple)) for b in got)
        got = [list(b) for b in got] if ok else got
        assert ok and all(isinstance(n, str) for b in got for n in b), (
            f"pack must return a list of buckets, each a list of names; got {type(got).__name__}")
        want = real_buckets(cfg, cap)
        if got != want:
            raise AssertionError(_diagnose(got, want, grads, cap, what))
        counts.append(f"{cap:,} B -> {len(want)}")
    return (f"pack correct: the buckets GradBuckets forms on {cfg} ({len(grads)} gradients) at "
            "every cap; buckets by cap: " + ", ".join(counts))
