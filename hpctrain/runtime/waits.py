"""Completing MPI requests without burning the core a peer needs, under the watchdog.

MPICH's blocking waits spin. When ranks outnumber cores (servers and workers sharing a node,
or a laptop), a spinning rank steals the core the rank it waits for needs. :func:`wait_all`
spins briefly (low latency when the answer is near), then polls with a growing sleep; a wait
described by a :class:`~hpctrain.runtime.watchdog.Wait` is watched (warn, then abort).
"""

from __future__ import annotations

import logging
import time

from mpi4py import MPI

from hpctrain.runtime import trace, watchdog
from hpctrain.runtime.abort import abort_job
from hpctrain.runtime.watchdog import Wait

__all__ = ["wait_all", "Backoff", "Wait"]

log = logging.getLogger(__name__)

_SPINS = 200
_FIRST_PAUSE_S = 20e-6
_MAX_PAUSE_S = 1e-3


class Backoff:
    """Spin, then sleep for doubling pauses up to 1 ms; ``reset`` after progress."""

    def __init__(self) -> None:
        self.reset()

    def reset(self) -> None:
        self._spins = 0
        self._pause = _FIRST_PAUSE_S

    def idle(self) -> None:
        self._spins += 1
        if self._spins > _SPINS:
            time.sleep(self._pause)
            self._pause = min(_MAX_PAUSE_S, self._pause * 2)


def wait_all(requests: list[MPI.Request], wait: Wait | None = None) -> None:
    """Complete every request in ``requests``; ``wait`` says what for, so that the
    watchdog can name the ranks a stalled wait is missing (and the timeline shows the wait
    as ``wait OP``)."""
    if wait is None:
        _wait_all(requests, None)
        return
    with trace.span(f"wait {wait.op}"):
        _wait_all(requests, wait)


def _wait_all(requests: list[MPI.Request], wait: Wait | None) -> None:
    board = watchdog.current() if wait is not None else None
    backoff = Backoff()
    if board is None:
        while not MPI.Request.Testall(requests):
            backoff.idle()
        return
    call = board.enter(wait)
    start = time.monotonic()
    warned = False
    try:
        while not MPI.Request.Testall(requests):
            backoff.idle()
            waited = time.monotonic() - start
            if board.abort_s and waited > board.abort_s:
                abort_job(f"hpctrain: watchdog: {board.stalled(wait, call, waited)}; "
                          f"aborting the job", 1)
            if board.warn_s and not warned and waited > board.warn_s:
                log.warning("watchdog: %s", board.stalled(wait, call, waited))
                warned = True
    finally:
        board.leave()
