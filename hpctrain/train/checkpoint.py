"""Checkpoints in HDF5: per-holder row files, the dense state, and a manifest that commits.

Layout of ``RUN_DIR/checkpoints/step-00000200/``:

- ``dense.h5`` (worker 0): the dense parameters (``param/<i>``), the dense optimizer state
  (``optim/<i>``) and torch's RNG state; with tensor/pipeline parallelism one
  ``dense-stage<p>-tensor<t>.h5`` per stage and tensor shard instead (its first replica's);
- ``tables.h5`` (worker 0, replicated tables), ``shard-<s>.h5`` (server ``s``) or
  ``shard-w<w>.h5`` (worker ``w``, all-to-all sharded tables): row files.
  Each holds ``rows`` (int64 global row ids), ``weight`` (float32 [n, dim]) and ``state``
  (float32 [n, optimizer state width]); any holder can load any file, so a checkpoint restores
  onto another number of workers or servers (rows are re-partitioned by the new plan);
- ``dense-table-<s>.h5`` (server ``s``, full mode): the dense table's rows in the same form,
  their ``state`` the per-value optimizer's (``SparseOptimizer.state_width``: twice as wide
  as the rows for per-value Adagrad, an accumulator and a round sum per value);
- ``manifest.h5``: format and version, step, the resolved config (TOML), the sharding plan,
  roles, clocks, every file's size and SHA-256. World rank 0 writes it last.

Every file is written to a temporary name, flushed, fsynced, then renamed; the manifest's
rename is the commit point. A crash or a full disk mid-write leaves the previous checkpoint
complete and loadable; resume takes the newest directory whose manifest exists and whose
checksums match. Nothing is loaded with pickle: HDF5 datasets and attributes only.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import h5py
import numpy as np

from hpctrain.errors import CheckpointError
from hpctrain.runtime.durable import fsync_path

__all__ = ["DENSE_TABLE_PREFIX", "FORMAT", "VERSION", "Manifest", "FileEntry", "step_dir",
           "write_atomic", "write_rows", "read_rows", "write_manifest", "read_manifest",
           "latest", "prune", "young_daly_s", "file_sha256"]

log = logging.getLogger(__name__)

FORMAT = "hpctrain-checkpoint"
VERSION = 1
_CHUNK_ROWS = 1 << 18
_STEP_PREFIX = "step-"
DENSE_TABLE_PREFIX = "dense-table-"


@dataclass(frozen=True)
class FileEntry:
    name: str
    bytes: int
    sha256: str
    rows: int = 0


@dataclass
class Manifest:
    step: int
    config_toml: str
    workers: int
    servers: int
    shape: dict[str, str] = field(default_factory=dict)
    """What must match on resume (table sizes, dims, optimizer, mode), as text."""
    files: list[FileEntry] = field(default_factory=list)
    plan_json: str = ""
    created: float = 0.0
    clock_s: float | None = None
    """The run's clock at the save (training seconds, evaluations and checkpoint writes left
    out), so that a resumed run's curve goes on from it; None in checkpoints written before
    hpctrain saved it."""
    samples: int | None = None
    """Samples trained by the save (over all workers); None as for ``clock_s``."""
    path: str = ""  # where it was read from (not stored)

    def file(self, name: str) -> FileEntry | None:
        return next((f for f in self.files if f.name == name), None)

    def row_files(self) -> list[str]:
        """The files holding embedding rows (all but the dense ones)."""
        return [f.name for f in self.files if not f.name.startswith("dense")]

    def dense_table_files(self) -> list[str]:
        """Full mode's dense table rows with their per-value optimizer state, one file per
        server."""
        return [f.name for f in self.files if f.name.startswith(DENSE_TABLE_PREFIX)]


def step_dir(run_dir: str | os.PathLike[str], step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{_STEP_PREFIX}{step:08d}"


def write_atomic(path: Path, fill: Callable[[h5py.File], None], rows: int = 0) -> FileEntry:
    """Write an HDF5 file through a temporary name, fsync it, rename it into place."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with h5py.File(tmp, "w") as f:
            fill(f)
        fsync_path(tmp)
        os.replace(tmp, path)
        fsync_path(path.parent)
    except OSError as exc:
        tmp.unlink(missing_ok=True)
        # h5py's strerror is HDF5's multi-line record (time, file, buffer, offset); the
        # errno says it in one line ("No space left on device")
        reason = os.strerror(exc.errno) if exc.errno else (exc.strerror or exc)
        raise CheckpointError(f"cannot write checkpoint file {path}: {reason}; "
                              f"earlier checkpoints are untouched") from None
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return FileEntry(path.name, path.stat().st_size, file_sha256(path), rows)


def write_rows(path: Path, rows: np.ndarray, weight: np.ndarray, state: np.ndarray) -> FileEntry:
    """A row file: global ``rows`` with their ``weight`` and optimizer ``state``."""

    def fill(f: h5py.File) -> None:
        f.attrs["format"] = FORMAT
        f.attrs["kind"] = "rows"
        for name, data in (("rows", rows), ("weight", weight), ("state", state)):
            f.create_dataset(name, data=data, chunks=True if data.size else None)

    return write_atomic(path, fill, rows=len(rows))


def read_rows(folder: Path, names: Sequence[str]) -> Iterator[tuple[np.ndarray, np.ndarray,
                                                                    np.ndarray]]:
    """(rows, weight, state) chunks of the row files ``names`` in ``folder``."""
    for name in names:
        path = folder / name
        try:
            with h5py.File(path, "r") as f:
                n = f["rows"].shape[0]
                for lo in range(0, n, _CHUNK_ROWS):
                    hi = min(n, lo + _CHUNK_ROWS)
                    yield f["rows"][lo:hi], f["weight"][lo:hi], f["state"][lo:hi]
        except (OSError, KeyError) as exc:
            raise CheckpointError(f"checkpoint row file {path} is unreadable: {exc}") from None


def write_manifest(folder: Path, manifest: Manifest) -> None:
    """Write ``manifest.h5`` last: its rename commits the checkpoint."""

    def fill(f: h5py.File) -> None:
        f.attrs["format"] = FORMAT
        f.attrs["version"] = VERSION
        f.attrs["step"] = manifest.step
        f.attrs["workers"] = manifest.workers
        f.attrs["servers"] = manifest.servers
        f.attrs["created"] = time.time()
        f.attrs["config_toml"] = manifest.config_toml
        f.attrs["plan_json"] = manifest.plan_json
        if manifest.clock_s is not None and manifest.samples is not None:
            f.attrs["clock_s"] = manifest.clock_s
            f.attrs["samples"] = manifest.samples
        shape = f.create_group("shape")
        for key, value in manifest.shape.items():
            shape.attrs[key] = value
        group = f.create_group("files")
        for entry in manifest.files:
            item = group.create_group(entry.name)
            item.attrs["bytes"] = entry.bytes
            item.attrs["sha256"] = entry.sha256
            item.attrs["rows"] = entry.rows

    write_atomic(folder / "manifest.h5", fill)


def read_manifest(folder: Path, verify: bool = True) -> Manifest:
    """The manifest of the checkpoint in ``folder``; with ``verify``, every listed file must
    exist with its recorded size and SHA-256."""
    path = folder / "manifest.h5"
    try:
        with h5py.File(path, "r") as f:
            if f.attrs.get("format") != FORMAT:
                raise CheckpointError(f"{path} is not an hpctrain checkpoint manifest")
            if int(f.attrs.get("version", -1)) != VERSION:
                raise CheckpointError(f"{path}: checkpoint format version "
                                      f"{f.attrs.get('version')} is not {VERSION}")
            manifest = Manifest(
                step=int(f.attrs["step"]), config_toml=str(f.attrs["config_toml"]),
                workers=int(f.attrs["workers"]), servers=int(f.attrs["servers"]),
                plan_json=str(f.attrs["plan_json"]), created=float(f.attrs["created"]),
                clock_s=float(f.attrs["clock_s"]) if "clock_s" in f.attrs else None,
                samples=int(f.attrs["samples"]) if "samples" in f.attrs else None,
                shape={k: str(v) for k, v in f["shape"].attrs.items()},
                files=[FileEntry(name, int(g.attrs["bytes"]), str(g.attrs["sha256"]),
                                 int(g.attrs["rows"])) for name, g in f["files"].items()],
                path=str(folder))
    except CheckpointError:
        raise
    except (OSError, KeyError) as exc:
        raise CheckpointError(f"{path} is missing, truncated or not a checkpoint manifest "
                              f"({exc})") from None
    if verify:
        for entry in manifest.files:
            file = folder / entry.name
            if not file.exists() or file.stat().st_size != entry.bytes or \
                    file_sha256(file) != entry.sha256:
                raise CheckpointError(f"checkpoint file {file} is missing or does not match "
                                      f"its checksum in {path}")
    return manifest


def latest(run_dir: str | os.PathLike[str]) -> Manifest:
    """The newest complete, intact checkpoint under ``run_dir`` (older ones are tried when a
    newer one fails verification)."""
    root = Path(run_dir) / "checkpoints"
    candidates = sorted(root.glob(f"{_STEP_PREFIX}*"), reverse=True) if root.is_dir() else []
    problems = []
    for folder in candidates:
        if not (folder / "manifest.h5").exists():
            continue
        try:
            manifest = read_manifest(folder)
        except CheckpointError as exc:
            problems.append(str(exc))
            continue
        for problem in problems:  # the steps since this one are lost: say so, and why
            log.warning("skipping a damaged checkpoint: %s; resuming from the older %s",
                        problem, folder)
        return manifest
    detail = f" ({'; '.join(problems)})" if problems else ""
    raise CheckpointError(f"no complete checkpoint under {root}{detail}")


def prune(run_dir: str | os.PathLike[str], keep: int,
          verified: set[str] | None = None) -> None:
    """Keep the ``keep`` newest *verified* checkpoints (manifest present, every file with its
    size and SHA-256) and delete only what is older than the oldest of them: older
    checkpoints, damaged ones and incomplete leftovers. Newer folders (damaged, or being
    written) are left alone, and with fewer than ``keep`` verified nothing is deleted.
    ``verified`` remembers folders already checked (a caller's cache across commits)."""
    root = Path(run_dir) / "checkpoints"
    folders = sorted(root.glob(f"{_STEP_PREFIX}*"), reverse=True)
    verified = set() if verified is None else verified
    intact: list[Path] = []
    for folder in folders:
        if len(intact) == keep:
            break
        if str(folder) not in verified:
            try:
                read_manifest(folder)
            except CheckpointError:
                continue
            verified.add(str(folder))
        intact.append(folder)
    if len(intact) < keep:
        return
    for folder in folders:
        if folder < intact[-1]:
            shutil.rmtree(folder, ignore_errors=True)
            verified.discard(str(folder))


def young_daly_s(write_s: float, mtbf_hours: float) -> float:
    """Optimal checkpoint interval sqrt(2 x write time x MTBF) (Young 1974, Daly 2006)."""
    return (2.0 * write_s * mtbf_hours * 3600.0) ** 0.5


def file_sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()

