"""``hpctrain bench alltoall``: the toolkit's alltoallv algorithms against ``MPI_Alltoallv``.

For each total (bytes each rank sends, split evenly over the ranks) the cases are
interleaved and timed as the slowest rank's mean over back-to-back calls
(:func:`hpctrain.bench.allreduce.time_collective`); the baseline, ``MPI_Alltoallv``, is the
library called directly on the same buffers (``native`` is the toolkit's call of it, with
the Python every exchange pays). The count matrix is exchanged once before timing for every
case (the store pays that exchange once per pull or push, for two alltoallvs), so the
ratios compare the data movement itself.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import Any

import numpy as np
from mpi4py import MPI

from hpctrain.bench.allreduce import _calls_for, _interleaved, parse_sizes
from hpctrain.comm.alltoall import EXCHANGES, alltoallv, choose_exchange, exchange_counts
from hpctrain.comm.alltoall import Matrix as ByteMatrix
from hpctrain.comm.group import Group

__all__ = ["add_arguments", "run", "BASELINE", "COLUMNS"]

BASELINE = "MPI_Alltoallv"  # the library, called directly
COLUMNS = ["size_bytes", "ranks", "algorithm", "median_us", "ratio_to_native",
           "best_ratio_to_native", "selected"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--sizes", type=parse_sizes, default="4KiB-16MiB",
                        help="bytes each rank sends in all: a range of powers of two "
                             "(4KiB-16MiB, the default) or a list")
    parser.add_argument("--reps", type=int, default=7, help="interleaved repetitions")
    parser.add_argument("--json", metavar="FILE", help="write the rows as JSON")


def run(args: argparse.Namespace, group: Group) -> list[dict[str, Any]] | None:
    """Time every enabled algorithm, ``auto`` and ``MPI_Alltoallv`` for each size
    (collective over ``group``); rank 0 returns the rows."""
    p, r = group.size, group.rank
    rows = []
    for size in args.sizes:
        per = max(1, size // (4 * p))
        counts = np.full(p, per, np.int64)
        send = np.random.default_rng(r).standard_normal(per * p).astype(np.float32)
        matrix = exchange_counts(counts, group)[0]
        cases = _cases(group, send, counts, matrix)
        calls = _calls_for(group.comm, cases[BASELINE])
        times = _interleaved(group.comm, cases, args.reps, calls)
        chosen = choose_exchange(ByteMatrix(matrix, row=4), group.layout, group.params).name
        base, base_best = times[BASELINE]
        for name, (median, best) in times.items():
            rows.append({"size_bytes": per * p * 4, "ranks": p, "algorithm": name,
                         "median_s": median, "median_us": median * 1e6,
                         "ratio_to_native": median / base,
                         "best_ratio_to_native": best / base_best,
                         "selected": chosen if name == "auto" else ""})
    return rows if r == 0 else None


def _cases(group: Group, send: np.ndarray, counts: np.ndarray,
           matrix: np.ndarray) -> dict[str, Callable[[], object]]:
    """``MPI_Alltoallv`` called directly on the same buffers, ``auto`` and each enabled
    algorithm (``native`` among them: the toolkit's call of ``MPI_Alltoallv``)."""
    out = np.empty_like(send)
    offsets = np.concatenate(([0], np.cumsum(counts)[:-1]))

    def native() -> None:
        group.comm.Alltoallv([send, counts, offsets, MPI.FLOAT],
                             [out, counts, offsets, MPI.FLOAT])

    def ours(name: str) -> Callable[[], object]:
        return lambda: alltoallv(send, counts, comm=group, algorithm=name, matrix=matrix)

    names = ["auto", *(e.name for e in EXCHANGES if e.enabled(group.layout))]
    return {BASELINE: native, **{n: ours(n) for n in names}}
