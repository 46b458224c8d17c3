"""Side-by-side benchmarks: minipar's implementations against PyTorch's own, in one process tree.

    python bench/run.py                                   # every entry, default settings
    python bench/run.py allreduce --worlds 2 4 --sizes 4K 1M 64M

Each entry is a module here with `add_arguments(parser)` and `run(args, out_dir) -> str` (a markdown
table, also written to out_dir with its plots); register it in ENTRIES.
"""
import argparse
import pathlib
import sys

import allreduce  # bench/ is on sys.path (the script's folder), so workers import it by name too
import cp_ep
import ddp
import pp
import scheduler
import search
import tp
import zero

ENTRIES = {"allreduce": allreduce, "ddp": ddp, "zero": zero, "tp": tp, "pp": pp, "cp_ep": cp_ep,
           "search": search, "scheduler": scheduler}
RESULTS = pathlib.Path(__file__).resolve().parent / "results"


def main(argv: list[str]) -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="entry")
    for name, module in ENTRIES.items():
        module.add_arguments(sub.add_parser(name, help=module.__doc__.splitlines()[0]))
    args = parser.parse_args(argv)
    RESULTS.mkdir(exist_ok=True)
    names = [args.entry] if args.entry else list(ENTRIES)
    for name in names:
        entry_args = args if args.entry else parser.parse_args([name])
        print(f"## {name}\n", flush=True)
        print(ENTRIES[name].run(entry_args, RESULTS), "\n", flush=True)
    print(f"tables and plots in {RESULTS}")


if __name__ == "__main__":
    main(sys.argv[1:])
