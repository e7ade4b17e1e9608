"""Cross-memory attach: a rank reads another rank's memory with ``process_vm_readv``
(Linux 3.2+), so a byte moves between ranks of a node in one copy, where a shared window
needs two (in, then out). MPI libraries use the same call for large messages inside a node.

Whether one process may read another depends on the kernel's ptrace policy: under Yama's
``ptrace_scope = 1`` (Ubuntu's default) only a declared tracer may, so every process
declares any process of its user one, with ``prctl(PR_SET_PTRACER, PR_SET_PTRACER_ANY)``,
as Open MPI's CMA path does. :func:`works` then tries one read per rank, so that every rank
of a node knows alike whether the path is there before an algorithm relies on it.
"""

from __future__ import annotations

import ctypes
import os

import numba
import numpy as np
from mpi4py import MPI
from numba import types

__all__ = ["read", "publish", "read_published", "works", "compile_kernels"]

# All six arguments are machine words (pid, two iovec arrays and their lengths, flags);
# bound by name, so that the numba functions calling it can be cached.
_process_vm_readv = types.ExternalFunction("process_vm_readv", types.int64(*[types.int64] * 6))

_PR_SET_PTRACER = 0x59616D61
_PR_SET_PTRACER_ANY = ctypes.c_ulong(-1)


@numba.njit(cache=True, nogil=True)
def read(pid, address, dst, at, n, iov):
    """Copy ``n`` bytes at ``address`` in process ``pid`` to byte ``at`` of ``dst``
    (``iov``: 4 scratch words for the two iovecs): whether all arrived."""
    iov[0] = dst.ctypes.data + at
    iov[1] = n
    iov[2] = address
    iov[3] = n
    return _process_vm_readv(pid, iov.ctypes.data, 1, iov.ctypes.data + 16, 1, 0) == n


@numba.njit(cache=True, nogil=True, inline="always")
def publish(words, stride, rank, buffer, pid):
    """Put where ``buffer`` lies and this process's pid in words 1 and 2 of ``rank``'s
    chunk of a shared window (``words``: the window as int64, ``stride``: a chunk in
    words), beside its first flag, for :func:`read_published`."""
    words[rank * stride + 1] = buffer.ctypes.data
    words[rank * stride + 2] = pid


@numba.njit(cache=True, nogil=True, inline="always")
def read_published(words, stride, k, offset, dst, at, n, iov):
    """:func:`read` of ``n`` bytes from byte ``offset`` of the buffer rank ``k``
    published (:func:`publish`)."""
    return read(words[k * stride + 2], words[k * stride + 1] + offset, dst, at, n, iov)


def _allow_peers() -> None:
    """Let any process of this user read this one (a no-op where Yama is absent: the call
    then fails with ``EINVAL``, which leaves nothing to allow)."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PTRACER, _PR_SET_PTRACER_ANY, 0, 0, 0)


def works(node: MPI.Intracomm) -> bool:
    """Whether every rank of ``node`` (ranks sharing memory) can read the next rank's memory
    (collective over ``node``: one ``MPI_Allgather`` and one ``MPI_Allreduce``)."""
    p, r = node.Get_size(), node.Get_rank()
    if p == 1:
        return True
    _allow_peers()
    mine = np.array([os.getpid(), r + 1], np.int64)  # the word a peer reads: r + 1
    where = node.allgather((os.getpid(), mine.ctypes.data + 8))
    pid, address = where[(r + 1) % p]
    got = np.zeros(1, np.int64)
    ok = read(pid, address, got, 0, 8, np.empty(4, np.int64)) and got[0] == (r + 1) % p + 1
    return bool(node.allreduce(int(ok), op=MPI.MIN))  # ``mine`` lives until all have read


def compile_kernels() -> None:
    """Run :func:`read` once, on this process's own memory with the argument types of
    :func:`works`' probe, so that a group's probe (in a run's first collective) does not
    compile it."""
    mine, got = np.ones(1, np.int64), np.zeros(1, np.int64)
    read(os.getpid(), mine.ctypes.data, got, 0, 8, np.empty(4, np.int64))
