"""The MPI world of one job, built once from the config and passed down.

:func:`build_topology` is the only place that reads ``MPI.COMM_WORLD``. It ``Dup()``s it so
the library's messages never match a user's, splits off the node-local communicator
(``Split_type(COMM_TYPE_SHARED)``) and the role communicators (workers, servers), picks the
device and the torch thread count. Every rank-dependent choice elsewhere reads this object.
"""

from __future__ import annotations

import os
import socket
from dataclasses import dataclass, field

import torch
from mpi4py import MPI

from hpctrain.config import JobConfig
from hpctrain.errors import ConfigError
from hpctrain.runtime.topology import Roles, assign_roles, threads_per_rank

__all__ = ["Topology", "build_topology", "available_cores"]

WORKER, SERVER = "worker", "server"


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
    hostname: str = field(default_factory=socket.gethostname)

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

    def free(self) -> None:
        for comm in (self.role_comm, self.node, self.world):
            if comm != MPI.COMM_NULL:
                comm.Free()


def available_cores() -> int:
    """Cores this process may run on (its affinity mask, as Slurm/PBS set it)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # pragma: no cover - non-Linux
        return os.cpu_count() or 1


def build_topology(config: JobConfig, base: MPI.Intracomm | None = None) -> Topology:
    """Build the job's communicators and placement; collective over ``base``
    (``MPI.COMM_WORLD`` unless a test hands in another world, such as ``COMM_SELF``).

    Raises :class:`ConfigError` identically on every rank when the world does not fit the
    config, before any message is exchanged.
    """
    base = MPI.COMM_WORLD if base is None else base
    roles = assign_roles(base.Get_size(), config.ps.servers)
    _check_fits(config, roles)
    world = base.Dup()
    rank = world.Get_rank()
    node = world.Split_type(MPI.COMM_TYPE_SHARED, key=rank)
    role_comm = world.Split(1 if roles.is_server(rank) else 0, key=rank)
    threads = threads_per_rank(available_cores(), node.Get_size(), config.runtime.threads)
    torch.set_num_threads(threads)
    device = _select_device(config.runtime.device, node.Get_rank())
    return Topology(world, node, role_comm, roles, device, threads)


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
