"""The one owner of a job's :class:`~hpctrain.comm.group.Group` objects.

The :class:`~hpctrain.runtime.world.Topology` builds and frees the job's MPI communicators
(workers, servers, the data/tensor/pipeline axes), but it cannot build the collectives'
groups over them: ``runtime`` lies below ``comm`` in the layers. So the owner lives in the
lowest layer that can, here, and the Topology holds it: :func:`communicators` makes the
job's :class:`Communicators` once per Topology (stored with
:meth:`~hpctrain.runtime.world.Topology.keep`), and ``Topology.free()``, which the CLI calls
when a command ends, closes it first.

Every group is built with the job's ``CommConfig`` (so ``comm.algorithm``, ``comm.check``,
``comm.calibration`` and ``comm.node_size`` reach every axis) and recorded; a part that is
done with its group (a trainer, an engine, a benchmark) gives it back with :meth:`release`,
which frees its windows, torch groups and communicators, so a process that trains several
times holds no more than one training's worth. :func:`hpctrain.comm.window.open_windows`
counts what remains.
"""

from __future__ import annotations

from mpi4py import MPI

from hpctrain.comm.group import Group
from hpctrain.config import CommConfig
from hpctrain.runtime.world import Topology

__all__ = ["Communicators", "communicators"]


class Communicators:
    """Groups over the communicators of one Topology, with the job's ``CommConfig``."""

    def __init__(self, topo: Topology, config: CommConfig) -> None:
        self.topo, self.config = topo, config
        self._live: list[Group] = []

    def workers(self) -> Group:
        """A group over the workers (collective over ``topo.role_comm``)."""
        return self.over(self.topo.role_comm)

    def over(self, comm: MPI.Intracomm) -> Group:
        """A group over ``comm``, a communicator the Topology handed out (collective over
        it; the group ``Dup()``s it)."""
        group = Group(comm, self.config)
        self._live.append(group)
        return group

    @property
    def live(self) -> int:
        """Groups handed out and not yet released."""
        return len(self._live)

    def release(self, group: Group) -> None:
        """Free ``group`` (collective over its communicator)."""
        self._live.remove(group)
        group.free()

    def close(self) -> None:
        """Free every group still held, newest first (collective as :meth:`release`)."""
        while self._live:
            self.release(self._live[-1])


def communicators(topo: Topology) -> Communicators:
    """The job's group owner, made on first use and closed by ``topo.free()``."""
    return topo.keep("comm", lambda: Communicators(topo, topo.comm_config))
