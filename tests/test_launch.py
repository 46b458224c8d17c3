"""The launcher: results by rank, output echoed, the ways a job goes wrong, and scripts it refuses."""
import importlib.machinery
import os
import signal
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import workers_launch as w

import minipar
from minipar.launch import check_script, heartbeat


def alive(pid: int) -> bool:
    """True if pid runs (a zombie, dead but not yet reaped, counts as gone)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False


def pids(folder) -> list[int]:
    return [int(p.read_text()) for p in sorted(Path(folder).glob("*.pid"))]


def assert_all_gone(folder, expected: int, within: float = 5.0):
    found = pids(folder)
    assert len(found) == expected, f"only {len(found)} of {expected} ranks started"
    end = time.monotonic() + within
    while any(alive(p) for p in found) and time.monotonic() < end:
        time.sleep(0.1)
    assert not [p for p in found if alive(p)], "workers were left behind"


@pytest.mark.parametrize("world", [1, 3, 4])
def test_results_come_back_by_rank(world, capsys):
    results = minipar.launch(w.hello, world, 10)
    assert results == [(10 * r, float(sum(range(world)))) for r in range(world)]
    out = capsys.readouterr().out
    for r in range(world):
        assert f"[rank {r}] hello from rank {r} of {world}" in out
        assert f"[rank {r}] to stderr from rank {r}" in out


def test_gloo_on_cpu_and_threads_shared_between_ranks():
    results = minipar.launch(w.backend_and_threads, 4, backend="gloo")
    assert {b for b, _ in results} == {"gloo"}
    assert {t for _, t in results} == {max(1, len(os.sched_getaffinity(0)) // 4)}


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs two cores and CPU affinity (Linux)")
def test_a_caller_pinned_to_one_core_gives_its_ranks_that_core_and_one_thread():
    """A job pinned to one core (taskset, or as here os.sched_setaffinity) after the worker server
    started on every core: its ranks run on that core alone, one thread each (not cpu_count's)."""
    code = ("import os, multiprocessing.forkserver as f, minipar, workers_launch as w\n"
            "from minipar import server\n"
            "server.context(); f.ensure_running()\n"
            "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})\n"
            "print(minipar.launch(w.threads_and_cores, 1), min(os.sched_getaffinity(0)))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         cwd=Path(__file__).parent)
    *result, core = out.stdout.split(" ")
    assert " ".join(result) == f"[(1, [{core.strip()}])]", out.stderr


def test_ranks_that_do_no_collective_launch_on_a_busy_machine():
    """A rank whose fn does no collective returns at once: it must not exit while a slower rank is
    still connecting to it. Without the wait for every rank before exit, 2 ranks on a 2-core
    machine with 2 spinning processes per core failed 7 to 13 of these 80 launches (three runs, the
    machine busy otherwise too; 7 of 200 in bench/launch_stress.py --load 4); here none may. They
    take 15-20 s on a 2-core machine doing nothing else, 50-70 s when other jobs share it."""
    load, launches = 2 * (os.cpu_count() or 1), 80
    spinners = [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(load)]
    failures = []
    try:
        for _ in range(launches):
            try:
                minipar.launch(minipar.demos.hello, 2, on_line=lambda rank, line: True)
            except minipar.WorkerError as err:
                failures.append(str(err)[-500:])
    finally:
        for p in spinners:
            p.kill()
            p.wait()
    assert not failures, f"{len(failures)} of {launches} launches failed, the first: {failures[0]}"


def test_a_raising_rank_stops_the_job_with_its_traceback(tmp_path):
    start = time.monotonic()
    with pytest.raises(minipar.WorkerError) as err:
        minipar.launch(w.fail_on, 3, 1, tmp_path, timeout=60)
    assert time.monotonic() - start < 15, "the others were not stopped promptly"
    message = str(err.value)
    assert "rank 1 of 3 raised" in message
    assert "ValueError: rank 1 failed on purpose" in message and "fail_on" in message  # the traceback
    others = message.splitlines()[-1]  # what became of ranks 0 and 2: failed too, or stopped
    assert "0" in others and "2" in others and "1" not in others, others
    assert_all_gone(tmp_path, 3)


@pytest.mark.parametrize("failed,done,said", [
    ({1: 0}, {}, "ranks 0, 2 were stopped"),
    ({1: 0, 0: 1}, {}, "rank 0 failed too, not shown; rank 2 was stopped"),
    ({1: 0, 0: 1, 2: 2}, {}, "ranks 0, 2 failed too, not shown"),
    ({1: 0}, {0: None, 2: None}, "the others had finished")])
def test_the_error_says_what_became_of_the_other_ranks(failed, done, said):
    from minipar.launch import _the_others

    assert _the_others(1, failed, done, 3) == said


def test_a_failure_just_before_the_watchdog_is_still_the_cause(tmp_path):
    """A rank that raises within the failure's grace period before the watchdog fires: the job
    ends with its traceback, not with a timeout that drops it."""
    with pytest.raises(minipar.WorkerError, match="rank 1 of 2 raised") as err:
        minipar.launch(w.fail_just_before_the_watchdog, 2, 1, tmp_path, 3.0, timeout=3)
    assert "ValueError: rank 1 failed late" in str(err.value)
    assert_all_gone(tmp_path, 2)


@pytest.mark.parametrize("last_words", [None, "goodbye"])
def test_a_rank_that_dies_ends_the_job(tmp_path, last_words):
    with pytest.raises(minipar.WorkerError, match="(?s)rank 2 of 3 died.*exit code 3") as err:
        minipar.launch(w.die_on, 3, 2, tmp_path, last_words, timeout=60)
    hint = "the worker printed nothing: it may have failed while starting, see this terminal's stderr"
    if last_words:  # its last words, and no hint that it said nothing
        assert "its last output:\ngoodbye" in str(err.value) and hint not in str(err.value)
    else:
        assert hint in str(err.value)
    assert_all_gone(tmp_path, 3)


def test_a_rank_killed_by_a_signal_is_named_so(tmp_path):
    with pytest.raises(minipar.WorkerError, match="(?s)rank 1 of 2 died.*exit code -9 "
                                                  r"\(killed by SIGKILL\)"):
        minipar.launch(w.kill_self_on, 2, 1, tmp_path, timeout=60)
    assert_all_gone(tmp_path, 2)


def test_a_hanging_rank_ends_the_job_after_the_timeout(tmp_path):
    start = time.monotonic()
    with pytest.raises(minipar.WorkerTimeout) as err:
        minipar.launch(w.hang_on, 2, 0, tmp_path, timeout=3)
    assert 3 <= time.monotonic() - start < 12
    message = str(err.value)
    assert "no progress for 3 s" in message and "ranks [0, 1] were still running" in message
    assert "hang_on" in message  # each stuck rank's stack says where it was
    assert_all_gone(tmp_path, 2)


def test_timeout_is_a_watchdog_not_a_deadline(capfd):
    """A job three times longer than `timeout` that prints nothing but heartbeats finishes."""
    start = time.monotonic()
    assert minipar.launch(w.silent_but_alive, 2, 6.0, 0.2, timeout=2) == [0, 1]
    assert time.monotonic() - start >= 6
    out, err = capfd.readouterr()
    assert "heartbeat" not in out + err  # consumed by the caller, not echoed


def test_heartbeat_outside_a_launched_worker_does_nothing(capfd):
    heartbeat()
    assert capfd.readouterr() == ("", "")


def test_workers_exit_when_their_caller_is_killed(tmp_path):
    caller = subprocess.Popen([sys.executable, str(Path(__file__).parent / "caller_killed.py"), str(tmp_path)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    end = time.monotonic() + 60
    while len(pids(tmp_path)) < 2 and time.monotonic() < end:
        time.sleep(0.1)
    caller.send_signal(signal.SIGKILL)
    caller.wait()
    assert_all_gone(tmp_path, 2, within=10)


def test_bad_arguments_fail_before_any_process_starts():
    with pytest.raises(ValueError, match="world_size must be a positive integer"):
        minipar.launch(w.hello, 0, 1)
    with pytest.raises(ValueError, match="needs one GPU per rank"):
        minipar.launch(w.hello, 2, 1, backend="nccl")
    with pytest.raises(ValueError, match="backend must be"):
        minipar.launch(w.hello, 2, 1, backend="mpi")


def test_under_torchrun_it_joins_the_job(tmp_path):
    script = tmp_path / "job.py"
    script.write_text("import minipar, workers_launch\n"
                      "if __name__ == '__main__':\n"
                      "    print('RESULT', minipar.launch(workers_launch.hello, 2, 7))\n")
    # tests/ for the worker module, then the caller's path: this tree's minipar, not the installed one
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(Path(__file__).parent),
                                                                     os.environ.get("PYTHONPATH")]))}
    with socket.socket() as s:  # a free port for torchrun's rendezvous
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    out = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
                          "--master-addr", "127.0.0.1", "--master-port", str(port), str(script)],
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    # every rank gets every rank's result (the two ranks' prints may interleave)
    assert out.stdout.count("RESULT") == out.stdout.count("[(0, 1.0), (7, 1.0)]") == 2


# ----------------------------------------------------------------------------- the caller's script

README = "import minipar\n\nresults = minipar.launch(minipar.demos.hello, 3)\nprint(results)\n"
IN_GUARD = ("import minipar\n\nif __name__ == '__main__':\n    def work():\n        return 1\n\n"
            "    print(minipar.launch(work, 2))\n")
OUTSIDE = ("import minipar\n\nresults = minipar.launch(minipar.demos.hello, 2)\n\n"
           "if __name__ == '__main__':\n    print(results)\n")
RIGHT = ("import minipar\n\ndef work():\n    return 1\n\n"
         "if __name__ == '__main__':\n    print('RESULT', minipar.launch(work, 2))\n")


def run_script(folder, source: str) -> subprocess.CompletedProcess:
    (folder / "job.py").write_text(source)
    return subprocess.run([sys.executable, "job.py"], cwd=folder, capture_output=True, text=True,
                          timeout=120)


@pytest.mark.parametrize("source, message", [
    (README, 'job.py has no `if __name__ == "__main__":` block: worker processes re-import job.py; '
             'put the code that launches under `if __name__ == "__main__":`'),
    (IN_GUARD, "fn 'work' is defined inside `if __name__ == \"__main__\":` of job.py; workers "
               "re-import the script without running that block: define it at the top level (or in "
               "a module)"),
    (OUTSIDE, "job.py launches at line 3, outside `if __name__ == \"__main__\":`; worker processes "
              "re-import job.py and would launch again: move it under the guard"),
], ids=["the README without a guard", "fn inside the guard", "a launch outside the guard"])
def test_a_script_workers_cannot_import_fails_before_any_worker(tmp_path, source, message):
    out = run_script(tmp_path, source)
    assert out.returncode != 0
    assert out.stderr.strip().splitlines()[-1] == f"ValueError: {message}"
    assert "[rank" not in out.stdout + out.stderr  # no worker started


def test_a_guarded_script_launches(tmp_path):
    out = run_script(tmp_path, RIGHT)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "RESULT [1, 1]" in out.stdout


def fake_main(path=None, spec: str | None = None) -> types.ModuleType:
    """A `__main__` as python sets it: a script's has __file__, python -m's a __spec__ too."""
    main = types.ModuleType("__main__")
    if path is not None:
        main.__file__ = str(path)
    main.__spec__ = importlib.machinery.ModuleSpec(spec, None) if spec else None
    return main


def in_main():
    """A function that claims to be defined in __main__ (as a script's functions are)."""


in_main.__module__ = "__main__"


def test_callers_that_workers_can_import_pass(tmp_path):
    check_script(w.hello, fake_main())  # python -c, the REPL: nothing is re-run
    check_script(w.hello, fake_main(Path(sys.executable).parent / "pytest"))  # the pytest console script
    check_script(w.hello, fake_main(Path(pytest.__file__).parent / "__main__.py", "pytest.__main__"))
    module = tmp_path / "tool.py"  # python -m tool, guarded, fn at the top level or in the else
    module.write_text("def in_main(): pass\nif __name__ == '__main__':\n    pass\n")
    check_script(in_main, fake_main(module, "tool"))
    module.write_text("if __name__ == '__main__':\n    def in_main(): pass\nelse:\n    in_main = 1\n")
    check_script(in_main, fake_main(module))


def test_callers_that_workers_cannot_import_are_refused(tmp_path):
    with pytest.raises(ValueError, match="defined in a notebook or REPL"):
        check_script(in_main, fake_main())
    module = tmp_path / "tool.py"
    module.write_text("import minipar\nminipar.launch(print, 2)\n")
    with pytest.raises(ValueError, match="has no `if __name__"):  # python -m tool, no guard
        check_script(w.hello, fake_main(module, "tool"))
    with pytest.raises(ValueError, match="which workers do not import"):  # python -m package
        check_script(in_main, fake_main(tmp_path / "__main__.py", "pkg.__main__"))


def test_in_ipython_a_session_function_is_refused_and_a_module_one_passes():
    code = ("import workers_launch\nfrom minipar.launch import check_script\n"
            "check_script(workers_launch.hello)\nprint('MODULE OK')\ndef work(): pass\n"
            "check_script(work)\n")
    out = subprocess.run([sys.executable, "-m", "IPython", "--quick", "--colors=nocolor", "-c", code],
                         capture_output=True, text=True, timeout=120, cwd=Path(__file__).parent)
    assert "MODULE OK" in out.stdout
    assert "fn 'work' is defined in a notebook or REPL" in out.stdout + out.stderr


def test_the_first_optimizer_imports_nothing_the_forkserver_lacks():
    """A worker's first AdamW imported torch._dynamo (about 800 modules, ~1 s of CPU a rank) until
    the forkserver preloaded it."""
    for new in minipar.launch(w.first_optimizer_imports, 2, timeout=60):
        assert not [m for m in new if m.startswith(("torch._dynamo", "sympy"))], new[:10]


def test_prestart_starts_the_worker_server_in_the_background():
    """A fresh process: prestart returns at once (twice: idempotent) and the server is up seconds
    later without any launch (a broken prestart would leave none: its thread's exceptions do not
    reach the caller)."""
    code = ("import time, multiprocessing.forkserver as f, minipar\n"
            "t = time.perf_counter(); minipar.prestart(); minipar.prestart()\n"
            "returned = time.perf_counter() - t\n"
            "while f._forkserver._forkserver_pid is None and time.perf_counter() - t < 60:\n"
            "    time.sleep(0.05)\n"
            "print(returned, f._forkserver._forkserver_pid is not None)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    returned, up = out.stdout.split()
    assert float(returned) < 0.5 and up == "True", out.stderr


def test_import_minipar_leaves_torch_unimported_so_prestart_overlaps_it():
    """`import minipar` is lazy (PEP 562): prestart runs before this process imports torch, and
    `minipar.train` and `minipar.launch` stay the functions when their modules are imported."""
    code = ("import sys, minipar\n"
            "print('torch' in sys.modules)\n"
            "from minipar.lessons import demos_3d\n"
            "import minipar.launch\n"
            "print(callable(minipar.train), callable(minipar.launch), minipar.demos.__name__)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "True", "True", "minipar.lessons.demos"], out.stderr
