"""Command line: `minipar train | plan | schedule | sample | lessons` (or `python -m minipar ...`;
each takes --help).

  train    train a GPT in any layout on the bundled corpus, synthetic data or your own text
  plan     rank the layouts of a model on a GPU cluster by predicted step time
  schedule simulate many training jobs on a shared cluster under scheduling policies
  sample   generate text from a checkpoint
  lessons  copy the lesson notebooks into a folder

Under torchrun (RANK and WORLD_SIZE set) `train` joins that job as one of its ranks.
"""
from __future__ import annotations

import argparse
import importlib.metadata
import os
import shutil
import sys
import warnings

import torch

from minipar import checkpoint, hardware, preflight
from minipar import data as dataset
from minipar.config import CP_METHODS, PRECISIONS, RECOMPUTE, SCHEDULES, ParallelConfig
from minipar.data import TOKENIZERS
from minipar.launch import WorkerError, WorkerTimeout
from minipar.server import torchrun_rank
from minipar.model import GPT, GPTConfig, sample
from minipar.planner import NoFeasiblePlan, explain, format_table, plan
from minipar.planner.cluster import Cluster
from minipar.planner.gpu_time import WHOSE
from minipar.scheduler import cli as schedule_cli
from minipar.precision import DTYPES
from minipar.train import NonFiniteLoss, train

BPE_VOCAB = 512  # --tokenizer bpe without --vocab-size: small enough for the CPU presets


SIZES = ("n_layer", "n_head", "n_kv_head", "d_model", "ffn_hidden", "vocab_size", "seq_len",
         "n_expert", "top_k")


class Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every flag's default after its help (none for a flag whose help says what its absence
    means), and descriptions printed as written."""

    def _get_help_string(self, action):
        return action.help if action.default is None else super()._get_help_string(action)


def model_arguments(p, default: str) -> None:
    """--model and the size overrides (train and plan)."""
    p.add_argument("--model", default=default, choices=sorted(GPTConfig.PRESETS),
                   help="model preset")
    for name in SIZES:
        p.add_argument(f"--{name.replace('_', '-')}", type=int,
                       help=f"override the preset's {name}")
    p.add_argument("--mlp", choices=("gelu", "swiglu"), help="override the preset's MLP "
                                                             "(with --n-expert: each expert's)")
    p.add_argument("--capacity-factor", type=float, help="with --n-expert: the token-slots an "
                                                         "expert takes, over its even share "
                                                         "(default: dropless)")
    p.add_argument("--tie-embeddings", action=argparse.BooleanOptionalAction,
                   help="override whether the head's weight is the token embedding's")


def model_of(args) -> tuple[GPTConfig, str]:
    """The model and how to name it: the preset, with the sizes that were overridden."""
    overrides = {k: getattr(args, k) for k in (*SIZES, "mlp", "tie_embeddings", "capacity_factor")
                 if getattr(args, k) is not None}
    name = args.model + "".join(f" {k}={v}" for k, v in overrides.items())
    return GPTConfig.preset(args.model, **overrides), name


def sequence_and_experts(par) -> None:
    """--cp, --cp-method and --ep (the layout's context and expert parallelism)."""
    par.add_argument("--cp", type=int, default=1,
                     help="context-parallel ranks: each sequence's tokens split over them")
    par.add_argument("--cp-method", default="ring", choices=CP_METHODS,
                     help="how attention reaches the other ranks' tokens (with --cp > 1)")
    par.add_argument("--ep", type=int, default=1,
                     help="expert-parallel ranks (with --n-expert): each MoE layer's experts cut "
                          "over that many of the data-parallel ranks")


def train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("train", help="train a GPT with a parallel layout",
                       formatter_class=Help)
    model_arguments(p.add_argument_group("model"), "tiny")
    par = p.add_argument_group("layout (ParallelConfig)")
    par.add_argument("--dp", type=int, help="data-parallel replicas (default: 1, or under "
                                            "torchrun what its world leaves after tp and pp)")
    par.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks per layer")
    par.add_argument("--pp", type=int, default=1, help="pipeline stages")
    par.add_argument("--zero", type=int, default=0, choices=(0, 1, 2, 3),
                     help="ZeRO stage over the data-parallel ranks")
    sequence_and_experts(par)
    par.add_argument("--microbatches", type=int, default=1,
                     help="per data-parallel rank: pipeline micro-batches, or accumulation steps")
    par.add_argument("--virtual-stages", type=int, default=1,
                     help="model chunks per pipeline rank (interleaved-1f1b)")
    par.add_argument("--schedule", choices=SCHEDULES,
                     help="pipeline schedule, with --pp > 1 (default: 1f1b)")
    par.add_argument("--sequence-parallel", action="store_true",
                     help="shard LayerNorm activations along the sequence (with --tp > 1)")
    par.add_argument("--precision", default="fp32", choices=PRECISIONS, help="number format")
    par.add_argument("--recompute", default="none", choices=RECOMPUTE,
                     help="activation recomputation")
    par.add_argument("--reduce-16bit", action="store_true",
                     help="bf16/fp16 under DP or ZeRO: accumulate and reduce 16-bit gradients "
                          "instead of fp32 ones (2 + 2 + 12 bytes a parameter, not 2 + 4 + 12)")
    t = p.add_argument_group("training")
    t.add_argument("--steps", type=int, default=300, help="optimizer steps, from the start")
    t.add_argument("--global-batch", type=int, default=16, help="sequences a step")
    t.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    t.add_argument("--warmup", type=int, default=0, help="steps of linear learning-rate warmup")
    t.add_argument("--decay", default="none", choices=("none", "cosine"),
                   help="learning-rate decay after warmup (cosine: to lr/10 at the last step)")
    t.add_argument("--weight-decay", type=float, default=0.0, help="AdamW's, on matrices")
    t.add_argument("--clip", type=float, default=0.0,
                   help="clip gradients to this global norm (0: no clipping)")
    t.add_argument("--seed", type=int, default=0, help="initialisation and data order")
    t.add_argument("--data", default="shakespeare",
                   help="'shakespeare' (bundled), 'synthetic', or a text file or folder of .txt")
    t.add_argument("--tokenizer", default="char", choices=TOKENIZERS,
                   help="char (96 symbols) or bpe (byte-level BPE trained on the data; "
                        f"vocabulary --vocab-size, default {BPE_VOCAB})")
    t.add_argument("--eval-every", type=int, default=100,
                   help="steps between validation losses on held-out data (0: none)")
    t.add_argument("--eval-batches", type=int, default=2,
                   help="held-out global batches each validation loss averages")
    t.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="cpu: gloo ranks; cuda: one GPU per rank, NCCL; auto: cuda if enough GPUs")
    t.add_argument("--slowdown", type=float, default=1.0,
                   help="every rank computes this many times slower (>= 1): a slower kind of "
                        "device, emulated by sleeping after each compute")
    t.add_argument("--timeout", type=float, default=600.0,
                   help="local ranks: stop the job when none makes progress for this long; "
                        "under torchrun: the limit of one collective")
    output_arguments(p.add_argument_group("output"))
    return p


def output_arguments(o) -> None:
    o.add_argument("--save", help="checkpoint path, written at the end (and every --save-every "
                                  "steps)")
    o.add_argument("--save-every", type=int, default=0,
                   help="steps between checkpoints (0: at the end only)")
    o.add_argument("--resume", help="checkpoint to continue from, in any layout (--steps counts "
                                    "from the start)")
    o.add_argument("--stop-file", help="preemption: when this file exists after a step, save the "
                                       "checkpoint to --save and stop (--resume continues)")
    o.add_argument("--metrics", help="JSON-lines file: one line of numbers per step")
    o.add_argument("--tensorboard", help="TensorBoard folder for the same numbers")
    o.add_argument("--plot", default="out/loss.png",
                   help="where to save the loss curve ('' for none)")
    o.add_argument("--sample", type=int, default=300,
                   help="tokens of text to generate at the end (0: none)")
    o.add_argument("--prompt", help="the sample's start (default: 'ROMEO:' for shakespeare, a "
                                    "newline for other text)")
    o.add_argument("--recalibrate-peak", action="store_true",
                   help="measure this CPU's matmul peak (MFU's denominator) again")


def layout_of(args) -> ParallelConfig:
    """The ParallelConfig the flags ask for; under torchrun --dp defaults to the world it leaves."""
    if args.schedule and args.pp == 1:
        raise ValueError(f"--schedule {args.schedule} needs --pp > 1 (one stage has no pipeline)")
    dp = args.dp
    world = int(os.environ["WORLD_SIZE"]) if torchrun_rank() is not None else None
    if dp is None:
        dp = world // (args.tp * args.pp * args.cp) if world else 1
        if world and dp * args.tp * args.pp * args.cp != world:
            raise ValueError(f"torchrun started {world} processes, which --tp {args.tp} x --pp "
                             f"{args.pp} x --cp {args.cp} does not divide: give --dp, --tp, --pp "
                             f"and --cp whose product is {world}")
    return ParallelConfig(dp=dp, tp=args.tp, pp=args.pp, zero=args.zero,
                          microbatches=args.microbatches, schedule=args.schedule or "1f1b",
                          virtual_stages=args.virtual_stages,
                          sequence_parallel=args.sequence_parallel, precision=args.precision,
                          recompute=args.recompute, reduce_fp32=not args.reduce_16bit,
                          cp=args.cp, cp_method=args.cp_method, ep=args.ep)


def run_train(args) -> None:
    if args.tokenizer == "bpe" and args.vocab_size is None:
        args.vocab_size = BPE_VOCAB
    cfg, name = model_of(args)
    par = layout_of(args)
    if args.sample < 0:
        raise ValueError(f"--sample must be >= 0 tokens, got {args.sample}")
    if args.save_every and not args.save:
        raise ValueError("--save-every needs --save (the checkpoint's path)")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ValueError("--device cuda: this machine has no GPU that torch can use")
    if args.prompt == "":
        raise ValueError("--prompt is empty: give some text to continue")
    preflight.check_writable(args.plot, "plot")
    leader = torchrun_rank() in (None, 0)  # alone, or rank 0 of a torchrun job
    if args.recalibrate_peak and leader:
        hardware.peak("cpu", DTYPES[par.precision], recalibrate=True)
    if leader:
        print(f"model {name}: {cfg.num_params:,} parameters | layout: {par.label}")
    backend = {"auto": "auto", "cpu": "gloo", "cuda": "nccl"}[args.device]
    res = train(cfg, par, steps=args.steps, global_batch=args.global_batch, lr=args.lr,
                weight_decay=args.weight_decay, seed=args.seed, data=args.data,
                tokenizer=args.tokenizer, backend=backend,
                return_state=args.sample > 0, progress=leader, save=args.save,
                save_every=args.save_every, resume=args.resume, clip=args.clip,
                warmup=args.warmup, decay=args.decay, eval_every=args.eval_every,
                eval_batches=args.eval_batches, metrics=args.metrics,
                tensorboard=args.tensorboard, timeout=args.timeout, slowdown=args.slowdown,
                stop_file=args.stop_file)
    if not leader:
        return
    print(res.summary())
    if res.preempted:
        print(f"checkpoint of {res.preempted} steps saved to {args.save}: --resume it to continue")
    print("memory per rank after the first step (states; activations at their most), MiB, "
          "measured (predicted by memory.predict" + ("; the experts' activations for an even "
                                                     "routing" if par.ep > 1 else "") + "):")
    for rank, (mem, pred) in enumerate(zip(res.peak_memory, res.predicted_memory)):
        print(f"  rank {rank}: " + ", ".join(f"{k} {v / 2**20:.2f}" + (f" ({pred[k] / 2**20:.2f})"
                                                                       if k in pred else "")
                                            for k, v in mem.items()))
    if args.plot:
        os.makedirs(os.path.dirname(args.plot) or ".", exist_ok=True)
        from minipar.lessons.viz import loss_curve   # matplotlib: only when a plot is asked
        loss_curve({par.label: res.losses}, val=res.val_losses).savefig(args.plot)
        print(f"loss curve saved to {args.plot}")
    data = res.data
    if args.sample and data.source == "synthetic":
        print("(no text sample: the synthetic data is numbers, not text)")
    elif args.sample:
        model = GPT(cfg)
        model.load_state_dict(res.state_dict)
        print("--- sample ---\n" + sample(model, prompt_for(data, args.prompt), args.sample,
                                         seed=args.seed, tokenizer=data))


def prompt_for(data, prompt: str | None) -> str:
    """The sample's start: the one asked for, else a speaker of the bundled plays, else a
    newline (the start of a line of the user's text)."""
    if prompt is not None:
        return prompt
    return "ROMEO:" if data.source == "shakespeare" else "\n"


def sample_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("sample", help="generate text from a checkpoint",
                       formatter_class=Help)
    p.add_argument("--checkpoint", required=True, help="a checkpoint written by train --save")
    p.add_argument("--prompt", help="the text to continue (default: as train --sample does)")
    p.add_argument("--tokens", type=int, default=300, help="tokens to generate")
    p.add_argument("--temperature", type=float, default=0.8, help="softmax temperature (> 0)")
    p.add_argument("--seed", type=int, default=0, help="the sampler's seed")
    return p


def run_sample(args) -> None:
    if args.tokens < 1:
        raise ValueError(f"--tokens must be >= 1, got {args.tokens}")
    if args.prompt == "":
        raise ValueError("--prompt is empty: give some text to continue")
    if not args.temperature > 0:
        raise ValueError(f"--temperature must be > 0, got {args.temperature}")
    saved = checkpoint.load(args.checkpoint)
    cfg = GPTConfig(**saved["config"])
    data = dataset.Dataset(**saved["data"]) if saved.get("data") else dataset.prepare("shakespeare")
    if data.source == "synthetic":
        raise ValueError(f"{args.checkpoint!r} was trained on synthetic numbers: there is no text "
                         "to sample")
    model = GPT(cfg)
    model.load_state_dict(saved["model"])
    print(sample(model, prompt_for(data, args.prompt), args.tokens, args.temperature, args.seed,
                 tokenizer=data))


def lessons_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("lessons", help="copy the lesson notebooks into a folder, to open with "
                                       "Jupyter",
                       formatter_class=Help)
    p.add_argument("folder", nargs="?", default="minipar-lessons", help="where to copy them")
    return p


def run_lessons(args) -> None:
    preflight.check_writable(args.folder, "lessons folder", folder=True)
    if os.path.isdir(args.folder) and os.listdir(args.folder):
        raise ValueError(f"{args.folder!r} exists and is not empty: choose a new folder")
    shutil.copytree(dataset.lessons_dir(), args.folder, ignore=shutil.ignore_patterns("__*"),
                    dirs_exist_ok=True)
    count = sum(name.endswith(".ipynb") for name in os.listdir(args.folder))
    print(f"{count} notebooks copied to {args.folder} (README.md: the map): "
          f"jupyter lab {args.folder}")


def plan_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser("plan", help="rank the layouts of a model on a cluster by predicted step "
                                    "time",
                       formatter_class=Help)
    model_arguments(p, "llama3-8b")
    p.add_argument("--cluster", default="dgx-h100", help=f"one of {', '.join(Cluster.PRESETS)}")
    p.add_argument("--nodes", type=int, default=1,
                   help="islands of the preset (an 8-GPU board, a whole TPU slice...)")
    p.add_argument("--overlap", default="minipar", choices=sorted(WHOSE),
                   help="whose overlaps and pipeline messages to time: minipar's code, "
                        "Megatron-LM's (production) or DeepSpeed's (Megatron-DeepSpeed's)")
    p.add_argument("--global-batch", type=int, default=512, help="sequences a step")
    p.add_argument("--precision", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--top", type=int, default=10, help="rows of the table")
    return p


def run_plan(args) -> None:
    (cfg, name), cluster = model_of(args), Cluster.preset(args.cluster, nodes=args.nodes)
    for field in ("top", "global_batch"):  # before the header: nothing printed for a bad request
        if getattr(args, field) < 1:
            raise ValueError(f"{field} must be a positive integer, got {getattr(args, field)}")
    print(f"model {name}: {cfg.num_params / 1e6:,.1f} M parameters | {cluster.world} GPUs "
          f"({args.cluster} x {args.nodes}; {cluster.usable:.0%} of each GPU's "
          f"{cluster.memory_per_gpu / 2**30:.0f} GiB usable) | global batch {args.global_batch} | "
          f"{WHOSE[args.overlap]} overlaps")
    try:
        ranked = plan(cfg, cluster, args.global_batch, precision=args.precision,
                      overlap=args.overlap)
    except NoFeasiblePlan as e:
        sys.exit(f"no layout fits: {e}")
    print(format_table(ranked, top=args.top))
    print(explain(ranked[:args.top]))


def main(argv=None) -> None:
    # the console script says `minipar`, `python -m minipar` says that
    prog = "python -m minipar" if sys.argv[0].endswith("__main__.py") else "minipar"
    parser = argparse.ArgumentParser(prog=prog, description=__doc__, formatter_class=Help)
    warnings.formatwarning = lambda message, *_, **__: f"warning: {message}\n"  # one line
    parser.add_argument("--version", action="version", version=f"minipar {version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    commands = {"train": run_train, "plan": run_plan, "sample": run_sample, "lessons": run_lessons,
                "schedule": schedule_cli.run}
    for make in (train_parser, plan_parser, sample_parser, lessons_parser):
        make(sub)
    schedule_cli.add_parser(sub, Help)
    args = parser.parse_args(argv)
    # what went wrong in one line, no traceback of ours: a bad configuration says what to change;
    # a rank's failure carries that rank's own traceback
    try:
        commands[args.command](args)
    except (ValueError, NonFiniteLoss, WorkerError, WorkerTimeout) as err:
        fail(f"error: {err}")
    except KeyboardInterrupt:  # launch has stopped every rank on its way out
        saved = getattr(args, "save", None)
        kept = saved and os.path.exists(saved)
        fail("interrupted: every rank stopped" + (f"; the last checkpoint written is {saved}"
                                                  if kept else ""), code=130)


def fail(message: str, code: int = 1) -> None:
    """Exit with `message` on stderr and a non-zero status; under torchrun every rank fails alike,
    so rank 0 alone says it."""
    if torchrun_rank() not in (None, 0):
        sys.exit(code)
    if code == 1:
        sys.exit(message)  # SystemExit(message): printed, status 1
    print(message, file=sys.stderr)
    sys.exit(code)


def version() -> str:
    try:
        return importlib.metadata.version("minipar")
    except importlib.metadata.PackageNotFoundError:  # run from a checkout that is not installed
        return "(not installed)"


if __name__ == "__main__":
    main()
