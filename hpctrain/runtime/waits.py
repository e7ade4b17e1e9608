"""Completing MPI requests without burning the core a peer needs, under the watchdog.

MPICH's blocking waits spin. When ranks outnumber cores (servers and workers sharing a node,
or a laptop), a spinning rank steals the core the rank it waits for needs. :func:`wait_all`
spins briefly (low latency when the answer is near), then polls with a growing sleep, inside
the :class:`~hpctrain.runtime.waiting.watching` record it is given (``Wait``), which the
watchdog's timer watches (warn, then abort), and which the timeline records as a span.
:func:`waiting` is that frame (also the emulated network's), and it adds the main thread's
blocked seconds to :func:`waited_s`, so a step can tell its own work from its waits on others
(the straggler injection delays only the former).
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

from mpi4py import MPI

from hpctrain.runtime import trace
from hpctrain.runtime.waiting import watching as Wait

__all__ = ["wait_all", "waiting", "waited_s", "Backoff", "Wait"]

_waited = [0.0]  # the main thread's seconds inside waiting()

_SPINS = 200
_FIRST_PAUSE_S = 20e-6
_MAX_PAUSE_S = 1e-3


class Backoff:
    """Spin, then sleep for doubling pauses up to 1 ms; ``reset`` after progress.

    With ``yield_s``, the first ``yield_s`` seconds after the spins yield the core instead
    of sleeping: a peer that arrives then is seen at once, not at the end of a pause (a
    sleep of 20 us-1 ms added up to that much to every wait that outlasted the spins, which
    the skew between ranks at each exchange of a step does). ``spins``: polls before that
    (the shared window's waits poll none where ranks outnumber cores: a polling rank holds
    the core a peer needs).
    """

    def __init__(self, yield_s: float = 0.0, spins: int = _SPINS) -> None:
        self.yield_s, self.spins = yield_s, spins
        self.reset()

    def reset(self) -> None:
        self._spins = 0
        self._pause = _FIRST_PAUSE_S
        self._yield_until = 0.0

    def idle(self, longest: float = _MAX_PAUSE_S) -> None:
        """Spin, yield or sleep, never longer than ``longest`` (when something is due then)."""
        self._spins += 1
        if self._spins <= self.spins:
            return
        if self.yield_s:
            now = time.perf_counter()
            if self._spins == self.spins + 1:
                self._yield_until = now + self.yield_s
            if now < self._yield_until:
                os.sched_yield()
                return
        time.sleep(min(self._pause, longest))
        self._pause = min(_MAX_PAUSE_S, self._pause * 2)


def wait_all(requests: list[MPI.Request], wait: Wait) -> None:
    """Complete every request in ``requests``; ``wait`` says what for (the operation, the
    communicator, the ranks of it waited for), so that the watchdog can name the ranks a
    stalled wait is missing (the timeline shows it as ``wait OP``)."""
    backoff = Backoff()
    with waiting(wait):
        while not MPI.Request.Testall(requests):
            backoff.idle()


@contextmanager
def waiting(wait: Wait) -> Iterator[None]:
    """A blocking wait described by ``wait``: watched, a timeline span, and counted in
    :func:`waited_s` when on the main thread."""
    start = time.perf_counter()
    try:
        with trace.span(f"wait {wait.op}"), wait:
            yield
    finally:
        if threading.current_thread() is threading.main_thread():
            _waited[0] += time.perf_counter() - start


def waited_s() -> float:
    """Seconds the main thread has spent blocked in :func:`waiting` so far."""
    return _waited[0]
