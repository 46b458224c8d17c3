"""Checkpoints (checkpoint.py): resume in the same or another layout continues the same training;
a save killed half-way leaves the previous checkpoint whole; a wrong file is refused up front."""
import glob
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
from reference import assert_same_training

import minipar
from minipar import checkpoint
from minipar.config import ParallelConfig

TINY = minipar.GPTConfig.preset("tiny")
KW = dict(global_batch=8, lr=1e-3, weight_decay=0.1, seed=0)


@pytest.fixture(scope="module")
def uninterrupted():
    return minipar.train(TINY, ParallelConfig(), steps=4, return_state=True, **KW)


@pytest.fixture(scope="module")
def saved_3d(tmp_path_factory):
    """Two steps at dp2 tp2 pp2 with ZeRO-1 (8 ranks), saved."""
    path = str(tmp_path_factory.mktemp("ckpt") / "3d.pt")
    run = minipar.train(TINY, ParallelConfig(dp=2, tp=2, pp=2, zero=1, microbatches=2), steps=2, save=path, **KW)
    return path, run


def test_resume_in_the_same_layout_repeats_the_run_exactly(tmp_path, uninterrupted):
    path = str(tmp_path / "one.pt")
    first = minipar.train(TINY, ParallelConfig(), steps=2, save=path, **KW)
    rest = minipar.train(TINY, ParallelConfig(), steps=4, resume=path, return_state=True, **KW)
    assert first.losses + rest.losses == uninterrupted.losses  # bit for bit
    assert all((rest.state_dict[k] == v).all() for k, v in uninterrupted.state_dict.items())


@pytest.mark.parametrize("stage", [1, 3])
def test_zero_in_bf16_resumes_exactly(tmp_path, stage):
    """ZeRO keeps fp32 masters and moments in flat shards (ZeRO-3: one a unit): saved whole, cut again."""
    par, path = ParallelConfig(dp=2, zero=stage, precision="bf16"), str(tmp_path / "zero.pt")
    whole = minipar.train(TINY, par, steps=4, **KW)
    first = minipar.train(TINY, par, steps=2, save=path, **KW)
    rest = minipar.train(TINY, par, steps=4, resume=path, **KW)
    assert first.losses + rest.losses == whole.losses


@pytest.mark.parametrize("par", [ParallelConfig(tp=4, pp=2, microbatches=2), ParallelConfig(),
                                 ParallelConfig(dp=2, pp=2, microbatches=2, schedule="gpipe"),
                                 ParallelConfig(dp=4, zero=2), ParallelConfig(dp=2, zero=3)],
                         ids=lambda p: p.label)
def test_resume_in_another_layout_continues_the_same_training(par, saved_3d, uninterrupted):
    path, first = saved_3d
    assert first.losses == pytest.approx(uninterrupted.losses[:2], rel=1e-5)
    rest = minipar.train(TINY, par, steps=4, resume=path, return_state=True, **KW)
    expected = minipar.TrainResult(**{**uninterrupted.__dict__, "losses": uninterrupted.losses[2:]})
    assert_same_training(rest, expected)


def test_a_save_killed_half_way_leaves_the_previous_checkpoint(tmp_path):
    path = str(tmp_path / "c.pt")
    writer = subprocess.Popen([sys.executable, os.path.join(os.path.dirname(__file__), "checkpoint_writer.py"), path],
                              stdout=subprocess.PIPE, text=True)
    try:
        assert writer.stdout.readline().strip() == "saved"
        deadline = time.monotonic() + 60
        while not any(os.path.getsize(t) > 0 for t in glob.glob(path + ".tmp-*")):  # the big save has begun
            assert writer.poll() is None and time.monotonic() < deadline
            time.sleep(0.001)
        writer.send_signal(signal.SIGKILL)
    finally:
        writer.kill()
        writer.wait()
    assert glob.glob(path + ".tmp-*")  # the half-written file is left, beside the checkpoint
    assert checkpoint.load(path, TINY)["steps_done"] == 7  # the previous one, whole


def test_the_next_save_removes_what_a_killed_save_left(tmp_path):
    path = str(tmp_path / "c.pt")
    dead = subprocess.Popen(["true"])
    dead.wait()  # reaped: its pid names no process
    saving = subprocess.Popen(["sleep", "60"])  # stands for a concurrent save, alive
    try:
        stale, busy, other = (f"{path}.tmp-{dead.pid}", f"{path}.tmp-{saving.pid}",
                              f"{path}.tmp-notes")
        for tmp in (stale, busy, other):
            with open(tmp, "wb") as f:
                f.write(b"half a checkpoint")
        checkpoint.save({"steps_done": 1}, path)
        assert not os.path.exists(stale)  # its writer was killed: litter
        assert os.path.exists(busy) and os.path.exists(other)  # a live writer's; not a save's
        assert torch.load(path) == {"steps_done": 1}
    finally:
        saving.kill()
        saving.wait()


def test_wrong_files_are_refused_before_any_process(tmp_path, saved_3d):
    path, _ = saved_3d
    with pytest.raises(ValueError, match=r"holds another model: .* \{'n_layer': \(6, 4\)\}"):
        minipar.train(TINY.replace(n_layer=6), ParallelConfig(dp=2), steps=3, resume=path, **KW)
    garbage = tmp_path / "garbage.pt"
    garbage.write_bytes(b"not a checkpoint")
    with pytest.raises(ValueError, match="is not a readable minipar checkpoint"):
        minipar.train(TINY, ParallelConfig(dp=2), steps=3, resume=str(garbage), **KW)
    with pytest.raises(ValueError, match="no checkpoint at"):
        minipar.train(TINY, ParallelConfig(dp=2), steps=3, resume=str(tmp_path / "missing.pt"), **KW)
    with pytest.raises(ValueError, match="has 2 steps done already"):
        minipar.train(TINY, ParallelConfig(), steps=2, resume=path, **KW)


def test_save_and_resume_from_the_cli(tmp_path, capsys):
    from minipar.__main__ import main
    path = str(tmp_path / "cli.pt")
    common = ["--steps", "2", "--global-batch", "4", "--plot", "", "--sample", "0", "--data", "synthetic"]
    main(["train", "--tp", "2", "--save", path, *common])
    main(["train", "--pp", "2", "--microbatches", "2", "--resume", path, *common[:1], "3", *common[2:]])
    out, _ = capsys.readouterr()
    assert "in 1 steps" in out


STEPS = 8  # a preempted run's: room for the stop to land a step or two after the file appears


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """The uninterrupted run, with a stop file that never appears (the check changes nothing)."""
    folder = tmp_path_factory.mktemp("finished")
    return minipar.train(TINY, ParallelConfig(), steps=STEPS, return_state=True,
                         save=str(folder / "end.pt"), stop_file=str(folder / "never"), **KW)


def preempted(tmp_path, par: ParallelConfig, after: int = 2):
    """Train `par` towards STEPS steps, its stop file made once `after` steps are reported (on_step:
    the ranks may be a step further on by then); returns the run and its checkpoint's path. A rank
    that stopped alone would leave its peers waiting: the watchdog ends that in a minute, not 10."""
    stop, path, reported = tmp_path / "stop", str(tmp_path / "preempted.pt"), []

    def on_step(loss, tokens_per_s):
        reported.append(loss)
        if len(reported) == after:
            stop.touch()
    run = minipar.train(TINY, par, steps=STEPS, save=path, stop_file=str(stop), on_step=on_step,
                        timeout=60, **KW)
    return run, path


@pytest.mark.parametrize("first, then", [(ParallelConfig(dp=2), ParallelConfig()),
                                         (ParallelConfig(pp=2, microbatches=2), ParallelConfig(tp=2))],
                         ids=lambda p: p.label)
def test_a_preempted_run_resumed_in_another_layout_ends_as_the_uninterrupted_run(tmp_path, first,
                                                                                 then, finished):
    """Stopped by its file at a step boundary, saved there, resumed in another layout: the losses
    of both parts and the final weights are the uninterrupted run's."""
    stopped, path = preempted(tmp_path, first)
    assert 2 <= stopped.preempted < STEPS and len(stopped.losses) == stopped.preempted
    assert checkpoint.load(path, TINY)["steps_done"] == stopped.preempted  # saved at the stop
    rest = minipar.train(TINY, then, steps=STEPS, resume=path, return_state=True, **KW)
    assert finished.preempted == 0 and rest.preempted == 0
    whole = minipar.TrainResult(**{**rest.__dict__, "losses": stopped.losses + rest.losses})
    assert_same_training(whole, finished)


def test_a_stop_file_needs_a_checkpoint_to_save():
    with pytest.raises(ValueError, match="stop_file needs save"):
        minipar.train(TINY, ParallelConfig(dp=2), steps=3, stop_file="stop", **KW)


def test_a_run_stopped_after_its_first_step_still_summarises(tmp_path):
    """Stopped before the step a Tracker watches (the second), a run has no step peak: its summary
    (what `minipar train` prints as it exits) reports the memory after a step instead."""
    stopped, _ = preempted(tmp_path, ParallelConfig(), after=1)
    assert stopped.preempted == 1 and stopped.step_peak == [{}]
    assert "memory after a step" in stopped.summary() and "stopped after step 1" in stopped.summary()
