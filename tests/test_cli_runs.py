"""`python -m minipar train` as a process: past the launcher's old deadline, under torchrun, and
stopped by Ctrl-C or a killed rank: one line says what happened, nothing is left running."""
import os
import re
import signal
import socket
import subprocess
import sys
import time

import minipar
from minipar import GPTConfig, ParallelConfig

TINY = GPTConfig.preset("tiny")
QUIET = ["--plot", "", "--sample", "0", "--eval-every", "0", "--data", "synthetic"]


def minipar_cli(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "minipar", "train", *args], text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, **popen)


def children_of(pid: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout
    return [int(p) for p in out.split()]


def test_a_run_longer_than_the_timeout_goes_on_while_it_makes_progress():
    """timeout is a hang watchdog, not a limit on the job: a 2-rank run longer than it finishes,
    because every step tells the launcher it is alive (the old deadline would have stopped it)."""
    start = time.monotonic()
    res = minipar.train(TINY, ParallelConfig(dp=2), steps=400, global_batch=8, timeout=4.0)
    assert time.monotonic() - start > 4.0 and len(res.losses) == 400


def wait_for_steps(proc, lines: int = 2) -> None:
    """Until the run's progress bar has moved (stderr), so the ranks are training."""
    seen = ""
    while seen.count("it/s") < lines and proc.poll() is None:
        seen += proc.stderr.read(1)


def workers_of(pid: int) -> list[int]:
    """The ranks: children of the launcher's forkserver, itself a child of the launcher."""
    return [w for c in children_of(pid) for w in children_of(c)]


def test_ctrl_c_stops_every_rank_and_says_so_in_one_line():
    # its own session: Ctrl-C in a terminal signals the whole foreground group, ranks included. And
    # SIGINT at its default, as in a terminal: a test run started in the background (`make test &`)
    # hands its children SIGINT ignored, and a job that ignores Ctrl-C rightly goes on
    proc = minipar_cli("--dp", "2", "--steps", "100000", *QUIET, start_new_session=True,
                       preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    wait_for_steps(proc)
    workers = workers_of(proc.pid)
    assert len(workers) == 2
    os.killpg(proc.pid, signal.SIGINT)
    try:
        _, err = proc.communicate(timeout=30)
    except subprocess.TimeoutExpired as e:  # say what was still alive, and leave nothing behind
        alive = [p for p in [proc.pid, *workers] if os.path.exists(f"/proc/{p}")]
        os.killpg(proc.pid, signal.SIGKILL)
        tail = (e.stderr or b"").decode(errors="replace")[-1500:]
        raise AssertionError(f"no exit 30 s after Ctrl-C; alive: {alive}; stderr ends: {tail}") from None
    assert proc.returncode == 130
    assert "interrupted: every rank stopped" in err and "Traceback" not in err
    time.sleep(0.5)
    assert not [p for p in workers if os.path.exists(f"/proc/{p}")]


def test_a_killed_rank_ends_the_job_with_one_line_naming_it():
    proc = minipar_cli("--dp", "2", "--steps", "100000", *QUIET)
    wait_for_steps(proc)
    workers = workers_of(proc.pid)
    assert len(workers) == 2
    os.kill(workers[-1], signal.SIGKILL)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 1 and re.search(r"error: rank \d of 2 died", err), err[-2000:]
    assert "Traceback" not in err.split("error: rank")[0]  # none of the launcher's own
    time.sleep(0.5)
    assert not [p for p in workers if os.path.exists(f"/proc/{p}")]


def test_a_stop_file_preempts_a_pinned_slowed_run_which_saves_and_exits(tmp_path):
    """What a scheduler does: a 2-rank run pinned to one core and slowed 2x is preempted by its
    stop file; it saves the checkpoint of the steps done, says so, and exits 0."""
    stop, path = tmp_path / "stop", tmp_path / "job.pt"
    pinned = hasattr(os, "sched_setaffinity")
    core = {min(os.sched_getaffinity(0))} if pinned else None
    proc = minipar_cli("--dp", "2", "--steps", "100000", "--slowdown", "2", "--save", str(path),
                       "--stop-file", str(stop), *QUIET,
                       preexec_fn=(lambda: os.sched_setaffinity(0, core)) if pinned else None)
    wait_for_steps(proc)
    stop.touch()
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err[-2000:]
    steps = int(re.search(r"preempted: stopped after step (\d+)", out).group(1))
    assert f"checkpoint of {steps} steps saved to {path}" in out
    assert minipar.checkpoint.load(str(path), TINY)["steps_done"] == steps


def test_under_torchrun_dp_is_what_the_world_leaves_and_errors_come_once():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    torchrun = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                "--master-port", str(port), "-m", "minipar", "train"]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    ok = subprocess.run([*torchrun, "--steps", "2", "--global-batch", "4", *QUIET],
                        capture_output=True, text=True, env=env, timeout=120)
    assert ok.returncode == 0, ok.stderr[-2000:]
    assert "layout: dp=2" in ok.stdout
    bad = subprocess.run([*torchrun, "--steps", "2", "--lr", "-1", *QUIET], capture_output=True,
                         text=True, env=env, timeout=120)
    assert bad.returncode != 0 and bad.stderr.count("error: lr must be a positive number") == 1
