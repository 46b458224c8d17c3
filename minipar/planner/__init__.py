"""The cost model and the planner: a layout's memory and step time on a described cluster, and
a search.

    cluster.py        the cluster as a value: GPU kinds, presets, links, mixed clusters (no I/O)
    gpu_time.py       what one GPU spends on its share of a step: compute, memory-bound kernels,
                      TP, PP, DP
    cpu_time.py       the same for local CPU ranks, from the model's own layer timed
    calibrate.py      this machine measured: its cores, gloo links and time-sharing, as a Cluster
    layer_profile.py  the model's own layer timed on this machine
    matmul_fit.py     gpu_time's matmul model fitted to this machine's measured matmuls
    predict.py        `estimate`: memory by category and the step time with its breakdown
    search.py         `plan` (every layout that fits, fastest first), `explain`, `format_table`,
                      `sweep` (one layout against one knob)
    published.py      published runs the model is checked against, and what each checks
"""
from minipar.planner.calibrate import this_machine
from minipar.planner.cluster import Cluster, GiB, Link
from minipar.planner.gpu_step import TERMS
from minipar.planner.predict import Estimate, estimate
from minipar.planner.search import NoFeasiblePlan, candidates, explain, format_table, plan, sweep

__all__ = ["GiB", "TERMS", "Cluster", "Estimate", "Link", "NoFeasiblePlan", "candidates",
           "estimate", "explain", "format_table", "plan", "sweep", "this_machine"]
