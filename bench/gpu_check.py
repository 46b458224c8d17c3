"""The GPU check of the scale-up issue: gpt2-medium and gpt2-large,
bf16, one GPU, the full minipar path.

    python bench/gpu_check.py            # on a machine with one CUDA GPU (an H200 in the issue)

For each model: tokens/s, MFU against 989 TFLOP/s (the H100/H200 dense bf16 peak; model FLOPs, no
recomputation counted: docs/references.md), and peak memory: torch.cuda.max_memory_allocated beside
minipar's counted categories and memory.predict. It runs `minipar.train` exactly as a user would:
mixed precision with fp32 masters, fused SDPA attention, CUDA-event step times. Prints a Markdown
table for the README. Nothing here runs without a GPU.
"""
from __future__ import annotations

import argparse
import sys

import torch

import minipar

PEAK = 989e12


def check(model: str, global_batch: int, microbatches: int, steps: int) -> dict:
    cfg = minipar.GPTConfig.preset(model)
    par = minipar.ParallelConfig(precision="bf16", microbatches=microbatches)
    res = minipar.train(cfg, par, steps=steps, global_batch=global_batch, data="synthetic",
                        backend="nccl")
    # median after two warm-up steps
    step = sorted(res.step_times[2:])[len(res.step_times[2:]) // 2]
    mem, pred = res.peak_memory[0], res.predicted_memory[0]
    counted = sum(mem[c] for c in ("params", "grads", "optimizer", "activations", "comm"))
    return dict(model=model, b=global_batch // microbatches, m=microbatches,
                tokens_s=global_batch * cfg.seq_len / step,
                mfu=cfg.flops_per_token * global_batch * cfg.seq_len / step / PEAK,
                cuda_gib=mem["cuda_max_allocated"] / 2**30, counted_gib=counted / 2**30,
                predicted_gib=sum(pred.values()) / 2**30, loss=(res.losses[0], res.losses[-1]))


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--runs", nargs="+",
                   default=["gpt2-medium:16:1", "gpt2-large:16:1", "gpt2-large:32:2"],
                   help="model:global_batch:microbatches")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("no CUDA GPU here: this check runs on a GPU machine")
    print(f"device: {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print("| model | micro-batch | micro-batches | tokens/s | MFU | max allocated GiB | counted | "
          "predicted | loss |")
    print("|---|---|---|---|---|---|---|---|---|")
    for run in args.runs:
        model, batch, m = run.split(":")
        r = check(model, int(batch), int(m), args.steps)
        print(f"| {r['model']} | {r['b']} | {r['m']} | {r['tokens_s']:,.0f} | "
              f"{100 * r['mfu']:.1f}% | "
              f"{r['cuda_gib']:.1f} | {r['counted_gib']:.1f} | {r['predicted_gib']:.1f} | "
              f"{r['loss'][0]:.2f} -> {r['loss'][1]:.2f} |", flush=True)
