"""``hpctrain bench allreduce``: every algorithm against native ``MPI_Allreduce``, one launch.

For each message size the algorithms are interleaved (each repetition runs every case
once, starting from a different one), so the machine's drift hits all of them alike, and
each case's time is the slowest rank's mean over a few back-to-back calls. Reported per
size and case: the median time, algorithm bandwidth (bytes / time), bus bandwidth
(algbw * 2 (p-1)/p, the per-rank traffic of an optimal allreduce, as NCCL reports it), bus
bandwidth as a fraction of one core's memory-copy bandwidth, the time ratio to native
measured in the same run, and (one node) the time over the memory bound: the least
memory traffic of any allreduce of that size, timed as one copy of a buffer of that size
on every rank at once (:func:`memory_bound_s`). Cases: each enabled algorithm, ``auto``,
``resident`` (auto on a buffer in the node's shared window) and ``fusion`` (50 gradients
of 64 KiB through :class:`~hpctrain.comm.fusion.FusedGradients`, as a ratio to one
allreduce of the same bytes pre-joined). The ``native`` baseline is ``MPI_Allreduce``
called directly, with none of this package's dispatch.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch
from mpi4py import MPI

from hpctrain.bench import report
from hpctrain.comm import kernels, select
from hpctrain.comm.collectives import allreduce
from hpctrain.comm.fusion import FusedGradients
from hpctrain.comm.group import Group
from hpctrain.comm.types import DTYPES, Request
from hpctrain.errors import CommError

__all__ = ["Row", "parse_sizes", "memcpy_bandwidth", "memory_bound_s", "sweep", "fusion_ratio",
           "format_table", "plot", "time_collective", "run_allreduce"]

_UNITS = {"": 1, "b": 1, "k": 1 << 10, "kb": 1 << 10, "kib": 1 << 10, "m": 1 << 20,
          "mb": 1 << 20, "mib": 1 << 20, "g": 1 << 30, "gb": 1 << 30, "gib": 1 << 30}
_SAMPLE_S = 0.004  # aim for this much time per timed sample (several calls when small)


@dataclass
class Row:
    """One (size, case) cell of the sweep."""

    size_bytes: int
    algorithm: str
    ranks: int
    median_s: float
    algbw_gbs: float
    busbw_gbs: float
    memcpy_fraction: float
    ratio_to_native: float
    best_s: float  # the fastest sample: what the case costs when the machine is quiet
    best_ratio_to_native: float
    selected: str = ""  # what auto (or resident) ran
    bound_s: float = 0.0  # memory_bound_s (0: several nodes)
    ratio_to_bound: float = 0.0  # median time / bound_s


def parse_sizes(text: str) -> list[int]:
    """``4KiB-64MiB`` (every power of two in between) or ``4KiB,1MiB,...``."""
    def one(token: str) -> int:
        m = re.fullmatch(r"\s*(\d+)\s*([a-zA-Z]*)\s*", token)
        if not m or m.group(2).lower() not in _UNITS:
            raise ValueError(f"bad size {token!r} (examples: 4096, 4KiB, 64MiB)")
        size = int(m.group(1)) * _UNITS[m.group(2).lower()]
        if size < 1:
            raise ValueError(f"bad size {token!r}: a message needs at least one byte")
        return size

    if "-" in text:
        lo, _, hi = text.partition("-")
        a, b = one(lo), one(hi)
        if a <= 0 or b < a:
            raise ValueError(f"bad size range {text!r}")
        sizes = []
        while a <= b:
            sizes.append(a)
            a *= 2
        return sizes
    return [one(t) for t in text.split(",")]


def _idle_barrier(comm: MPI.Intracomm) -> None:
    """A barrier that sleeps instead of polling, so a rank timing alone has the core."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(0.0005)


def memcpy_bandwidth(comm: MPI.Intracomm, nbytes: int = 64 << 20) -> float:
    """Bytes per second one core copies (``np.copyto`` of ``nbytes``, median of 5), measured
    on rank 0 while the others sleep; the result is broadcast (``MPI_Bcast``)."""
    gbs = 0.0
    if comm.Get_rank() == 0:
        src = np.ones(nbytes, np.uint8)
        dst = np.zeros(nbytes, np.uint8)
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t0)
        gbs = nbytes / float(np.median(times))
    _idle_barrier(comm)
    return comm.bcast(gbs, root=0)


def memory_bound_s(comm: MPI.Intracomm, size: int) -> float:
    """Least time of a one-node allreduce of ``size`` bytes, bound by memory traffic.

    However it is done, the ``p`` inputs are read and the ``p`` outputs written at least
    once: ``2 p size`` bytes over ``p`` ranks, as much as each rank copying ``size`` bytes
    (a copy reads and writes them). So it is timed as that: ``np.copyto`` of ``size`` bytes
    on every rank of ``comm`` at once, the slowest rank, the fastest of 5 rounds (ranks on
    one node share its memory bandwidth, its caches and, oversubscribed, its cores, as a
    collective's do). A buffer that fits the caches is bound by them, not by memory."""
    src = np.ones(size, np.uint8)
    dst = np.zeros(size, np.uint8)
    np.copyto(dst, src)  # touch the pages first
    calls = max(1, (1 << 22) // size)  # a few MiB per sample, as the collectives' samples
    times = []
    for _ in range(5):
        comm.Barrier()
        t0 = time.perf_counter()
        for _ in range(calls):
            np.copyto(dst, src)
        times.append(comm.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX))
    return min(times)


def time_collective(comm: MPI.Intracomm, fn: Callable[[], object], calls: int) -> float:
    """Seconds per call of ``fn`` on the slowest rank (``MPI_Barrier``, one untimed call,
    ``calls`` back to back, then a max-``allreduce`` of the times). The untimed call aligns
    the ranks: they leave a barrier microseconds to milliseconds apart, and the first call
    would wait that out."""
    comm.Barrier()
    fn()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn()
    return comm.allreduce((time.perf_counter() - t0) / calls, op=MPI.MAX)


def _interleaved(comm: MPI.Intracomm, cases: dict[str, Callable[[], object]], reps: int,
                 calls: int) -> dict[str, tuple[float, float]]:
    """(median, fastest) seconds per call of each case, the cases interleaved."""
    names = list(cases)
    samples: dict[str, list[float]] = {n: [] for n in names}
    for rep in range(reps):
        for i in range(len(names)):
            name = names[(rep + i) % len(names)]
            samples[name].append(time_collective(comm, cases[name], calls))
    return {n: (float(np.median(s)), min(s)) for n, s in samples.items()}


def _calls_for(comm: MPI.Intracomm, fn: Callable[[], object]) -> int:
    t = time_collective(comm, fn, 1)
    return int(min(200, max(1, _SAMPLE_S // max(t, 1e-7))))


def sweep(group: Group, sizes: Sequence[int], algorithms: Sequence[str], reps: int,
          dtype: str = "float32", memcpy_bps: float = 0.0, bound: bool = False) -> list[Row]:
    """Time allreduce (sum) of each size with each of ``algorithms`` (names of
    :data:`~hpctrain.comm.select.ALGORITHMS`, plus ``resident``), interleaved. Collective
    over ``group.comm``; every rank returns the same rows; with ``bound``, each size's
    :func:`memory_bound_s` too."""
    dt = DTYPES[dtype]
    storage = np.float32 if dtype == "bfloat16" else (
        np.float16 if dtype == "float16" else np.dtype(dtype))
    p = group.size
    largest = max(sizes) // dt.itemsize
    resident = group.resident(largest, np.dtype(dtype)) if "resident" in algorithms and \
        dtype in ("float32", "float64") else None
    rows: list[Row] = []
    for size in sizes:
        count = size // dt.itemsize
        x = np.zeros(count, storage)
        x[:] = 0  # touch every page before timing
        cases: dict[str, Callable[[], object]] = {"native": _baseline(group, x, dt.kind)}
        chosen: dict[str, str] = {}
        for name in algorithms:
            if name == "native":  # the baseline row already is (MPI_Allreduce itself)
                continue
            if name == "resident":
                if resident is None:
                    continue
                view = resident[:count]
                cases[name] = lambda v=view: allreduce(v, comm=group)
                chosen[name] = _chosen(group, count, dtype, True)
                continue
            try:  # left out where the layout does not allow it
                select.choose(Request("allreduce", count, dt), group.layout, group.params, name)
            except CommError:
                continue
            if name == "auto":  # what allreduce(algorithm="auto") runs: comm.algorithm's
                chosen[name] = _chosen(group, count, dtype, False)
            cases[name] = lambda x=x, n=name: allreduce(x, comm=group, algorithm=n)
        for fn in cases.values():  # warm up: windows, process groups, compiled kernels
            fn()
        calls = _calls_for(group.comm, cases["native"])
        times = _interleaved(group.comm, cases, reps, calls)
        native, native_best = times["native"]
        least = memory_bound_s(group.comm, size) if bound else 0.0
        for name, (t, best) in times.items():
            algbw = size / t
            busbw = algbw * 2 * (p - 1) / p
            rows.append(Row(size, name, p, t, algbw / 1e9, busbw / 1e9,
                            busbw / memcpy_bps if memcpy_bps else 0.0, t / native, best,
                            best / native_best, chosen.get(name, ""), least,
                            t / least if least else 0.0))
    return rows


def _baseline(group: Group, x: np.ndarray, kind: int) -> Callable[[], object]:
    """What users get today: ``MPI_Allreduce`` called directly (MPI cannot add 16-bit
    floats, so for those the native family's widen-reduce-narrow stands in)."""
    if kind == kernels.ARITH:
        return lambda: group.comm.Allreduce(MPI.IN_PLACE, x, op=MPI.SUM)
    return lambda: allreduce(x, comm=group, algorithm="native")


def _chosen(group: Group, count: int, dtype: str, resident: bool) -> str:
    return select.choose(Request("allreduce", count, DTYPES[dtype], resident=resident),
                         group.layout, group.params, group.config.algorithm).name


def fusion_ratio(group: Group, bucket_bytes: int, resident: bool, reps: int,
                 tensors: int = 50, numel: int = 16384) -> tuple[float, float, int]:
    """(seconds through buckets, seconds of one pre-joined allreduce, buckets) for
    ``tensors`` gradients of ``numel`` float32, in the same kind of memory."""
    params = [torch.nn.Parameter(torch.zeros(numel)) for _ in range(tensors)]
    fused = FusedGradients(params, group, bucket_bytes, resident=resident, overlap=False)
    joined = group.resident(tensors * numel) if fused.residents[0] is not None else \
        np.zeros(tensors * numel, np.float32)

    def through_buckets() -> None:
        fused.arm()
        for p in reversed(params):
            fused.ready(p)
        fused.finish()

    cases = {"fusion": through_buckets, "joined": lambda: allreduce(joined, comm=group)}
    for fn in cases.values():
        fn()
    times = _interleaved(group.comm, cases, reps, _calls_for(group.comm, cases["joined"]))
    fused.close()
    return times["fusion"][0], times["joined"][0], len(fused.buckets)


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if n < 1024 or unit == "GiB":
            return f"{n:g} {unit}"
        n /= 1024
    raise AssertionError


def _seconds(t: float) -> str:
    return f"{t * 1e6:9.1f} us" if t < 1e-3 else f"{t * 1e3:9.2f} ms"


def format_table(rows: Sequence[Row], header: str) -> str:
    """The sweep as a text table, one block per size."""
    cells, last = [], None
    for r in rows:
        cells.append([_human(r.size_bytes) if r.size_bytes != last else "",
                      f"{r.algorithm} ({r.selected})" if r.selected else r.algorithm,
                      _seconds(r.median_s).strip(), f"{r.algbw_gbs:.3f}", f"{r.busbw_gbs:.3f}",
                      f"{r.memcpy_fraction:.1%}", f"{r.ratio_to_native:.2f}",
                      f"{r.best_ratio_to_native:.2f}",
                      f"{r.ratio_to_bound:.2f}" if r.ratio_to_bound else "-"])
        last = r.size_bytes
    return header + "\n" + report.format_table(
        ["size", "algorithm", "median", "algbw GB/s", "busbw GB/s", "of memcpy", "x native",
         "best", "x bound"], cells, left=2)


def plot(path: str | Path, rows: Sequence[Row], title: str, memcpy_gbs: float) -> None:
    """Bus bandwidth against message size, one line per case (PNG)."""
    series = {name: [(r.size_bytes, r.busbw_gbs) for r in rows if r.algorithm == name]
              for name in dict.fromkeys(r.algorithm for r in rows)}
    report.line_plot(path, series, title, "message size (bytes)", "bus bandwidth (GB/s)",
                     log_x=True, log_y=True, bold=("auto", "native"),
                     hlines=[(memcpy_gbs, "memcpy, 1 core")] if memcpy_gbs else ())


def run_allreduce(group: Group, sizes: Sequence[int], algorithms: Sequence[str], reps: int,
                  dtype: str, fusion: bool, json_path: str | None, plot_path: str | None,
                  echo: Callable[[str], None]) -> list[Row]:
    """The whole ``hpctrain bench allreduce`` run (collective over ``group.comm``); rank 0
    prints through ``echo`` and writes the files. The CLI checked ``algorithms`` before the
    world was laid out."""
    lead = group.rank == 0
    layout = group.layout
    memcpy = memcpy_bandwidth(group.comm)
    bound = layout.nodes == 1
    header = (f"allreduce (sum) of {dtype} over {layout.size} ranks on {layout.nodes} node(s)"
              f"{', oversubscribed' if layout.oversubscribed else ''}; cost model: "
              f"{group.params.source}; memcpy, 1 core: {memcpy / 1e9:.1f} GB/s; {reps} "
              f"repetitions, cases interleaved; x native = median time / MPI_Allreduce's, "
              f"best = the same for the fastest samples"
              + ("; x bound = median time / the memory bound (every rank copying a buffer of "
                 "the size at once: each input read and each output written once)"
                 if bound else ""))
    rows = sweep(group, sizes, algorithms, reps, dtype, memcpy, bound)
    if lead:
        echo(format_table(rows, header))
    meta: dict[str, object] = {"ranks": layout.size, "nodes": layout.nodes,
                               "oversubscribed": layout.oversubscribed, "dtype": dtype,
                               "memcpy_gbs": memcpy / 1e9, "reps": reps,
                               "cost_model": group.params.source}
    if fusion:
        bucket = group.config.bucket_kib * 1024
        fused, joined, buckets = fusion_ratio(group, bucket, group.config.resident, reps)
        meta["fusion"] = {"tensors": 50, "tensor_bytes": 65536, "bucket_bytes": bucket,
                          "buckets": buckets, "fused_s": fused, "joined_s": joined,
                          "ratio": fused / joined}
        if lead:
            echo(f"fusion: 50 gradients of 64 KiB in {buckets} bucket(s) of "
                 f"{_human(bucket)}: {_seconds(fused).strip()}, one pre-joined 3.125 MiB "
                 f"allreduce: {_seconds(joined).strip()}, ratio {fused / joined:.2f}")
    if lead and json_path:
        report.write_json(json_path, {**meta, "rows": [asdict(r) for r in rows]})
        echo(f"wrote {json_path}")
    if lead and plot_path:
        plot(plot_path, rows, f"allreduce, {layout.size} ranks ({dtype})", memcpy / 1e9)
        echo(f"wrote {plot_path}")
    return rows
