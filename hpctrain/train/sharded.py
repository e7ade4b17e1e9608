"""The all-to-all store in a training run: its plan, and its rows in checkpoints.

The plan is computed on worker 0 from the table sizes and the workers (and their nodes),
broadcast, logged and written to the run directory as ``plan.json``, as the parameter
server's is. A checkpoint holds full rows with global ids (``shard-w{rank}.h5``, one file
per worker), whatever the sharding: column-wise shards first trade their blocks so that each
worker writes full rows of a balanced range. Resume reads every row file and keeps the rows
(or columns) the new plan gives this worker, so a run can resume onto another number of
workers, another sharding, or from a replicated checkpoint.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np

from embeddings.alltoall import ShardedTables
from embeddings.optim import SparseOptimizer
from embeddings.tables import TableLayout
from embeddings.worker_sharding import WorkerPlan, plan_workers
from hpctrain.comm.alltoall import alltoallv
from hpctrain.comm.group import Group
from hpctrain.config import JobConfig
from hpctrain.errors import CheckpointError
from hpctrain.runtime.abort import agree
from hpctrain.runtime.topology import shard_range
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.rundir import RunDir

__all__ = ["sharded_store", "write_rows", "restore_rows"]

log = logging.getLogger(__name__)


def sharded_store(config: JobConfig, layout: TableLayout, group: Group,
                  optimizer: SparseOptimizer, run: RunDir | None) -> ShardedTables:
    """The all-to-all store of this worker (collective over ``group``); ``run`` is worker
    0's run directory, where the plan goes."""
    node = group.layout.local_size if group.layout.uniform else 0

    def plan() -> WorkerPlan | None:
        if group.rank != 0:
            return None
        made = plan_workers(layout.specs, group.size, config.embeddings.sharding, node,
                            config.train.seed)
        log.info("all-to-all plan: %s", made.describe())
        return made

    made = agree(group.comm, plan)
    text = group.comm.bcast(made.to_json() if made else None, root=0)
    if run:
        run.write_text("plan.json", text)
    return ShardedTables(layout, WorkerPlan.from_json(text), optimizer, config.train.seed,
                         group)


def write_rows(folder: Path, store: ShardedTables) -> ckpt.FileEntry:
    """Write this worker's rows, full width with global ids, optimizer state in the
    unsharded layout (column-wise: after one exchange of blocks)."""
    tables = store.tables
    if not store.plan.by_columns:
        rows = store.placement.rows_of(store.group.rank)(0, len(tables.weight))
        return ckpt.write_rows(folder / f"shard-w{store.group.rank}.h5", rows, tables.weight,
                               tables.state)
    rows, weight, state = _full_rows(store)
    return ckpt.write_rows(folder / f"shard-w{store.group.rank}.h5", rows, weight, state)


def _full_rows(store: ShardedTables) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Column-wise: full rows ``shard_range(rows, p, rank)``, gathered from every block."""
    group, tables, plan = store.group, store.tables, store.plan
    p, r, n = group.size, group.rank, len(tables.weight)
    ranges = [shard_range(n, p, j) for j in range(p)]
    block = np.concatenate([tables.weight, tables.state], axis=1)
    counts = np.array([hi - lo for lo, hi in ranges], np.int64)
    got, _ = alltoallv(np.ascontiguousarray(block.reshape(-1)), counts * block.shape[1],
                       comm=group)
    lo, hi = ranges[r]
    mine = hi - lo
    dim, adam = plan.dim, tables.optimizer.kind == "adam"
    weight = np.empty((mine, dim), np.float32)
    state = np.empty((mine, tables.optimizer.state_width(dim)), np.float32)
    start = 0
    for j in range(p):
        c0, c1 = plan.columns(j)
        w = c1 - c0
        cols = w + (2 * w + 1 if adam else tables.state.shape[1])
        part = got[start:start + mine * cols].reshape(mine, cols)
        start += part.size
        weight[:, c0:c1] = part[:, :w]
        if adam:  # moments per column, then the row's step count
            state[:, c0:c1] = part[:, w:2 * w]
            state[:, dim + c0:dim + c1] = part[:, 2 * w:3 * w]
            state[:, 2 * dim] = part[:, 3 * w]
        elif state.shape[1]:  # row-wise Adagrad: one accumulator, the same on every block
            state[:, 0] = part[:, w]
    return np.arange(lo, hi, dtype=np.int64), weight, state


def restore_rows(manifest: ckpt.Manifest, store: ShardedTables) -> int:
    """Copy into ``store`` the rows (columns) of ``manifest``'s row files that this worker
    owns under its plan; returns the rows restored."""
    folder, tables, plan = Path(manifest.path), store.tables, store.plan
    r, dim = store.group.rank, plan.dim
    c0, c1 = plan.columns(r)
    width = tables.optimizer.state_width(dim)
    restored = 0
    for rows, weight, state in ckpt.read_rows(folder, manifest.row_files()):
        if weight.shape[1] != dim or state.shape[1] != width:
            raise CheckpointError(f"checkpoint {folder}: rows of width {weight.shape[1]} with "
                                  f"{state.shape[1]} optimizer values do not fit this job")
        owner, slots = store.placement.locate(rows)
        keep = slice(None) if plan.by_columns else owner == r
        slots = slots[keep]
        tables.weight[slots] = weight[keep, c0:c1]
        if plan.by_columns and tables.optimizer.kind == "adam":
            tables.state[slots] = np.concatenate(
                [state[keep, c0:c1], state[keep, dim + c0:dim + c1], state[keep, 2 * dim:]],
                axis=1)
        else:
            tables.state[slots] = state[keep, :tables.state.shape[1]]
        restored += len(slots)
    return restored
