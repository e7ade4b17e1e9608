"""A group of ranks and everything its collectives need, built once and passed down.

:class:`Group` ``Dup()``s the communicator it is handed (so its messages never match the
caller's), splits it into nodes (``Split_type(COMM_TYPE_SHARED)``, or consecutive blocks
of ``comm.node_size`` ranks to emulate nodes on one machine) and into ``cross``
communicators (the ranks that share a local rank across nodes), reads the cost parameters
(rank 0 reads the calibration file and broadcasts it), and owns the lazily made shared
windows, scratch buffers and torch.distributed process groups (on its own
:class:`~hpctrain.runtime.torchdist.Rendezvous`, made on first use). Construction is
collective over ``comm``.

Point-to-point messages of the algorithms go through ``link`` (over ``comm``) and
``cross_link`` (over ``cross``), :class:`~hpctrain.comm.emulate.Channel` objects whose
nodes are this group's nodes: with ``comm.emulate`` they delay messages between nodes, the
shared-memory paths stay inside a node, and the cost model's ``net`` link becomes the
emulated one, so ``auto`` chooses for the emulated network.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import asdict
from typing import Any

import numpy as np
from mpi4py import MPI

from hpctrain.comm import cma, emulate
from hpctrain.comm.calibration import read_params
from hpctrain.comm.emulate import Channel
from hpctrain.comm.types import CostParams, Layout, Link
from hpctrain.comm.window import Resident, Window
from hpctrain.config import CommConfig
from hpctrain.errors import CommError
from hpctrain.runtime.torchdist import Rendezvous
from hpctrain.runtime.waiting import watching

__all__ = ["Group"]

_MIN_ARENA = 1 << 16
_SPIN = 200  # flag polls (under a microsecond each) before a waiting rank yields its core
_YIELD_S = 2e-3  # with a core per rank, a point-to-point wait yields this long, then sleeps


def emulated_node_error(real_nodes: list[int], node_size: int) -> str | None:
    """Why blocks of ``node_size`` consecutive ranks, ``real_nodes[r]`` naming rank ``r``'s
    real node, cannot be emulated nodes (one spans real nodes), or ``None``."""
    for start in range(0, len(real_nodes), node_size):
        block = real_nodes[start: start + node_size]
        if len(set(block)) > 1:
            return (f"comm.node_size = {node_size}: ranks {start}-{start + len(block) - 1} "
                    f"would form one node but share no memory (they sit on "
                    f"{len(set(block))} real nodes); use at most the ranks of one real node")
    return None


class Group:
    """The ranks of ``comm``, their node layout and the collectives' state."""

    def __init__(self, comm: MPI.Intracomm, config: CommConfig | None = None,
                 params: CostParams | None = None) -> None:
        self.config = config or CommConfig()
        with watching("create", comm):
            self.comm = comm.Dup()
        name = f"{comm.Get_name() or 'hpctrain'}.coll"
        self.comm.Set_name(name)  # the watchdog names and numbers its waits by it
        self.rank, self.size = self.comm.Get_rank(), self.comm.Get_size()
        with watching("create", self.comm):
            self._physical = self.comm.Split_type(MPI.COMM_TYPE_SHARED, key=self.rank)
            node_size = self.config.node_size
            if node_size:
                self._check_emulated_nodes(node_size)
            self.node = self.comm.Split(self.rank // node_size, key=self.rank) if node_size \
                else self._physical
            local_rank, local_size = self.node.Get_rank(), self.node.Get_size()
            self.cross = self.comm.Split(local_rank, key=self.rank)
        self.node.Set_name(f"{name}.node")
        self.cross.Set_name(f"{name}.cross")
        with watching("allgather", self.comm):
            sizes = self.comm.allgather(local_size if local_rank == 0 else 0)
            cores = set().union(*self._physical.allgather(os.sched_getaffinity(0)))
            single_copy = cma.works(self._physical)
        self.layout = Layout(
            size=self.size, rank=self.rank, local_size=local_size, local_rank=local_rank,
            nodes=sum(1 for s in sizes if s), uniform=len({s for s in sizes if s}) == 1,
            oversubscribed=self._physical.Get_size() > len(cores), single_copy=single_copy)
        self.spin = 0 if self.layout.oversubscribed else _SPIN
        self.params = params if params is not None else self._read_params()
        network = emulate.network(self.config)
        if network is not None:
            label = self.node.bcast(self.rank, root=0)
            self.params = dataclasses.replace(
                self.params, net=Link(network.latency_s, 1.0 / network.bandwidth))
        else:
            label = 0
        patience = 0.0 if self.layout.oversubscribed else _YIELD_S
        self.link = Channel.over(self.comm, label, network, patience)
        self.cross_link = Channel.over(self.cross, label, network, patience)
        self.plans: dict[tuple[Any, ...], Any] = {}  # distinct requests -> algorithm
        self.exchanges: dict[int, Any] = {}  # alltoallv size class -> auto's exchange
        self.calls: dict[tuple[Any, ...], Any] = {}  # recent buffers -> prepared call
        self._arena: Window | None = None
        self._residents: list[Resident] = []
        self._scratch = np.empty(0, np.uint8)
        self._torch: dict[str, Any] = {}
        self._rendezvous: Rendezvous | None = None

    def _check_emulated_nodes(self, node_size: int) -> None:
        """Emulated nodes must lie inside real ones: a shared window over ranks that share
        no memory is undefined (``MPI_Allgather`` over ``comm`` of each rank's real node,
        so every rank raises the same error)."""
        with watching("allgather", self.comm):
            leader = self._physical.bcast(self.rank, root=0)
            leaders = self.comm.allgather(leader)
        error = emulated_node_error(leaders, node_size)
        if error:
            raise CommError(error)

    def _read_params(self) -> CostParams:
        """Rank 0 reads the calibration file and broadcasts it (``MPI_Bcast``), so a file
        that only some ranks can read still gives every rank the same model or error."""
        path = self.config.calibration
        if not path:
            return CostParams()
        result: tuple[str, Any] = ("", None)
        if self.rank == 0:
            try:
                params = read_params(path)
                result = ("", (asdict(params), params.source))
            except CommError as exc:
                result = (str(exc), None)
        with watching("bcast", self.comm):
            error, data = self.comm.bcast(result, root=0)
        if error:
            raise CommError(f"comm.calibration: {error}")
        return CostParams.from_dict(data[0], data[1])

    # -- state the algorithms use -----------------------------------------------------------

    def arena(self, nbytes: int) -> Window:
        """The node's scratch window with two halves of at least ``nbytes`` per rank
        (re-allocated, collectively over ``node``, when a larger message arrives)."""
        if self._arena is None or self._arena.row_bytes < nbytes:
            size = max(_MIN_ARENA, 1 << (max(nbytes, 1) - 1).bit_length())
            if self._arena is not None:
                self._arena.free()
            self._arena = Window(self.node, size, rows=2, slots=3, spin=self.spin)
        return self._arena

    def scratch(self, count: int, dtype: np.dtype) -> np.ndarray:
        """A reusable buffer of ``count`` elements (its contents are not kept)."""
        nbytes = count * dtype.itemsize
        if self._scratch.nbytes < nbytes:
            self._scratch = np.empty(max(nbytes, 2 * self._scratch.nbytes), np.uint8)
        return self._scratch[:nbytes].view(dtype)

    def resident(self, count: int, dtype: np.dtype | str = np.float32,
                 slots: int = 0) -> np.ndarray:
        """A buffer of ``count`` elements in the node's shared memory (collective over
        ``node``); allreduces of it or of its slices need no copies. ``slots`` reserves
        flags for that many nonblocking bucket allreduces (:mod:`hpctrain.comm.fusion`)."""
        res = Resident(self.node, count, np.dtype(dtype), slots, self.spin)
        self._residents.append(res)
        return res.array

    def resident_of(self, arr: np.ndarray) -> Resident | None:
        """The resident buffer ``arr`` lies in (on this rank's row), if any."""
        for res in self._residents:
            if res.window.contains(arr) is not None:
                return res
        return None

    @property
    def has_residents(self) -> bool:
        return bool(self._residents)

    def torch_group(self, backend: str) -> Any:
        """The torch.distributed process group of this group (made on first use,
        collectively over ``comm``)."""
        if backend not in self._torch:
            if self._rendezvous is None:
                self._rendezvous = Rendezvous(self.comm)
            self._torch[backend] = self._rendezvous.process_group(
                f"comm-{backend}", self.rank, self.size, backend)
        return self._torch[backend]

    def free(self) -> None:
        """Release windows and communicators (collective over ``comm``)."""
        for res in self._residents:
            res.free()
        self._residents.clear()
        if self._arena is not None:
            self._arena.free()
            self._arena = None
        self._torch.clear()
        self._rendezvous = None
        self.link.close()
        self.cross_link.close()
        comms = [self.cross, self.node, self.comm]
        if self.node is not self._physical:
            comms.append(self._physical)
        for c in comms:
            c.Free()
