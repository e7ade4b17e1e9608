"""Rank math as pure functions: roles, shards of a range, threads per rank, the parallel grid.

Nothing here touches MPI, so every placement rule is unit-tested without a launcher;
:mod:`hpctrain.runtime.world` calls these with the sizes it reads from the communicators.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.errors import ConfigError

__all__ = ["Roles", "assign_roles", "shard_range", "threads_per_rank", "Grid", "make_grid",
           "place_grid"]


@dataclass(frozen=True)
class Roles:
    """Which world ranks train (workers) and which serve embedding shards (servers).

    Servers are the last ``servers`` ranks, so that worker ``i`` is world rank ``i`` and a
    Slurm/PBS allocation that packs ranks by node keeps workers together.
    """

    world_size: int
    servers: int

    @property
    def workers(self) -> int:
        return self.world_size - self.servers

    def is_server(self, rank: int) -> bool:
        return rank >= self.workers

    def worker_ranks(self) -> range:
        return range(self.workers)

    def server_ranks(self) -> range:
        return range(self.workers, self.world_size)


def assign_roles(world_size: int, servers: int) -> Roles:
    """Split ``world_size`` ranks into workers and ``servers`` parameter servers."""
    if servers >= world_size:
        raise ConfigError(f"ps.servers = {servers} leaves no worker in a world of {world_size} "
                          f"rank{'s' if world_size != 1 else ''}; launch at least "
                          f"{servers + 1} ranks or lower ps.servers")
    return Roles(world_size, servers)


def shard_range(n: int, parts: int, index: int) -> tuple[int, int]:
    """The ``index``-th of ``parts`` balanced contiguous slices of ``range(n)``.

    The first ``n % parts`` slices hold one extra item, so sizes differ by at most one.
    """
    if not 0 <= index < parts:
        raise ValueError(f"shard index {index} outside [0, {parts})")
    base, extra = divmod(n, parts)
    lo = index * base + min(index, extra)
    return lo, lo + base + (1 if index < extra else 0)


def threads_per_rank(mine: frozenset[int], node: list[frozenset[int]],
                     requested: int = 0) -> int:
    """Torch threads for one rank: ``requested``, or the cores of its affinity mask
    (``mine``) divided among the node's ranks whose masks (``node``, this one's included)
    overlap it: a rank the launcher bound to its own cores (``srun --cpu-bind``) keeps
    them all, ranks that share the node's cores divide them."""
    if requested > 0:
        return requested
    sharing = sum(1 for other in node if other & mine)
    return max(1, len(mine) // max(1, sharing))


@dataclass(frozen=True)
class Grid:
    """The workers as a ``dp x pp x tp`` grid of positions, tensor axis fastest.

    Position ``(d, s, t)`` (data replica ``d``, pipeline stage ``s``, tensor shard ``t``) is
    ``(s * dp + d) * tp + t``: a tensor group is ``tp`` consecutive positions (inside a node
    when nodes hold multiples of ``tp``), pipeline neighbours are ``dp * tp`` apart, so stage
    boundaries cross nodes before tensor groups do (Megatron's ``tp-dp-pp`` order).
    """

    dp: int
    tp: int
    pp: int

    @property
    def size(self) -> int:
        return self.dp * self.tp * self.pp

    def coords(self, position: int) -> tuple[int, int, int]:
        """``(d, s, t)`` of ``position``."""
        if not 0 <= position < self.size:
            raise ValueError(f"grid position {position} outside [0, {self.size})")
        rest, t = divmod(position, self.tp)
        s, d = divmod(rest, self.dp)
        return d, s, t

    def position(self, d: int, s: int, t: int) -> int:
        return (s * self.dp + d) * self.tp + t

    def tensor_groups(self) -> list[list[int]]:
        """Positions sharing ``(d, s)``, ordered by tensor rank."""
        return [[self.position(d, s, t) for t in range(self.tp)]
                for s in range(self.pp) for d in range(self.dp)]

    def pipeline_groups(self) -> list[list[int]]:
        """Positions sharing ``(d, t)``, ordered by stage."""
        return [[self.position(d, s, t) for s in range(self.pp)]
                for d in range(self.dp) for t in range(self.tp)]

    def data_groups(self) -> list[list[int]]:
        """Positions sharing ``(s, t)``, ordered by replica: the gradient-averaging groups."""
        return [[self.position(d, s, t) for d in range(self.dp)]
                for s in range(self.pp) for t in range(self.tp)]


def make_grid(workers: int, tp: int, pp: int, dp: int = 0) -> Grid:
    """The ``dp x tp x pp`` grid over ``workers`` ranks (``dp = 0``: ``workers / (tp * pp)``).

    Raises :class:`ConfigError` naming the sizes when they do not multiply to ``workers``.
    """
    if tp < 1 or pp < 1 or dp < 0:
        raise ConfigError(f"parallel grid: tp = {tp}, pp = {pp} must be >= 1 and dp = {dp} "
                          f">= 0")
    if dp == 0:
        if workers % (tp * pp):
            raise ConfigError(f"parallel grid: {workers} worker ranks do not divide into "
                              f"tp = {tp} x pp = {pp} = {tp * pp}; launch a multiple of "
                              f"{tp * pp} workers or change parallel.tp / parallel.pp")
        dp = workers // (tp * pp)
    if dp * tp * pp != workers:
        raise ConfigError(f"parallel grid: dp = {dp} x tp = {tp} x pp = {pp} = {dp * tp * pp} "
                          f"ranks, but the job has {workers} worker ranks")
    return Grid(dp, tp, pp)


def place_grid(grid: Grid, node_of: list[int]) -> tuple[list[int], bool]:
    """Which worker sits at each grid position, and whether every tensor group is node-local.

    ``node_of[w]`` names worker ``w``'s node (any label; the lowest worker rank on the node
    is a good one). Workers are ordered by (first appearance of their node, rank), so a
    launcher that places ranks round-robin over nodes still gets node-local tensor groups
    when every node holds a multiple of ``tp`` workers; worker 0 stays at position 0.
    """
    if len(node_of) != grid.size:
        raise ValueError(f"{len(node_of)} workers for a grid of {grid.size}")
    first: dict[int, int] = {}
    for w, node in enumerate(node_of):
        first.setdefault(node, w)
    order = sorted(range(grid.size), key=lambda w: (first[node_of[w]], w))
    local = all(len({node_of[order[p]] for p in group}) == 1 for group in grid.tensor_groups())
    return order, local
