"""``hpctrain bench calibrate``: measure the cost model's parameters on this machine.

Each parameter is fitted by weighted least squares (relative error) to times measured on
the group itself, so Python overheads and the ranks-per-core situation are part of the
measured latencies:

- ``p2p``: ``MPI_Sendrecv`` between ranks ``2i`` and ``2i+1``, ``alpha + beta * bytes``;
- ``net``: the same between the first ranks of two nodes (kept at the default on one node);
- ``shm``: ``alpha`` = one flag synchronisation of the node's window, ``beta`` = one core's
  copy time per byte while every rank copies;
- ``gamma``: the reduction kernel's time per byte while every rank reduces;
- ``native`` and ``torch``: ``MPI_Allreduce`` and gloo's allreduce fitted as
  ``alpha * ceil(log2 p) + beta * 2 (p-1)/p * bytes``.

Calibrated on an oversubscribed node, the latencies already include the waiting for
descheduled ranks, so ``oversubscribed`` is written as 1 (no further scaling).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import numpy as np
from mpi4py import MPI

from hpctrain.comm import kernels, torchdist
from hpctrain.comm.bench import time_collective
from hpctrain.comm.collectives import allreduce
from hpctrain.comm.group import Group
from hpctrain.comm.select import write_params
from hpctrain.comm.shm import Window
from hpctrain.comm.types import CostParams, Link

__all__ = ["calibrate", "fit", "run_calibrate"]

_REPS = 5


def fit(x: Sequence[float], times: Sequence[float], latency_weight: float = 1.0) -> Link:
    """``alpha * latency_weight + beta * x`` fitted to ``times`` (relative error)."""
    x, t = np.asarray(x, float), np.asarray(times, float)
    a = np.stack([np.full_like(x, latency_weight), x], axis=1) / t[:, None]
    (alpha, beta), *_ = np.linalg.lstsq(a, np.ones_like(t), rcond=None)
    return Link(max(float(alpha), 1e-8), max(float(beta), 1e-13))


def _median(comm: MPI.Intracomm, fn: Callable[[], object], calls: int) -> float:
    return float(np.median([time_collective(comm, fn, calls) for _ in range(_REPS)]))


def _calls(nbytes: int) -> int:
    return max(1, min(100, (4 << 20) // max(nbytes, 1)))


def _pairs(comm: MPI.Intracomm, partner: int | None, sizes: Sequence[int]) -> list[float]:
    """Seconds of one ``MPI_Sendrecv`` with ``partner`` per size (all ranks take part)."""
    out = []
    for n in sizes:
        send, recv = np.ones(n, np.uint8), np.empty(n, np.uint8)

        def exchange(send: np.ndarray = send, recv: np.ndarray = recv) -> None:
            if partner is not None:
                comm.Sendrecv(send, partner, 74, recv, partner, 74)
        exchange()
        out.append(_median(comm, exchange, _calls(n)))
    return out


def calibrate(group: Group) -> CostParams:
    """Measure every parameter (collective over ``group.comm``; same result on all ranks)."""
    comm, layout, rank = group.comm, group.layout, group.rank
    defaults = CostParams()
    sizes = [8, 1 << 10, 16 << 10, 256 << 10, 2 << 20]
    partner = rank ^ 1 if (rank ^ 1) < group.size else None
    p2p = fit(sizes, _pairs(comm, partner, sizes)) if group.size > 1 else defaults.p2p
    net = defaults.net
    if layout.nodes > 1:
        leaders = comm.allgather(rank if layout.local_rank == 0 else -1)
        first, second = [r for r in leaders if r >= 0][:2]
        peer = {first: second, second: first}.get(rank)
        net = fit(sizes, _pairs(comm, peer, sizes))

    window = Window(group.node, 64, spin=group.spin)
    sync = _median(comm, window.sync, 200)
    window.free()
    n = 4 << 20
    src, dst = np.ones(n // 4, np.float32), np.zeros(n // 4, np.float32)
    copy = _median(comm, lambda: np.copyto(dst, src), 5) / n
    gamma = _median(comm, lambda: kernels.reduce_pair(dst, src, kernels.SUM, kernels.ARITH),
                    5) / n
    shm = Link(max(sync, 1e-8), copy)

    p = group.size
    volume = 2.0 * (p - 1) / p if p > 1 else 1.0
    native = defaults.native
    torch_link = defaults.torch
    if p > 1:
        log2p = layout.log2
        ar_sizes = [8, 4 << 10, 64 << 10, 1 << 20, 8 << 20]
        buffers = [np.zeros(s // 4, np.float32) for s in ar_sizes]
        times = [_median(comm, lambda b=b: allreduce(b, comm=group, algorithm="native"),
                         _calls(b.nbytes)) for b in buffers]
        native = fit([volume * s for s in ar_sizes], times, log2p)
        if torchdist.available("gloo"):
            few = buffers[:1] + buffers[2:4]
            for b in few:
                allreduce(b, comm=group, algorithm="torch")
            times = [_median(comm, lambda b=b: allreduce(b, comm=group, algorithm="torch"),
                             _calls(b.nbytes)) for b in few]
            torch_link = fit([volume * b.nbytes for b in few], times, log2p)
    params = CostParams(p2p=p2p, net=net, shm=shm, gamma=gamma, native=native,
                        torch=torch_link,
                        oversubscribed=1.0 if layout.oversubscribed else defaults.oversubscribed,
                        source="calibrated")
    return comm.bcast(params, root=0)


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
