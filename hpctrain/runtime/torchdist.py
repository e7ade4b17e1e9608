"""torch.distributed over an MPI world: the toolkit's one rendezvous, and process groups made
on it without a process-wide default group.

MPI already knows every rank, so no launcher variables are needed. :class:`Rendezvous` over a
communicator works in three steps:

1. every rank's hostname is gathered (``MPI_Allgather``) and rank 0 picks the address its
   peers reach it by (:func:`listen_address`): loopback when every rank runs on this host,
   else ``MASTER_ADDR`` when set, else the address this host's name resolves to (the one an
   MPI launcher such as Hydra or srun reaches the host by);
2. rank 0 binds a listening socket on that address alone and hands it to a ``TCPStore``
   (``master_listen_fd``), so the store listens there and on no other interface, then
   broadcasts the address, the port and a random per-job key prefix (``MPI_Bcast``);
3. every rank connects; every key lives under the prefix, so two jobs' stores (or two stores
   of one job) never read each other's keys. The prefix is a namespace, not a secret from
   other users of the host.

:meth:`Rendezvous.process_group` makes a gloo (CPU) or NCCL (CUDA) backend directly on a
prefixed view of the store, over any subset of the ranks; only the members take part, and
gloo's own sockets bind the same interface. ``init_process_group`` is never called, so the
process holds no torch.distributed default group (no communicator global, STYLE.md point 3):
callers use the group objects' methods.
"""

from __future__ import annotations

import datetime
import os
import secrets
import socket

import torch.distributed as dist
from mpi4py import MPI

from hpctrain.errors import CommError
from hpctrain.runtime.waiting import watching

__all__ = ["Rendezvous", "listen_address", "TIMEOUT"]

TIMEOUT = datetime.timedelta(seconds=300)
LOOPBACK = "127.0.0.1"


def listen_address(hostnames: list[str], master_addr: str | None) -> str:
    """The address rank 0 listens on, from every rank's hostname: loopback when they are all
    the same host, else ``master_addr`` when given, else what the first name resolves to."""
    if len(set(hostnames)) == 1:
        return LOOPBACK
    if master_addr:
        return master_addr
    try:
        return socket.gethostbyname(hostnames[0])
    except OSError as exc:
        raise CommError(f"torch.distributed rendezvous: cannot resolve host "
                        f"{hostnames[0]!r} ({exc}); set MASTER_ADDR to its address") from None


class Rendezvous:
    """A ``TCPStore`` over the ranks of ``comm`` (rank ``i`` of ``comm`` is store rank
    ``i``), its keys under a per-job random prefix. Collective over ``comm``: one
    ``MPI_Allgather`` of hostnames, one ``MPI_Bcast`` of the address, the store's own
    handshake, one ``MPI_Barrier``. Process groups made on it keep the store alive."""

    def __init__(self, comm: MPI.Intracomm, timeout: datetime.timedelta = TIMEOUT) -> None:
        self.rank, self.size, self.timeout = comm.Get_rank(), comm.Get_size(), timeout
        with watching("allgather", comm):
            hostnames = comm.allgather(socket.gethostname())
        self.single_host = len(set(hostnames)) == 1
        fd, address = None, None
        if self.rank == 0:
            host = listen_address(hostnames, os.environ.get("MASTER_ADDR"))
            try:
                listener = socket.create_server((host, 0), backlog=max(128, self.size))
            except OSError as exc:
                listener, address = None, (f"cannot listen on {host} ({exc.strerror}); set "
                                           f"MASTER_ADDR to an address of this host", 0, "")
            if listener is not None:
                address = (host, listener.getsockname()[1], secrets.token_hex(8))
                fd = listener.detach()  # the store owns the socket from here on
        with watching("bcast", comm):
            host, port, prefix = comm.bcast(address, root=0)
        if not port:
            raise CommError(f"torch.distributed rendezvous on rank 0: {host}")
        self.host, self.port, self.prefix = host, port, prefix
        store = dist.TCPStore(host, port, self.size, self.rank == 0, timeout,
                              wait_for_workers=False, master_listen_fd=fd)
        self.store = dist.PrefixStore(f"hpctrain/{prefix}", store)
        self._scopes = 0
        with watching("barrier", comm):  # every rank has connected before any drops the store
            comm.Barrier()

    def scope(self) -> str:
        """A fresh key namespace for a set of groups; every rank calls it in the same order
        (a collective step of the caller, such as laying out a grid)."""
        self._scopes += 1
        return f"s{self._scopes}"

    def process_group(self, name: str, rank: int, size: int, backend: str = "gloo") -> object:
        """A ``backend`` process group of ``size`` members in which this rank is ``rank``;
        ``name`` (unique per store) keeps its keys apart. Collective over the members."""
        store = dist.PrefixStore(name, self.store)
        if backend == "nccl":
            return dist.ProcessGroupNCCL(store, rank, size)
        options = dist.ProcessGroupGloo._Options()
        options._timeout = self.timeout
        options._devices = [dist.ProcessGroupGloo.create_device(hostname=LOOPBACK)
                            if self.single_host else
                            dist.ProcessGroupGloo.create_default_device()]
        return dist.ProcessGroupGloo(store, rank, size, options)
