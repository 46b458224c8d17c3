"""minipar's PipelineExecutor against torch.distributed.pipelining:
step time per schedule, fp32, gloo.

One launch per world size p runs every variant side by side in the same p worker processes. Each
variant builds its own copy of the same GPT (seed 0, the full single-device init, then cut with
`chunks_for_rank`: chunk k of p·v on rank k % p, Megatron's placement, which PyTorch's interleaved
schedules use too) and runs the same m micro-batches of the same batch, loss = mean over
micro-batches of `minipar.model.cross_entropy`. PyTorch's stages are `PipelineStage`s around the
very same `Chunk` modules (static shapes given), its schedules built
with that loss and scale_grads=True:

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
i.e. what its executor would reach with free communication. "busy":
the slowest rank's time inside actions.
"""
from __future__ import annotations

import sys
import time

import common  # bench/ is on sys.path
import torch
import torch.distributed as dist
from common import RESULTS, add_timing_arguments, main

import minipar
from minipar import data
from minipar.model import GPT, GPTConfig, cross_entropy
from minipar.pipeline import schedule
from minipar.pipeline.runtime import PipelineExecutor, chunks_for_rank, free_unused

DEFAULTS = dict(worlds=(2, 4), model="small-cpu", n_layer=8, microbatches=8, rows=2, reps=6,
                warmup=2,
                launches=2, threads=1)
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
        loss, events = self.pipe.step(xs, ys)
        self.events = [(tuple(a), s, e) for a, s, e in events]
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
            # static shapes; floats must require grad, or the stage
            # plans no gradient message for them
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
    """The single-device loss and gradients of the same step: mean
    over micro-batches, full model."""
    torch.manual_seed(0)
    model = GPT(cfg)
    loss = sum(cross_entropy(model(x), y) for x, y in zip(xs, ys)) / len(xs)
    loss.backward()
    return loss.item(), {name: p.grad for name, p in model.named_parameters()}


def worker(cfg: GPTConfig, rows: int, m: int, reps: int, warmup: int, threads: int) -> dict:
    """On every rank: {"step": {variant: [seconds]}, "events": {variant: [per-rep timeline]},
    "loss": {variant: first loss (last rank) or None}, "grad_diff": {variant: largest relative
    gradient difference with the reference on this rank}, "ref_loss",
    "errors": {variant: why it did not run}}."""
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
        except Exception as e:  # a schedule that cannot run here: reported
                                #   and skipped (it must fail
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

    run(args, out_dir) with parsed arguments (bench/run.py), or
    run(worlds=(2,), reps=4) from Python.
    """
    import pp_report as report  # here, not at the top: it reads PAIRS from this module

    s = common.settings(DEFAULTS, args, overrides)
    out_dir, since = common.start(out_dir)
    cfg = model_config(s)
    def run(world: int, _: int) -> list:  # one launch of `world` ranks
        return minipar.launch(worker, world, cfg, s["rows"], s["microbatches"], s["reps"],
                              s["warmup"], s["threads"], timeout=1800)

    launches = common.launch_rounds(s["worlds"], s["launches"], run)
    rows = [row for world, runs in launches.items() for row in report.summarise(world, runs, s)]
    checks = report.check_table(launches)
    md, ops = report.table(rows), report.op_table(launches)
    verdict = report.verdicts(rows)
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
        f"repetitions)\n\n{ops}\n\n{report.notes(rows, launches)}"
        f"![step time and bubble](pp.png)\n\n"
        f"{common.footer(s['threads'], since, command)}")
    report.plot(rows, s, out_dir / "pp.png")
    return f"{setup}\n\n{checks}\n\n{md}\n\n{verdict}\n\n{ops}\n\n{report.notes(rows, launches)}"


if __name__ == "__main__":  # python bench/pp.py [options], the same as python
                            #   bench/run.py pp [options]
    main(sys.modules[__name__])
