"""``hpctrain bench emulate``: does the emulated network delay what it says it does?

Two groups over the world, the same ranks and nodes (``comm.node_size``), one with the job's
``comm.emulate`` and one without, timed interleaved round by round: a ping-pong between world
ranks 0 and the first rank on another emulated node, and an allreduce per algorithm. Each
row is the extra time of the emulated case (its median round less the fastest plain one),
the delay the model predicts, and their ratio (1.0: the emulator adds exactly latency +
bytes / bandwidth per message on the critical path). The delay runs from the send, so it
absorbs the real transfer (the fastest plain round absorbs least): on a loaded machine
``ratio`` reads low by that share, and ``emulated_ratio`` (the median emulated round over
the delay) high by the compute; both are near 1 when the delay dominates.

Predicted delays, ``d(n) = latency + n / bandwidth``, ``p`` ranks on ``N`` nodes: ping-pong
``2 d(n)``; ring ``2 (p-1) d(n/p)`` (every step has a hop across nodes); recursive doubling
(``p`` a power of two, one rank per node) ``log2 p * d(n)``; native (the model
:meth:`~hpctrain.comm.emulate.Channel.library` applies) ``ceil(log2 N) latency +
2 (N-1)/N n / bandwidth``.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import time
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from hpctrain.bench.allreduce import parse_sizes
from hpctrain.comm import allreduce, emulate
from hpctrain.comm.group import Group
from hpctrain.errors import ConfigError
from hpctrain.runtime.world import Topology

__all__ = ["add_arguments", "run", "COLUMNS"]

COLUMNS = ["case", "bytes", "ranks", "nodes", "plain_fastest_s", "emulated_s", "extra_s",
           "expected_s", "ratio", "emulated_ratio"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=parse_sizes, default=parse_sizes("1MiB"),
                        help="message sizes, e.g. 256KiB,1MiB (default 1MiB)")
    parser.add_argument("--reps", type=int, default=5, help="rounds per case (default 5)")
    parser.add_argument("--json", metavar="FILE", help="write the result rows as JSON")


def run(args: argparse.Namespace, topo: Topology) -> list[dict[str, Any]] | None:
    """Every rank measures; world rank 0 returns the rows."""
    config = topo.comm_config
    emulated = Group(topo.world, config)
    plain = Group(topo.world, dataclasses.replace(config, emulate=""))
    net = emulated.link.net
    if net is None:
        raise ConfigError(f"bench emulate: comm.emulate = {config.emulate!r} with "
                          f"comm.node_size = {config.node_size} delays nothing (one emulated "
                          f"node, or no network)")
    rows = []
    for size in args.sizes:
        for case, expected, fn in _cases(emulated, net, size):
            times = _interleaved(topo.world, {"plain": lambda f=fn: f(plain),
                                              "emulated": lambda f=fn: f(emulated)}, args.reps)
            extra = times["emulated"][0] - times["plain"][1]
            rows.append({"case": case, "bytes": size, "ranks": topo.size,
                         "nodes": emulated.link.node_count, "plain_fastest_s": times["plain"][1],
                         "emulated_s": times["emulated"][0], "extra_s": extra,
                         "expected_s": expected, "ratio": extra / expected,
                         "emulated_ratio": times["emulated"][0] / expected})
    for group in (plain, emulated):
        group.free()
    return rows if topo.rank == 0 else None


def _cases(group: Group, net: emulate.Network, nbytes: int
           ) -> list[tuple[str, float, Callable[[Group], None]]]:
    """(name, predicted delay, run over a group) for each case at ``nbytes``."""
    p, nodes = group.size, group.link.node_count

    def d(n: float) -> float:
        return net.latency_s + n / net.bandwidth

    peer = next(r for r in range(p) if group.link.nodes[r] != group.link.nodes[0])
    buf = np.zeros(nbytes, np.uint8)

    def ping_pong(g: Group) -> None:
        if g.rank == 0:
            g.link.Send(buf, peer, 3)
            g.link.Recv(buf, peer, 3)
        elif g.rank == peer:
            g.link.Recv(buf, 0, 3)
            g.link.Send(buf, 0, 3)

    data = np.zeros(nbytes // 4, np.float32)

    def reduce_with(name: str) -> Callable[[Group], None]:
        return lambda g: allreduce(data, comm=g, algorithm=name)

    cases = [("ping-pong", 2 * d(nbytes), ping_pong),
             ("allreduce ring", 2 * (p - 1) * d(data.nbytes / p), reduce_with("ring")),
             ("allreduce native", math.ceil(math.log2(nodes)) * net.latency_s
              + 2 * (nodes - 1) / nodes * data.nbytes / net.bandwidth, reduce_with("native"))]
    if p & (p - 1) == 0 and nodes == p:
        cases.append(("allreduce recursive_doubling", math.log2(p) * d(data.nbytes),
                      reduce_with("recursive_doubling")))
    return cases


def _interleaved(world: MPI.Intracomm, cases: dict[str, Callable[[], None]],
                 reps: int) -> dict[str, tuple[float, float]]:
    """(median, fastest) over ``reps`` rounds of the slowest rank's seconds, the cases
    alternating."""
    samples: dict[str, list[float]] = {name: [] for name in cases}
    for name in cases:  # warm up: scratch buffers, plans
        cases[name]()
    names = list(cases)
    for rep in range(reps):
        for i in range(len(names)):
            name = names[(rep + i) % len(names)]
            world.Barrier()
            start = time.perf_counter()
            cases[name]()
            samples[name].append(world.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return {name: (float(np.median(s)), min(s)) for name, s in samples.items()}
