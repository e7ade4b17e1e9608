"""``hpctrain bench ps``: parameter-server pull/push throughput and bytes on the wire.

Launch with servers and workers, e.g. ``mpiexec -n 3 hpctrain bench ps --servers 1``. Each
worker runs ``--steps`` steps over Zipf-distributed batches (the synthetic generator's ids):
pull the batch's unique rows, push a gradient for each, with and without prefetch. Reported
per worker: unique rows pulled and pushed per second of time spent pulling and pushing, bytes
per step against the minimum (unique rows x dim x 4 plus 8 bytes per id), and server memory
per stored row against (dim + optimizer state) x 4 bytes. Reported per server (rows with
``mode = "server"``): rows pulled and pushed per second of its serving time and the busy
fraction of that time (:class:`~ps.server.ServerStats`). The baseline, measured in the same
run on worker 0 alone, is torch ``nn.EmbeddingBag(sparse=True)`` with the same optimizer on
the same ids (lookup, backward, step).
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import numpy as np
import torch

from embeddings.optim import SparseOptimizer
from embeddings.tables import TableLayout
from hpctrain.config import PSConfig
from hpctrain.data.synthetic import SyntheticClicks
from hpctrain.runtime.waits import Wait, wait_all
from hpctrain.runtime.world import Topology
from hpctrain.sync.bsp import BSP
from ps.service import PSJob

__all__ = ["add_arguments", "run"]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--tables", type=int, default=8, help="embedding tables (default 8)")
    parser.add_argument("--rows", type=int, default=1_250_000, help="rows per table")
    parser.add_argument("--dim", type=int, default=16, help="row width")
    parser.add_argument("--batch", type=int, default=4096, help="samples per worker step")
    parser.add_argument("--steps", type=int, default=60, help="steps per mode")
    parser.add_argument("--zipf", type=float, default=1.05, help="Zipf exponent of the ids")
    parser.add_argument("--optimizer", default="sgd", choices=("sgd", "adagrad", "adam"))
    parser.add_argument("--json", metavar="FILE", help="write the result rows as JSON")


def run(args: argparse.Namespace, topo: Topology) -> list[dict[str, Any]] | None:
    """Run the benchmark on every rank; world rank 0 returns the rows."""
    layout = TableLayout.from_sizes([args.rows] * args.tables, args.dim)
    optimizer = SparseOptimizer(args.optimizer)
    job = PSJob.create(topo.world, topo.roles, layout,
                       PSConfig(servers=topo.roles.servers, sharding="row_hash"), seed=0,
                       comm=topo.comm_config)
    if topo.is_worker:
        mine = _worker(args, topo, job, layout, optimizer)
        facts = None
    else:
        mine = None
        facts = job.serve(optimizer, 0, [BSP] * args.tables, threads=topo.threads).as_dict()
    rows = topo.world.gather((mine, facts), root=0)
    if topo.rank != 0:
        return None
    worker_rows = rows[0][0]
    servers = [f for _, f in rows if f is not None]
    per_row = max(s["rss_growth_bytes"] / max(1, s["resident_bytes"]) for s in servers)
    ideal = (args.dim + optimizer.state_width(args.dim)) * 4
    for row in worker_rows:
        row["server_bytes_per_row"] = per_row * ideal
        row["server_memory_ratio"] = per_row
    return worker_rows + [_server_row(s, topo.workers) for s in servers]


def _server_row(facts: dict[str, Any], workers: int) -> dict[str, Any]:
    """One server over the whole run (both modes, warm-up included), from its ServerStats."""
    keys = ("rank", "threads", "rows_per_s", "busy_fraction", "serve_s", "busy_s", "busy_cpu_s",
            "pulls", "pushes", "rows_out", "rows_in")
    return {"mode": "server", "workers": workers, **{k: facts[k] for k in keys}}


def _batches(args: argparse.Namespace, layout: TableLayout, worker: int) -> list[np.ndarray]:
    data = SyntheticClicks([args.rows] * args.tables, (worker + 1) * args.batch * args.steps,
                           1, args.zipf, seed=11)
    start = worker * args.batch * args.steps
    return [layout.global_rows(data.read("train", start + s * args.batch,
                                         start + (s + 1) * args.batch).sparse)
            for s in range(args.steps)]


def _worker(args, topo: Topology, job: PSJob, layout: TableLayout,
            optimizer: SparseOptimizer) -> list[dict[str, Any]]:
    raw = _batches(args, layout, topo.worker_rank)
    ids = sum(b.size for b in raw)
    batches = [np.unique(b) for b in raw]
    unique = sum(len(b) for b in batches)
    baseline = _quiet(topo, lambda: _baseline(args, layout, optimizer, batches))
    client = job.client()
    client.pull(batches[0])  # warm-up: the first kernel calls load numba's cache
    client.push(batches[0], np.zeros((len(batches[0]), args.dim), np.float32), 0.0)
    results = []
    for prefetch in (False, True):
        client.stats = type(client.stats)()
        pull_s = push_s = 0.0
        for step, rows in enumerate(batches):
            t0 = time.perf_counter()
            client.pull(rows)
            if prefetch and step + 1 < len(batches):
                client.prefetch(batches[step + 1], ahead=1)
            t1 = time.perf_counter()
            client.push(rows, np.full((len(rows), args.dim), 1e-3, np.float32), 0.01)
            pull_s += t1 - t0
            push_s += time.perf_counter() - t1
        stats = client.stats
        minimum = unique * (args.dim * 4 + 8)
        pulled = stats.pull_bytes_sent + stats.pull_bytes_received
        for mode, seconds, wire in (("pull", pull_s, pulled),
                                    ("push", push_s, stats.push_bytes_sent)):
            results.append({
                "mode": mode, "prefetch": prefetch, "workers": topo.workers,
                "servers": topo.roles.servers, "rows_per_s": unique / seconds,
                "ids_per_step": ids / args.steps, "unique_rows_per_step": unique / args.steps,
                "bytes_per_step": wire / args.steps, "min_bytes_per_step": minimum / args.steps,
                "bytes_ratio": wire / minimum,
                "baseline_rows_per_s": baseline, "ratio_to_baseline": unique / seconds / baseline,
            })
    client.close()
    return results


def _baseline(args, layout: TableLayout, optimizer: SparseOptimizer,
              batches: list[np.ndarray]) -> float:
    """Unique rows per second through torch's EmbeddingBag(sparse=True) on one process."""
    bag = torch.nn.EmbeddingBag(layout.total_rows, args.dim, mode="sum", sparse=True)
    optim = {"sgd": torch.optim.SGD, "adagrad": torch.optim.Adagrad,
             "adam": torch.optim.SparseAdam}[optimizer.kind](bag.parameters(), lr=0.01)
    start = time.perf_counter()
    for rows in batches:
        out = bag(torch.from_numpy(rows).view(-1, 1))
        out.sum().backward()
        optim.step()
        optim.zero_grad()
    return sum(len(b) for b in batches) / (time.perf_counter() - start)


def _quiet(topo: Topology, work):
    """Run ``work`` on worker 0 while the other workers wait without spinning."""
    comm = topo.role_comm
    result = work() if comm.Get_rank() == 0 else None
    wait_all([comm.Ibarrier()], Wait("barrier", comm))
    return comm.bcast(result, root=0)
