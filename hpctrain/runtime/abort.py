"""Failure on one rank ends the whole job, with a message, never a hang.

MPI gives no way to unblock ranks waiting in a collective for a peer that raised, so the
only safe reaction to an error on a subset of ranks is ``MPI_Abort``: the launcher kills
every rank and exits non-zero. :func:`run_guarded` wraps a command's body:

- a user error (:class:`~hpctrain.errors.HpctrainError`) prints one line naming the rank and
  exits with code 2 (through ``Abort(2)`` when other ranks may be waiting);
- anything else prints the rank and traceback and aborts with code 1.

Errors raised identically by every rank before the first message (config validation) are
handled by the CLI without aborting, so they print once.
"""

from __future__ import annotations

import os
import sys
import traceback
from collections.abc import Callable
from typing import TypeVar

from mpi4py import MPI

from hpctrain.errors import HpctrainError

__all__ = ["USER_ERROR", "run_guarded", "abort_job", "world_rank", "world_size"]

USER_ERROR = 2
T = TypeVar("T")


def world_rank() -> int:
    return MPI.COMM_WORLD.Get_rank()


def world_size() -> int:
    return MPI.COMM_WORLD.Get_size()


def abort_job(message: str, code: int) -> None:
    """Print ``message`` to stderr and end every rank of the job with ``code``."""
    sys.stdout.flush()
    print(message, file=sys.stderr, flush=True)
    if world_size() > 1:
        MPI.COMM_WORLD.Abort(code)
    os._exit(code)  # MPI_Abort may return before the launcher kills us: run nothing more


def run_guarded(body: Callable[[], T]) -> T:
    """Run ``body``; on an exception on this rank, end the whole job (see module doc)."""
    try:
        return body()
    except HpctrainError as exc:
        abort_job(f"hpctrain: error: [rank {world_rank()}] {exc}", USER_ERROR)
    except KeyboardInterrupt:
        abort_job(f"hpctrain: [rank {world_rank()}] interrupted", 130)
    except SystemExit:
        raise
    except BaseException as exc:  # noqa: BLE001 - any bug must abort the job, not hang it
        text = "".join(traceback.format_exception(exc))
        abort_job(f"hpctrain: rank {world_rank()} failed, aborting the job:\n{text}", 1)
    raise AssertionError("unreachable")
