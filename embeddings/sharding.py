"""Sharding plans: which server holds which rows of which table (pure and deterministic).

Three placements, chosen per table:

- ``table``: the whole table on one server (small tables: one message, no split);
- ``row_range``: rows split into contiguous balanced ranges, one per server;
- ``row_hash``: row ``r`` goes to server ``p(r) mod K`` where ``p(r) = (a r + b) mod n`` is a
  seeded bijection of the table's rows, so the hot head of a Zipf table, wherever it sits,
  spreads evenly over the servers.

A plan is computed on one rank, broadcast as JSON, logged and stored with the run; the same
plan always gives the same placement (``plan_sharding`` is a pure function of its inputs).
Placement math that maps rows to (server, slot) lives in :class:`Placement`; the parameter
server's routing and storage build on it.
"""

from __future__ import annotations

import json
import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numba
import numpy as np

from embeddings.types import TableSpec
from hpctrain.errors import ConfigError
from hpctrain.runtime import rng
from hpctrain.runtime.topology import shard_range

__all__ = ["SCHEMES", "TableShard", "ShardingPlan", "plan_sharding", "Placement", "bijection",
           "locate_run"]

SCHEMES = ("auto", "table", "row_range", "row_hash")
_CODES = {"table": 0, "row_range": 1, "row_hash": 2}


@dataclass(frozen=True)
class TableShard:
    """Placement of one table: ``owner`` for table-wise, all servers for row-wise."""

    table: str
    rows: int
    scheme: str
    owner: int = 0
    multiplier: int = 1
    shift: int = 0


@dataclass(frozen=True)
class ShardingPlan:
    servers: int
    tables: tuple[TableShard, ...]

    def to_json(self) -> str:
        return json.dumps({"servers": self.servers, "tables": [asdict(t) for t in self.tables]},
                          indent=1)

    @classmethod
    def from_json(cls, text: str) -> ShardingPlan:
        data = json.loads(text)
        return cls(int(data["servers"]), tuple(TableShard(**t) for t in data["tables"]))

    def describe(self) -> str:
        kinds: dict[str, int] = {}
        for t in self.tables:
            kinds[t.scheme] = kinds.get(t.scheme, 0) + 1
        return (f"{len(self.tables)} tables on {self.servers} server(s): " +
                ", ".join(f"{n} {k}" for k, n in sorted(kinds.items())))


def plan_sharding(specs: Sequence[TableSpec], servers: int, scheme: str = "auto",
                  table_wise_below: int = 100_000, seed: int = 0) -> ShardingPlan:
    """Place every table on ``servers`` servers.

    ``auto`` puts tables under ``table_wise_below`` rows whole on the least-loaded server
    (largest first, so the bins stay balanced) and hashes the rows of larger tables.
    """
    if servers < 1:
        raise ConfigError(f"ps.servers: a sharding plan needs at least one server, got {servers}")
    if scheme not in SCHEMES:
        raise ConfigError(f"ps.sharding: expected one of {', '.join(SCHEMES)}, got {scheme!r}")
    load = [0] * servers
    shards: dict[int, TableShard] = {}
    order = sorted(range(len(specs)), key=lambda t: (-specs[t].rows, t))
    for t in order:
        spec = specs[t]
        kind = scheme
        if scheme == "auto":
            kind = "table" if spec.rows < table_wise_below or servers == 1 else "row_hash"
        if kind == "table":
            owner = min(range(servers), key=lambda s: (load[s], s))
            load[owner] += spec.rows
            shards[t] = TableShard(spec.name, spec.rows, "table", owner=owner)
        else:
            for s in range(servers):
                lo, hi = shard_range(spec.rows, servers, s)
                load[s] += hi - lo
            mult, shift = bijection(spec.rows, seed + t) if kind == "row_hash" else (1, 0)
            shards[t] = TableShard(spec.name, spec.rows, kind, multiplier=mult, shift=shift)
    return ShardingPlan(servers, tuple(shards[t] for t in range(len(specs))))


def bijection(n: int, seed: int) -> tuple[int, int]:
    """``(a, b)`` with ``gcd(a, n) = 1`` and ``a < 2**20`` (so ``a * r`` cannot overflow)."""
    if n <= 2:
        return 1, 0
    keys = rng.mix64(np.array([n, n + 1], dtype=np.uint64), seed)
    a = int(keys[0] % np.uint64(min(n - 1, 1 << 20))) + 1
    while math.gcd(a, n) != 1:
        a += 1
    return a, int(keys[1] % np.uint64(n))


class Placement:
    """Vectorised row placement of a plan: (table, id) -> (server, slot on that server).

    Each server stores its rows of all tables in one array; table ``t``'s rows on server
    ``s`` start at ``base[s, t]``. ``slot`` is the index into that array.
    """

    def __init__(self, plan: ShardingPlan) -> None:
        self.plan = plan
        k = plan.servers
        t = len(plan.tables)
        self.counts = np.zeros((k, t), dtype=np.int64)
        for i, shard in enumerate(plan.tables):
            for s in range(k):
                self.counts[s, i] = _rows_on(shard, k, s)
        self.base = np.zeros_like(self.counts)
        self.base[:, 1:] = np.cumsum(self.counts, axis=1)[:, :-1]
        self.rows = np.array([s.rows for s in plan.tables], dtype=np.int64)
        code = np.array([_CODES[s.scheme] for s in plan.tables], dtype=np.int64)
        owner = np.array([s.owner for s in plan.tables], dtype=np.int64)
        mult = np.array([s.multiplier for s in plan.tables], dtype=np.int64)
        shift = np.array([s.shift for s in plan.tables], dtype=np.int64)
        self.arrays = (code, owner, mult, shift, self.rows, self.base, np.int64(k))
        """The plan as arrays for :func:`locate_run`: (scheme code, owner, multiplier, shift,
        rows per table, base [servers, tables], servers)."""

    def server_rows(self, server: int) -> int:
        """Rows stored on ``server`` (all tables)."""
        return int(self.counts[server].sum())

    def locate(self, table: int, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Server and slot of rows ``ids`` (int64, in range) of table ``table``."""
        ids = np.ascontiguousarray(ids, dtype=np.int64)
        server, slot = _locate_many(table, ids, *self.arrays)
        return server.reshape(ids.shape), slot.reshape(ids.shape)

    def ids_at(self, server: int, table: int, start: int = 0,
               stop: int | None = None) -> np.ndarray:
        """Ids of table ``table`` in local positions ``[start, stop)`` of ``server``
        (the inverse of :meth:`locate`)."""
        shard, k = self.plan.tables[table], self.plan.servers
        stop = int(self.counts[server, table]) if stop is None else stop
        local = np.arange(start, stop, dtype=np.int64)
        if shard.scheme == "table":
            return local
        if shard.scheme == "row_range":
            return shard_range(shard.rows, k, server)[0] + local
        p = local * k + server
        inverse = pow(shard.multiplier, -1, shard.rows)
        return ((p - shard.shift) % shard.rows) * inverse % shard.rows


@numba.njit(cache=True, nogil=True, inline="always")
def locate_run(code, owner, mult, shift, rows, k, t, ids, lo, hi, server,
               local):  # pragma: no cover - compiled
    """``server[j]``, ``local[j]`` (position among that server's rows of table ``t``) of each
    id ``ids[j]`` of table ``t``, ``lo <= j < hi``: the one placement rule, used by
    :meth:`Placement.locate` and the parameter server's kernels. The scheme is chosen once
    per run: chosen per id, the branches kept numba's loop 5-40x slower."""
    c = code[t]
    if c == 0:
        for j in range(lo, hi):
            server[j], local[j] = owner[t], ids[j]
    elif c == 1:
        n = rows[t]
        base, extra = n // k, n % k
        cut = extra * (base + 1)
        for j in range(lo, hi):
            i = ids[j]
            if i < cut:
                server[j] = i // (base + 1)
                local[j] = i - server[j] * (base + 1)
            else:
                server[j] = extra + (i - cut) // max(base, 1)
                local[j] = i - cut - (server[j] - extra) * base
    else:
        a, b, n = mult[t], shift[t], rows[t]
        for j in range(lo, hi):
            p = (a * ids[j] + b) % n
            server[j], local[j] = p % k, p // k


@numba.njit(cache=True, nogil=True)
def _locate_many(t, ids, code, owner, mult, shift, rows, base, k):  # pragma: no cover
    flat = ids.ravel()
    server = np.empty(flat.shape[0], dtype=np.int64)
    slot = np.empty(flat.shape[0], dtype=np.int64)
    locate_run(code, owner, mult, shift, rows, k, t, flat, 0, flat.shape[0], server, slot)
    for j in range(flat.shape[0]):
        slot[j] += base[server[j], t]
    return server, slot


def _rows_on(shard: TableShard, servers: int, s: int) -> int:
    if shard.scheme == "table":
        return shard.rows if s == shard.owner else 0
    if shard.scheme == "row_range":
        lo, hi = shard_range(shard.rows, servers, s)
        return hi - lo
    return len(range(s, shard.rows, servers))  # p mod K == s for p in [0, rows)
