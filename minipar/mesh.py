"""The rank grid: which global rank does what along the dp, tp
and pp axes, and their process groups.

The world of dp * tp * pp ranks is laid out as a (pp, dp, tp) array, tp innermost:

    rank = (pp_rank * dp + dp_rank) * tp + tp_rank

so the ranks of one tensor-parallel group are consecutive and stay on one node (TP all-reduces are
the most frequent and need the fastest links), DP groups stride over tp, and pipeline stages are
the outermost blocks (their point-to-point traffic is the lightest). This is Megatron-LM's order.

`rank_at` is that formula and `grid_ranks` the ranks of a stage, a replica or a TP group, as pure
functions of (dp, tp, pp): the planner places layouts with them, without processes. A `Mesh` is a
value: built once, validated, passed explicitly. No module-level group state.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch.distributed as dist


def rank_at(dp: int, tp: int, dp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0) -> int:
    """The global rank at (dp_rank, tp_rank, pp_rank) of a dp x tp (x pp) grid, tp innermost."""
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def grid_ranks(dp: int, tp: int, pp: int, pp_rank: int | None = None,
               dp_rank: int | None = None) -> list[int]:
    """Global ranks, ascending, of pipeline stage `pp_rank`'s block (every replica), of DP replica
    `dp_rank` (every stage), or, with both, of one TP group; of the whole grid with neither."""
    return list(_grid_ranks(dp, tp, pp, pp_rank, dp_rank))


@functools.lru_cache(maxsize=1 << 14)
def _grid_ranks(dp: int, tp: int, pp: int, pp_rank, dp_rank) -> tuple[int, ...]:
    """grid_ranks, cached: the planner asks for the same blocks of every layout it times."""
    stages = range(pp) if pp_rank is None else [pp_rank]
    replicas = range(dp) if dp_rank is None else [dp_rank]
    return tuple(rank_at(dp, tp, j, k, i) for i in stages for j in replicas for k in range(tp))


@dataclass(frozen=True)
class Coords:
    """Where one global rank sits in the grid."""
    dp_rank: int
    tp_rank: int
    pp_rank: int


@dataclass(frozen=True)
class Mesh:
    """A dp x tp x pp grid of ranks, this process's place in it, and its groups along each axis."""
    dp: int
    tp: int
    pp: int
    rank: int = 0                                             # this process's global rank
    # ranks that differ only in dp_rank
    dp_group: object = field(default=None, compare=False, repr=False)
    tp_group: object = field(default=None, compare=False, repr=False)
    pp_group: object = field(default=None, compare=False, repr=False)

    def __post_init__(self):
        for name in ("dp", "tp", "pp"):
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} must be a positive integer, got {size!r}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {self.rank}")

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, rank: int | None = None) -> Coords:
        """Grid coordinates of `rank` (default: this process's)."""
        rank = self.rank if rank is None else rank
        return Coords(dp_rank=(rank // self.tp) % self.dp, tp_rank=rank % self.tp,
                      pp_rank=rank // (self.tp * self.dp))

    def global_rank(self, dp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0) -> int:
        return rank_at(self.dp, self.tp, dp_rank, tp_rank, pp_rank)

    def axis_groups(self, axis: str) -> list[list[int]]:
        """All groups of global ranks along `axis` ("dp", "tp" or "pp"):
        the ranks that differ only there."""
        groups = {}
        for r in range(self.world):
            c = self.coords(r)
            key = tuple(getattr(c, f"{a}_rank") for a in ("dp", "tp", "pp") if a != axis)
            groups.setdefault(key, []).append(r)
        return list(groups.values())

    @property
    def dp_rank(self) -> int:
        return self.coords().dp_rank

    @property
    def tp_rank(self) -> int:
        return self.coords().tp_rank

    @property
    def pp_rank(self) -> int:
        return self.coords().pp_rank

    @classmethod
    def build(cls, dp: int = 1, tp: int = 1, pp: int = 1) -> "Mesh":
        """The grid over the initialised world, with this rank's groups
        (collective: every rank calls it)."""
        mesh = cls(dp, tp, pp, rank=dist.get_rank() if dist.is_initialized() else 0)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != mesh.world:
            raise ValueError(f"dp*tp*pp = {dp}*{tp}*{pp} = {mesh.world} but the world has {world} "
                             "ranks")
        if not dist.is_initialized():
            return mesh
        groups = {}
        for axis in ("dp", "tp", "pp"):  # every rank creates every group, in the same order
            for ranks in mesh.axis_groups(axis):
                group = dist.new_group(ranks)
                if mesh.rank in ranks:
                    groups[f"{axis}_group"] = group
        return cls(dp, tp, pp, rank=mesh.rank, **groups)
