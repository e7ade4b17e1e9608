"""Preemption and time limits: SIGTERM or SIGUSR1 stop the run at an agreed step, resumable.

Batch systems warn a job before they end it: Slurm sends the signal asked for with
``--signal=B:USR1@SECONDS`` (the batch script forwards it to the ranks), a preemption or
``scancel`` sends SIGTERM. :class:`Preemption` turns either into a flag (the handler only
records it; nothing is interrupted). After every step each worker starts one
``MPI_Iallreduce(MAX)`` of its flag (and of whether its clock says a time-based checkpoint
is due) over the workers and completes the one it started
``lag`` steps earlier (0: this step's; watched, :func:`~hpctrain.runtime.waits.wait_all`): a
signal that reached some ranks only, or reached them in different steps, still stops every
worker after the same step, and the agreement never makes the workers meet at every step,
which would turn SSP and ASP into BSP. With ``lag`` beyond the staleness the sync model
allows, the completion never waits for a worker the model would not wait for either (under
ASP it caps how far one worker runs ahead at ``lag`` steps). The trainer then writes a
checkpoint of that step and ends; the command exits with :data:`EXIT_STOPPED` on every rank
(:func:`exit_code`), the code the job scripts requeue on. A parameter server's signal
reaches the workers in its replies (:func:`received`, :func:`relay`): a node that holds only
servers may be the one the batch system signals.
"""

from __future__ import annotations

import logging
import signal
from collections import deque
from dataclasses import dataclass

import numpy as np
from mpi4py import MPI

from hpctrain.runtime.waits import Wait, wait_all

__all__ = ["EXIT_STOPPED", "SIGNALS", "Agreed", "Preemption", "exit_code", "received",
           "relay"]

EXIT_STOPPED = 75  # EX_TEMPFAIL: stopped by a signal after a checkpoint; resume the run dir
SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Agreed:
    """The workers' common verdict after a step."""

    stop: bool
    """Some worker was signalled: checkpoint this step and stop."""
    save: bool
    """Some worker's clock said a time-based checkpoint was due."""


class Preemption:
    """Records SIGTERM/SIGUSR1 from installation on (every rank installs it, servers too,
    so that SIGTERM does not kill one before the workers' checkpoint); ``lag`` is the steps
    between a flag's reduction starting and its result being read."""

    def __init__(self, lag: int = 0) -> None:
        self.signal = 0
        self.lag = lag
        self._pending: deque[tuple[MPI.Request, np.ndarray, np.ndarray, int]] = deque()
        self._calls = 0  # after_step calls so far (the same count on every worker)
        self._covered = 0  # calls whose checkpoint requests a written checkpoint satisfied
        self._previous = {s: signal.signal(s, self._record) for s in SIGNALS}
        _installed[:] = [self]

    def _record(self, signum: int, frame: object) -> None:
        self.signal = signum

    def after_step(self, comm: MPI.Intracomm, save_due: bool) -> Agreed:
        """What every member of ``comm`` does after this step, from the flags of ``lag``
        steps ago: stop (a member had been signalled), checkpoint (a member's clock said one
        was due: ``save_due``). Collective over ``comm``: one watched ``Iallreduce`` of two
        integers per call, read ``lag`` calls later."""
        self._calls += 1
        call = self._calls
        flags = np.array([self.signal, int(save_due)], dtype=np.int64)
        if comm.Get_size() > 1:
            out = np.zeros(2, dtype=np.int64)
            self._pending.append((comm.Iallreduce(flags, out, op=MPI.MAX), flags, out, call))
            if len(self._pending) <= self.lag:
                return Agreed(False, False)
            request, _, flags, call = self._pending.popleft()
            wait_all([request], Wait("agree", comm))
        # a request made before the last checkpoint was written is satisfied by it: workers
        # whose clocks came due a step or more apart must not write one checkpoint each
        agreed = Agreed(bool(flags[0]), bool(flags[1]) and call > self._covered)
        if agreed.stop:
            log.warning("%s received: stopping after this step with a checkpoint",
                        signal.Signals(int(flags[0])).name)
            self.drain(comm)
        return agreed

    def saved(self) -> None:
        """A checkpoint was written after this step (on every worker): the checkpoint
        requests of the reductions started so far are satisfied by it."""
        self._covered = self._calls

    def drain(self, comm: MPI.Intracomm) -> None:
        """Complete the reductions still in flight (after the last step; collective)."""
        if self._pending:
            wait_all([r for r, _, _, _ in self._pending], Wait("agree", comm))
            self._pending.clear()

    def uninstall(self) -> None:
        for s, handler in self._previous.items():
            signal.signal(s, handler)
        _installed.clear()


_installed: list[Preemption] = []  # the process's handler: signals are per process


def received() -> int:
    """The signal this process's :class:`Preemption` recorded (0: none, or none installed);
    a parameter server stamps it on its replies."""
    return _installed[0].signal if _installed else 0


def relay(signum: int) -> None:
    """Record ``signum`` as if this process had received it (unless it recorded one): a
    server's signal, read from its reply, counts as the worker's own in the vote."""
    if _installed and not _installed[0].signal:
        _installed[0].signal = signum


def exit_code(world: MPI.Intracomm, stopped: bool) -> int:
    """:data:`EXIT_STOPPED` on every rank when the workers stopped early, else 0
    (collective over ``world``: one watched ``Iallreduce``)."""
    mine = np.array([int(stopped)], dtype=np.int64)
    agreed = np.zeros(1, dtype=np.int64)
    wait_all([world.Iallreduce(mine, agreed, op=MPI.MAX)], Wait("agree", world))
    return EXIT_STOPPED if agreed[0] else 0
