"""3D parallelism: every dp x tp x pp factorisation of 8 and of 6 ranks trains the single-process model.

Each layout runs with ZeRO 0 and 1; pipeline layouts take the schedules in turn (interleaved with 2
virtual stages where the layers allow), tensor-parallel ones alternate sequence parallelism, and
recomputation "selective" and "full" are spread over the matrix: which layout gets which is a fixed
function of its index, so the matrix is the same on every run. One launch per world runs them all.
"""
import itertools

import pytest
import torch
from reference import assert_same_training

import minipar
from minipar.config import ParallelConfig
from minipar.lessons import demos_3d

# heads divide by 8 and 6, the sequence by 8 and 6 (SP), 8 layers hold 8 stages or 4 x 2 virtual ones
CFG = minipar.GPTConfig(n_layer=8, n_head=24, d_model=48, vocab_size=96, seq_len=48)
STEPS, BATCH = 2, 24
SCHEDULES = ["1f1b", "gpipe", "interleaved-1f1b", "zb-h1"]


def factorisations(world):
    return [(dp, tp, world // (dp * tp)) for dp, tp in itertools.product(range(1, world + 1), repeat=2)
            if world % (dp * tp) == 0]


def matrix(world):
    layouts, pipelines = [], itertools.count()
    for i, (dp, tp, pp) in enumerate(factorisations(world)):
        schedule = SCHEDULES[next(pipelines) % 4] if pp > 1 else "1f1b"
        virtual = 2 if schedule == "interleaved-1f1b" and 2 * pp <= CFG.n_layer else 1
        schedule = "1f1b" if schedule == "interleaved-1f1b" and virtual == 1 else schedule
        for zero in (0, 1):
            layouts.append(ParallelConfig(dp=dp, tp=tp, pp=pp, zero=zero, microbatches=pp, schedule=schedule,
                                          virtual_stages=virtual, sequence_parallel=tp > 1 and (i + zero) % 2 == 0,
                                          recompute=("none", "selective", "full")[(i + zero) % 3]))
    return layouts


@pytest.fixture(scope="module")
def reference():
    return minipar.train(CFG, ParallelConfig(), steps=STEPS, global_batch=BATCH, lr=1e-3, weight_decay=0.1,
                         seed=0, return_state=True)


def test_the_matrix_covers_what_it_claims():
    for world, count in ((8, 10), (6, 9)):
        layouts = matrix(world)
        assert len(layouts) == 2 * count and {p.world for p in layouts} == {world}
        assert {p.schedule for p in layouts if p.pp > 1} == set(SCHEDULES)
        assert {p.recompute for p in layouts} == {"none", "selective", "full"}
        assert any(p.sequence_parallel for p in layouts) and any(p.virtual_stages == 2 for p in layouts)


@pytest.mark.slow
@pytest.mark.parametrize("world", [8, 6])
def test_every_factorisation_equals_the_single_process_run(world, reference):
    layouts = matrix(world)
    for par in layouts:
        par.check(CFG, BATCH)
    ranks = minipar.launch(demos_3d.layouts, world, CFG, layouts, STEPS, BATCH, 1e-3, 0.1, None, True, timeout=900)
    for par, run in zip(layouts, ranks[0]):
        try:
            assert_same_training(run, reference)
        except AssertionError as e:
            raise AssertionError(f"{par.label}: {e}") from None
    assert torch.is_tensor(next(iter(reference.state_dict.values())))
