"""A server's row work split over its threads.

A parameter-server rank takes requests one at a time on its main thread, which alone makes
MPI calls. The row passes of a request (gathering its rows into the reply, applying the
sparse optimizer to a push) are numba kernels that release the GIL, and a request's slots
are unique (the client sums repeats; the server coalesces what is not), so contiguous chunks
of a request touch disjoint rows and can run at once on several threads, in any order, with
the very result of one pass. The rank's thread count is ``runtime.threads`` as resolved for
it (its cores, divided among the node's ranks that share them): where ranks share a node's
cores, one thread each, and every request runs on the main thread as before.
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

__all__ = ["RowThreads", "MIN_ROWS"]

MIN_ROWS = 4096
"""The fewest rows a chunk gets: handing a chunk to a thread costs tens of microseconds,
about what a pass over a few hundred rows takes."""


class RowThreads:
    """Runs a pass over ``n`` rows as up to ``threads`` contiguous chunks of at least
    ``min_rows`` rows (:data:`MIN_ROWS` unless given), one on the calling thread and the
    others on helper threads."""

    def __init__(self, threads: int, min_rows: int | None = None) -> None:
        self.threads = max(1, threads)
        self.min_rows = MIN_ROWS if min_rows is None else min_rows
        self._pool = (ThreadPoolExecutor(self.threads - 1, thread_name_prefix="hpctrain-rows")
                      if self.threads > 1 else None)

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """The ``[lo, hi)`` ranges a pass over ``n`` rows is cut into (balanced)."""
        k = max(1, min(self.threads, n // self.min_rows))
        return [(n * i // k, n * (i + 1) // k) for i in range(k)]

    def run(self, work: Callable[[int, int], object], n: int) -> None:
        """``work(lo, hi)`` for each chunk of ``range(n)``; returns once all are done, and
        raises the first chunk's error after every chunk has ended."""
        first, *rest = self.chunks(n)
        if not rest or self._pool is None:
            work(*first)
            return
        futures = [self._pool.submit(work, lo, hi) for lo, hi in rest]
        try:
            work(*first)
        finally:
            for future in futures:
                future.exception()  # wait for every chunk before an error propagates
        for future in futures:
            future.result()

    def close(self) -> None:
        if self._pool is not None:
            self._pool.shutdown()
