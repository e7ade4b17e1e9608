"""The MPI world of one job, built once from the config and passed down.

:func:`build_topology` is the only place that reads ``MPI.COMM_WORLD``. It ``Dup()``s it so
the library's messages never match a user's, splits off the node-local communicator
(``Split_type(COMM_TYPE_SHARED)``) and the role communicators (workers, servers), lays the
workers out as the ``dp x tp x pp`` grid of :mod:`hpctrain.runtime.topology` with one
communicator per axis (and, on the torch backend, the torch.distributed groups of the same
ranks, made on the workers' :class:`~hpctrain.runtime.torchdist.Rendezvous`), picks the
device and the torch thread count. Every rank-dependent choice elsewhere
reads this object.
"""

from __future__ import annotations

import logging
import os
import socket
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from mpi4py import MPI

from hpctrain.config import CommConfig, JobConfig
from hpctrain.errors import ConfigError
from hpctrain.runtime import watchdog
from hpctrain.runtime.topology import (
    Grid,
    Roles,
    assign_roles,
    make_grid,
    place_grid,
    threads_per_rank,
)
from hpctrain.runtime.torchdist import Rendezvous
from hpctrain.runtime.waiting import watching

__all__ = ["Topology", "GridComms", "build_topology", "build_grid", "available_cores",
           "emulation_notes", "check_emulation_fits"]

WORKER, SERVER = "worker", "server"
AXES = ("tensor", "pipeline", "data")

log = logging.getLogger(__name__)


@dataclass
class GridComms:
    """This worker's place in a parallel grid and one communicator per axis.

    ``comms[axis]`` (``tensor``, ``pipeline``, ``data``) holds the ranks sharing the other
    two coordinates, ranked by the coordinate on ``axis``. ``torch_groups[axis]`` is the
    torch.distributed process group of the same ranks in the same order, or ``None`` on the
    MPI backend.
    """

    grid: Grid
    position: int
    comms: dict[str, MPI.Intracomm]
    torch_groups: dict[str, object] | None

    @property
    def coords(self) -> tuple[int, int, int]:
        """``(data replica, pipeline stage, tensor shard)`` of this rank."""
        return self.grid.coords(self.position)

    def free(self) -> None:
        for comm in self.comms.values():
            comm.Free()
        self.comms.clear()
        self.torch_groups = None


@dataclass
class Topology:
    """Communicators and placement of this rank. Collectives on ``world`` involve everyone;
    ``role_comm`` holds only the ranks of this rank's role (workers or servers)."""

    world: MPI.Intracomm
    node: MPI.Intracomm
    role_comm: MPI.Intracomm
    roles: Roles
    device: torch.device
    threads: int
    backend: str = "mpi"
    """Tensor/pipeline traffic: ``mpi``, or ``torch`` (NCCL on CUDA, gloo on CPU)."""
    grid: GridComms | None = None
    """The workers' ``dp x tp x pp`` grid (``None`` on servers)."""
    hostname: str = field(default_factory=socket.gethostname)
    comm_config: CommConfig = field(default_factory=CommConfig)
    """The job's collectives settings, for every group built over these communicators."""
    _kept: dict[str, Any] = field(default_factory=dict, repr=False)
    _rendezvous: Rendezvous | None = field(default=None, repr=False)

    @property
    def rank(self) -> int:
        return self.world.Get_rank()

    @property
    def size(self) -> int:
        return self.world.Get_size()

    @property
    def local_rank(self) -> int:
        return self.node.Get_rank()

    @property
    def local_size(self) -> int:
        return self.node.Get_size()

    @property
    def role(self) -> str:
        return SERVER if self.roles.is_server(self.rank) else WORKER

    @property
    def is_worker(self) -> bool:
        return self.role == WORKER

    @property
    def workers(self) -> int:
        return self.roles.workers

    @property
    def worker_rank(self) -> int:
        """Index among the workers (valid on workers only)."""
        return self.role_comm.Get_rank()

    @property
    def torch_backend(self) -> str:
        """The torch.distributed backend of this rank's device: NCCL on CUDA, else gloo."""
        return "nccl" if self.device.type == "cuda" else "gloo"

    def rendezvous(self) -> Rendezvous:
        """The workers' torch.distributed store; created on the first call, which is
        collective over the workers (see :class:`Rendezvous`)."""
        if self._rendezvous is None:
            if self.device.type == "cuda":
                torch.cuda.set_device(self.device)
            self._rendezvous = Rendezvous(self.role_comm)
        return self._rendezvous

    def keep(self, name: str, make: Callable[[], Any]) -> Any:
        """The object kept under ``name``, made by ``make()`` on the first call: owners of
        resources built over these communicators (the collectives' groups,
        :mod:`hpctrain.comm.owner`, which ``runtime`` cannot import) live as long as the
        Topology, and :meth:`free` closes them first."""
        if name not in self._kept:
            self._kept[name] = make()
        return self._kept[name]

    def free(self) -> None:
        """Close what :meth:`keep` holds (newest first), then free every communicator
        (collective over the world)."""
        for name in reversed(list(self._kept)):
            self._kept.pop(name).close()
        if self.grid is not None:
            self.grid.free()
        self.grid = None
        self._rendezvous = None
        for comm in (self.role_comm, self.node, self.world):
            if comm != MPI.COMM_NULL:
                comm.Free()


def affinity() -> frozenset[int]:
    """The cores this process may run on (its affinity mask, as Slurm/PBS set it)."""
    try:
        return frozenset(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return frozenset(range(os.cpu_count() or 1))


def available_cores() -> int:
    """How many cores :func:`affinity` allows."""
    return len(affinity())


def check_emulation_fits(emulate: str, node_ranks: int, ranks: int) -> None:
    """``comm.emulate`` needs every rank on one machine (``node_ranks``, the ranks sharing
    this rank's memory, are all ``ranks``)."""
    if emulate and node_ranks != ranks:
        raise ConfigError(f"comm.emulate = {emulate!r} compares send and arrival times on one "
                          f"clock, so every rank must run on one machine; this job spans real "
                          f"nodes of {node_ranks} of its {ranks} ranks")


def build_topology(config: JobConfig, base: MPI.Intracomm | None = None) -> Topology:
    """Build the job's communicators and placement; collective over ``base``
    (``MPI.COMM_WORLD`` unless a test hands in another world, such as ``COMM_SELF``).

    Raises :class:`ConfigError` identically on every rank when the world does not fit the
    config (servers, parallel grid), before any message is exchanged.
    """
    base = MPI.COMM_WORLD if base is None else base
    roles = assign_roles(base.Get_size(), config.ps.servers)
    _check_fits(config, roles)
    par = config.parallel
    shape = make_grid(roles.workers, par.tp, par.pp, par.dp)
    world = base.Dup()
    world.Set_name("hpctrain.world")
    rank = world.Get_rank()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    node.Set_name("hpctrain.node")
    check_emulation_fits(config.comm.emulate, node.Get_size(), world.Get_size())
    role_comm = world.Split(1 if roles.is_server(rank) else 0, key=rank)
    role_comm.Set_name("hpctrain.servers" if roles.is_server(rank) else "hpctrain.workers")
    rc = config.runtime
    if base == MPI.COMM_WORLD:
        watchdog.watch(world, rc.watchdog_warn_s, rc.watchdog_abort_s)
    mine = affinity()
    with watching("allgather", node):
        masks = node.allgather(mine)
    threads = threads_per_rank(mine, masks, config.runtime.threads)
    torch.set_num_threads(threads)
    device = _select_device(config.runtime.device, node.Get_rank())
    backend = par.backend if par.backend != "auto" else (
        "torch" if device.type == "cuda" else "mpi")
    if config.comm.emulate and rank == 0:
        for note in emulation_notes(config, roles, backend):
            log.warning("%s", note)
    topo = Topology(world, node, role_comm, roles, device, threads, backend,
                    comm_config=config.comm)
    if topo.is_worker:
        model_parallel = shape.tp * shape.pp > 1 and backend == "torch"
        topo.grid = build_grid(role_comm, shape, topo.rendezvous() if model_parallel else None,
                               topo.torch_backend)
    return topo


def build_grid(comm: MPI.Intracomm, grid: Grid, rendezvous: Rendezvous | None = None,
               backend: str = "gloo") -> GridComms | None:
    """Lay the first ``grid.size`` ranks of ``comm`` out as ``grid`` (``None`` on the others).

    Collective over ``comm``: an ``MPI_Allgather`` of node labels (the lowest rank of each
    node, via ``Split_type`` and an ``MPI_Allreduce(MIN)`` on the node), three
    ``MPI_Comm_split`` (one per axis) and, with ``rendezvous`` (made over ``comm``), one
    ``backend`` process group per axis, made by its members in a fresh key scope.
    """
    if grid.size > comm.Get_size():
        raise ConfigError(f"parallel grid: dp = {grid.dp} x tp = {grid.tp} x pp = {grid.pp} "
                          f"needs {grid.size} ranks, the communicator has {comm.Get_size()}")
    rank = comm.Get_rank()
    with watching("create", comm):
        node = comm.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    with watching("allreduce", node):
        label = node.allreduce(rank, op=MPI.MIN)
    node.Free()
    with watching("allgather", comm):
        labels = comm.allgather(label)
    order, local = place_grid(grid, labels[:grid.size])
    position = order.index(rank) if rank in order else None
    if grid.tp > 1 and not local and rank == 0:
        log.warning("tensor groups of %d ranks span nodes: give every node a multiple of %d "
                    "workers to keep tensor-parallel traffic inside nodes", grid.tp, grid.tp)
    comms: dict[str, MPI.Intracomm] = {}
    torch_groups: dict[str, object] = {}
    scope = rendezvous.scope() if rendezvous is not None else ""
    for axis in AXES:
        groups = {"tensor": grid.tensor_groups, "pipeline": grid.pipeline_groups,
                  "data": grid.data_groups}[axis]()
        color, key = MPI.UNDEFINED, 0
        for index, group in enumerate(groups):
            if position in group:
                color, key = index, group.index(position)
                if rendezvous is not None:
                    torch_groups[axis] = rendezvous.process_group(
                        f"{scope}/{axis}/{index}", key, len(group), backend)
        with watching("create", comm):
            comms[axis] = comm.Split(color, key)
        if comms[axis] != MPI.COMM_NULL:
            comms[axis].Set_name(f"hpctrain.{axis}")  # the watchdog names waits by it
    if position is None:
        return None
    return GridComms(grid, position, comms, torch_groups if rendezvous else None)


def emulation_notes(config: JobConfig, roles: Roles, backend: str) -> list[str]:
    """What ``comm.emulate`` leaves undelayed in this job, whose tensor/pipeline traffic
    goes over ``backend`` (``parallel.backend`` resolved; warnings, one line each)."""
    notes = []
    size = config.comm.node_size
    if not roles.servers and (size == 0 or size >= roles.workers):
        notes.append(f"comm.emulate: all {roles.workers} workers sit on one emulated node "
                     f"(comm.node_size = {size}) and there is no parameter server, so no "
                     f"message is delayed; set comm.node_size below {roles.workers}")
    par = config.parallel
    if par.pp > 1 or (par.tp > 1 and backend == "torch"):
        notes.append("comm.emulate: tensor/pipeline-parallel messages between stages (and "
                     "over torch.distributed) are not delayed; only the collectives groups', "
                     "the all-to-all's and the parameter server's are")
    return notes


def _check_fits(config: JobConfig, roles: Roles) -> None:
    """Config keys that name ranks must fit this world (checked before any message)."""
    missing = [w for w in config.sync.slow_workers if w >= roles.workers]
    if missing:
        raise ConfigError(f"sync.slow_workers names worker {missing[0]}, but the job has "
                          f"{roles.workers} workers (0..{roles.workers - 1})")
    if config.ps.mode == "full" and not config.ps.servers:
        raise ConfigError("ps.mode = 'full' keeps the dense parameters on the servers: "
                          "set ps.servers >= 1")


def _select_device(choice: str, local_rank: int) -> torch.device:
    if choice == "cpu" or (choice == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise ConfigError("runtime.device = 'cuda' but torch sees no CUDA device on this node")
    return torch.device("cuda", local_rank % torch.cuda.device_count())
