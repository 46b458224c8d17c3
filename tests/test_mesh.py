"""The dp x tp x pp grid: tp innermost, pp outermost, and groups along each axis."""
import pytest
import workers_launch as w

import minipar
from minipar import Mesh
from minipar.mesh import Coords, grid_ranks


def test_layout_is_tp_innermost_then_dp_then_pp():
    mesh = Mesh(dp=2, tp=3, pp=2)
    assert [mesh.coords(r) for r in (0, 1, 3, 6, 11)] == [
        Coords(0, 0, 0), Coords(0, 1, 0), Coords(1, 0, 0), Coords(0, 0, 1), Coords(1, 2, 1)]
    assert all(mesh.global_rank(**vars(mesh.coords(r))) == r for r in range(mesh.world))
    assert mesh.axis_groups("tp") == [[0, 1, 2], [3, 4, 5], [6, 7, 8], [9, 10, 11]]
    assert mesh.axis_groups("dp") == [[0, 3], [1, 4], [2, 5], [6, 9], [7, 10], [8, 11]]
    assert mesh.axis_groups("pp") == [[0, 6], [1, 7], [2, 8], [3, 9], [4, 10], [5, 11]]


def test_grid_ranks_are_the_mesh_blocks():
    mesh = Mesh(dp=2, tp=3, pp=2)
    assert grid_ranks(2, 3, 2, pp_rank=1) == list(range(6, 12))         # a stage, every replica
    assert grid_ranks(2, 3, 2, dp_rank=1) == [3, 4, 5, 9, 10, 11]       # a replica, every stage
    assert grid_ranks(2, 3, 2, pp_rank=1, dp_rank=0) in mesh.axis_groups("tp")  # a TP group
    assert grid_ranks(2, 3, 2) == list(range(mesh.world))


def test_every_rank_is_in_exactly_one_group_per_axis():
    mesh = Mesh(dp=3, tp=2, pp=2)
    for axis in ("dp", "tp", "pp"):
        members = sorted(r for g in mesh.axis_groups(axis) for r in g)
        assert members == list(range(12))
        assert {len(g) for g in mesh.axis_groups(axis)} == {getattr(mesh, axis)}


def test_mesh_is_a_validated_frozen_value():
    with pytest.raises(ValueError, match="tp must be a positive integer"):
        Mesh(dp=1, tp=0, pp=1)
    with pytest.raises(ValueError, match="rank must be in"):
        Mesh(dp=2, tp=1, pp=1, rank=2)
    with pytest.raises(AttributeError):
        Mesh(2, 1, 1).dp = 3


def test_groups_on_a_real_world_of_eight():
    results = minipar.launch(w.mesh_groups, 8, 2, 2, 2)
    for rank, (coords, groups, tp_sum) in enumerate(results):
        mesh = Mesh(2, 2, 2, rank=rank)
        assert coords == mesh.coords()
        for axis in ("dp", "tp", "pp"):
            assert groups[axis] in mesh.axis_groups(axis) and rank in groups[axis]
        assert tp_sum == sum(groups["tp"])


def test_stages_of_different_tp_are_blocks_one_after_the_other():
    mesh = Mesh(dp=2, tp=2, pp=3, stage_tp=(1, 2, 1))      # 2 + 4 + 2 ranks
    assert mesh.world == 8 and [mesh.coords(r).pp_rank for r in range(8)] == [0, 0, 1, 1, 1, 1, 2, 2]
    assert all(mesh.global_rank(**vars(mesh.coords(r))) == r for r in range(mesh.world))
    assert mesh.axis_groups("tp") == [[0], [1], [2, 3], [4, 5], [6], [7]]
    assert mesh.axis_groups("dp") == [[0, 1], [2, 4], [3, 5], [6, 7]]
    assert mesh.axis_groups("pp") == [[0, 2, 6], [1, 4, 7], [3], [5]]      # TP rank 1 only on stage 1
    assert mesh.axis_groups("replica") == [[0, 2, 3, 6], [1, 4, 5, 7]]
    assert grid_ranks(2, 2, 3, pp_rank=1, stage_tp=(1, 2, 1)) == [2, 3, 4, 5]
    # (receive from, send to) on each stage: a stage of one TP rank sends its copy to both of stage 1's
    assert Mesh(2, 2, 3, rank=0, stage_tp=(1, 2, 1)).pipeline_peers() == [(0, [0]), (2, [2, 3]), (6, [6])]
    assert Mesh(2, 2, 3, rank=3, stage_tp=(1, 2, 1)).pipeline_peers() == [(0, []), (3, [3]), (6, [])]
    with pytest.raises(ValueError, match=r"stage_tp \(1, 2\) needs pp = 3 degrees"):
        Mesh(dp=1, tp=2, pp=3, stage_tp=(1, 2))
