"""torch.distributed over an MPI world: rendezvous over MPI, groups over the same ranks.

MPI already knows every rank, so no launcher variables are needed: rank 0 of the
communicator opens a ``TCPStore`` on a free port (the OS picks it), an ``MPI_Bcast`` tells
the others its host and port, and every rank joins with its MPI rank. The backend follows
the device: NCCL when the dense model runs on CUDA (tensors stay on the device), gloo on
CPU (how the tests exercise this path). torch.distributed keeps one default group per
process; :class:`TorchWorld` owns it and :meth:`TorchWorld.close` releases it.
"""

from __future__ import annotations

import datetime
import os
import socket

import torch
import torch.distributed as dist
from mpi4py import MPI

from hpctrain.errors import CommError

__all__ = ["TorchWorld"]

TIMEOUT = datetime.timedelta(seconds=300)


class TorchWorld:
    """The torch.distributed default group over ``comm``: rank ``i`` of ``comm`` is torch
    rank ``i``. Collective over ``comm`` (one ``MPI_Bcast`` of the store address)."""

    def __init__(self, comm: MPI.Intracomm, device: torch.device) -> None:
        if dist.is_initialized():
            raise CommError("torch.distributed is already initialised in this process; "
                            "free the previous Topology first")
        self.backend = "nccl" if device.type == "cuda" else "gloo"
        rank, size = comm.Get_rank(), comm.Get_size()
        store, address = None, None
        if rank == 0:
            host = os.environ.get("MASTER_ADDR") or socket.gethostname()
            store = dist.TCPStore(host, 0, size, is_master=True, wait_for_workers=False,
                                  timeout=TIMEOUT)
            address = (host, store.port)
        host, port = comm.bcast(address, root=0)
        if store is None:
            store = dist.TCPStore(host, port, size, is_master=False, timeout=TIMEOUT)
        if device.type == "cuda":
            torch.cuda.set_device(device)
        dist.init_process_group(self.backend, store=store, rank=rank, world_size=size,
                                timeout=TIMEOUT)
        self.rank, self.size = rank, size

    def new_group(self, ranks: list[int]) -> dist.ProcessGroup | None:
        """A group of torch ranks ``ranks`` (group rank ``i`` is ``ranks[i]``); every rank of
        the world must call it, in the same order (torch.distributed's rule); members get
        the group, others ``None``."""
        group = dist.new_group(ranks, backend=self.backend, sort_ranks=False)
        return group if self.rank in ranks else None

    def close(self) -> None:
        if dist.is_initialized():
            dist.destroy_process_group()
