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

Stages of different TP degrees (`stage_tp`, e.g. a slower kind's stages on more chips): stage i is
a dp x t_i block, the blocks one after the other, so rank = dp * (t_0 + ... + t_{i-1}) + dp_rank *
t_i + tp_rank; with every t_i = tp that is the formula above. A pipeline group is then the ranks
of one (dp_rank, tp_rank) on the stages that have that tp_rank, and the stages talk by the rule of
`pipeline_peers`; a replica's group (`replica_group`) spans all its stages.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass, field

import torch.distributed as dist


def rank_at(dp: int, tp: int, dp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0,
            stage_tp: tuple | None = None) -> int:
    """The global rank at (dp_rank, tp_rank, pp_rank) of a dp x tp (x pp) grid, tp innermost;
    stage_tp: each stage's own tp (the module docstring)."""
    if stage_tp:
        return dp * sum(stage_tp[:pp_rank]) + dp_rank * stage_tp[pp_rank] + tp_rank
    return (pp_rank * dp + dp_rank) * tp + tp_rank


def grid_ranks(dp: int, tp: int, pp: int, pp_rank: int | None = None,
               dp_rank: int | None = None, stage_tp: tuple | None = None) -> list[int]:
    """Global ranks, ascending, of pipeline stage `pp_rank`'s block (every replica), of DP replica
    `dp_rank` (every stage), or, with both, of one TP group; of the whole grid with neither."""
    return list(_grid_ranks(dp, tp, pp, pp_rank, dp_rank, stage_tp))


@functools.lru_cache(maxsize=1 << 14)
def _grid_ranks(dp: int, tp: int, pp: int, pp_rank, dp_rank, stage_tp) -> tuple[int, ...]:
    """grid_ranks, cached: the planner asks for the same blocks of every layout it times."""
    stages = range(pp) if pp_rank is None else [pp_rank]
    replicas = range(dp) if dp_rank is None else [dp_rank]
    return tuple(rank_at(dp, tp, j, k, i, stage_tp) for i in stages for j in replicas
                 for k in range(stage_tp[i] if stage_tp else tp))


def layout_ranks(par, pp_rank: int | None = None, dp_rank: int | None = None) -> list[int]:
    """grid_ranks of a ParallelConfig's grid (its stage_tp too; with context parallelism its DP
    axis holds dp x cp ranks, and DP replica dp_rank's first CP rank stands for it)."""
    cp = par.cp
    return grid_ranks(par.dp * cp, par.tp, par.pp, pp_rank,
                      None if dp_rank is None else dp_rank * cp, par.stage_tp)


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
    stage_tp: tuple | None = None                             # each stage's tp (ParallelConfig's)
    replica_group: object = field(default=None, compare=False, repr=False)  # with stage_tp

    def __post_init__(self):
        for name in ("dp", "tp", "pp"):
            size = getattr(self, name)
            if not isinstance(size, int) or isinstance(size, bool) or size < 1:
                raise ValueError(f"{name} must be a positive integer, got {size!r}")
        if self.stage_tp is not None and (len(self.stage_tp) != self.pp
                                          or max(self.stage_tp) != self.tp):
            raise ValueError(f"stage_tp {self.stage_tp} needs pp = {self.pp} degrees, the largest "
                             f"tp = {self.tp}")
        if not 0 <= self.rank < self.world:
            raise ValueError(f"rank must be in [0, {self.world}), got {self.rank}")

    @property
    def world(self) -> int:
        return self.dp * (sum(self.stage_tp) if self.stage_tp else self.tp * self.pp)

    def tp_at(self, pp_rank: int) -> int:
        return self.stage_tp[pp_rank] if self.stage_tp else self.tp

    def coords(self, rank: int | None = None) -> Coords:
        """Grid coordinates of `rank` (default: this process's)."""
        rank = self.rank if rank is None else rank
        pp_rank = 0
        while rank >= self.dp * self.tp_at(pp_rank):  # the stages' blocks, one after the other
            rank, pp_rank = rank - self.dp * self.tp_at(pp_rank), pp_rank + 1
        t = self.tp_at(pp_rank)
        return Coords(dp_rank=rank // t, tp_rank=rank % t, pp_rank=pp_rank)

    def global_rank(self, dp_rank: int = 0, tp_rank: int = 0, pp_rank: int = 0) -> int:
        return rank_at(self.dp, self.tp, dp_rank, tp_rank, pp_rank, self.stage_tp)

    def pipeline_peers(self) -> list[tuple[int, list[int]]]:
        """For each pipeline rank q: (the global rank of q's stage this rank receives from, those
        it sends to), in its own DP replica. A stage's activations, and the gradients of its
        input, are whole and alike on its TP ranks (no sequence parallelism), so a receiver needs
        one copy: TP rank r takes it from the sender's TP rank r % t_sender; a sender then has up
        to ceil(t_receiver / t_sender) receivers, or none when its stage has more TP ranks. On its
        own stage a rank is its own peer. With one tp: the same (dp_rank, tp_rank) on q."""
        me = self.coords()
        return [(self.global_rank(me.dp_rank, me.tp_rank % self.tp_at(q), q),
                 [self.global_rank(me.dp_rank, r, q) for r in range(self.tp_at(q))
                  if r % self.tp_at(me.pp_rank) == me.tp_rank])
                for q in range(self.pp)]

    def axis_groups(self, axis: str) -> list[list[int]]:
        """All groups of global ranks along `axis` ("dp", "tp" or "pp"): the ranks that differ
        only there; "replica": each DP replica's ranks (every stage, every TP rank)."""
        groups = {}
        for r in range(self.world):
            c = self.coords(r)
            key = (c.dp_rank,) if axis == "replica" else \
                tuple(getattr(c, f"{a}_rank") for a in ("dp", "tp", "pp") if a != axis)
            groups.setdefault(key, []).append(r)
        return list(groups.values())

    def dp_subgroups(self, cut) -> list:
        """The groups that contain this rank among those `cut(ranks) -> [ranks, ...]` makes of
        every DP group (`axis_groups("dp")`, ranks in dp_rank order), in cut's order: context
        parallelism's and expert parallelism's groups. Collective: every rank creates every group,
        in the same order."""
        mine = []
        for ranks in self.axis_groups("dp"):
            for part in cut(ranks):
                group = dist.new_group(part)
                if self.rank in part:
                    mine.append(group)
        return mine

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
    def build(cls, dp: int = 1, tp: int = 1, pp: int = 1, stage_tp: tuple | None = None) -> "Mesh":
        """The grid over the initialised world, with this rank's groups
        (collective: every rank calls it)."""
        mesh = cls(dp, tp, pp, rank=dist.get_rank() if dist.is_initialized() else 0,
                   stage_tp=stage_tp)
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != mesh.world:
            grid = f"dp*sum(stage_tp) = {dp}*{sum(stage_tp)}" if stage_tp else \
                f"dp*tp*pp = {dp}*{tp}*{pp}"
            raise ValueError(f"{grid} = {mesh.world} but the world has {world} ranks")
        if not dist.is_initialized():
            return mesh
        groups = {}
        # every rank creates every group, in the same order
        for axis in ("dp", "tp", "pp") + ("replica",) * bool(stage_tp):
            for ranks in mesh.axis_groups(axis):
                group = dist.new_group(ranks)
                if mesh.rank in ranks:
                    groups[f"{axis}_group"] = group
        return cls(dp, tp, pp, rank=mesh.rank, stage_tp=stage_tp, **groups)
