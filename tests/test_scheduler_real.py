"""The scheduler for real on this machine's two cores: `minipar train` jobs started, preempted,
resumed in another layout or on another (emulated) kind as a policy decides; each job's losses and
final weights those of its uninterrupted single-process run; each job's completion time the
simulator's, within 20%.

The simulator is judged twice. With the rates and start-ups the run measured (`runner.replayed`,
`Measured.starts`), it checks the simulator's accounting of rounds, starts, stops and completions
alone: asserted for every job.
With the planner's rates it is the prediction the lesson shows; the host's noise moves step times
10-25% between runs here, so that check is asserted when the measured rates are within 15% of the
planner's, and skipped (saying so) when the host ran the jobs slower or faster than that."""
import json

import pytest
import torch

import minipar
from minipar.scheduler import runner
from minipar.scheduler.jobs import Job
from tests.reference import flat, rel_diff

ROUND_S = 2.0
CORES = {"core": (2, 1.0)}                       # one kind: a job on 1 or 2 cores
KINDS = {"fast": (1, 1.0), "slow": (1, 2.0)}     # two kinds: the slow one throttled 2x


@pytest.fixture(scope="module")
def costs():
    return runner.measure_costs(CORES)


def uninterrupted(job):
    """The single-process run of `job` (its losses and final weights)."""
    return minipar.train(minipar.GPTConfig.preset(job.model), steps=job.steps,
                         global_batch=job.global_batch, lr=runner.LR, seed=runner.SEED,
                         data="synthetic", return_state=True)


def check_trace(jobs, machine, policy, costs, folder):
    """Run the trace for real; every job trained as one process would; the simulator's JCTs.
    Returns the Measured run."""
    matrix = runner.machine_matrix(jobs, machine)
    measured = runner.run(jobs, machine, policy, ROUND_S, folder=str(folder), matrix=matrix)
    for job in jobs:
        ref = uninterrupted(job)
        with open(f"{folder}/{job.name}.jsonl") as f:
            losses = [json.loads(line)["loss"] for line in f]
        assert len(losses) == job.steps   # every step once, across its segments
        assert max(abs(a - b) / b for a, b in zip(losses, ref.losses)) <= 1e-5, job.name
        saved = torch.load(measured.checkpoints[job.name], weights_only=True)["model"]
        assert rel_diff(flat(saved), flat(ref.state_dict)) <= 1e-5, job.name
    replay = runner.simulated(jobs, machine, policy, ROUND_S, runner.replayed(matrix[0], measured),
                              costs, starts=measured.starts, decide=matrix[0])
    planned = runner.simulated(jobs, machine, policy, ROUND_S, matrix[0], costs)
    for job in jobs:
        print(f"{job.name}: measured {measured.jct[job.name]:.2f} s, replayed "
              f"{replay.jct[job.name]:.2f} s, predicted {planned.jct[job.name]:.2f} s")
        assert replay.jct[job.name] == pytest.approx(measured.jct[job.name], rel=0.2), job.name
    off = {(j, w): r / matrix[0][j][w] for j, by in measured.rates.items() for w, r in by.items()}
    print("measured / planned rates:", {k: round(v, 2) for k, v in off.items()})
    return measured, planned, off


def prediction_holds(measured, planned, off):
    """The planner-rate simulation within 20% of every measured JCT; skipped on a noisy host."""
    if any(abs(v - 1) > 0.15 for v in off.values()):
        pytest.skip(f"the host ran the jobs at {min(off.values()):.2f}-{max(off.values()):.2f}x "
                    f"the planner's rates: the prediction is not judged on this run")
    for name, jct in measured.jct.items():
        assert planned.jct[name] == pytest.approx(jct, rel=0.2), name


def test_a_job_shrinks_and_grows_in_another_layout_and_trains_as_one_process(costs, tmp_path):
    # A alone takes both cores (dp2); B's arrival shrinks it to one (a single process), B's end
    # grows it back: two restarts, each resuming the checkpoint in the other layout. B accepts one
    # core only, so "one each" is minipar's choice at any two-core speed-up up to 2, and
    # machine_matrix holds it to 2 (calibrations here read 1.5-2.15; with B elastic too, its
    # fairness floor would hold it only below about 1.81)
    jobs = [Job("A", "tiny", 64, 120, 0.0, 1, (1, 2)), Job("B", "tiny", 64, 40, 5.0, 1)]
    measured, planned, off = check_trace(jobs, CORES, "minipar", costs, tmp_path)
    a = [(count, label) for name, _, count, _, _, label in measured.segments if name == "A"]
    assert [count for count, _ in a] == [2, 1, 2] and a[0][1] != a[1][1]
    assert measured.restarts == {"A": 2, "B": 0}
    prediction_holds(measured, planned, off)


def test_a_job_moves_to_a_faster_emulated_kind_and_trains_as_one_process(costs, tmp_path):
    # least attained service, arrival order within its first queue: A holds the fast core, B the
    # slow one (throttled 2x) until A ends, then B moves to the fast one (a restart)
    jobs = [Job("A", "tiny", 64, 40, 0.0, 1), Job("B", "tiny", 64, 60, 1.0, 1)]
    measured, planned, off = check_trace(jobs, KINDS, "las", costs, tmp_path)
    b = [kind for name, kind, *_ in measured.segments if name == "B"]
    assert b == ["slow", "fast"] and measured.restarts == {"A": 0, "B": 1}
    assert measured.rates["B"][("slow", 1)] < 0.7 * measured.rates["B"][("fast", 1)]
    prediction_holds(measured, planned, off)


def test_a_machine_of_more_slots_than_cores_is_refused():
    with pytest.raises(ValueError, match="slots"):
        runner.cores_of({"core": (64, 1.0)})
