"""The step's peak memory per rank, measured (minipar.tracker, over the second step) beside
step_memory.predict_peak and the after-step tally (memory.predict), for ZeRO 0-3 in fp32 and bf16.

    python bench/step_memory.py --model tiny --dp 2 4 --global-batch 16

Memory is exact and deterministic (no timing): one launch per dp, every layout in it.
"""
from __future__ import annotations

import argparse

import minipar
from minipar import GPTConfig, ParallelConfig, memory
from minipar.lessons import demos
from minipar.step_memory import predict_peak

LAYOUTS = [(0, "bucketed"), (1, "naive"), (1, "bucketed"), (2, "naive"), (2, "bucketed"),
           (3, "bucketed")]
HELD = ("params", "grads", "optimizer", "activations", "comm")


def layouts(dp: int, bucket_mb: float) -> list[ParallelConfig]:
    return [ParallelConfig(dp=dp, zero=z, precision=p,
                           **({"dp_mode": "naive"} if mode == "naive" else
                              {"bucket_mb": bucket_mb} if z < 3 else {}))
            for p in ("fp32", "bf16") for z, mode in LAYOUTS]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="tiny")
    parser.add_argument("--dp", type=int, nargs="+", default=[2, 4])
    parser.add_argument("--global-batch", type=int, default=16)
    parser.add_argument("--bucket-mb", type=float, default=0.25)
    args = parser.parse_args(argv)
    cfg = GPTConfig.preset(args.model)
    print(f"{args.model}: {cfg.num_params:,} parameters, global batch {args.global_batch}, "
          f"buckets {args.bucket_mb} MiB; rank 0, KiB")
    print(f"{'dp':>3} {'precision':>9} {'zero':>4} {'dp_mode':>8} {'measured':>10} "
          f"{'predicted':>10} {'ratio':>7} {'phase':>9} {'tally':>10}")
    for dp in args.dp:
        cases = layouts(dp, args.bucket_mb)
        ranks = minipar.launch(demos.zero_memory, dp, cfg, cases, 2, args.global_batch,
                               timeout=600)
        for par, res in zip(cases, ranks[0]):
            held = res.step_memory["held"]
            measured = sum(held[c] for c in HELD)
            want = predict_peak(cfg, par, args.global_batch)
            predicted = sum(want[c] for c in HELD)
            tally = sum(memory.predict(cfg, par, args.global_batch).values())
            print(f"{dp:>3} {par.precision:>9} {par.zero:>4} {par.dp_mode:>8} "
                  f"{measured / 1024:>10,.1f} {predicted / 1024:>10,.1f} "
                  f"{measured / predicted:>7.4f} {held['phase']:>9} {tally / 1024:>10,.1f}")


if __name__ == "__main__":
    main()
