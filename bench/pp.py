"""minipar's PipelineExecutor against torch.distributed.pipelining: step time per schedule, fp32,
gloo.

One launch per world size p runs every variant side by side in the same p worker processes. Each
variant builds its own copy of the same GPT (seed 0, the full single-device init, then cut with
`chunks_for_rank`: chunk k of p·v on rank k % p, Megatron's placement, which PyTorch's interleaved
schedules use too) and runs the same m micro-batches of the same batch, loss = mean over
micro-batches of `minipar.model.cross_entropy`. PyTorch's stages are `PipelineStage`s around the
very same `Chunk` modules (static shapes given), its schedules built with that loss and
scale_grads=True:

  schedule          minipar (PipelineExecutor + schedules.schedule)   PyTorch
  gpipe             "gpipe"                                            ScheduleGPipe
  1f1b              "1f1b"                                             Schedule1F1B
  interleaved-1f1b  "interleaved-1f1b", v = 2                          ScheduleInterleaved1F1B, v =
                    2
  zb-h1             "zb-h1", v = 1
                    ScheduleInterleavedZeroBubble, v = 2
  zb-h1 (v = 1)     "zb-h1", v = 1
                    ScheduleInterleavedZeroBubble, v = 1

PyTorch has no plain ZB-H1: its zero-bubble schedule is the interleaved ZB1P of the same paper, with
v chunks per rank. At v = 2 (the row "zb-h1") it has half of ZB-H1's fill and drain but twice its
messages, so that row compares two different schedules; at v = 1 (the row "zb-h1 (v = 1)") it is the
closest PyTorch has to ZB-H1 (one chunk per rank, B and W split, Ws filling the drain), which makes
that row the comparison of the two executors' split backward.

A first, untimed step checks that the comparison is of one computation: on every rank the full model
runs the whole batch single-device (the reference); every variant's loss must equal it within 1e-5
and its gradients are compared parameter by parameter (largest relative norm of the difference, over
ranks). Then, after warm-up steps, a repetition runs one step of each variant (forward and backward
of every micro-batch; no optimizer: gradients are dropped with set-to-None after the step, on both
sides alike), each from a barrier, starting with a different variant each time; its time is the
slowest rank's. Times are medians over every repetition of every launch; "/ torch" is the median of
minipar/torch over repetitions run back to back, "per launch" its range launch by launch.

Bubbles. minipar's measured bubble is `Timeline.from_events` of the executor's own timeline (an
action starts when its inputs have arrived): idle / (p · step span). PyTorch's is measured the same
way around its stages' forward_one_chunk / backward_one_chunk / backward_weight_one_chunk (wrapped
with a timer; the loss is then outside F, and a receive is waited before the call). "sim F=B": the
simulated bubble of minipar's schedule with equal F and B costs per micro-batch and rank (B = W =
F/2 when split); "sim measured": the simulation with minipar's own median F, B, W times per chunk,
i.e. what its executor would reach with free communication. "busy": the slowest rank's time inside
actions.
"""
from __future__ import annotations

import statistics
import sys
import time

import common  # bench/ is on sys.path
import torch
import torch.distributed as dist
from common import RESULTS, add_timing_arguments, main

import minipar
from minipar import data
from minipar.lessons import demos
from minipar.model import GPT, GPTConfig, cross_entropy
from minipar.pipeline import Timeline, schedule, simulate
from minipar.pipeline.runtime import PipelineExecutor, chunks_for_rank, free_unused

DEFAULTS = dict(worlds=(2, 4), model="small-cpu", n_layer=8, microbatches=8, rows=2, reps=6,
                warmup=2,
                launches=2, threads=1)
GOAL = 1.10  # the goal: minipar's step within 1.10x of PyTorch's, for each schedule
LOSS_TOL = 1e-5
# row -> (minipar schedule, its v, PyTorch schedule class, its v)
PAIRS = {"gpipe": ("gpipe", 1, "ScheduleGPipe", 1),
         "1f1b": ("1f1b", 1, "Schedule1F1B", 1),
         "interleaved-1f1b": ("interleaved-1f1b", 2, "ScheduleInterleaved1F1B", 2),
         "zb-h1": ("zb-h1", 1, "ScheduleInterleavedZeroBubble", 2),
         "zb-h1 (v = 1)": ("zb-h1", 1, "ScheduleInterleavedZeroBubble", 1)}


def add_arguments(parser) -> None:
    parser.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULTS["worlds"]),
                        help="pipeline sizes p")
    parser.add_argument("--model", default=DEFAULTS["model"], help="GPTConfig preset")
    parser.add_argument("--n-layer", dest="n_layer", type=int, default=DEFAULTS["n_layer"],
                        help="override the preset's layers (at least 2·p for v = 2; 0: the "
                             "preset's)")
    parser.add_argument("--microbatches", type=int, default=DEFAULTS["microbatches"],
                        help="micro-batches m per step (a multiple of every p)")
    parser.add_argument("--rows", type=int, default=DEFAULTS["rows"], help="sequences per "
                                                                           "micro-batch")
    add_timing_arguments(parser, DEFAULTS)


def model_config(s: dict) -> GPTConfig:
    return GPTConfig.preset(s["model"], **({"n_layer": s["n_layer"]} if s["n_layer"] else {}))


def variants() -> list[str]:
    """"minipar/<schedule>" and "torch/<class> v=<v>", each once, in PAIRS' order."""
    names = []
    for ours, v, theirs, tv in PAIRS.values():
        for name in (f"minipar/{ours}" + (f" v={v}" if v > 1 else ""), f"torch/{theirs} v={tv}"):
            names += [name] if name not in names else []
    return names


def pair_names(row: str) -> tuple[str, str]:
    ours, v, theirs, tv = PAIRS[row]
    return f"minipar/{ours}" + (f" v={v}" if v > 1 else ""), f"torch/{theirs} v={tv}"


# ----------------------------------------------------------------------------- inside a worker


def _model(cfg: GPTConfig, v: int) -> tuple[GPT, dict]:
    torch.manual_seed(0)
    model = GPT(cfg)  # the full model on every rank, then cut, as minipar.train does
    chunks = chunks_for_rank(model, dist.get_world_size(), dist.get_rank(), v)
    free_unused(model, chunks.values())
    return model, chunks


class _Minipar:
    def __init__(self, name: str, cfg: GPTConfig, rows: int, m: int):
        v = int(name.partition(" v=")[2] or 1)
        self.plan = schedule(name.split("/")[1].split(" ")[0], dist.get_world_size(), m, v)
        self.model, chunks = _model(cfg, v)
        self.pipe = PipelineExecutor(chunks, self.plan, (rows, cfg.seq_len, cfg.d_model),
                                     loss_fn=cross_entropy)
        self.events = []

    def step(self, xs, ys) -> float:
        loss, timeline = self.pipe.step(xs, ys)
        self.events = [(tuple(a), s, e) for a, s, e in timeline]
        return loss


class _Torch:
    def __init__(self, name: str, cfg: GPTConfig, rows: int, m: int):
        from torch.distributed import pipelining

        cls_name, _, v = name.split("/")[1].partition(" v=")
        p, v = dist.get_world_size(), int(v)
        self.model, chunks = _model(cfg, v)
        n, h, s = p * v, cfg.d_model, cfg.seq_len
        self.first, self.last, self.events = 0 in chunks, n - 1 in chunks, []
        stages = []
        for k, chunk in sorted(chunks.items()):
            # static shapes; floats must require grad, or the stage plans no gradient message for
            # them
            x = torch.zeros(rows, s, dtype=torch.long) if k == 0 else \
                torch.zeros(rows, s, h, requires_grad=True)
            y = torch.zeros(rows, s, cfg.vocab_size if k == n - 1 else h, requires_grad=True)
            stages.append(self._timed(pipelining.PipelineStage(chunk, k, n, torch.device("cpu"), x,
                                                               y)))
        cls = getattr(pipelining, cls_name)
        multi = issubclass(cls, pipelining.schedules.PipelineScheduleMulti)
        self.schedule = cls(stages if multi else stages[0], m, loss_fn=cross_entropy,
                            scale_grads=True)

    def _timed(self, stage):
        """Record (op, stage, micro-batch, start, end) of every compute call of this stage."""
        def wrap(method, op_of):
            def timed(mb, *args, **kwargs):
                start = time.perf_counter()
                out = method(mb, *args, **kwargs)
                self.events.append(((op_of(kwargs), stage.stage_index, mb), start,
                                    time.perf_counter()))
                return out
            return timed
        stage.forward_one_chunk = wrap(stage.forward_one_chunk, lambda kw: "F")
        stage.backward_one_chunk = wrap(stage.backward_one_chunk, lambda kw: "B")
        stage.backward_weight_one_chunk = wrap(stage.backward_weight_one_chunk, lambda kw: "W")
        return stage

    def step(self, xs, ys) -> float:
        self.events, losses = [], []
        self.schedule.step(*([torch.cat(xs)] if self.first else []),
                           target=torch.cat(ys) if self.last else None,
                           losses=losses if self.last else None, return_outputs=False)
        return torch.stack(losses).mean().item() if self.last else 0.0


def _reference(cfg: GPTConfig, xs, ys) -> tuple[float, dict]:
    """The single-device loss and gradients of the same step: mean over micro-batches, full
    model."""
    torch.manual_seed(0)
    model = GPT(cfg)
    loss = sum(cross_entropy(model(x), y) for x, y in zip(xs, ys)) / len(xs)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def worker(cfg: GPTConfig, rows: int, m: int, reps: int, warmup: int, threads: int) -> dict:
    """On every rank: {"step": {variant: [seconds]}, "events": {variant: [per-rep timeline]},
    "loss": {variant: first loss (last rank) or None}, "grad_diff": {variant: largest relative
    gradient difference with the reference on this rank}, "ref_loss", "errors": {variant: why it did
    not run}}."""
    if threads:
        torch.set_num_threads(threads)
    x, y = data.global_batch("synthetic", 0, rows * m, cfg.seq_len, cfg.vocab_size)
    xs, ys = [data.shard(x, 0, 1, j, m) for j in range(m)], [data.shard(y, 0, 1, j, m)
                                                             for j in range(m)]
    ref_loss, ref_grads = _reference(cfg, xs, ys)
    runs, errors, first, grad_diff = {}, {}, {}, {}
    last = dist.get_world_size() - 1
    for name in variants():
        try:
            run = (_Minipar if name.startswith("minipar/") else _Torch)(name, cfg, rows, m)
            loss = run.step(xs, ys)
        except Exception as e:  # a schedule that cannot run here: reported and skipped (it must
                                #   fail
            # before a rank waits on a peer)
            errors[name] = " ".join(f"{type(e).__name__}: {e}".split())[:300]
        failed = torch.tensor([float(name in errors)])
        dist.all_reduce(failed)  # every rank skips it if any rank failed
        if failed.item():
            errors.setdefault(name, "failed on another rank")
            continue
        first[name] = loss if dist.get_rank() == last else None
        grad_diff[name] = max(((p.grad - ref_grads[n]).norm() / ref_grads[n].norm()).item()
                              for n, p in run.model.named_parameters())
        run.model.zero_grad(set_to_none=True)
        runs[name] = run
    names = list(runs)
    step, events = {n: [] for n in names}, {n: [] for n in names}
    for i in range(warmup + reps):
        k = i % len(names)
        for name in names[k:] + names[:k]:
            run = runs[name]
            dist.barrier()
            start = time.perf_counter()
            run.step(xs, ys)
            end = time.perf_counter()
            run.model.zero_grad(set_to_none=True)
            if i >= warmup:
                step[name].append(end - start)
                events[name].append(run.events)
    return dict(step=step, events=events, loss=first, grad_diff=grad_diff, ref_loss=ref_loss,
                errors=errors)


# ----------------------------------------------------------------------------- in the caller


def run(args=None, out_dir=RESULTS, **overrides) -> str:
    """Run the comparison; write pp.md and pp.png to out_dir; return the markdown table.

    run(args, out_dir) with parsed arguments (bench/run.py), or run(worlds=(2,), reps=4) from
    Python.
    """
    s = common.settings(DEFAULTS, args, overrides)
    out_dir, since = common.start(out_dir)
    cfg = model_config(s)
    def run(world: int, _: int) -> list:  # one launch of `world` ranks
        return minipar.launch(worker, world, cfg, s["rows"], s["microbatches"], s["reps"],
                              s["warmup"], s["threads"], timeout=1800)

    launches = common.launch_rounds(s["worlds"], s["launches"], run)
    rows = [row for world, runs in launches.items() for row in summarise(world, runs, s)]
    checks = check_table(launches)
    md, ops = table(rows), op_table(launches)
    verdict = "\n".join(f"Goal, minipar {r['row']} within {GOAL:.2f}x of PyTorch's step at p = "
                        f"{r['world']}: "
                        f"{'met' if r['ratio'] <= GOAL else 'NOT met'} (median ratio "
                        f"{r['ratio']:.2f})."
                        for r in rows if "ratio" in r)
    command = (f"python bench/run.py pp --worlds {' '.join(map(str, s['worlds']))} --model "
               f"{s['model']} "
               f"--n-layer {s['n_layer']} --microbatches {s['microbatches']} --rows {s['rows']} "
               f"--reps {s['reps']} "
               f"--warmup {s['warmup']} --launches {s['launches']} --threads {s['threads']}")
    setup = (f"Model `{s['model']}` with n_layer = {cfg.n_layer}: {cfg.num_params:,} parameters; m "
             "= "
             f"{s['microbatches']} micro-batches of {s['rows']} x {cfg.seq_len} tokens per step; "
             "activations "
             f"between chunks {s['rows']} x {cfg.seq_len} x {cfg.d_model} fp32 "
             f"({4 * s['rows'] * cfg.seq_len * cfg.d_model / 2**10:.0f} KiB a message).")
    (out_dir / "pp.md").write_text(
        "# pipeline parallel: minipar PipelineExecutor vs torch.distributed.pipelining (gloo), "
        "fp32\n\n"
        f"{__doc__.strip()}\n\n{setup}\n\n## Same computation\n\n{checks}\n\n## Step "
        f"time\n\n{md}\n\n{verdict}\n\n"
        "## Time per action (median, all ranks and "
        f"repetitions)\n\n{ops}\n\n{notes(rows, launches)}"
        f"![step time and bubble](pp.png)\n\n"
        f"{common.footer(s['threads'], since, command)}")
    plot(rows, s, out_dir / "pp.png")
    return f"{setup}\n\n{checks}\n\n{md}\n\n{verdict}\n\n{ops}\n\n{notes(rows, launches)}"


def _bubble_and_busy(by_rank: list[dict], name: str) -> tuple[list[float], list[float]]:
    """Per repetition: the measured bubble (all ranks' events on one clock) and the busiest rank's
    busy time."""
    out = ([], [])
    for rep in range(len(by_rank[0]["events"][name])):
        tl = Timeline.from_events([r["events"][name][rep] for r in by_rank])
        out[0].append(tl.bubble), out[1].append(max(tl.busy))
    return out


def _simulated(name: str, by_rank: list[dict], p: int, m: int) -> tuple[float, float]:
    """minipar's schedule simulated: (bubble with F = B per micro-batch and rank, bubble with its
    measured median F, B, W time per chunk)."""
    sched, _, v = name.split("/")[1].partition(" v=")
    v = int(v or 1)
    plan = schedule(sched, p, m, v)
    split = sched == "zb-h1"
    equal = {"F": 1 / v, "B": 0.5 / v, "W": 0.5 / v} if split else {"F": 1 / v, "B": 1 / v}
    times = {}
    for r in by_rank:
        for rep in r["events"][name]:
            for (op, c, _), t0, t1 in rep:
                times.setdefault((op, c), []).append(t1 - t0)
    measured = {op: [statistics.median(times[op, c]) for c in range(p * v)]
                for op in ("FBW" if split else "FB")}
    return (simulate(plan, p, m, v, cost=equal).bubble,
            simulate(plan, p, m, v, cost=measured).bubble)


def summarise(world: int, runs: list[list[dict]], s: dict) -> list[dict]:
    """One row per PAIRS entry from every launch (runs[launch][rank] = worker's result)."""
    slowest = [demos.slowest_rank(by_rank) for by_rank in runs]
    rows = []
    for row in PAIRS:
        ours, theirs = pair_names(row)
        out = dict(world=world, row=row, ours=ours, theirs=theirs)
        for side, name in (("ours", ours), ("theirs", theirs)):
            if name not in slowest[0]:
                out[f"{side}_error"] = runs[0][0]["errors"].get(name, "did not run")
                continue
            bubbles, busy = zip(*(_bubble_and_busy(by_rank, name) for by_rank in runs))
            out[f"{side}_step"] = statistics.median(t for launch in slowest for t in launch[name])
            out[f"{side}_bubble"] = statistics.median(b for launch in bubbles for b in launch)
            out[f"{side}_busy"] = statistics.median(b for launch in busy for b in launch)
        if "ours_step" in out and "theirs_step" in out:
            out |= common.ratios(slowest, ours,
                                 theirs) | dict(reps=sum(len(launch[ours]) for launch in slowest))
        if "ours_step" in out:
            out["sim_equal"], out["sim_measured"] = _simulated(ours, runs[0], world,
                                                               s["microbatches"])
        rows.append(out)
    return rows


def check_table(launches: dict) -> str:
    """The first step of every variant against the single-device reference (first launch)."""
    lines = ["| p | variant | first loss | reference loss | loss diff | grads: max rel. diff | "
             "same |",
             "|" + "---|" * 7]
    for world, runs in launches.items():
        by_rank = runs[0]
        ref = by_rank[0]["ref_loss"]
        for name in variants():
            if name in by_rank[0]["errors"]:
                lines.append(f"| {world} | {name} | did not run: {by_rank[0]['errors'][name]} | | "
                             "| | |")
                continue
            loss = by_rank[-1]["loss"][name]
            grad = max(r["grad_diff"][name] for r in by_rank)
            ok = abs(loss - ref) <= LOSS_TOL and grad <= 1e-4
            lines.append(f"| {world} | {name} | {loss:.7f} | {ref:.7f} | {abs(loss - ref):.1e} | "
                         f"{grad:.1e} "
                         f"| {'yes' if ok else '**NO**'} |")
    return "\n".join(lines)


def table(rows: list[dict]) -> str:
    ms = lambda r, k: f"{r[k] * 1e3:.1f}" if k in r else "—"  # noqa: E731
    pct = lambda r, k: f"{r[k]:.1%}" if k in r else "—"  # noqa: E731
    lines = ["| p | schedule | minipar (ms) | PyTorch (ms) | minipar / PyTorch | per launch | "
             "minipar busy (ms) "
             "| PyTorch busy (ms) | minipar bubble | sim F=B | sim measured | PyTorch bubble | "
             "reps |",
             "|" + "---|" * 13]
    for r in rows:
        ratio = f"**{r['ratio']:.2f}**" if "ratio" in r else "—"
        spread = f"{r['ratio_lo']:.2f}–{r['ratio_hi']:.2f}" if "ratio" in r else "—"
        lines.append(f"| {r['world']} | {r['row']} | {ms(r, 'ours_step')} | {ms(r, 'theirs_step')} "
                     f"| {ratio} "
                     f"| {spread} | {ms(r, 'ours_busy')} | {ms(r, 'theirs_busy')} | "
                     f"{pct(r, 'ours_bubble')} "
                     f"| {pct(r, 'sim_equal')} | {pct(r, 'sim_measured')} | "
                     f"{pct(r, 'theirs_bubble')} "
                     f"| {r.get('reps', '—')} |")
        for side in ("ours", "theirs"):
            if f"{side}_error" in r:
                lines.append(f"|  | ↳ {r[side]} did not run: {r[f'{side}_error']} |" + " |" * 11)
    return "\n".join(lines)


def op_times(runs: list[list[dict]], name: str) -> dict:
    """Median milliseconds of each op over every timed action of `name`, {(op, "first" | "rest"):
    ms}: chunk 0 apart, since both runtimes treat the first chunk's backward specially (it sends
    nothing)."""
    times = {}
    for by_rank in runs:
        for rank in by_rank:
            for rep in rank["events"].get(name, []):
                for (op, c, _), t0, t1 in rep:
                    times.setdefault((op, "first" if c == 0 else "rest"), []).append(t1 - t0)
    return {k: statistics.median(v) * 1e3 for k, v in times.items()}


def op_table(launches: dict) -> str:
    """Per world and variant: median F, B, W of chunk 0 and of the other chunks, and B + W."""
    lines = ["| p | variant | F (ms) | B chunk 0 | W chunk 0 | B + W chunk 0 | B other | W other | "
             "B + W other |",
             "|" + "---|" * 9]
    for world, runs in launches.items():
        for name in variants():
            if name not in runs[0][0]["step"]:
                continue
            t = op_times(runs, name)
            get = lambda op, where: t.get((op, where), 0.0)  # noqa: E731
            # noqa: E731
            cell = lambda op, where: f"{t[op, where]:.1f}" if (op, where) in t else "—"
            lines.append(f"| {world} | {name} | {get('F', 'rest'):.1f} | {cell('B', 'first')} | "
                         f"{cell('W', 'first')} "
                         f"| {get('B', 'first') + get('W', 'first'):.1f} | {cell('B', 'rest')} | "
                         f"{cell('W', 'rest')} "
                         f"| {get('B', 'rest') + get('W', 'rest'):.1f} |")
    return "\n".join(lines)


def notes(rows: list[dict], launches: dict) -> str:
    """What the tables say, read off them (numbers computed here, not typed in)."""
    out, doubled = [], False
    for world, runs in launches.items():
        ours, theirs = pair_names("zb-h1 (v = 1)")
        if ours not in runs[0][0]["step"] or theirs not in runs[0][0]["step"]:
            continue
        a, b = op_times(runs, ours), op_times(runs, theirs)
        w0, w = a.get(("W", "first"), 0.0), a.get(("W", "rest"), 0.0)
        doubled |= bool(w) and w0 / w > 1.5
        out.append(f"- p = {world}, zb-h1: minipar's chunk 0 costs B "
                   f"{a.get(('B', 'first'), 0):.1f} + W {w0:.1f} ms "
                   f"a micro-batch, PyTorch's B {b.get(('B', 'first'), 0):.1f} + W "
                   f"{b.get(('W', 'first'), 0):.1f} "
                   f"ms; minipar's W on chunk 0 is {w0 / w:.1f}x its W on the other chunks "
                   f"({w:.1f} ms), where the "
                   f"work is the same (the blocks' weight GEMMs; the embeddings' are tiny).")
    if not out:
        return ""
    if doubled:
        out.append("  A W that costs about twice the others re-runs the input-gradient path: "
                   "`_assign` sorts the "
                   "chunk's modules deepest first by `n.count('.') + 1`, which gives the Chunk "
                   "itself (name '') depth "
                   "1, the same as `tok_emb` / `pos_emb` / `ln_f` / `head`; the stable sort keeps "
                   "the Chunk first, so "
                   "it is assigned those parameters with the chunk's *output* as their y, and W's "
                   "backward from there "
                   "to `tok_emb.weight` goes back through all the chunk's blocks (their "
                   "input-gradient matmuls, "
                   "attention and GELU backward again). Depth 0 for the root (`n.count('.') + 1 if "
                   "n else 0`) gives "
                   "each embedding its own output.")
    return ("## Notes\n\n" + "\n".join(out) + "\n"
            "- PyTorch's zero-bubble stage 0 does nothing in B (no input needs a gradient) and "
            "runs its whole, "
            "unsplit backward in W (`backward_weight_one_chunk`: stage_index 0 takes the \"full\" "
            "path), so chunk 0 "
            "pays no split at all; minipar splits every chunk. On the other chunks the two split "
            "differently: "
            "minipar's B is one `autograd.grad` to the input and to every weight-owning module's "
            "output, its W one "
            "backward per module; PyTorch's B walks the autograd graph for the nodes where the "
            "weights join, hooks "
            "them, and its W differentiates from those nodes. Their cost beside the unsplit "
            "backward: the B + W "
            "columns against the 1f1b rows' B.\n"
            "- Busy time and bubbles are not measured at the same boundaries: minipar's F and B "
            "include posting "
            "their sends (a gloo isend writes to the socket in the caller's thread when the "
            "receive is already "
            "posted) and, on the last chunk, the loss; PyTorch's timer wraps its stage's compute "
            "calls only, and "
            "leaves its sends, the loss and the gradient scaling after the last backward in the "
            "idle time. The step "
            "time is the comparison; the bubbles say where each side waits. Four ranks on two "
            "cores share them, so "
            "p = 4 times include waiting for a core, not only for a message.\n\n")


def plot(rows: list[dict], s: dict, path) -> None:
    """Step time (minipar beside PyTorch) and bubble (measured beside simulated), by world and
    schedule."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    worlds = list(s["worlds"])
    fig, axes = plt.subplots(2, len(worlds), figsize=(6.5 * len(worlds), 7.5), squeeze=False)
    for col, world in enumerate(worlds):
        rs = [r for r in rows if r["world"] == world]
        x = np.arange(len(rs))
        for ax, keys, labels, unit in (
                (axes[0, col], ("ours_step", "theirs_step"), ("minipar", "PyTorch"), 1e3),
                (axes[1, col], ("ours_bubble", "sim_equal", "sim_measured", "theirs_bubble"),
                 ("minipar measured", "sim F=B", "sim, minipar's op times", "PyTorch measured"),
                 100)):
            width = 0.8 / len(keys)
            for i, (key, label) in enumerate(zip(keys, labels)):
                ax.bar(x + (i - (len(keys) - 1) / 2) * width, [r.get(key, 0) * unit for r in rs],
                       width, label=label)
            ax.set_xticks(x, [r["row"] for r in rs], fontsize=8)
            ax.margins(y=0.3)  # room for the legend above the bars
            ax.grid(axis="y", alpha=0.3)
            ax.legend(fontsize=7)
        axes[0, col].set(ylabel="step time (ms, median)", title=f"p = {world}: forward + backward "
                                                                "step")
        axes[1, col].set(ylabel="bubble (% of p x step)", title=f"p = {world}: bubble")
    fig.suptitle(f"minipar PipelineExecutor vs torch.distributed.pipelining: {s['model']} "
                 f"({s['n_layer']} layers), "
                 f"m = {s['microbatches']} x {s['rows']} rows, gloo")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


if __name__ == "__main__":  # python bench/pp.py [options], the same as python bench/run.py pp
                            #   [options]
    main(sys.modules[__name__])
