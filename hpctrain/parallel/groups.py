"""The two :class:`~hpctrain.parallel.types.Group` backends and their choice from the grid.

- :class:`MPIGroup`: an MPI communicator; reductions use the toolkit's collectives
  (:func:`hpctrain.comm.allreduce`), the rest MPI calls on host buffers (a CUDA
  tensor is staged through the host, which is why ``parallel.backend = "auto"`` picks torch
  on CUDA).
- :class:`TorchGroup`: a torch.distributed group (NCCL on CUDA, gloo on CPU) whose tensors
  never leave their device. These are tensor-level collectives on one grid axis, beside the
  buffer-level ones of :mod:`hpctrain.comm`, because NCCL needs device tensors and a stream.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from mpi4py import MPI

from hpctrain.comm import Group as CommGroup
from hpctrain.comm import allreduce
from hpctrain.comm.native import allgatherv
from hpctrain.comm.owner import Communicators
from hpctrain.parallel.types import Group, Pending
from hpctrain.runtime.waits import Wait, wait_all
from hpctrain.runtime.world import GridComms

__all__ = ["MPIGroup", "TorchGroup", "ParallelGroups", "parallel_groups"]

_TORCH_OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX}


class _HostRecv:
    """An ``MPI_Irecv`` into a host buffer, copied into the device tensor on ``wait``."""

    def __init__(self, request: MPI.Request, host: np.ndarray, target: torch.Tensor,
                 comm: MPI.Comm, peer: int) -> None:
        self.request, self.host, self.target = request, host, target
        self.comm, self.peer = comm, peer

    def wait(self) -> None:
        wait_all([self.request], Wait("recv", self.comm, (self.peer,)))
        self.target.copy_(torch.from_numpy(self.host))


class _MPIRequest:
    """An ``MPI_Isend``/``MPI_Irecv`` holding its host buffer until ``wait``."""

    def __init__(self, request: MPI.Request, host: np.ndarray, op: str, comm: MPI.Comm,
                 peer: int) -> None:
        self.request, self.host = request, host
        self.op, self.comm, self.peer = op, comm, peer

    def wait(self) -> None:
        wait_all([self.request], Wait(self.op, self.comm, (self.peer,)))


class MPIGroup(Group):
    """A group over the communicator of a collectives' :class:`~hpctrain.comm.Group`
    (rank = communicator rank), which its owner built with the job's ``CommConfig``."""

    def __init__(self, group: CommGroup) -> None:
        self.group, self.comm = group, group.comm
        self.rank, self.size = group.rank, group.size

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """In-place allreduce by the toolkit's cheapest algorithm for the size."""
        if self.size == 1:
            return tensor
        host = _host(tensor)
        allreduce(host, op, comm=self.group)
        return _back(tensor, host)

    def all_gather(self, tensor: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """``MPI_Allgatherv`` of the last dimension (moved to the front for the call)."""
        if self.size == 1:
            return tensor
        front = tensor.detach().movedim(-1, 0).contiguous().cpu().numpy()
        out = torch.from_numpy(allgatherv(front, self.comm)).movedim(0, -1)
        return out.to(tensor.device).contiguous()

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """``MPI_Bcast`` in place."""
        if self.size == 1:
            return tensor
        host = _host(tensor)
        with Wait("bcast", self.comm):
            self.comm.Bcast(host, root=root)
        return _back(tensor, host)

    def post(self, sends: Sequence[tuple[torch.Tensor, int]],
             recvs: Sequence[tuple[torch.Tensor, int]]) -> list[Pending]:
        """``MPI_Isend``/``MPI_Irecv``; one tag suffices since between two stages
        activations flow one way and gradients the other."""
        pending: list[Pending] = []
        for tensor, peer in sends:
            host = np.ascontiguousarray(tensor.detach().cpu().numpy())
            pending.append(_MPIRequest(self.comm.Isend(host, dest=peer), host, "send",
                                       self.comm, peer))
        for tensor, peer in recvs:
            if tensor.device.type == "cpu" and tensor.is_contiguous():
                host = tensor.numpy()
                pending.append(_MPIRequest(self.comm.Irecv(host, source=peer), host, "recv",
                                           self.comm, peer))
            else:
                host = np.empty(tuple(tensor.shape), dtype=torch.empty(0, dtype=tensor.dtype)
                                .numpy().dtype)
                pending.append(_HostRecv(self.comm.Irecv(host, source=peer), host, tensor,
                                         self.comm, peer))
        return pending


class _TorchWork:
    """A torch.distributed work item whose ``wait`` the watchdog watches (the call
    releases the GIL, so the watchdog's thread runs meanwhile)."""

    def __init__(self, work: Any, op: str, comm: MPI.Comm, peers: Sequence[int]) -> None:
        self.work, self.op, self.comm, self.peers = work, op, comm, tuple(peers)

    def wait(self) -> None:
        with Wait(self.op, self.comm, self.peers):
            self.work.wait()


class TorchGroup(Group):
    """A torch.distributed process group (a gloo or NCCL backend made on the job's
    :class:`~hpctrain.runtime.torchdist.Rendezvous`, not registered with a default group):
    its own methods are called, with group ranks, which are those of ``comm``, the MPI
    communicator of the same members, in whose name the watchdog records each wait.

    Construction is collective over the members: one ``allreduce``, because a group's first
    call must involve every member before it carries point-to-point traffic (NCCL creates
    its communicator then).
    """

    def __init__(self, group: Any, comm: MPI.Intracomm) -> None:
        self.group, self.comm = group, comm
        self.rank, self.size = comm.Get_rank(), comm.Get_size()
        self.nccl = group.name() == "nccl"
        self.device = torch.device("cuda", torch.cuda.current_device()) if self.nccl else None
        self.all_reduce(torch.zeros(1, device=self.device))

    def all_reduce(self, tensor: torch.Tensor, op: str = "sum") -> torch.Tensor:
        """``allreduce`` on the group, on the tensor's device."""
        if self.size > 1:
            opts = dist.AllreduceOptions()
            opts.reduceOp = _TORCH_OPS[op]
            _TorchWork(self.group.allreduce([tensor], opts), "allreduce", self.comm, ()).wait()
        return tensor

    def all_gather(self, tensor: torch.Tensor, sizes: Sequence[int]) -> torch.Tensor:
        """``allgather`` of the last dimension padded to the largest share, then trimmed."""
        if self.size == 1:
            return tensor
        width = max(sizes)
        padded = torch.nn.functional.pad(tensor.detach(), (0, width - tensor.shape[-1]))
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        _TorchWork(self.group.allgather([parts], [padded.contiguous()]), "allgather",
                   self.comm, ()).wait()
        return torch.cat([p[..., :n] for p, n in zip(parts, sizes, strict=True)], dim=-1)

    def broadcast(self, tensor: torch.Tensor, root: int) -> torch.Tensor:
        """``broadcast`` from group rank ``root``."""
        if self.size > 1:
            opts = dist.BroadcastOptions()
            opts.rootRank = root
            _TorchWork(self.group.broadcast([tensor], opts), "bcast", self.comm, ()).wait()
        return tensor

    def post(self, sends: Sequence[tuple[torch.Tensor, int]],
             recvs: Sequence[tuple[torch.Tensor, int]]) -> list[Pending]:
        """Every transfer as a ``send``/``recv`` of the group, coalesced into one NCCL group
        call on CUDA (as ``batch_isend_irecv`` does)."""
        if not sends and not recvs:
            return []
        coalesce = self.nccl and self.group.supports_coalescing
        if coalesce:
            self.group._start_coalescing(self.device)
        works = [_TorchWork(self.group.send([t.detach().contiguous()], peer, 0), "send",
                            self.comm, (peer,)) for t, peer in sends]
        works += [_TorchWork(self.group.recv([t], peer, 0), "recv", self.comm, (peer,))
                  for t, peer in recvs]
        if coalesce:
            peers = [peer for _, peer in [*sends, *recvs]]
            return [_TorchWork(self.group._end_coalescing(self.device), "send", self.comm,
                               peers)]
        return works


@dataclass
class ParallelGroups:
    """This rank's groups on the three axes of the grid: tensor and pipeline traffic through
    :class:`Group`, gradient averaging over ``data_group`` (the ``data`` communicator's
    collectives). ``owned`` lists the collectives' groups made for them, given back to their
    owner by :meth:`close`."""

    tensor: Group
    pipeline: Group
    data: MPI.Intracomm
    data_group: CommGroup
    owner: Communicators
    owned: list[CommGroup]

    def close(self) -> None:
        """Free the collectives' groups (collective over each axis)."""
        while self.owned:
            self.owner.release(self.owned.pop())


def parallel_groups(grid: GridComms, owner: Communicators) -> ParallelGroups:
    """Groups of ``grid``: torch.distributed ones when the grid has them, else MPI, the
    collectives' ones made by ``owner`` with the job's ``CommConfig``. Collective over the
    grid (see :class:`TorchGroup`)."""
    comms = grid.comms
    data = owner.over(comms["data"])
    if grid.torch_groups is None:
        tensor, pipeline = owner.over(comms["tensor"]), owner.over(comms["pipeline"])
        return ParallelGroups(MPIGroup(tensor), MPIGroup(pipeline), comms["data"], data,
                              owner, [data, tensor, pipeline])
    tg = grid.torch_groups
    return ParallelGroups(TorchGroup(tg["tensor"], comms["tensor"]),
                          TorchGroup(tg["pipeline"], comms["pipeline"]), comms["data"], data,
                          owner, [data])


def _host(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous host array sharing memory with ``tensor`` when it can."""
    if tensor.device.type == "cpu" and tensor.is_contiguous():
        return tensor.detach().numpy()
    return np.ascontiguousarray(tensor.detach().cpu().numpy())


def _back(tensor: torch.Tensor, host: np.ndarray) -> torch.Tensor:
    if tensor.device.type != "cpu" or not tensor.is_contiguous():
        tensor.copy_(torch.from_numpy(host))
    return tensor
