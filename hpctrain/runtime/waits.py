"""Completing MPI requests without burning the core a peer needs, under the watchdog.

MPICH's blocking waits spin. When ranks outnumber cores (servers and workers sharing a node,
or a laptop), a spinning rank steals the core the rank it waits for needs. :func:`wait_all`
spins briefly (low latency when the answer is near), then polls with a growing sleep, inside
the :class:`~hpctrain.runtime.waiting.watching` record it is given (``Wait``), which the
watchdog's timer watches (warn, then abort), and which the timeline records as a span.
"""

from __future__ import annotations

import time

from mpi4py import MPI

from hpctrain.runtime import trace
from hpctrain.runtime.waiting import watching as Wait

__all__ = ["wait_all", "Backoff", "Wait"]

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

    def idle(self, longest: float = _MAX_PAUSE_S) -> None:
        """Spin or sleep, never longer than ``longest`` (when something is due then)."""
        self._spins += 1
        if self._spins > _SPINS:
            time.sleep(min(self._pause, longest))
            self._pause = min(_MAX_PAUSE_S, self._pause * 2)


def wait_all(requests: list[MPI.Request], wait: Wait) -> None:
    """Complete every request in ``requests``; ``wait`` says what for (the operation, the
    communicator, the ranks of it waited for), so that the watchdog can name the ranks a
    stalled wait is missing (the timeline shows it as ``wait OP``)."""
    backoff = Backoff()
    with trace.span(f"wait {wait.op}"), wait:
        while not MPI.Request.Testall(requests):
            backoff.idle()
