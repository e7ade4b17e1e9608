"""When to checkpoint, who writes what, and how a run resumes from it.

A checkpoint is taken at a step boundary that every worker reaches (after its push of that
step). Workers with parameter servers send ``SAVE`` to every server; each server writes its
shard once all workers asked (their pushes are applied by then). Worker 0 writes the dense
state (and, with replicated tables, all rows). Everyone then joins :func:`commit`, a gather
over the world to rank 0, which writes the manifest (the commit point) and prunes old
checkpoints. Format and atomicity: :mod:`hpctrain.train.checkpoint`.

Resume restores rows into whatever holds them now (replicas, or servers under a new plan),
dense parameters and optimizer state, the clocks and the data position (step), so that a
deterministic run continues bitwise as if never interrupted.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import h5py
import numpy as np
import torch
from mpi4py import MPI

from embeddings.sharding import Placement
from embeddings.tables import TableLayout
from hpctrain.config import CheckpointConfig, JobConfig, dump_toml
from hpctrain.errors import CheckpointError
from hpctrain.runtime.waits import Wait, wait_all
from hpctrain.train import checkpoint as ckpt
from hpctrain.train.checkpoint_rows import SavedRows

__all__ = ["Cadence", "shape_of", "check_compatible", "commit", "write_dense", "read_dense",
           "restore_rows", "server_hooks"]

log = logging.getLogger(__name__)


class Cadence:
    """When a step ends with a checkpoint: by step count and at the end (the same on every
    worker), or by time (:meth:`time_due`, this worker's clock, which the workers agree on
    after the step: :meth:`hpctrain.runtime.preempt.Preemption.after_step`)."""

    def __init__(self, config: CheckpointConfig) -> None:
        self.config = config
        self.last = time.monotonic()
        self.write_s: float | None = None
        self._asked = False  # a time-based checkpoint was asked for and is not written yet

    @property
    def enabled(self) -> bool:
        c = self.config
        return bool(c.every_steps or c.every_minutes or c.mtbf_hours or c.at_end)

    def interval_s(self) -> float | None:
        """Seconds between time-based checkpoints (the Young-Daly interval once a write
        time has been measured; 0 before that, to measure one)."""
        c = self.config
        choices = []
        if c.every_minutes:
            choices.append(c.every_minutes * 60.0)
        if c.mtbf_hours:
            choices.append(0.0 if self.write_s is None else ckpt.young_daly_s(self.write_s,
                                                                              c.mtbf_hours))
        return min(choices) if choices else None

    def due(self, done: int, final: bool) -> bool:
        """Whether step ``done`` (completed steps) checkpoints by count or at the end."""
        c = self.config
        return (final and c.at_end) or bool(c.every_steps and done % c.every_steps == 0)

    def time_due(self) -> bool:
        """Whether the time since the last checkpoint has reached the interval, said once
        until the next checkpoint: the workers agree on it ``lag`` steps later, and the
        steps in between must not ask for more checkpoints."""
        interval = self.interval_s()
        if self._asked or interval is None or time.monotonic() - self.last < interval:
            return False
        self._asked = True
        return True

    def saved(self, seconds: float) -> None:
        self._asked = False
        self.last = time.monotonic()
        self.write_s = seconds
        if self.config.mtbf_hours:
            log.info("checkpoint written in %.2f s; Young-Daly interval %.1f s", seconds,
                     self.interval_s())


def shape_of(config: JobConfig, layout: TableLayout) -> dict[str, str]:
    """What a checkpoint and the job restoring it must agree on, in the order they are
    checked: the mode first, since full mode adds the dense table to the tables."""
    m = config.model
    return {"ps.mode": config.ps.mode if config.ps.servers else "replicated",
            "table_sizes": json.dumps([int(n) for n in layout.sizes]),
            "model.embedding_dim": str(m.embedding_dim), "model.bottom_mlp": str(m.bottom_mlp),
            "model.top_mlp": str(m.top_mlp), "train.optimizer": config.train.optimizer,
            # a buffer per parameter or none: restoring would fail, or drop the buffers
            "train.momentum": "> 0 (momentum buffers)" if config.train.momentum else
            "0 (no momentum buffers)",
            "train.sparse_optimizer": config.train.table_optimizer,
            # tensor/pipeline parallel: one dense file per (stage, tensor shard)
            "dense layout": _dense_layout(config),
            # the data position is the step: these must not change under a resume
            "train.batch_size": str(config.train.batch_size),
            "train.accumulate": str(config.train.accumulate),
            **{f"data.{key}": json.dumps(getattr(config.data, key)) for key in _DATA_KEYS}}


def _dense_layout(config: JobConfig) -> str:
    """The dense files a checkpoint holds: one, one per (stage, tensor shard), whose split
    the cuts (balanced from ``model.top_mlp`` when empty) decide, or full mode's dense table
    on the servers with its optimizer's state per value."""
    par = config.parallel
    if config.ps.servers and config.ps.mode == "full":
        return "a table on the servers, optimizer state per value and round"
    if par.tp * par.pp == 1:
        return "whole"
    return (f"parallel.tp = {par.tp}, parallel.pp = {par.pp}, parallel.stage_cuts = "
            f"{list(par.stage_cuts)}")


_DATA_KEYS = ("source", "paths", "eval_paths", "eval_fraction", "train_samples",
              "eval_samples", "seed", "zipf")


def check_compatible(manifest: ckpt.Manifest, config: JobConfig, layout: TableLayout) -> None:
    mine = shape_of(config, layout)
    order = list(mine)  # the job's order: ps.mode before the dense layout it implies
    for key, value in sorted(manifest.shape.items(),
                             key=lambda kv: order.index(kv[0]) if kv[0] in order else len(order)):
        ours = mine.get(key)
        compatible = ours == value or (key == "ps.mode" and "full" not in (ours, value))
        if not compatible:
            raise CheckpointError(f"checkpoint {manifest.path} was made with {key} = {value}; "
                                  f"this job has {ours}")


def commit(world: MPI.Intracomm, folder: Path, files: list[ckpt.FileEntry],
           manifest: ckpt.Manifest | None, keep: int) -> None:
    """Gather every rank's written files to world rank 0 (``gather`` over ``world``), which
    writes the manifest (the commit point) and prunes; ``manifest`` is rank 0's."""
    wait_all([world.Ibarrier()], Wait("save", world))  # the watchdog names a missing rank
    with Wait("gather", world):
        everything = world.gather([asdict(f) for f in files], root=0)
    if world.Get_rank() != 0:
        return
    manifest.files = [ckpt.FileEntry(**f) for part in everything for f in part]
    for rank, part in enumerate(everything):
        for entry in part:
            _check_visible(folder, ckpt.FileEntry(**entry), rank)
    ckpt.write_manifest(folder, manifest)
    _VERIFIED.add(str(folder))
    ckpt.prune(folder.parent.parent, keep, _VERIFIED)


_VERIFIED: set[str] = set()  # checkpoint folders rank 0 has verified (prune's cache)


def _check_visible(folder: Path, entry: ckpt.FileEntry, rank: int) -> None:
    """World rank 0 must read every file of a checkpoint as its writer recorded it: a
    node-local run directory fails the first commit instead of the resume."""
    path = folder / entry.name
    if not path.is_file():
        raise CheckpointError(f"checkpoint commit: {path}, written by rank {rank}, is not "
                              f"visible to rank 0; train.run_dir must be on a file system "
                              f"every node shares")
    if path.stat().st_size != entry.bytes or ckpt.file_sha256(path) != entry.sha256:
        raise CheckpointError(f"checkpoint commit: {path}, written by rank {rank}, does not "
                              f"match its size or SHA-256 as rank 0 reads it")


def write_dense(path: Path, params: list[torch.Tensor],
                optim_state: list[torch.Tensor]) -> ckpt.FileEntry:
    """Write parameters, optimizer state and torch's RNG state to ``path`` atomically."""
    def fill(f: h5py.File) -> None:
        f.attrs["format"] = ckpt.FORMAT
        f.attrs["kind"] = "dense"
        for i, p in enumerate(params):
            f.create_dataset(f"param/{i}", data=p.detach().cpu().numpy())
        for i, s in enumerate(optim_state):
            f.create_dataset(f"optim/{i}", data=s.detach().cpu().numpy())
        f.create_dataset("torch_rng", data=torch.get_rng_state().numpy())

    return ckpt.write_atomic(path, fill)


def read_dense(path: Path, params: list[torch.Tensor],
               optim_state: list[torch.Tensor]) -> None:
    """Copy what :func:`write_dense` wrote to ``path`` into the given tensors."""
    try:
        with h5py.File(path, "r") as f, torch.no_grad():
            for i, p in enumerate(params):
                p.copy_(torch.from_numpy(f[f"param/{i}"][()]))
            for i, s in enumerate(optim_state):
                s.copy_(torch.from_numpy(f[f"optim/{i}"][()]))
            torch.set_rng_state(torch.from_numpy(f["torch_rng"][()]))
    except (OSError, KeyError, TypeError, RuntimeError) as exc:
        raise CheckpointError(f"checkpoint file {path} does not fit this model: {exc}") from None


def restore_rows(source: SavedRows, weight: np.ndarray, state: np.ndarray,
                 select: Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]],
                 first: int = 0) -> int:
    """Copy the rows of ``source`` that ``select`` keeps into ``weight`` and ``state``;
    ``select(rows)`` gives (mask of rows held here, their slots), ``first`` the slot of
    ``weight[0]``. Returns the rows restored."""
    restored = 0
    for rows, saved_weight, saved_state in source.rows(weight.shape[1], state.shape[1]):
        mask, slots = select(rows)
        weight[slots - first] = saved_weight[mask]
        state[slots - first] = saved_state[mask]
        restored += len(slots)
    return restored


def shard_select(layout: TableLayout, placement: Placement,
                 server: int) -> Callable[[np.ndarray], tuple[np.ndarray, np.ndarray]]:
    """Rows of server ``server`` under ``placement`` (the new plan), and their slots."""

    def select(rows: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        tables = layout.table_of(rows)
        mask = np.zeros(len(rows), dtype=bool)
        slots = np.empty(len(rows), dtype=np.int64)
        for t in np.unique(tables).tolist():
            at = tables == t
            owner, slot = placement.locate(t, rows[at] - layout.offsets[t])
            mask[at] = owner == server
            slots[at] = slot
        return mask, slots[mask]

    return select


def server_hooks(world: MPI.Intracomm, run_dir: str, keep: int, layout: TableLayout,
                 placement: Placement, server: int, manifest: ckpt.Manifest | None):
    """(restore, on_save) for :meth:`ps.service.PSJob.serve` on server ``server``."""

    def restore(store) -> int:
        if manifest is None:
            return 0
        select, t, lo = shard_select(layout, placement, server), store.tables, store.dense_from
        restore_rows(SavedRows(manifest), t.weight[:lo], t.state[:lo], select)
        if store.dense_state is not None:
            restore_rows(SavedRows(manifest, manifest.dense_table_files()), t.weight[lo:],
                         store.dense_state, select, first=lo)
        return manifest.step

    def on_save(store, step: int) -> None:
        folder, t, lo = ckpt.step_dir(run_dir, step), store.tables, store.dense_from
        rows = store.global_rows(0, len(t.weight))
        entries = [ckpt.write_rows(folder / f"shard-{server}.h5", rows[:lo], t.weight[:lo],
                                   t.state[:lo])]
        if store.dense_state is not None:
            entries.append(ckpt.write_rows(folder / f"{ckpt.DENSE_TABLE_PREFIX}{server}.h5",
                                           rows[lo:], t.weight[lo:], store.dense_state))
        commit(world, folder, entries, None, keep)

    return restore, on_save


def new_manifest(config: JobConfig, layout: TableLayout, step: int, workers: int,
                 servers: int, plan_json: str, clock_s: float, samples: int) -> ckpt.Manifest:
    return ckpt.Manifest(step=step, config_toml=dump_toml(config), workers=workers,
                         servers=servers, shape=shape_of(config, layout), plan_json=plan_json,
                         clock_s=clock_s, samples=samples)
