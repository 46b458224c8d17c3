"""Pipeline parallelism: schedules as data (schedules.py), their timelines (simulate.py).

    from minipar import pipeline
    plan = pipeline.schedule("1f1b", stages=4, microbatches=8)  # [Action("F", 0, 0), ...] a rank
    pipeline.check(plan, 4, 8)                                  # ValueError if it cannot run
    tl = pipeline.simulate(plan, 4, 8, cost={"F": 1, "B": 2})   # tl.bubble, tl.peak_in_flight
    pipeline.to_chrome_trace(tl, "1f1b.json")                   # or lessons.viz_pipeline.gantt(tl)
"""
from minipar.pipeline.schedules import (SCHEDULES, Action, cached_schedule, check, gpipe, inputs,
                                        interleaved_1f1b, one_f_one_b, rank_of, replay, schedule,
                                        stage_of, validate, zb_h1)
from minipar.pipeline.simulate import Replay, Timeline, replayed, simulate, to_chrome_trace

__all__ = ["SCHEDULES", "Action", "Replay", "Timeline", "cached_schedule", "check", "gpipe",
           "inputs", "interleaved_1f1b", "one_f_one_b", "rank_of", "replay", "replayed", "schedule",
           "simulate",
           "stage_of", "to_chrome_trace", "validate", "zb_h1"]
