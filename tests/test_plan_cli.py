"""`python -m minipar plan`: the ranked table and why the runners-up lose; an impossible request says so."""
import pytest

from minipar.__main__ import main


def test_plan_prints_a_ranked_table_with_reasons(capsys):
    main(["plan", "--model", "gpt2-xl", "--cluster", "dgx-h100", "--global-batch", "64", "--top", "3"])
    out, _ = capsys.readouterr()
    assert "8 GPUs (dgx-h100 x 1; 80% of each GPU's 80 GiB usable)" in out and "MFU" in out and "dp_comm s" in out
    assert out.count("\n#2 ") == 1 and "#3 " in out  # the winner, then what each runner-up loses by
    assert "minipar's overlaps" in out
    main(["plan", "--model", "gpt2-xl", "--cluster", "dgx-h100", "--global-batch", "64", "--top", "3",
          "--overlap", "production"])
    assert "Megatron-LM's overlaps" in capsys.readouterr()[0]


def test_a_plan_nothing_satisfies_says_what_would(capsys):
    with pytest.raises(SystemExit, match="no layout fits: .*GPUs"):
        main(["plan", "--model", "gpt2-xl", "--n-layer", "96", "--d-model", "12288", "--n-head", "96",
              "--cluster", "dgx-a100-80g", "--global-batch", "8"])  # GPT-3 175B on 8 GPUs


@pytest.mark.parametrize("flag, value", [("--top", "0"), ("--top", "-3"), ("--global-batch", "0")])
def test_a_top_or_global_batch_below_one_is_an_error_naming_it(flag, value):
    with pytest.raises(SystemExit, match=f"^error: {flag[2:].replace('-', '_')} must be a positive integer"):
        main(["plan", "--model", "gpt2-xl", "--cluster", "dgx-h100", "--global-batch", "64", flag, value])
