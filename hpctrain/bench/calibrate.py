"""``hpctrain bench calibrate``: measure the cost model's parameters on this machine.

Every parameter comes from times measured on the launched ranks themselves, all of them
working at once as they do inside a collective, so Python overheads, memory contention and
the ranks-per-core situation are part of the numbers; each is the fastest of a few
samples, since load from elsewhere only adds time. Latencies (``alpha``) come from tiny
messages and per-byte costs (``beta``, ``gamma``) from large ones (256 KiB to 16 MiB; the
dearest per byte is kept), so the model holds at both ends of the size range:

- ``p2p``: the link with which halving-doubling's cost reproduces its own whole calls over
  the node's ranks (8 bytes for ``alpha``, 256 KiB-16 MiB for ``beta``): a step of the
  point-to-point algorithms as they pay it, their Python and MPI's protocol switches
  included (``MPI_Sendrecv`` alone priced 1 MiB at two thirds of what the algorithms
  take);
- ``net``: ``MPI_Sendrecv`` between the first ranks of two nodes (kept at the default on
  one node);
- ``shm``: ``alpha`` = the shared window's one-synchronisation allreduce of 8 bytes (a
  synchronisation as a collective pays it), ``beta`` = one core's copy time per byte
  into the window;
- ``gamma``: the reduction kernel's time per byte (into the window);
- ``native`` and ``torch``: ``MPI_Allreduce`` and gloo's allreduce, as
  ``alpha * ceil(log2 p) + beta * 2 (p-1)/p * bytes``;
- ``single_copy``: the shared window's single-copy allreduce over the node's ranks, timed
  whole at 1 and 4 MiB, against ``2 (q-1)/q * bytes`` (where the ranks can read each
  other's memory);
- ``exchange_shm``, ``exchange_cma``, ``exchange_p2p``, ``exchange_native``: the
  all-to-all's exchanges, each timed whole through
  :func:`~hpctrain.comm.alltoall.alltoallv` on totals of 8 bytes and 64 KiB-4 MiB split
  evenly over the ranks, against the bytes its cost counts (the shared-memory, single-copy
  and pairwise ones on one node only, the single-copy one where the ranks can read each
  other's memory).

Calibrated on an oversubscribed node, the latencies already include the waiting for
descheduled ranks, so ``oversubscribed`` is written as 1 (no further scaling). The fit of
a link from measured points, like the file's format, belongs to the cost model
(:mod:`hpctrain.comm.calibration`).
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np
from mpi4py import MPI

from hpctrain.bench.allreduce import time_collective
from hpctrain.comm import kernels, torchdist
from hpctrain.comm.alltoall import Matrix, alltoallv, exchange_counts
from hpctrain.comm.calibration import fit, write_params
from hpctrain.comm.collectives import allreduce
from hpctrain.comm.group import Group
from hpctrain.comm.recursive import HALVING_DOUBLING
from hpctrain.comm.types import DTYPES, CostParams, Link, Request
from hpctrain.comm.window import Window, allreduce_single_copy, allreduce_small

__all__ = ["calibrate", "run_calibrate"]

_REPS = 7
_LARGE = 16 << 20
_SIZES = (256 << 10, 2 << 20, _LARGE)
_EXCHANGE_SIZES = (64 << 10, 256 << 10, 1 << 20, 4 << 20)


def _best(comm: MPI.Intracomm, fn: Callable[[], object], calls: int) -> float:
    """Fastest of a few samples: load on the machine only ever adds time."""
    return min(time_collective(comm, fn, calls) for _ in range(_REPS))


def _exchange(comm: MPI.Intracomm, partner: int | None, nbytes: int) -> tuple[float, float]:
    """(bytes, seconds) of one ``MPI_Sendrecv`` with ``partner`` (all ranks take part)."""
    send, recv = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)

    def exchange() -> None:
        if partner is not None:
            comm.Sendrecv(send, partner, 74, recv, partner, 74)
    exchange()
    return nbytes, _best(comm, exchange, _calls(nbytes))


def _calls(nbytes: int) -> int:
    return max(1, min(200, (1 << 20) // max(nbytes, 1)))


def _p2p(group: Group, gamma: float) -> Link:
    """The node's point-to-point link as the algorithms pay it: the ``alpha`` and ``beta``
    with which halving-doubling's cost model gives the times of its whole calls over the
    node's ranks (Python's share included): ``alpha`` from 8 bytes, ``beta`` the dearest
    per byte of 256 KiB-16 MiB (collective over ``group``; every node measures its own)."""
    node = Group(group.node, group.config)
    try:
        def seconds(nbytes: int) -> float:
            buf = np.zeros(nbytes // 4, np.float32)
            allreduce(buf, comm=node, algorithm="halving_doubling")
            return _best(group.comm, lambda: allreduce(buf, comm=node,
                                                       algorithm="halving_doubling"),
                         _calls(nbytes))

        def predicted(nbytes: int, link: Link) -> float:
            return HALVING_DOUBLING.cost(Request("allreduce", nbytes // 4, DTYPES["float32"]),
                                         node.layout, CostParams(p2p=link, gamma=gamma,
                                                                 oversubscribed=1.0)).seconds

        base = predicted(8, Link(0.0, 0.0))
        alpha = (seconds(8) - base) / (predicted(8, Link(1.0, 0.0)) - base)
        alpha = max(alpha, 1e-8)
        beta = max((seconds(n) - predicted(n, Link(alpha, 0.0))) /
                   (predicted(n, Link(0.0, 1.0)) - predicted(n, Link(0.0, 0.0)))
                   for n in _SIZES)
        return Link(alpha, max(beta, 1e-13))
    finally:
        node.free()


def calibrate(group: Group) -> CostParams:
    """Measure every parameter (collective over ``group.comm``; same result on all ranks)."""
    comm, layout, rank, p = group.comm, group.layout, group.rank, group.size
    tiny = np.zeros(2, np.float32)
    defaults = CostParams()
    p2p, net, native, torch_link = defaults.p2p, defaults.net, defaults.native, defaults.torch
    if layout.nodes > 1:
        leaders = [r for r in comm.allgather(rank if layout.local_rank == 0 else -1) if r >= 0]
        peer = {leaders[0]: leaders[1], leaders[1]: leaders[0]}.get(rank)
        net = fit(_exchange(comm, peer, 8), [_exchange(comm, peer, n) for n in _SIZES])

    sync = _best(comm, lambda: allreduce_small(tiny, group.arena(8), kernels.SUM,
                                                kernels.ARITH), 200) \
        if group.node.Get_size() > 1 else defaults.shm.alpha
    window = Window(group.node, _LARGE, spin=group.spin)
    src = np.ones(_LARGE // 4, np.float32)
    dst = window.row(window.rank, 0, src.dtype, src.size)  # shared memory, as in shm
    copy = _best(comm, lambda: np.copyto(dst, src), 2) / _LARGE
    gamma = _best(comm, lambda: kernels.reduce_pair(dst, src, kernels.SUM, kernels.ARITH),
                  2) / _LARGE
    window.free()
    if layout.local_size > 1:
        p2p = _p2p(group, gamma)

    if p > 1:
        volume = 2.0 * (p - 1) / p

        def allreduce_point(nbytes: int, algorithm: str) -> tuple[float, float]:
            buf = np.zeros(max(nbytes // 4, 1), np.float32)
            allreduce(buf, comm=group, algorithm=algorithm)
            return volume * buf.nbytes, _best(
                comm, lambda: allreduce(buf, comm=group, algorithm=algorithm),
                _calls(nbytes))

        native = fit(allreduce_point(8, "native"),
                     [allreduce_point(n, "native") for n in _SIZES], layout.log2)
        if torchdist.available("gloo"):
            torch_link = fit(allreduce_point(8, "torch"),
                             [allreduce_point(n, "torch") for n in _SIZES[:2]], layout.log2)
    exchanges = _exchanges(group) if p > 1 else {}
    single_copy = _single_copy(group) if layout.single_copy and layout.local_size > 1 \
        else defaults.single_copy
    params = CostParams(p2p=p2p, net=net, shm=Link(max(sync, 1e-8), copy), gamma=gamma,
                        native=native, torch=torch_link, single_copy=single_copy, **exchanges,
                        oversubscribed=1.0 if layout.oversubscribed else defaults.oversubscribed,
                        source="calibrated")
    return comm.bcast(params, root=0)


def _single_copy(group: Group) -> Link:
    """The single-copy allreduce's line over each node's ranks, from whole calls at 1 and
    4 MiB, where it overtakes the window path (larger ones leave the cache and would price
    every size at memory's cost per byte; collective over ``group``)."""
    q = group.layout.local_size

    def point(nbytes: int) -> tuple[float, float]:
        buf = np.zeros(nbytes // 4, np.float32)

        def call() -> None:
            allreduce_single_copy(buf, group.arena(0), kernels.SUM)
        call()
        return 2.0 * (q - 1) / q * nbytes, _best(group.comm, call, _calls(nbytes))
    return fit(point(1 << 20), [point(4 << 20)])


def _exchanges(group: Group) -> dict[str, Link]:
    """The all-to-all's exchange links: ``alpha`` from 8 bytes to every rank, ``beta`` the
    dearest per byte of 64 KiB-4 MiB totals (collective over ``group``)."""
    p, one_node = group.size, group.layout.nodes == 1
    counted = {"exchange_native": ("native", lambda m: m.maxima[1], p - 1)}
    if one_node:
        counted["exchange_shm"] = ("shm", lambda m: m.maxima[0], 1)
        counted["exchange_p2p"] = ("pairwise", lambda m: m.maxima[3] + m.maxima[2], p - 1)
        if group.layout.single_copy:
            counted["exchange_cma"] = ("cma", lambda m: m.maxima[1] + m.maxima[2], 1)
    links = {}
    for field, (algorithm, counts_bytes, latencies) in counted.items():
        points = [_alltoall_point(group, algorithm, total, counts_bytes)
                  for total in (8 * p, *_EXCHANGE_SIZES)]
        links[field] = fit(points[0], points[1:], latencies)
    return links


def _alltoall_point(group: Group, algorithm: str, total: int,
                    counts_bytes: Callable[[Matrix], int]) -> tuple[float, float]:
    """(the bytes the exchange's cost counts, seconds) of ``alltoallv`` with ``algorithm``
    sending ``total`` bytes from every rank, split evenly."""
    counts = np.full(group.size, max(total // (4 * group.size), 1), np.int64)
    send = np.ones(int(counts.sum()), np.float32)
    matrix = exchange_counts(counts, group)[0]

    def exchange() -> None:
        alltoallv(send, counts, comm=group, algorithm=algorithm, matrix=matrix)
    exchange()
    return counts_bytes(Matrix(matrix, group.rank, row=4)), _best(group.comm, exchange,
                                                               _calls(total))


def run_calibrate(group: Group, path: str, echo: Callable[[str], None]) -> CostParams:
    """Calibrate, then rank 0 writes ``path`` and prints the parameters."""
    params = calibrate(group)
    if group.rank == 0:
        layout = group.layout
        write_params(path, params, {
            "measured": time.strftime("%Y-%m-%dT%H:%M:%S"), "ranks": layout.size,
            "ranks_per_node": layout.local_size, "nodes": layout.nodes,
            "oversubscribed": layout.oversubscribed, "mpi": MPI.Get_library_version().split(
                "\n")[0].strip()})
        echo(f"wrote {path} (use it with --set comm.calibration='{path}'):")
        for name, value in params.to_dict().items():
            text = (f"alpha {value['alpha'] * 1e6:8.2f} us  beta {value['beta'] * 1e9:8.4f} "
                    f"ns/B ({1 / value['beta'] / 1e9:6.2f} GB/s)" if isinstance(value, dict)
                    else f"{value:.4g}")
            echo(f"  {name:<15} {text}")
    return params
