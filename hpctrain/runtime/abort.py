"""Failure on one rank ends the whole job, with a message, never a hang.

MPI gives no way to unblock ranks waiting in a collective for a peer that raised, so the
only safe reaction to an error on a subset of ranks is ``MPI_Abort``: the launcher kills
every rank and exits non-zero. :func:`run_guarded` wraps a command's body:

- a user error (:class:`~hpctrain.errors.HpctrainError`) prints one line naming the rank and
  exits with code 2 (through ``Abort(2)`` when other ranks may be waiting);
- stdout's reader leaving (``hpctrain trace summarize FILE | head``) ends the job quietly
  with code 141, as a Unix filter killed by ``SIGPIPE`` does;
- anything else prints the rank and traceback and aborts with code 1.

Errors raised identically by every rank before the first message (config validation) are
handled by the CLI without aborting, so they print once. Where ranks may or may not fail
together (opening the data, a step's non-finite values), :func:`agree` shares every rank's
outcome first and raises :class:`AgreedError` on all of them: the job prints one line, and
exits with code 2 without an abort when the whole world agreed.
"""

from __future__ import annotations

import os
import select
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from typing import TypeVar

from mpi4py import MPI

from hpctrain.errors import HpctrainError
from hpctrain.runtime.waiting import watching

__all__ = ["USER_ERROR", "AgreedError", "agree", "run_guarded", "abort_job", "world_rank",
           "world_size"]

USER_ERROR = 2
BROKEN_PIPE = 128 + 13  # what a shell reports for a filter that SIGPIPE ended
_FORWARD_S = 0.3  # before MPI_Abort: time for the launcher to relay the last line
T = TypeVar("T")


def world_rank() -> int:
    return MPI.COMM_WORLD.Get_rank()


def world_size() -> int:
    return MPI.COMM_WORLD.Get_size()


def abort_job(message: str | None, code: int) -> None:
    """Print ``message`` (if any) to stderr and end every rank of the job with ``code``."""
    sys.stdout.flush()
    if message is not None:
        print(message, file=sys.stderr, flush=True)
    if world_size() > 1:
        time.sleep(_FORWARD_S)
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # MPI_Abort may return before the launcher kills us: run nothing more


class AgreedError(HpctrainError):
    """A user error that every rank of ``comm`` raises together (see :func:`agree`)."""

    def __init__(self, message: str, comm: MPI.Intracomm) -> None:
        super().__init__(message)
        self.comm = comm


def agree(comm: MPI.Intracomm, body: Callable[[], T]) -> T:
    """Run ``body`` on every rank of ``comm`` and agree on its user errors.

    Collective over ``comm``: one ``allgather`` of each rank's world rank and error text
    (``None`` on success). When ``body`` raised an :class:`HpctrainError` on any rank, every
    rank raises :class:`AgreedError` with the lowest failing rank's message, prefixed by the
    world ranks that failed with it; :func:`run_guarded` then prints it once.
    """
    try:
        result, error = body(), None
    except HpctrainError as exc:
        result, error = None, str(exc)
    with watching("agree", comm):
        outcomes = comm.allgather((world_rank(), error))
    failed = [(rank, text) for rank, text in outcomes if text is not None]
    if not failed:
        return result
    message = failed[0][1]
    same = [rank for rank, text in failed if text == message]
    others = len(failed) - len(same)
    tail = f" (and {others} more rank{'s' if others > 1 else ''} failing otherwise)" \
        if others else ""
    raise AgreedError(f"[{_ranks(same)}] {message}{tail}", comm)


def _ranks(ranks: Sequence[int]) -> str:
    """``rank 3``, or ``ranks 0-2, 5`` (sorted ranks as ranges)."""
    if len(ranks) == 1:
        return f"rank {ranks[0]}"
    spans: list[list[int]] = []
    for rank in ranks:
        if spans and rank == spans[-1][1] + 1:
            spans[-1][1] = rank
        else:
            spans.append([rank, rank])
    return "ranks " + ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in spans)


def _end_agreed(exc: AgreedError) -> None:
    """Print an agreed error once; leave together when the whole world agreed, else abort
    (after a barrier over the agreeing ranks, so the line is out first)."""
    if exc.comm.Get_rank() == 0:
        print(f"hpctrain: error: {exc}", file=sys.stderr, flush=True)
    if exc.comm.Get_size() < world_size():
        exc.comm.Barrier()
        time.sleep(_FORWARD_S)
        MPI.COMM_WORLD.Abort(USER_ERROR)
    sys.exit(USER_ERROR)


def _stdout_gone() -> bool:
    """Whether stdout is a pipe or socket whose reader has left (``poll`` reports an
    error on it), so that a broken pipe elsewhere still counts as a bug."""
    poller = select.poll()
    poller.register(sys.stdout.fileno(), select.POLLOUT)
    return any(events & (select.POLLERR | select.POLLHUP) for _, events in poller.poll(0))


def run_guarded(body: Callable[[], T]) -> T:
    """Run ``body``; on an exception on this rank, end the whole job (see module doc)."""
    try:
        return body()
    except AgreedError as exc:
        _end_agreed(exc)
    except HpctrainError as exc:
        abort_job(f"hpctrain: error: [rank {world_rank()}] {exc}", USER_ERROR)
    except KeyboardInterrupt:
        abort_job(f"hpctrain: [rank {world_rank()}] interrupted", 130)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - any bug must abort the job, not hang it
        if isinstance(exc, BrokenPipeError) and _stdout_gone():  # nothing left to print to
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
            abort_job(None, BROKEN_PIPE)
        text = "".join(traceback.format_exception(exc))
        abort_job(f"hpctrain: rank {world_rank()} failed, aborting the job:\n{text}", 1)
    raise AssertionError("unreachable")
