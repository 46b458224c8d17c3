"""The scheduler for real: this machine's cores as a small cluster of slots, real training jobs
started, preempted and resumed as a policy decides, and the simulator's prediction of the same.

A machine is {kind: (slots, slowdown)}: `slots` cores of an accelerator kind emulated by the
throttle (a kind `slowdown` times slower sleeps that much longer after each compute: hardware.py's
throttle, `minipar train --slowdown`). Slot s is core s of the cores this process may use, kinds in
order. A job is `python -m minipar train` in its own process group, pinned to its slots' cores
(so a 1-slot job's rank gets 1 thread, a 2-slot job's 2 ranks 1 each), its layout the planner's best
for that kind and count on this machine (the CPU cost model, calibrated pinned to that many
cores: `machine_matrix`).

Each round (`round_s`) the policy sees the jobs present and returns {job: (kind, count)}, exactly
as in the simulator (policies.py). A job whose allocation changed is preempted: its stop file
appears, it finishes the step it is in, writes its checkpoint and exits (`train(stop_file=...)`);
then it starts again on its new slots, resuming the checkpoint in the layout planned for them
(checkpoints resume in any layout). A job that has not yet made its first step where it was put
owes its restart, as in the simulator: the policy leaves it its slots (a process cannot stop before
its first step). A job that finishes frees its slots at once; the policy fills them at the next
round, as the simulator does.

`run` returns what happened (`Measured`: each job's completion time, its segments, restarts, its
checkpoint). `simulated` replays the same trace, machine and policy in the simulator, with the
planner's rates and the start and stop costs measured here (`measure_costs`; or the run's own
start-ups, Measured.starts), so the two timelines can be laid side by side.
"""
from __future__ import annotations

import ctypes
import dataclasses
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field

from minipar.config import ParallelConfig
from minipar.scheduler import policies
from minipar.scheduler.simulate import simulate

LR, SEED = 1e-3, 0   # every job's learning rate and seed (the data: synthetic). At 3e-3 the tiny
                    # model amplifies summation order (gradient accumulation alone) to 2% of the
                    # loss by step 150; at 1e-3 every layout stays within 1e-5 of one process


def cores_of(machine: dict) -> dict:
    """{kind: [core ids]}: slots in kind order on the cores this process may use."""
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else \
        list(range(os.cpu_count() or 1))
    need = sum(slots for slots, _ in machine.values())
    if need > len(cores):
        raise ValueError(f"the machine has {need} slots and this process {len(cores)} cores: "
                         f"one slot a core")
    out, i = {}, 0
    for kind, (slots, slowdown) in machine.items():
        if not (isinstance(slots, int) and slots >= 1) or not slowdown >= 1:
            raise ValueError(f"kind {kind}: slots must be a positive integer and slowdown >= 1, "
                             f"got {slots!r}, {slowdown!r}")
        out[kind], i = cores[i:i + slots], i + slots
    return out


def _slots(machine: dict) -> dict:
    """{kind: slots}: the machine as the policies' capacity."""
    return {k: slots for k, (slots, _) in machine.items()}


def _in_order(machine: dict) -> list:
    """Every slot's core, kinds in order (a job of n slots probed or planned on the first n)."""
    return [c for cs in cores_of(machine).values() for c in cs]


def _pinned(cores):
    """A child's start: pinned to `cores`, and (Linux) killed when the runner dies, however it dies
    (its own workers follow it: launch's workers exit with their caller)."""
    def start():
        os.sched_setaffinity(0, cores)
        try:
            ctypes.CDLL(None).prctl(1, signal.SIGKILL)   # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    return start


def _plan_rows(request: dict) -> dict:
    """In a process pinned to `count` cores: {"model,batch": {kind: [step s, ParallelConfig]}}."""
    from minipar.model import GPTConfig
    from minipar.planner import NoFeasiblePlan, plan, this_machine
    from minipar.planner.calibrate import emulate
    count, machine = request["count"], this_machine(request["count"])
    out = {}
    for model, batch in request["types"]:
        for kind, slowdown in request["kinds"]:
            cluster = emulate(machine, [(kind, count, slowdown, machine.memory_per_gpu)])
            try:
                best = plan(GPTConfig.preset(model), cluster, batch, precision="fp32")[0]
                row = [best.step_time, dataclasses.asdict(best.par)]
            except NoFeasiblePlan:
                row = None
            out.setdefault(f"{model},{batch}", {})[kind] = row
    return out


def _plan_main() -> None:   # the pinned planner's entry: a JSON request on stdin, rows on stdout
    print(json.dumps(_plan_rows(json.loads(sys.stdin.read()))))


def machine_matrix(jobs, machine: dict) -> tuple[dict, dict]:
    """(rates {job: {(kind, count): steps/s}}, layouts {(job type, kind, count): ParallelConfig})
    from the planner on this machine, one process pinned to `count` cores for each count asked;
    each count's step time held to linear scaling from the smaller counts (`_held_to_linear`)."""
    cores = cores_of(machine)
    counts = sorted({n for j in jobs for n in j.counts if any(n <= len(c) for c in
                                                              cores.values())})
    first = _in_order(machine)
    types = sorted({j.kind for j in jobs})
    layouts, steps = {}, {}
    for n in counts:
        kinds = [(k, machine[k][1]) for k in machine if machine[k][0] >= n]
        request = json.dumps({"count": n, "types": types, "kinds": kinds})
        done = subprocess.run([sys.executable, "-c", "from minipar.scheduler.runner import "
                               "_plan_main; _plan_main()"], input=request, text=True,
                              capture_output=True, preexec_fn=_pinned(first[:n]), check=False)
        if done.returncode:
            raise RuntimeError(f"planning on {n} cores failed:\n{done.stderr[-2000:]}")
        for key, row in json.loads(done.stdout.strip().splitlines()[-1]).items():
            model, batch = key.split(",")
            for kind, got in row.items():
                if got:
                    steps[((model, int(batch)), kind, n)] = got[0]
                    layouts[((model, int(batch)), kind, n)] = ParallelConfig(**got[1])
    steps = _held_to_linear(steps)
    rates = {j.name: {(k, n): 1.0 / steps[(j.kind, k, n)] for k in machine for n in j.counts
                      if (j.kind, k, n) in steps} for j in jobs}
    return rates, layouts


def _held_to_linear(steps: dict) -> dict:
    """{(job type, kind, n): step s} with each step time on n cores held to at least m/n of the
    time on m < n cores. Each count's plan rests on its own calibration (pinned to that many cores,
    at its own moment), and their noise (up to 30% here) can put a 2-core plan above twice the
    1-core one: no layout runs faster than linearly in its cores, and a policy would rotate jobs to
    chase the gain."""
    out = {}
    for (job_type, kind, n), t in sorted(steps.items(), key=lambda item: item[0][2]):
        fewer = [out[(job_type, kind, m)] * m / n for m in range(1, n)
                 if (job_type, kind, m) in out]
        out[(job_type, kind, n)] = max([t, *fewer])
    return out


def command(job, par: ParallelConfig, slowdown: float, folder: str, resume: bool) -> list:
    """The `minipar train` command line of `job` in layout `par`, its files under `folder`."""
    model, batch = job.kind
    flags = dict(model=model, steps=job.steps, global_batch=batch, lr=LR, seed=SEED,
                 data="synthetic", eval_every=0, sample=0, plot="", slowdown=slowdown,
                 dp=par.dp, tp=par.tp, pp=par.pp, zero=par.zero, microbatches=par.microbatches,
                 virtual_stages=par.virtual_stages, precision=par.precision,
                 recompute=par.recompute, save=f"{folder}/{job.name}.pt",
                 stop_file=f"{folder}/{job.name}.stop", metrics=f"{folder}/{job.name}.jsonl")
    if par.pp > 1:
        flags["schedule"] = par.schedule
    if resume:
        flags["resume"] = flags["save"]
    args = [sys.executable, "-m", "minipar", "train"]
    for name, value in flags.items():
        args += [f"--{name.replace('_', '-')}", str(value)]
    return args + ["--sequence-parallel"] * par.sequence_parallel


def measure_costs(machine: dict, model: str = "tiny", batch: int = 8, repeats: int = 2,
                  timeout: float = 120.0) -> dict:
    """{slots: (start s, stop s)} of a job here on that many cores: a probe job started (its wall
    time to the end of its first step, less the step: the process, imports, workers, data), then
    stopped by its stop file (the seconds to its exit: the step it is in, its checkpoint, its
    processes gone). Per count the machine's kinds can hold (1 and the most), the fastest of
    `repeats` probes (the first may read files no process has read yet); a probe that fails or
    outlasts `timeout` s is an error, and leaves no process behind."""
    counts = sorted({1, max(s for s, _ in machine.values())})
    return {n: tuple(map(min, zip(*(_probe(machine, n, model, batch, timeout)
                                    for _ in range(repeats))))) for n in counts}


def _probe(machine: dict, n: int, model: str, batch: int, timeout: float) -> tuple:
    """One probe on n cores (`measure_costs`): (start s, stop s)."""
    from minipar.scheduler.jobs import Job
    first = _in_order(machine)
    with tempfile.TemporaryDirectory() as folder:
        job = Job("probe", model, batch, 10 ** 6, 0.0, n)
        t = time.monotonic()
        proc = subprocess.Popen(command(job, ParallelConfig(dp=n), 1.0, folder, False),
                                stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                                preexec_fn=_pinned(first[:n]), start_new_session=True)
        try:
            while not _metrics(folder, "probe") and proc.poll() is None and \
                    time.monotonic() - t < timeout:
                time.sleep(0.005)
            started = time.monotonic() - t
            stop = time.monotonic()
            open(f"{folder}/probe.stop", "w").close()
            if proc.wait(timeout=timeout):
                raise RuntimeError(f"the probe job on {n} cores failed")
            stopped = time.monotonic() - stop
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
        return started - _metrics(folder, "probe")[0]["step_time"], stopped


@dataclass
class Measured:
    jct: dict = field(default_factory=dict)        # {job: s from arrival to completion}
    finish: dict = field(default_factory=dict)     # {job: s from the trace's start}
    segments: list = field(default_factory=list)   # (job, kind, count, start, end, layout label)
    restarts: dict = field(default_factory=dict)
    checkpoints: dict = field(default_factory=dict)  # {job: its final checkpoint's path}
    rates: dict = field(default_factory=dict)      # {job: {(kind, count): steps/s measured}}:
                                                   #   1 / the median step of its segments there
    starts: dict = field(default_factory=dict)     # {(job, kind, count, first start): s from its
                                                   #   process's start to the start of its first
                                                   #   step (the step left out), median}


@dataclass
class _Running:
    proc: subprocess.Popen
    where: tuple
    cores: list
    start: float
    label: str
    first: int                 # steps done when it started
    fresh: bool                # no checkpoint to resume: the job's first start
    stopping: bool = False
    started: float | None = None   # s from its start to its first step's (once it made one)


def run(jobs, machine: dict, policy: str = "minipar", round_s: float = 2.0,
        folder: str | None = None, matrix=None, timeout: float = 600.0, **options) -> Measured:
    """Run `jobs` for real on `machine` under `policy` (module docstring); their checkpoints,
    metrics and logs go to `folder` (a new temporary one by default). matrix: machine_matrix's
    (rates, layouts), computed if not given."""
    if policy not in policies.POLICIES:
        raise ValueError(f"unknown policy {policy!r}; choose from {sorted(policies.POLICIES)}")
    cores = cores_of(machine)
    rates, layouts = matrix or machine_matrix(jobs, machine)
    caps = _slots(machine)
    folder = folder or tempfile.mkdtemp(prefix="minipar-schedule-")   # (kept: the jobs' files)
    stale = [f for j in jobs for f in os.listdir(folder) if f.split(".")[0] == j.name]
    if stale:
        raise ValueError(f"{folder} already holds {', '.join(sorted(stale))}: a job would resume "
                         f"an old checkpoint; give a new folder")
    pending, states = sorted(jobs, key=lambda j: j.arrival), {}
    free = {k: list(c) for k, c in cores.items()}
    running: dict[str, _Running] = {}
    out = Measured(restarts={j.name: 0 for j in jobs})
    t0, next_round = time.monotonic(), 0.0
    try:
        while len(out.finish) < len(jobs):
            now = time.monotonic() - t0
            if now > timeout:
                raise TimeoutError(f"the trace did not finish in {timeout} s")
            _first_steps(running, folder, now)
            for name, r in list(running.items()):   # exits: finished or preempted
                if r.proc.poll() is not None:
                    free[r.where[0]] += r.cores
                    del running[name]
                    _ended(states[name], r, folder, out, now)
            if now >= next_round:
                while pending and pending[0].arrival <= now:
                    job = pending.pop(0)
                    states[job.name] = policies.JobState(job)
                present = [s for n, s in states.items() if n not in out.finish]
                _owed(present, running)
                if present:
                    view = policies.Round(now, present, caps, rates, options)
                    alloc = policies.POLICIES[policy](view)
                    policies.check(view, alloc)
                    for s in present:
                        _decide(s, alloc.get(s.job.name), running, folder, out, round_s)
                next_round += round_s
            for s in states.values():   # starts whose slots are free
                name = s.job.name
                if s.current and name not in running and name not in out.finish and \
                        len(free[s.current[0]]) >= s.current[1]:
                    kind, n = s.current
                    mine, free[kind] = free[kind][:n], free[kind][n:]
                    par = layouts[(s.job.kind, kind, n)]
                    running[name] = _start(s, par, machine[kind][1], mine, folder, now)
            time.sleep(0.02)
    finally:
        for r in running.values():   # an error or an interrupt: nothing left behind
            os.killpg(r.proc.pid, signal.SIGKILL)
            r.proc.wait()
    out.rates = {n: {w: statistics.median(v) for w, v in by.items()} for n, by in out.rates.items()}
    out.starts = {key: statistics.median(v) for key, v in out.starts.items()}
    return out


def _ended(s, r: _Running, folder: str, out: Measured, now: float) -> None:
    """A job's process exited at `now`: its segment, its measured rate there, its completion."""
    name = s.job.name
    if r.proc.returncode:
        with open(f"{folder}/{name}.log") as f:
            raise RuntimeError(f"job {name} failed:\n{f.read()[-3000:]}")
    out.segments.append((name, *r.where, r.start, now, r.label))
    if r.started is not None:
        out.starts.setdefault((name, *r.where, r.fresh), []).append(r.started)
    lines = _metrics(folder, name)
    # its steps' times there, the first of each start left out (warm-up: not the rate it runs at)
    times = sorted(line["step_time"] for line in lines if line["step"] > r.first + 1)
    if times:
        out.rates.setdefault(name, {}).setdefault(r.where, []).append(1.0 / times[len(times) // 2])
    if lines and lines[-1]["step"] >= s.job.steps:
        out.finish[name], out.jct[name] = now, now - s.job.arrival
        out.checkpoints[name] = f"{folder}/{name}.pt"


def _first_steps(running: dict, folder: str, now: float) -> None:
    """A start's cost, once it made its first step: the time since it started less its steps."""
    for name, r in running.items():
        if r.started is not None:
            continue
        new = [line for line in _metrics(folder, name) if line["step"] > r.first]
        if new:
            r.started = now - r.start - sum(line["step_time"] for line in new)


def _owed(present: list, running: dict) -> None:
    """A job that has still to make its first step where it was put (waiting for its slots, or its
    process starting) owes its restart, as in the simulator: the policy lets it keep its slots."""
    for s in present:
        r = running.get(s.job.name)
        s.owed = float(s.current is not None and (r is None or r.stopping or r.started is None))


def _decide(s, where, running: dict, folder: str, out: Measured, round_s: float) -> None:
    """Apply one job's allocation for this round: a change stops its process (its stop file)."""
    r = running.get(s.job.name)
    if where != s.current and r and not r.stopping:
        open(f"{folder}/{s.job.name}.stop", "w").close()
        r.stopping = True
    out.restarts[s.job.name] += s.assign(where) == "restart"
    if where:
        s.attained += where[1] * round_s


def _start(s, par, slowdown: float, cores: list, folder: str, now: float) -> _Running:
    stop = f"{folder}/{s.job.name}.stop"
    if os.path.exists(stop):
        os.remove(stop)
    resume = os.path.exists(f"{folder}/{s.job.name}.pt")   # (written by its first stop)
    with open(f"{folder}/{s.job.name}.log", "a") as log:
        proc = subprocess.Popen(command(s.job, par, slowdown, folder, resume), stdout=log,
                                stderr=subprocess.STDOUT, preexec_fn=_pinned(cores),
                                start_new_session=True)
    lines = _metrics(folder, s.job.name)
    return _Running(proc, s.current, cores, now, par.label, lines[-1]["step"] if lines else 0,
                    not resume)


def _metrics(folder: str, name: str) -> list[dict]:
    """The lines of the job's metrics file so far (one a step; [] before the first)."""
    try:
        with open(f"{folder}/{name}.jsonl") as f:
            text = f.read()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines()[:text.count("\n")]]  # whole lines


def replayed(planned: dict, measured: Measured) -> dict:
    """The throughput matrix with the rates a real run measured in place of the planner's where it
    ran: the simulator's own accounting (rounds, starts, stops) checked apart from the planner's
    prediction of speed, which the host's noise moves (10-25% here). Give it to `simulated` as
    rates, with decide=planned: the policy must see what the run's policy saw."""
    return {job: {**row, **measured.rates.get(job, {})} for job, row in planned.items()}


def simulated(jobs, machine: dict, policy: str, round_s: float, rates: dict, costs: dict,
              starts: dict | None = None, **options):
    """The simulator's run of the same trace: `rates` (the planner's, or `replayed`; the policy
    decides on the planner's either way, as the run's did: pass decide=), each start and stop
    costing what `measure_costs` measured for its slots (the nearest count measured); `starts`
    (a run's Measured.starts, to replay it): each start as the run measured it where it has one.
    A start near a round's end decides the round a job is seen running in, so a replay of a run
    needs the run's own starts: a probe's start-up is not the next job's to a second here."""
    def cost(count: int) -> tuple:
        return costs[min(costs, key=lambda n: abs(n - count))]

    def restart(job, where, first) -> float:
        return (starts or {}).get((job.name, *where, first), cost(where[1])[0])
    caps = _slots(machine)
    return simulate(jobs, caps, policy, round_s, rates=rates, restart=restart,
                    stop=lambda job, where: cost(where[1])[1], **options)
