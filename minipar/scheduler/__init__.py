"""Many training jobs on one shared cluster of mixed accelerators: traces, the throughput matrix
from minipar's planner, a discrete-event simulator with scheduling policies, and a runner that
schedules real `minipar.train` jobs on this machine's cores.

    jobs.py        Job, `generate` (Gavel's Philly-fitted distribution), `read_trace` (PAI, Philly)
    throughput.py  `throughput_matrix`: steps/s per job, kind and count, and the layout, planned
    policies.py    fifo, las, max-min, max-min-blind, max-throughput, minipar
    simulate.py    `simulate`: rounds, preemption with a restart cost, the metrics
    runner.py      `run`: the same policies deciding for real jobs on this machine's cores

    from minipar import scheduler
    jobs = scheduler.generate(n_jobs=50, jobs_per_hour=20, seed=0)
    result = scheduler.simulate(jobs, {"dgx-h100": 32, "dgx-a100-80g": 32}, policy="max-min")
    result.avg_jct, result.makespan, result.utilization
"""
from minipar.scheduler.jobs import TYPES, Job, generate, read_trace
from minipar.scheduler.policies import POLICIES
from minipar.scheduler.simulate import Result, simulate
from minipar.scheduler.throughput import capacity, layout, rate, throughput_matrix, to_gavel

__all__ = ["POLICIES", "TYPES", "Job", "Result", "capacity", "generate", "layout", "rate",
           "read_trace", "simulate", "throughput_matrix", "to_gavel"]
