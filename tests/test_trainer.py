"""The trainer as a user drives it: the loop's knobs (warmup, cosine decay, clipping, validation),
the numbers it writes, and every mistake refused before any work can be lost."""
import json
import re
import math
import os
import sys

import pytest
import torch
from reference import assert_same_training

import minipar
from minipar import GPTConfig, ParallelConfig, checkpoint
from minipar.__main__ import main
from minipar.train import NonFiniteLoss, lr_at, train_layouts

TINY = GPTConfig.preset("tiny")
KW = dict(global_batch=8, data="synthetic")
CLI = ["--steps", "2", "--global-batch", "4", "--plot", "", "--sample", "0", "--eval-every", "0"]


def test_warmup_then_cosine_decay_to_a_tenth():
    rates = [lr_at(s, 1.0, steps=10, warmup=4, decay="cosine") for s in range(10)]
    assert rates[:4] == [0.25, 0.5, 0.75, 1.0]  # linear warmup, reaching lr at its last step
    assert rates[4:] == sorted(rates[4:], reverse=True) and math.isclose(rates[-1], 0.1)
    assert lr_at(7, 1.0, steps=10, warmup=4) == 1.0  # no decay: constant after warmup


def test_loop_knobs_equal_the_single_process_in_every_layout():
    """Clipping (active: the norm is above it every step), warmup + cosine and validation losses in
    DP (with ZeRO-3), TP and PP (interleaved) give the single process's losses, norms and weights."""
    knobs = dict(cfg=TINY, steps=4, lr=3e-3, clip=0.05, warmup=2, decay="cosine", eval_every=2,
                 return_state=True, **KW)
    ref = minipar.train(**knobs)
    assert min(ref.grad_norms) > 0.05 and len(ref.val_losses) == 2
    layouts = [ParallelConfig(dp=2, zero=3), ParallelConfig(tp=2),
               ParallelConfig(pp=2, microbatches=2, schedule="interleaved-1f1b", virtual_stages=2)]
    ranks = minipar.launch(train_layouts, 2, layouts, **{**knobs, "data": minipar.data.prepare(
        "synthetic")}, timeout=120)
    for i, par in enumerate(layouts):
        got = ranks[0][i]
        assert got.grad_norms == pytest.approx(ref.grad_norms, rel=1e-5), par.label
        assert [v for _, v in got.val_losses] == pytest.approx([v for _, v in ref.val_losses],
                                                               rel=1e-5), par.label
        assert_same_training(got, ref, lr=3e-3)


def test_a_loss_that_turns_nan_stops_the_run_and_says_so():
    with pytest.raises(NonFiniteLoss, match=r"the loss is nan at step \d+") as err:
        minipar.train(TINY, steps=200, lr=1e4, **KW)
    assert len(err.value.result.losses) < 200
    with pytest.raises(SystemExit, match="error: the loss is nan"):
        main(["train", "--lr", "10000", "--steps", "200", "--data", "synthetic", *CLI[2:]])


@pytest.mark.parametrize("flags, message", [
    (["--model", "gpt2-xl"], r"needs about \d+\.\d GiB .* this machine has"),
    (["--lr", "-1"], "lr must be a positive number"),
    (["--weight-decay", "-5"], "weight_decay must be a number >= 0"),
    (["--sample", "-5"], "--sample must be >= 0"),
    (["--vocab-size", "10"], "vocab"),
    (["--schedule", "zb-h1"], "--schedule zb-h1 needs --pp > 1"),
    (["--plot", "/proc/loss.png"], "plot '/proc/loss.png' cannot be written"),
    (["--plot", "README.md/loss.png"], "cannot be written"),
    (["--save", "/"], "save '/' is a directory"),
    (["--save", "/proc/x/ck.pt"], "cannot be written"),
    (["--data", "no/such/file.txt"], "no/such/file.txt"),
    (["--clip", "-1"], "clip must be a number >= 0"),
    (["--tensorboard", "tb", "--timeout", "0"], "timeout must be positive"),
])
def test_mistakes_are_refused_before_any_work(flags, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--dp", "2", *CLI, "--data", "shakespeare", *flags])
    assert exit_.value.code.startswith("error: ") and len(exit_.value.code.splitlines()) == 1
    assert re.search(message, exit_.value.code), exit_.value.code
    assert "[rank" not in capsys.readouterr().out  # no worker ever started


def test_metrics_go_to_json_lines_and_tensorboard(tmp_path):
    pytest.importorskip("tensorboard")
    path, board = tmp_path / "m.jsonl", tmp_path / "tb"
    res = minipar.train(TINY, steps=3, eval_every=2, clip=1.0, metrics=str(path),
                        tensorboard=str(board), **KW)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [line["step"] for line in lines] == [1, 2, 3]
    assert [line["loss"] for line in lines] == res.losses
    assert {"val_loss", "grad_norm", "tokens_per_s", "mfu", "step_time", "lr",
            "max_memory_mib"} <= set(lines[1])
    assert "val_loss" not in lines[0] and lines[2]["val_loss"] == res.val_losses[-1][1]
    assert any(name.startswith("events.out.tfevents") for name in os.listdir(board))


def test_resuming_refuses_other_data_and_warns_of_another_lr(tmp_path):
    path = str(tmp_path / "ck.pt")
    minipar.train(TINY, steps=2, save=path, seed=0, **KW)
    assert checkpoint.load(path)["run"]["global_batch"] == 8
    for change, field in (({"seed": 1}, "seed 0"), ({"global_batch": 4}, "global_batch 8"),
                          ({"data": "shakespeare"}, "data 'synthetic'")):
        with pytest.raises(ValueError, match=f"trained with {field}"):
            minipar.train(TINY, steps=3, resume=path, **{**KW, "seed": 0, **change})
    with pytest.warns(UserWarning, match="resuming with lr 0.002; the checkpoint was trained "
                                         "with 0.001"):
        minipar.train(TINY, steps=3, resume=path, lr=2e-3, **KW)


def test_fp16_resumes_exactly_with_its_loss_scale(tmp_path):
    path, fp16 = str(tmp_path / "ck.pt"), ParallelConfig(precision="fp16")
    whole = minipar.train(TINY, fp16, steps=4, return_state=True, **KW)
    minipar.train(TINY, fp16, steps=2, save=path, **KW)
    saved = checkpoint.load(path)["scaler"]
    saved["scale"] = 8.0  # a scale the fresh scaler would not have: the resume must take it
    ck = checkpoint.load(path)
    torch.save({**ck, "scaler": saved}, path)
    rest = minipar.train(TINY, fp16, steps=4, resume=path, return_state=True, **KW)
    assert rest.losses != whole.losses[2:]  # the loss scale travelled (a smaller scale rounds
    # the fp16 gradients differently)
    torch.save(ck, path)
    rest = minipar.train(TINY, fp16, steps=4, resume=path, return_state=True, **KW)
    assert rest.losses == whole.losses[2:]


def test_own_text_with_a_bpe_tokenizer_trains_and_samples(tmp_path, capsys):
    text = tmp_path / "notes.txt"
    text.write_text("the quick brown fox jumps over the lazy dog. " * 400)
    ck = str(tmp_path / "ck.pt")
    main(["train", "--data", str(text), "--tokenizer", "bpe", "--vocab-size", "300", "--steps",
          "3", "--global-batch", "4", "--seq-len", "16", "--plot", "", "--sample", "20",
          "--eval-every", "3", "--save", ck])
    out = capsys.readouterr().out
    assert "validation" in out and "--- sample ---" in out
    main(["sample", "--checkpoint", ck, "--prompt", "the quick", "--tokens", "5"])
    assert capsys.readouterr().out.startswith("the quick")


def test_synthetic_data_prints_no_text_sample(capsys):
    main(["train", "--data", "synthetic", "--steps", "1", "--global-batch", "4", "--plot", "",
          "--sample", "20"])
    out = capsys.readouterr().out
    assert "(no text sample: the synthetic data is numbers" in out and "ROMEO" not in out


def test_resuming_a_bpe_run_keeps_its_vocabulary(tmp_path):
    """Even when the text has changed since (a retrained BPE would give the ids other meanings)."""
    text, first, second = tmp_path / "t.txt", str(tmp_path / "a.pt"), str(tmp_path / "b.pt")
    text.write_text("a stitch in time saves nine. " * 300)
    common = ["train", "--data", str(text), "--tokenizer", "bpe", "--vocab-size", "300",
              "--seq-len", "16", "--global-batch", "4", "--plot", "", "--sample", "0",
              "--eval-every", "0"]
    main([*common, "--steps", "1", "--save", first])
    text.write_text(text.read_text() + "many hands make light work. " * 300)
    main([*common, "--steps", "2", "--resume", first, "--save", second])
    assert checkpoint.load(second)["data"]["vocab"] == checkpoint.load(first)["data"]["vocab"]


def test_the_cli_names_itself_shows_every_default_and_its_version(capsys):
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    help_text = capsys.readouterr().out
    for flag in ("--tp", "--pp", "--zero", "--microbatches", "--virtual-stages", "--clip",
                 "--warmup", "--timeout"):
        line = help_text[help_text.index(f"\n  {flag} ") + 1:].split("\n  -")[0]
        assert "default:" in line, flag
    with pytest.raises(SystemExit):
        main(["--version"])
    assert capsys.readouterr().out.startswith("minipar ")
    sys.argv[0], argv = "/usr/bin/minipar", sys.argv[0]
    try:
        with pytest.raises(SystemExit):
            main(["--help"])
        assert capsys.readouterr().out.startswith("usage: minipar ")
    finally:
        sys.argv[0] = argv


def test_lessons_are_copied_into_a_new_folder(tmp_path, capsys):
    main(["lessons", str(tmp_path / "lessons")])
    copied = sorted(p.name for p in (tmp_path / "lessons").iterdir())
    assert "00_collectives.ipynb" in copied and "08_explorer.ipynb" in copied
    assert f"jupyter lab {tmp_path / 'lessons'}" in capsys.readouterr().out
    with pytest.raises(SystemExit, match="exists and is not empty"):
        main(["lessons", str(tmp_path / "lessons")])
