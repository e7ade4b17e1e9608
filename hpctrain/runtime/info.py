"""``hpctrain info``: the facts a user checks before trusting an allocation."""

from __future__ import annotations

from typing import Any

import torch

from hpctrain.runtime.env import allocation, mpi_library
from hpctrain.runtime.waiting import watching
from hpctrain.runtime.world import Topology, available_cores

__all__ = ["collect_info", "format_info"]


def collect_info(topo: Topology) -> list[dict[str, Any]] | None:
    """Every rank's facts, gathered on world rank 0 (``gather`` over the world)."""
    mine = {"rank": topo.rank, "host": topo.hostname, "local_rank": topo.local_rank,
            "local_size": topo.local_size, "role": topo.role, "device": str(topo.device),
            "threads": topo.threads, "cores": available_cores(),
            "allocation": allocation()}
    with watching("gather", topo.world):
        return topo.world.gather(mine, root=0)


def format_info(ranks: list[dict[str, Any]]) -> str:
    mpi = mpi_library()
    hosts = sorted({r["host"] for r in ranks})
    per_node = sorted({r["local_size"] for r in ranks})
    workers = sum(r["role"] == "worker" for r in ranks)
    cuda = (f"available ({torch.cuda.device_count()} devices)" if torch.cuda.is_available()
            else "not available")
    nccl = torch.distributed.is_available() and torch.distributed.is_nccl_available()
    lines = [
        f"MPI library      {mpi['library']}",
        f"MPI standard     {mpi['standard']}, thread level {mpi['thread_level']}",
        f"world            {len(ranks)} ranks on {len(hosts)} node(s), "
        f"{'/'.join(map(str, per_node))} ranks per node",
        f"roles            {workers} workers, {len(ranks) - workers} parameter servers",
        f"torch            {torch.__version__}, CUDA "
        f"{cuda}, NCCL {'available' if nccl else 'not available'}",
        "",
        f"{'rank':>4}  {'host':<20} {'local':>5}  {'role':<6}  {'device':<8} {'threads':>7} "
        f"{'cores':>5}",
    ]
    for r in ranks:
        lines.append(f"{r['rank']:>4}  {r['host'][:20]:<20} {r['local_rank']:>5}  "
                     f"{r['role']:<6}  {r['device']:<8} {r['threads']:>7} {r['cores']:>5}")
    alloc = ranks[0]["allocation"]
    lines.append("")
    if alloc:
        lines.append("allocation       " + ", ".join(f"{k}={v}" for k, v in alloc.items()))
    else:
        lines.append("allocation       none detected (no Slurm/PBS variables)")
    return "\n".join(lines)
