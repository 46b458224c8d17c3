"""Bad configurations fail with a ValueError that names the field and the rule, before any process."""
import pytest

import minipar
from minipar import GPTConfig, ParallelConfig

TINY = GPTConfig.preset("tiny")


@pytest.mark.parametrize("field,value,message", [
    ("dp", 0, "ParallelConfig.dp must be a positive integer, got 0"),
    ("tp", -2, "ParallelConfig.tp must be a positive integer, got -2"),
    ("pp", 1.5, "ParallelConfig.pp must be a positive integer, got 1.5"),
    ("dp", True, "ParallelConfig.dp must be a positive integer, got True"),
    ("microbatches", 0, "ParallelConfig.microbatches must be a positive integer"),
    ("virtual_stages", "2", "ParallelConfig.virtual_stages must be a positive integer"),
    ("zero", 4, "ParallelConfig.zero must be 0, 1, 2 or 3, got 4"),
    ("schedule", "pipedream", "ParallelConfig.schedule must be one of"),
    ("precision", "fp8", "ParallelConfig.precision must be one of"),
    ("recompute", "some", "ParallelConfig.recompute must be one of"),
    ("sequence_parallel", 1, "ParallelConfig.sequence_parallel must be True or False"),
])
def test_each_field_is_validated(field, value, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        ParallelConfig(**{field: value})


def test_zero3_refuses_a_split_backward():
    """ZeRO-3 with zb-h1 crashed in a worker (a LayerNorm's W found its unit's weights freed)."""
    with pytest.raises(ValueError, match="zero=3 does not combine with schedule='zb-h1'"):
        ParallelConfig(pp=2, zero=3, microbatches=2, schedule="zb-h1")
    ParallelConfig(pp=2, zero=2, microbatches=2, schedule="zb-h1")


def test_virtual_stages_need_the_interleaved_schedule():
    with pytest.raises(ValueError, match="virtual_stages=2 needs schedule='interleaved-1f1b'"):
        ParallelConfig(pp=2, virtual_stages=2, schedule="1f1b")
    ParallelConfig(pp=2, virtual_stages=2, schedule="interleaved-1f1b")


@pytest.mark.parametrize("par,batch,message", [
    (ParallelConfig(dp=3), 8, r"global_batch \(8\) must divide by dp \* microbatches \(3 \* 1 = 3\)"),
    (ParallelConfig(dp=2, microbatches=3), 8, r"must divide by dp \* microbatches \(2 \* 3 = 6\)"),
    (ParallelConfig(), 0, "global_batch must be a positive integer, got 0"),
    (ParallelConfig(tp=3), 6, r"tp \(3\) must divide the model's n_head \(4\)"),
    (ParallelConfig(pp=5), 8, r"must not exceed the model's n_layer \(4\)"),
    (ParallelConfig(pp=2, virtual_stages=3, schedule="interleaved-1f1b"), 8, r"pp \* virtual_stages \(2 \* 3\)"),
])
def test_rules_that_need_the_model_and_batch(par, batch, message):
    with pytest.raises(ValueError, match=message):
        par.check(TINY, batch)


def test_train_rejects_bad_input_before_starting_processes():
    with pytest.raises(ValueError, match="global_batch"):
        minipar.train(TINY, ParallelConfig(dp=3), global_batch=8)
    with pytest.raises(ValueError, match="data must be one of"):
        minipar.train(TINY, data="wikipedia")
    with pytest.raises(ValueError, match="steps must be a positive integer"):
        minipar.train(TINY, steps=0)
    with pytest.raises(ValueError, match="needs one GPU per rank"):
        minipar.train(TINY, backend="nccl")


@pytest.mark.parametrize("field,value", [("n_layer", 0), ("d_model", 65), ("vocab_size", 2.0), ("dropout", 1.0)])
def test_model_config_is_validated(field, value):
    with pytest.raises(ValueError, match=f"GPTConfig.{field}"):
        TINY.replace(**{field: value})


def test_presets():
    assert GPTConfig.preset("tiny", n_layer=2).n_layer == 2
    with pytest.raises(ValueError, match="unknown model preset 'gpt5'"):
        GPTConfig.preset("gpt5")


def test_the_cli_reports_bad_input_without_a_traceback(capsys):
    from minipar.__main__ import main
    with pytest.raises(SystemExit) as exit_:
        main(["train", "--dp", "3", "--global-batch", "8", "--steps", "1"])
    assert "error: global_batch (8) must divide by dp * microbatches" in str(exit_.value.code)
