"""The preprocessed click log: one chunked HDF5 file, written once, sliced by every rank.

Why a second reader beside :mod:`hpctrain.data.criteo`: parsing text costs far more than a
training step, so big inputs are parsed once (``hpctrain preprocess``) into this binary
layout, which each rank then slices read-only::

    /train/dense    float32 [n, 13]   transformed integer features
    /train/sparse   int32   [n, T]    table rows; int64 when a table has over 2**31 rows
    /train/labels   uint8   [n]       0 or 1
    /eval/...                         the same for the held-out split
    attributes: format = "hpctrain-clicklog", version = 1, table_sizes (int64 [T]),
                skipped (malformed input lines dropped while converting)

Datasets are uncompressed and chunked by rows. A reader loads ``BLOCK_ROWS`` contiguous rows
of a split at a time (one read per dataset, its ids checked and converted once) and serves
the batches inside the block from memory: per-batch hyperslab reads of a few hundred rows
cost more in HDF5 calls than the data they move. One process writes (h5py is serial here);
the file appears under its name only when complete (temporary file in the same folder,
fsync, ``os.replace``).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import h5py
import numpy as np
from tqdm import tqdm

from hpctrain.config import NUM_DENSE
from hpctrain.data.types import SPLITS, Batch, Dataset
from hpctrain.errors import DataError
from hpctrain.runtime.durable import fsync_path

__all__ = ["FORMAT", "VERSION", "write_hdf5", "HDF5Dataset"]

FORMAT = "hpctrain-clicklog"
VERSION = 1
BLOCK_ROWS = 1 << 16
"""Rows a reader loads per split at a time (the writer's chunk: whole chunks per read)."""
_HINT = "(re)write it with `hpctrain preprocess`"


def write_hdf5(dataset: Dataset, out_path: str, *, chunk_rows: int = 65536,
               progress: bool = False) -> dict[str, Any]:
    """Convert both splits of ``dataset`` into the HDF5 layout above, ``chunk_rows`` at a time.

    An existing ``out_path`` is replaced only after the new file is complete and synced; on
    any failure (or interrupt) it stays as it was and the temporary file is removed. Returns
    ``{"path", "train", "eval", "skipped", "bytes"}`` (rows written per split).
    """
    if chunk_rows < 1:
        raise ValueError(f"chunk_rows must be positive, got {chunk_rows}")
    out_path = os.fspath(out_path)
    folder, name = os.path.split(os.path.abspath(out_path))
    if not os.path.isdir(folder):
        raise DataError(f"{out_path}: cannot write, folder {folder} does not exist")
    sizes = tuple(int(s) for s in dataset.table_sizes)
    tmp = os.path.join(folder, f".{name}.tmp-{os.getpid()}")
    total = sum(dataset.num_samples(s) for s in SPLITS)
    rows: dict[str, int] = {}
    try:
        try:
            with h5py.File(tmp, "w") as h5, tqdm(total=total, unit="rows", disable=not progress,
                                                 desc=f"writing {name}") as bar:
                h5.attrs["format"] = FORMAT
                h5.attrs["version"] = VERSION
                h5.attrs["table_sizes"] = np.asarray(sizes, np.int64)
                for split in SPLITS:
                    rows[split] = _write_split(h5.create_group(split), dataset, split, sizes,
                                               chunk_rows, bar)
                h5.attrs["skipped"] = int(dataset.skipped)
            fsync_path(tmp)
            os.replace(tmp, out_path)
        except OSError as exc:
            raise DataError(f"{out_path}: cannot write ({exc.strerror or exc})") from exc
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    with contextlib.suppress(OSError):  # make the rename itself durable
        fsync_path(folder)
    return {"path": out_path, "train": rows["train"], "eval": rows["eval"],
            "skipped": int(dataset.skipped), "bytes": os.path.getsize(out_path)}


def _write_split(group: h5py.Group, dataset: Dataset, split: str, sizes: tuple[int, ...],
                 chunk_rows: int, bar: tqdm) -> int:
    n = dataset.num_samples(split)
    chunk = max(1, min(chunk_rows, n))
    ids = np.int32 if max(sizes) <= 2**31 else np.int64
    shapes = {"dense": ((NUM_DENSE,), np.float32), "sparse": ((len(sizes),), ids),
              "labels": ((), np.uint8)}
    out = {key: group.create_dataset(key, (n, *tail), dtype, maxshape=(None, *tail),
                                     chunks=(chunk, *tail))
           for key, (tail, dtype) in shapes.items()}
    at = 0
    for lo in range(0, n, chunk_rows):
        hi = min(n, lo + chunk_rows)
        batch = dataset.read(split, lo, hi)
        k = len(batch)
        if batch.dense.shape != (k, NUM_DENSE) or batch.sparse.shape != (k, len(sizes)):
            raise ValueError(f"{split} [{lo}, {hi}): batch shapes {batch.dense.shape}, "
                             f"{batch.sparse.shape} do not match {NUM_DENSE} dense features "
                             f"and {len(sizes)} tables")
        out["dense"][at:at + k] = batch.dense
        out["sparse"][at:at + k] = batch.sparse.astype(ids)
        out["labels"][at:at + k] = batch.labels.astype(np.uint8)
        at += k
        bar.update(hi - lo)
    if at < n:  # lines were skipped
        for data in out.values():
            data.resize(at, axis=0)
    return at



class HDF5Dataset(Dataset):
    """A file from :func:`write_hdf5`, checked when constructed and opened read-only.

    The handle is opened on the first :meth:`read` (and again in a forked child), so building
    the object is cheap to repeat on every rank. Every problem with the file, including a
    table row outside its table, raises :class:`~hpctrain.errors.DataError` naming it.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = os.fspath(path)
        self._h5: h5py.File | None = None
        self._block: dict[str, tuple[int, Batch]] = {}  # split -> (first row, rows)
        self._pid = -1
        with self._open() as h5:
            self._check(h5)

    def num_samples(self, split: str) -> int:
        if split not in self._rows:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self._rows[split]

    def read(self, split: str, start: int, stop: int) -> Batch:
        n = self.num_samples(split)
        if not 0 <= start <= stop <= n:
            raise ValueError(f"samples [{start}, {stop}) outside {split} [0, {n})")
        if stop - start >= BLOCK_ROWS:
            return self._checked(split, start, self._load(split, start, stop))
        first, block = self._block.get(split, (0, None))
        if block is None or start < first or stop > first + len(block):
            first, block = start, self._load(split, start, min(n, start + BLOCK_ROWS))
            self._block[split] = (first, block)
        a, b = start - first, stop - first
        return self._checked(split, start, Batch(block.dense[a:b].copy(),
                                                 block.sparse[a:b].copy(),
                                                 block.labels[a:b].copy()))

    def _load(self, split: str, start: int, stop: int) -> Batch:
        """Rows ``[start, stop)`` of ``split`` as read, ids widened to int64."""
        group = self._handle()[split]
        try:
            dense, sparse, labels = (group[key][start:stop] for key in
                                     ("dense", "sparse", "labels"))
        except OSError as exc:
            raise DataError(f"{self.path}: cannot read /{split} rows [{start}, {stop}) "
                            f"({exc}); is the file truncated?") from None
        return Batch(dense.astype(np.float32, copy=False), sparse.astype(np.int64, copy=False),
                     labels.astype(np.float32))

    def _checked(self, split: str, start: int, batch: Batch) -> Batch:
        """``batch`` (samples ``start``, ...), once its ids lie in their tables and its labels
        are 0 or 1."""
        sparse = batch.sparse
        bad = (sparse < 0) | (sparse >= self._sizes)
        if bad.any():
            r, t = np.argwhere(bad)[0]
            raise DataError(f"{self.path}: /{split}/sparse[{start + r}, {t}] = {sparse[r, t]} "
                            f"is outside table {t} ({self.table_sizes[t]} rows)")
        labels = batch.labels
        wrong = (labels != 0) & (labels != 1)
        if wrong.any():
            i = int(np.flatnonzero(wrong)[0])
            raise DataError(f"{self.path}: /{split}/labels[{start + i}] = {labels[i]:g}; a click "
                            f"label is 0 or 1")
        return batch

    def close(self) -> None:
        """Close the file handle (reopened by the next :meth:`read`)."""
        if self._h5 is not None:
            with contextlib.suppress(Exception):
                self._h5.close()
            self._h5 = None
        self._block.clear()

    def _handle(self) -> h5py.File:
        if self._h5 is None or self._pid != os.getpid():
            self._h5, self._pid = self._open(), os.getpid()
        return self._h5

    def _open(self) -> h5py.File:
        if not os.path.exists(self.path):
            raise DataError(f"{self.path}: no such file")
        try:
            return h5py.File(self.path, "r")
        except OSError as exc:
            raise DataError(f"{self.path}: not a readable HDF5 file ({exc}); "
                            f"{_HINT}") from None

    def _check(self, h5: h5py.File) -> None:
        """Format attribute, version, table sizes, then every dataset's shape and dtype."""
        fmt, version = (_plain(h5.attrs.get(key)) for key in ("format", "version"))
        if not isinstance(fmt, str) or fmt != FORMAT:
            raise DataError(f"{self.path}: not an hpctrain click log (format attribute is "
                            f"{fmt!r}, expected {FORMAT!r}); {_HINT}")
        if not isinstance(version, int) or version != VERSION:
            raise DataError(f"{self.path}: format version {version!r} is not supported "
                            f"(this hpctrain reads version {VERSION})")
        sizes = np.asarray(h5.attrs.get("table_sizes", []))
        if sizes.ndim != 1 or not len(sizes) or sizes.dtype.kind not in "iu" or (
                sizes < 1).any():
            raise DataError(f"{self.path}: attribute table_sizes must list positive "
                            f"integers, got {sizes.tolist()!r}")
        self.table_sizes = tuple(int(s) for s in sizes)
        self._sizes = sizes.astype(np.int64)
        skipped = _plain(h5.attrs.get("skipped", 0))
        self.skipped = skipped if isinstance(skipped, int) else 0
        expect = {"dense": ((NUM_DENSE,), "f"), "sparse": ((len(sizes),), "iu"),
                  "labels": ((), "fiub")}
        self._rows = {}
        for split in SPLITS:
            counts = {}
            for key, (tail, kinds) in expect.items():
                data = h5.get(f"{split}/{key}")
                where = f"{self.path}: /{split}/{key}"
                if not isinstance(data, h5py.Dataset):
                    raise DataError(f"{where} is missing; {_HINT}")
                if data.ndim != 1 + len(tail) or data.shape[1:] != tail:
                    raise DataError(f"{where} has shape {data.shape}, expected "
                                    f"{('n', *tail)}".replace("'", ""))
                if data.dtype.kind not in kinds:
                    raise DataError(f"{where} has dtype {data.dtype}, not a "
                                    f"{'float' if kinds == 'f' else 'numeric'} type")
                counts[key] = data.shape[0]
            if len(set(counts.values())) != 1:
                raise DataError(f"{self.path}: /{split} datasets disagree on the sample "
                                f"count: {counts}")
            self._rows[split] = counts["dense"]
        if not self._rows["train"]:
            raise DataError(f"{self.path}: /train holds no samples; {_HINT}")


def _plain(value: Any) -> Any:
    """An attribute as a Python value (numpy scalars and bytes unwrapped; arrays kept)."""
    value = value.item() if isinstance(value, np.generic) else value
    return value.decode(errors="replace") if isinstance(value, bytes) else value
