"""Setting up the parameter server inside one MPI job, on every rank.

:meth:`PSJob.create` is collective over the world: rank 0 computes the sharding plan and
broadcasts it (so every rank routes by the very same plan), and every rank ``Dup``s the world
into the parameter-server communicator, whose tags belong to the protocol alone; its
messages go through a :class:`~hpctrain.comm.emulate.Channel` that, with ``comm.emulate``,
delays those between emulated nodes (workers in blocks of ``comm.node_size``, each server a
node of its own). Then server ranks :meth:`~PSJob.serve` and worker ranks talk to them
through :meth:`~PSJob.client`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from mpi4py import MPI

from embeddings.optim import SparseOptimizer
from embeddings.sharding import Placement, ShardingPlan, plan_sharding
from embeddings.tables import TableLayout
from hpctrain.comm import emulate
from hpctrain.comm.emulate import Channel
from hpctrain.config import CommConfig, PSConfig
from hpctrain.runtime.env import current_rss_bytes
from hpctrain.runtime.topology import Roles
from hpctrain.runtime.waiting import watching
from hpctrain.sync.types import SyncModel
from ps.client import PSClient
from ps.server import Server, ServerStats
from ps.store import ShardStore

__all__ = ["PSJob"]

log = logging.getLogger(__name__)


@dataclass
class PSJob:
    comm: Channel
    roles: Roles
    layout: TableLayout
    plan: ShardingPlan
    placement: Placement
    wire: str = "float32"  # ps.wire_dtype: pulled rows and pushed gradients

    @classmethod
    def create(cls, world: MPI.Intracomm, roles: Roles, layout: TableLayout,
               config: PSConfig, seed: int, comm: CommConfig | None = None) -> PSJob:
        """Plan on rank 0, ``bcast`` it, ``Dup`` the world; collective over ``world``.
        ``comm``: the job's ``comm.emulate`` and ``comm.node_size``."""
        text = None
        if world.Get_rank() == 0:
            plan = plan_sharding(layout.specs, roles.servers, config.sharding,
                                 config.table_wise_below, seed)
            text = plan.to_json()
            log.info("sharding plan: %s", plan.describe())
        with watching("bcast", world):
            plan = ShardingPlan.from_json(world.bcast(text, root=0))
        with watching("create", world):
            dup = world.Dup()
        dup.Set_name("hpctrain.ps")
        comm = comm or CommConfig()
        nodes = emulate.ps_nodes(roles.workers, roles.servers, comm.node_size)
        return cls(Channel(dup, nodes, emulate.network(comm)), roles, layout, plan,
                   Placement(plan), config.wire_dtype)

    def client(self, models: Sequence[SyncModel] | None = None,
               state_width: int = 0) -> PSClient:
        """A worker's client; ``models[t]`` is table ``t``'s sync model, so that one pull
        request never mixes tables of different models; ``state_width`` as the servers'
        optimizer keeps it (to move rows with their state)."""
        groups = None if models is None else [sorted(set(models), key=str).index(m)
                                              for m in models]
        return PSClient(self.comm, self.layout, self.placement, self.roles.server_ranks(),
                        groups, state_width, self.wire)

    def serve(self, optimizer: SparseOptimizer, seed: int, models: Sequence[SyncModel],
              deterministic: bool = False,
              restore: Callable[[ShardStore], int] | None = None,
              on_save: Callable[[ShardStore, int], None] | None = None,
              dense_optimizer: SparseOptimizer | None = None,
              threads: int = 1) -> ServerStats:
        """Hold this server's shard and serve the workers until they are all done.

        ``restore(store)`` fills the shard from a checkpoint and returns its step, where
        every worker's clock then starts; ``on_save`` writes checkpoints (see ps.server);
        ``dense_optimizer`` updates the last table, full mode's dense parameters (see
        :class:`~ps.store.ShardStore`); ``threads``: this rank's, for big requests' row
        passes (:class:`~ps.threads.RowThreads`)."""
        index = self.comm.Get_rank() - self.roles.workers
        before = current_rss_bytes()
        store = ShardStore(self.layout, self.placement, index, optimizer, seed, dense_optimizer)
        clock = restore(store) if restore else 0
        server = Server(self.comm, store, self.roles.worker_ranks(), models, deterministic,
                        clock, on_save, threads)
        server.stats.rss_growth_bytes = current_rss_bytes() - before
        log.info("server %d holds %d rows (%.1f MB)", index, self.placement.server_rows(index),
                 store.resident_bytes() / 2**20)
        return server.serve()
