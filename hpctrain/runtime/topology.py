"""Rank math as pure functions: roles, shards of a range, threads per rank.

Nothing here touches MPI, so every placement rule is unit-tested without a launcher;
:mod:`hpctrain.runtime.world` calls these with the sizes it reads from the communicators.
"""

from __future__ import annotations

from dataclasses import dataclass

from hpctrain.errors import ConfigError

__all__ = ["Roles", "assign_roles", "shard_range", "threads_per_rank"]


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


def threads_per_rank(cores: int, ranks_on_node: int, requested: int = 0) -> int:
    """Torch threads for one rank: ``requested``, or the node's cores divided among its ranks."""
    if requested > 0:
        return requested
    return max(1, cores // max(1, ranks_on_node))
