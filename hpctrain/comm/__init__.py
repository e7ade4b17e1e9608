"""Collectives over an explicit group of ranks: ring, trees, recursive halving/doubling,
shared memory, hierarchical, native MPI and torch.distributed, chosen by a cost model
(see README.md, "Collectives")."""

from hpctrain.comm.collectives import (
    allgather,
    allgatherv,
    allreduce,
    alltoallv,
    broadcast,
    gather,
    reduce,
    reduce_scatter,
    scatter,
)
from hpctrain.comm.group import Group

__all__ = ["Group", "allreduce", "reduce_scatter", "allgather", "broadcast", "reduce",
           "gather", "scatter", "allgatherv", "alltoallv"]
