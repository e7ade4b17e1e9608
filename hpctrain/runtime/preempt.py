"""Preemption and time limits: SIGTERM or SIGUSR1 stop the run at an agreed step, resumable.

Batch systems warn a job before they end it: Slurm sends the signal asked for with
``--signal=B:USR1@SECONDS`` (the batch script forwards it to the ranks), a preemption or
``scancel`` sends SIGTERM. :class:`Preemption` turns either into a flag (the handler only
records it; nothing is interrupted). After every step the workers agree on it, one
``MPI_Iallreduce(MAX)`` of a single integer over the workers completed by
:func:`~hpctrain.runtime.waits.wait_all` (watched), so a signal that reached some ranks
only, or reached them in different steps, still stops every worker after the same step.
The trainer then writes a checkpoint of that step and ends; the command exits with
:data:`EXIT_STOPPED` on every rank (:func:`exit_code`), the code the job scripts requeue on.
"""

from __future__ import annotations

import logging
import signal

import numpy as np
from mpi4py import MPI

from hpctrain.runtime.waits import Wait, wait_all

__all__ = ["EXIT_STOPPED", "SIGNALS", "Preemption", "exit_code"]

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after a checkpoint; resume the run dir
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

log = logging.getLogger(__name__)


class Preemption:
    """Records SIGTERM/SIGUSR1 from installation on (every rank installs it, servers too,
    so that SIGTERM does not kill one before the workers' checkpoint)."""

    def __init__(self) -> None:
        self.signal = 0
        self._flag = np.zeros(1, dtype=np.int64)
        self._agreed = np.zeros(1, dtype=np.int64)
        self._previous = {s: signal.signal(s, self._record) for s in SIGNALS}

    def _record(self, signum: int, frame: object) -> None:
        self.signal = signum

    def stop_now(self, comm: MPI.Intracomm) -> bool:
        """Whether any member of ``comm`` has been signalled (collective over ``comm``:
        one watched ``Iallreduce`` of one integer)."""
        self._flag[0] = self.signal
        if comm.Get_size() == 1:
            self._agreed[0] = self._flag[0]
        else:
            wait_all([comm.Iallreduce(self._flag, self._agreed, op=MPI.MAX)],
                     Wait("agree", comm))
        if self._agreed[0]:
            name = signal.Signals(int(self._agreed[0])).name
            log.warning("%s received: stopping after this step with a checkpoint", name)
        return bool(self._agreed[0])

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)


def exit_code(world: MPI.Intracomm, stopped: bool) -> int:
    """:data:`EXIT_STOPPED` on every rank when the workers stopped early, else 0
    (collective over ``world``: one watched ``Iallreduce``)."""
    mine = np.array([int(stopped)], dtype=np.int64)
    agreed = np.zeros(1, dtype=np.int64)
    wait_all([world.Iallreduce(mine, agreed, op=MPI.MAX)], Wait("agree", world))
    return EXIT_STOPPED if agreed[0] else 0
