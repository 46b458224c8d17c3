"""Training jobs and traces of them: Gavel's generator and readers of the public trace formats.

A job is a model and a global batch (its type), a number of optimizer steps, an arrival time, the
accelerator count it asks for (`scale`) and the counts it accepts (`counts`: an elastic job may run
on fewer or more, in another layout). Traces say how long jobs ran, not how many steps: a duration
becomes steps at the job's rate on the reference kind at its scale (the throughput matrix), as
Gavel's simulator turns durations into steps on its reference V100.

generate: Gavel's Philly-fitted distribution (Narayanan et al. OSDI 2020, its simulator's
    generator): Poisson arrivals at `jobs_per_hour`; scale factor 1 / 2 / 4 / 8 with probability
    0.70 / 0.10 / 0.15 / 0.05; duration 10^U(1.5, 3) minutes with probability 0.8, else 10^U(3, 4);
    the job type uniform over TYPES (Gavel draws its job types uniformly too).
read_trace: a CSV with Alibaba PAI's task-table columns (cluster-trace-gpu-v2020,
    pai_task_table.csv: job_name, task_name, inst_num, status, start_time, end_time, plan_cpu,
    plan_mem, plan_gpu, gpu_type; plan_gpu 100 = one GPU a instance, times in seconds), or a JSON
    list in Microsoft Philly's cluster_job_log form (jobid, submitted_time, attempts[] with
    start_time, end_time and detail[].gpus; times "YYYY-MM-DD HH:MM:SS"). Neither names a model:
    each job gets a type drawn from TYPES with the reader's seed (as Gavel does for Philly jobs).
    data/traces/ holds a small made-up sample of each format.
"""
from __future__ import annotations

import csv
import datetime
import json
import math
import random
from dataclasses import dataclass

# (GPT preset, global batch): the kinds of training job a generated trace holds, GPT-2's four sizes
# (every one fits one 80 GiB GPU, so every scale factor runs each)
TYPES = (("gpt2-small", 64), ("gpt2-medium", 64), ("gpt2-large", 32), ("gpt2-xl", 32))
SCALES, SCALE_P = (1, 2, 4, 8), (0.70, 0.10, 0.15, 0.05)   # Gavel's Philly fit
REFERENCE = "dgx-a100-80g"   # durations are seconds on this kind at the job's scale


@dataclass(frozen=True)
class Job:
    name: str
    model: str            # a GPTConfig preset (or any name the throughput function knows)
    global_batch: int     # sequences a step
    steps: int            # optimizer steps to run
    arrival: float        # seconds from the trace's start
    scale: int            # accelerators it asks for (what fixed-size policies give it)
    counts: tuple = ()    # accelerator counts it accepts (elastic policies choose); () = (scale,)

    def __post_init__(self):
        if not (isinstance(self.steps, int) and self.steps >= 1):
            raise ValueError(f"job {self.name}: steps must be a positive integer, got "
                             f"{self.steps!r}")
        if not self.arrival >= 0:
            raise ValueError(f"job {self.name}: arrival must be >= 0 s, got {self.arrival!r}")
        counts = tuple(sorted(set(self.counts or (self.scale,))))
        if self.scale not in counts or counts[0] < 1:
            raise ValueError(f"job {self.name}: counts {counts} must be positive and hold its "
                             f"scale {self.scale}")
        object.__setattr__(self, "counts", counts)

    @property
    def kind(self) -> tuple:
        """The job's type: what its throughput depends on."""
        return self.model, self.global_batch

    @property
    def tokens(self) -> int:
        """Tokens it trains on: steps x global batch x the model's sequence length."""
        from minipar.model import GPTConfig
        return self.steps * self.global_batch * GPTConfig.preset(self.model).seq_len


def elastic(scale: int) -> tuple:
    """The counts an elastic job accepts: powers of two from 1 to twice its scale."""
    return tuple(1 << i for i in range(max(1, 2 * scale).bit_length()) if 1 << i <= 2 * scale)


def _duration(rng: random.Random) -> float:
    """Seconds: 10^U(1.5, 3) minutes with probability 0.8, else 10^U(3, 4) (Gavel's)."""
    low, high = (1.5, 3.0) if rng.random() < 0.8 else (3.0, 4.0)
    return 60.0 * 10 ** rng.uniform(low, high)


def generate(n_jobs: int = 50, jobs_per_hour: float = 20.0, seed: int = 0, types=TYPES,
             rate=None, reference: str = REFERENCE) -> list[Job]:
    """n_jobs jobs of Gavel's Philly-fitted distribution (module docstring), seeded. rate(job type,
    kind, count) -> steps/s turns each duration into steps on `reference` at the job's scale
    (default: the planner's, throughput.rate). Every job accepts `elastic(scale)` counts."""
    if not (isinstance(n_jobs, int) and n_jobs >= 1) or not jobs_per_hour > 0:
        raise ValueError(f"n_jobs must be a positive integer and jobs_per_hour positive, got "
                         f"{n_jobs!r}, {jobs_per_hour!r}")
    rate = rate or _planned_rate
    rng, t, jobs = random.Random(seed), 0.0, []
    for i in range(n_jobs):
        t += rng.expovariate(jobs_per_hour / 3600.0)
        scale = rng.choices(SCALES, SCALE_P)[0]
        duration, kind = _duration(rng), rng.choice(types)
        jobs.append(Job(f"job{i}", *kind, steps=_steps(duration, rate, kind, reference, scale),
                        arrival=t, scale=scale, counts=elastic(scale)))
    return jobs


def _steps(duration: float, rate, kind, reference: str, scale: int) -> int:
    """The steps a job of `kind` at `scale` runs in `duration` s on the reference kind."""
    steps_per_s = rate(kind, reference, scale)
    if not steps_per_s > 0:
        raise ValueError(f"{kind[0]} (batch {kind[1]}) does not run on {scale} x {reference}, the "
                         f"reference kind: its durations cannot become steps")
    return max(1, round(duration * steps_per_s))


def _planned_rate(kind, device: str, count: int) -> float:
    from minipar.scheduler.throughput import rate   # (the planner: imported when first needed)
    return rate(kind, device, count)


def _power_of_two(gpus: float) -> int:
    """A trace's GPU count as the power of two at or above it (1 at least; Gavel's scales)."""
    return 1 << max(0, math.ceil(math.log2(max(gpus, 1))))


def read_trace(path: str, seed: int = 0, types=TYPES, rate=None, reference: str = REFERENCE,
               limit: int | None = None) -> list[Job]:
    """The finished jobs of a PAI task-table CSV or a Philly job-log JSON (module docstring), as
    Jobs in arrival order, arrivals from the first; `limit`: the first that many."""
    try:
        rows = _philly(path) if str(path).endswith(".json") else _pai(path)
    except (KeyError, TypeError, AttributeError, ValueError) as e:   # a file of another form
        form = "a Philly job log (JSON)" if str(path).endswith(".json") else \
            "a PAI task table (CSV)"
        raise ValueError(f"{path}: not {form}: {type(e).__name__} {e}") from None
    rows.sort(key=lambda r: r[1])
    rows = rows[:limit] if limit else rows
    if not rows:
        raise ValueError(f"{path}: no finished job with a GPU and a positive duration")
    rng, rate, start = random.Random(seed), rate or _planned_rate, rows[0][1]
    jobs = []
    for name, submit, duration, gpus in rows:
        kind, scale = rng.choice(types), _power_of_two(gpus)
        jobs.append(Job(name, *kind, steps=_steps(duration, rate, kind, reference, scale),
                        arrival=submit - start, scale=scale, counts=elastic(scale)))
    return jobs


def _pai(path) -> list[tuple]:
    """(name, submit s, duration s, GPUs) of each terminated job with a GPU, its tasks summed."""
    jobs: dict[str, list] = {}
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = {"job_name", "inst_num", "status", "start_time", "end_time", "plan_gpu"} - \
            set(reader.fieldnames or ())
        if missing:
            raise KeyError(f"no column {', '.join(sorted(missing))}")
        for row in reader:
            if row["status"] != "Terminated" or not row["plan_gpu"] or not row["end_time"]:
                continue
            start, end = float(row["start_time"]), float(row["end_time"])
            gpus = int(row["inst_num"]) * float(row["plan_gpu"]) / 100.0
            if end > start and gpus > 0:
                job = jobs.setdefault(row["job_name"], [start, end, 0.0])
                job[0], job[1], job[2] = min(job[0], start), max(job[1], end), job[2] + gpus
    return [(name, s, e - s, g) for name, (s, e, g) in jobs.items()]


def _seconds(stamp: str) -> float:
    """Seconds of a Philly time stamp, read as UTC (any one zone will do: only differences count;
    the machine's own would move them across its daylight-saving changes)."""
    return datetime.datetime.strptime(stamp, "%Y-%m-%d %H:%M:%S").replace(
        tzinfo=datetime.timezone.utc).timestamp()


def _philly(path) -> list[tuple]:
    """(name, submit s, run s summed over attempts, GPUs of the last attempt) of each Pass job."""
    with open(path) as f:
        log = json.load(f)
    rows = []
    for job in log:
        tried = [a for a in job["attempts"] if a.get("start_time") and a.get("end_time")]
        if job["status"] != "Pass" or not tried:
            continue
        run = sum(_seconds(a["end_time"]) - _seconds(a["start_time"]) for a in tried)
        gpus = sum(len(d["gpus"]) for d in tried[-1]["detail"])
        if run > 0 and gpus > 0:
            rows.append((job["jobid"], _seconds(job["submitted_time"]), run, gpus))
    return rows
