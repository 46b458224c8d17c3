"""Expert parallelism (expert_parallel.py) against the single-device MoE layer (moe.py).

On every rank, with its own number of tokens: the output, the tokens' gradients and the router's
equal the single-device layer's on those tokens, and each local expert's gradients equal the sum
over every rank's tokens of the single-device layer's (float64, so to rounding); at ep 2 and 3,
top 1 and 2, dropless and with capacity, and with an expert no token reaches anywhere (it works,
and learns nothing). The bytes each rank sends are the module's formula.
"""
import pytest
import workers_ep

import minipar
from minipar.launch import WorkerError

H = 8


@pytest.mark.parametrize("ep,n_expert,top_k,capacity,starve", [
    (2, 4, 2, None, None), (3, 6, 2, 1.0, None), (3, 3, 1, None, None), (2, 4, 1, None, 3),
    (2, 2, 2, 0.5, None)])
def test_expert_parallel_equals_the_single_device_layer(ep, n_expert, top_k, capacity, starve):
    ranks = minipar.launch(workers_ep.errors, ep, n_expert, top_k, capacity, starve, timeout=120)
    for rank, (errors, sent, to, starved) in enumerate(ranks):
        assert max(errors.values()) < 1e-12, (rank, errors)
        away = sum(to) - to[rank]                                  # my slots bound elsewhere
        arriving = sum(r[2][rank] for i, r in enumerate(ranks) if i != rank)
        row = H * 8
        assert sent["ep_dispatch"] == sent["ep_combine"] == (away + arriving) * row, rank
        assert sent["ep_counts"] == (ep - 1) * (n_expert // ep) * 8
        if starved is not None:
            assert starved == 0.0
    if starve is not None:
        assert any(r[3] is not None for r in ranks)


def test_experts_that_do_not_divide_over_the_ranks_are_refused():
    with pytest.raises(WorkerError, match="must divide the experts"):
        minipar.launch(workers_ep.three_experts, 2, timeout=60)
