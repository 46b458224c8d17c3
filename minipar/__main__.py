"""Command line: `python -m minipar train ...` (see `python -m minipar train --help`).

Under torchrun (RANK and WORLD_SIZE set) the same command joins that job as one of its ranks.
"""
from __future__ import annotations

import argparse
import os
import sys

from minipar.config import PRECISIONS, RECOMPUTE, SCHEDULES, ParallelConfig
from minipar.data import SOURCES
from minipar.launch import torchrun_rank
from minipar.lessons.viz import loss_curve
from minipar.model import GPT, GPTConfig, sample
from minipar.planner import NoFeasiblePlan, explain, format_table, plan
from minipar.planner.cluster import Cluster
from minipar.train import train


def train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a GPT with a parallel layout",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    m = p.add_argument_group("model")
    m.add_argument("--model", default="tiny", choices=sorted(GPTConfig.PRESETS),
                   help="model preset")
    for name in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len"):
        m.add_argument(f"--{name.replace('_', '-')}", type=int,
                       help=f"override the preset's {name}")
    par = p.add_argument_group("layout (ParallelConfig)")
    for name in ("dp", "tp", "pp", "zero", "microbatches", "virtual_stages"):
        default = 0 if name == "zero" else 1
        par.add_argument(f"--{name.replace('_', '-')}", type=int, default=default)
    par.add_argument("--schedule", default="1f1b", choices=SCHEDULES)
    par.add_argument("--sequence-parallel", action="store_true")
    par.add_argument("--precision", default="fp32", choices=PRECISIONS)
    par.add_argument("--recompute", default="none", choices=RECOMPUTE)
    par.add_argument("--reduce-16bit", action="store_true",
                     help="bf16/fp16 under DP: all-reduce the 16-bit gradients instead of the fp32 "
                          "masters")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=300)
    t.add_argument("--global-batch", type=int, default=16)
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--weight-decay", type=float, default=0.0)
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--data", default="shakespeare", choices=SOURCES)
    t.add_argument("--backend", default="auto", choices=("auto", "gloo", "nccl"))
    t.add_argument("--save", help="checkpoint path, written at the end (and every --save-every "
                                  "steps)")
    t.add_argument("--save-every", type=int, default=0, help="steps between checkpoints (0: at the "
                                                             "end only)")
    t.add_argument("--resume", help="checkpoint to continue from, in any layout (--steps counts "
                                    "from the start)")
    t.add_argument("--plot", default="out/loss.png", help="where to save the loss curve ('' for "
                                                          "none)")
    t.add_argument("--sample", type=int, default=300, help="characters of text to generate at the "
                                                           "end (0: none)")
    return p


def run_train(args) -> None:
    overrides = {k: getattr(args, k)
                 for k in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len")
                 if getattr(args, k) is not None}
    cfg = GPTConfig.preset(args.model, **overrides)
    par = ParallelConfig(dp=args.dp, tp=args.tp, pp=args.pp, zero=args.zero,
                         microbatches=args.microbatches,
                         schedule=args.schedule, virtual_stages=args.virtual_stages,
                         sequence_parallel=args.sequence_parallel, precision=args.precision,
                         recompute=args.recompute, reduce_fp32=not args.reduce_16bit)
    leader = torchrun_rank() in (None, 0)  # alone, or rank 0 of a torchrun job
    if leader:
        print(f"model {args.model}: {cfg.num_params:,} parameters | layout: {par.label}")
    res = train(cfg, par, steps=args.steps, global_batch=args.global_batch, lr=args.lr,
                weight_decay=args.weight_decay, seed=args.seed, data=args.data,
                backend=args.backend,
                return_state=args.sample > 0, progress=leader, save=args.save,
                save_every=args.save_every,
                resume=args.resume)
    if not leader:
        return
    print(res.summary())
    predicted = res.predicted_memory or [{}] * len(res.peak_memory)
    print("memory per rank, MiB, measured (predicted by memory.predict):")
    for rank, (mem, pred) in enumerate(zip(res.peak_memory, predicted)):
        print(f"  rank {rank}: " + ", ".join(f"{k} {v / 2**20:.2f}" + (f" ({pred[k] / 2**20:.2f})"
                                                                       if k in pred else "")
                                            for k, v in mem.items()))
    if args.plot:
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        loss_curve({par.label: res.losses}).savefig(args.plot)
        print(f"loss curve saved to {args.plot}")
    if args.sample:
        model = GPT(cfg)
        model.load_state_dict(res.state_dict)
        print("--- sample ---\n" + sample(model, "ROMEO:", args.sample, seed=args.seed))


def plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="rank the layouts of a model on a cluster by predicted step "
                                    "time",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default="gpt2-xl", choices=sorted(GPTConfig.PRESETS),
                   help="model preset")
    for name in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len"):
        p.add_argument(f"--{name.replace('_', '-')}", type=int,
                       help=f"override the preset's {name}")
    p.add_argument("--cluster", default="dgx-h100", help="dgx-a100-80g, dgx-h100 or h200")
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--global-batch", type=int, default=512, help="sequences a step")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    return p


def run_plan(args) -> None:
    overrides = {k: getattr(args, k)
                 for k in ("n_layer", "n_head", "d_model", "vocab_size", "seq_len")
                 if getattr(args, k) is not None}
    cfg, cluster = GPTConfig.preset(args.model, **overrides), Cluster.preset(args.cluster,
                                                                             nodes=args.nodes)
    print(f"model {args.model}: {cfg.num_params / 1e9:.2f} B parameters | {cluster.world} GPUs "
          f"({args.cluster} "
          f"x {args.nodes}) | global batch {args.global_batch}")
    try:
        ranked = plan(cfg, cluster, args.global_batch, precision=args.precision)
    except NoFeasiblePlan as e:
        sys.exit(f"no layout fits: {e}")
    print(format_table(ranked, top=args.top))
    print(explain(ranked[:args.top]))


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m minipar", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    train_parser(sub)
    plan_parser(sub)
    args = parser.parse_args(argv)
    try:
        if args.command == "train":
            run_train(args)
        elif args.command == "plan":
            run_plan(args)
    except ValueError as err:  # a bad configuration: say what to change, no traceback
        sys.exit(f"error: {err}")


if __name__ == "__main__":
    main()
