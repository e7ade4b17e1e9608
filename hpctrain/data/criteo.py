"""Criteo click-log text files (Kaggle ``train.txt``, Terabyte ``day_N``) with random access.

One sample per line, 40 tab-separated fields: ``label I1..I13 C1..C26``. Integer features may
be empty or negative; categorical features are hex strings (usually 8 digits) or empty.
Samples are the lines of the input files in order; each file is indexed once by a sequential
scan for newlines (8 bytes of memory per line), after which :meth:`CriteoText.read` seeks to
and parses only the lines it is asked for, so each rank reads just its own slice. Parsing
validates every line with one regular expression and converts the good ones with numpy; only a
line that fails is looked at field by field, to say what is wrong and where. Big files are
meant to be converted once with ``hpctrain preprocess`` (:mod:`hpctrain.data.hdf5`).

A file whose name ends in ``.gz`` (the Terabyte layout ships its days compressed) is read
through :mod:`gzip`, its lines indexed in the uncompressed stream. One handle per file stays
open, so reading forward (a rank's slices of successive batches) decompresses each byte once;
reading backward starts decompressing again from the file's beginning.
"""

from __future__ import annotations

import gzip
import logging
import math
import os
import re
from collections.abc import Iterator, Sequence

import numpy as np

from hpctrain.config import NUM_DENSE
from hpctrain.data.types import SPLITS, Batch, Dataset
from hpctrain.errors import ConfigError, DataError

__all__ = ["CriteoText", "NUM_CATEGORICAL", "held_out"]

NUM_CATEGORICAL = 26
"""Categorical features (C1..C26), one embedding table each."""

_NUM_FIELDS = 1 + NUM_DENSE + NUM_CATEGORICAL
_DENSE = rb"(?:-?[0-9]{1,18})?"  # at most 18 digits, so every value fits int64
_HEX = rb"[0-9a-fA-F]*"
_LINE = re.compile(rb"[01]" + (rb"\t" + _DENSE) * NUM_DENSE + (rb"\t" + _HEX) * NUM_CATEGORICAL)
_DENSE_FIELD = re.compile(_DENSE.decode())
_HEX_FIELD = re.compile(_HEX.decode())
_HEX_LUT = np.zeros(256, np.uint8)  # byte -> value of the hex digit
_HEX_LUT[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16)
_HEX_LUT[np.frombuffer(b"ABCDEF", np.uint8)] = np.arange(10, 16)
_SCAN_CHUNK = 1 << 24
_log = logging.getLogger(__name__)


def held_out(num_lines: int, eval_fraction: float) -> int:
    """Lines held out for ``eval`` when there are no ``eval_paths``: the last ones.

    ``floor(num_lines * eval_fraction)``, but at least one whenever the fraction is positive
    (a tiny input still gets an evaluation) and never all of them (training needs a sample).
    """
    if eval_fraction <= 0 or num_lines < 2:
        return 0
    wanted = math.floor(round(num_lines * eval_fraction, 6))  # round: 0.29 * 100 is 28.99..
    return min(max(wanted, 1), num_lines - 1)


class _File:
    """One indexed text file: line ``i`` is bytes ``[starts[i], starts[i + 1] - 1)``."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.starts = _scan(path)
        self.lines = len(self.starts) - 1
        self._gz: tuple[int, gzip.GzipFile] | None = None  # (pid, handle) of a .gz file

    def read_lines(self, lo: int, hi: int) -> list[bytes]:
        begin, end = int(self.starts[lo]), int(self.starts[hi]) - 1
        try:
            if self.path.endswith(".gz"):
                if self._gz is None or self._gz[0] != os.getpid():
                    self._gz = (os.getpid(), gzip.open(self.path, "rb"))  # noqa: SIM115 (kept open)
                f = self._gz[1]
                f.seek(begin)
                data = f.read(end - begin)
            else:
                with open(self.path, "rb") as f:
                    f.seek(begin)
                    data = f.read(end - begin)
        except (OSError, EOFError) as exc:
            raise DataError(f"{self.path}: cannot read ({_why(exc)})") from None
        lines = data.split(b"\n")
        if len(data) != end - begin or len(lines) != hi - lo:
            raise DataError(f"{self.path}: the file changed since it was indexed")
        if b"\r" in data:  # tolerate CRLF line ends
            lines = [line[:-1] if line.endswith(b"\r") else line for line in lines]
        return lines


def _scan(path: str) -> np.ndarray:
    """Line starts of ``path`` plus one past the end of its last line (int64 [lines + 1])."""
    pieces, pos, chunk, tail_at = [], 0, 0, 0
    try:
        with (gzip.open(path, "rb") if path.endswith(".gz") else open(path, "rb")) as f:
            buf = bytearray(_SCAN_CHUNK)
            while n := f.readinto(buf):
                pieces.append(np.flatnonzero(np.frombuffer(buf, np.uint8, n) == 10) + pos)
                chunk, tail_at = n, pos
                pos += n
    except (OSError, EOFError) as exc:
        raise DataError(f"{path}: cannot read ({_why(exc)})") from None
    if pos == 0:
        raise DataError(f"{path}: empty file")
    tail = buf[:chunk]  # the file's last chunk (readinto leaves it at the end)
    ends = np.concatenate(pieces).astype(np.int64)
    if tail[-1] != 10:  # no final newline: the last line ends at the end of the file
        ends = np.append(ends, pos)
    starts = np.concatenate([[0], ends + 1])
    lines = len(ends)
    while lines and (ends[lines - 1] == starts[lines - 1] or (  # drop trailing blank lines
            ends[lines - 1] == starts[lines - 1] + 1 and starts[lines - 1] >= tail_at
            and tail[starts[lines - 1] - tail_at] == 13)):  # a CRLF file's blank line: "\r"
        lines -= 1
    if lines == 0:
        raise DataError(f"{path}: no complete line (only blank lines)")
    return starts[: lines + 1]


def _why(exc: BaseException) -> str:
    return getattr(exc, "strerror", None) or str(exc)


class _Split:
    """Lines ``[lo, hi)`` of the concatenation of ``files``."""

    def __init__(self, files: list[_File], lo: int, hi: int) -> None:
        self.files, self.lo, self.hi = files, lo, hi
        self.first = np.cumsum([0] + [f.lines for f in files])

    def segments(self, start: int, stop: int) -> Iterator[tuple[_File, int, int, int]]:
        """``(file, lo, hi, index of line lo in the split)`` covering samples [start, stop)."""
        g0, g1 = self.lo + start, self.lo + stop
        for k, f in enumerate(self.files):
            first = int(self.first[k])
            a, b = max(g0, first) - first, min(g1, first + f.lines) - first
            if a < b:
                yield f, a, b, first + a - self.lo


class CriteoText(Dataset):
    """Criteo text files as a :class:`~hpctrain.data.types.Dataset`.

    ``eval`` is the lines of ``eval_paths`` when given, else the last :func:`held_out` lines
    of ``paths``. Integer features become ``log(1 + max(x, 0))`` (empty is 0); categorical
    feature ``t`` becomes row ``int(hex, 16) % table_sizes[t]`` (empty is row 0). A malformed
    line raises :class:`~hpctrain.errors.DataError` as ``file:line: what``, or with
    ``on_bad_line="skip"`` is dropped from its batch and counted once in :attr:`skipped`.
    """

    def __init__(self, paths: Sequence[str], table_sizes: Sequence[int], *,
                 eval_paths: Sequence[str] = (), eval_fraction: float = 0.1,
                 on_bad_line: str = "error") -> None:
        if len(table_sizes) != NUM_CATEGORICAL or any(
                isinstance(s, bool) or not isinstance(s, int | np.integer) or s < 1
                for s in table_sizes):
            raise ConfigError(f"data.table_sizes: the Criteo layout needs {NUM_CATEGORICAL} "
                              f"positive table sizes (C1..C{NUM_CATEGORICAL}), got "
                              f"{len(table_sizes)}: {tuple(table_sizes)!r}")
        if on_bad_line not in ("error", "skip"):
            raise ConfigError(f"data.on_bad_line: expected 'error' or 'skip', got "
                              f"{on_bad_line!r}")
        if not 0 <= eval_fraction < 1:
            raise ConfigError(f"data.eval_fraction: expected a number in [0, 1), got "
                              f"{eval_fraction!r}")
        if not paths:
            raise ConfigError("data.paths: the Criteo reader needs at least one input file")
        self.table_sizes = tuple(int(s) for s in table_sizes)
        self.skipped = 0
        self._sizes = np.asarray(self.table_sizes, np.int64)
        self._skip = on_bad_line == "skip"
        self._skipped_at: dict[str, set[int]] = {s: set() for s in SPLITS}
        train = [_File(str(p)) for p in paths]
        total = sum(f.lines for f in train)
        if eval_paths:
            held = [_File(str(p)) for p in eval_paths]
            self._splits = {"train": _Split(train, 0, total),
                            "eval": _Split(held, 0, sum(f.lines for f in held))}
        else:
            cut = total - held_out(total, eval_fraction)
            self._splits = {"train": _Split(train, 0, cut), "eval": _Split(train, cut, total)}

    def num_samples(self, split: str) -> int:
        part = self._split(split)
        return part.hi - part.lo

    def read(self, split: str, start: int, stop: int) -> Batch:
        part = self._split(split)
        if not 0 <= start <= stop <= part.hi - part.lo:
            raise ValueError(f"samples [{start}, {stop}) outside {split} "
                             f"[0, {part.hi - part.lo})")
        batches = [self._parse(f.read_lines(a, b), f.path, a + 1, split, index)
                   for f, a, b, index in part.segments(start, stop)]
        return Batch.concat(batches) if batches else _empty(len(self.table_sizes))

    def _split(self, split: str) -> _Split:
        if split not in self._splits:
            raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
        return self._splits[split]

    def _parse(self, lines: list[bytes], path: str, lineno: int, split: str,
               index: int) -> Batch:
        """Lines of ``path`` starting at 1-based ``lineno`` (split sample ``index``)."""
        good = [line for line in lines if _LINE.fullmatch(line)]
        if len(good) < len(lines):
            for i, line in enumerate(lines):
                if _LINE.fullmatch(line):
                    continue
                message = f"{path}:{lineno + i}: {_diagnose(line)}"
                if not self._skip:
                    raise DataError(message)
                if index + i not in self._skipped_at[split]:
                    self._skipped_at[split].add(index + i)
                    self.skipped += 1
                    log = _log.warning if self.skipped == 1 else _log.debug
                    log("skipping malformed line %s", message)
        if not good:
            return _empty(NUM_CATEGORICAL)
        fields = np.array(b"\t".join(good).split(b"\t")).reshape(len(good), _NUM_FIELDS)
        counts = fields[:, 1:1 + NUM_DENSE]
        counts = np.where(counts == b"", b"0", counts).astype(np.int64)
        dense = np.log1p(np.maximum(counts, 0).astype(np.float64)).astype(np.float32)
        sparse = _hex_ids(fields[:, 1 + NUM_DENSE:], self._sizes)
        labels = (fields[:, 0] == b"1").astype(np.float32)
        return Batch(dense, sparse, labels)


def _hex_ids(cols: np.ndarray, sizes: np.ndarray) -> np.ndarray:
    """Table rows of hex fields ``cols`` (bytes [n, T]): value mod size, empty -> 0."""
    n, t = cols.shape
    raw = np.ascontiguousarray(cols).view(np.uint8).reshape(n, t, cols.dtype.itemsize)
    length = (raw != 0).sum(axis=2)  # bytes arrays are NUL-padded; fields hold no NUL
    width = min(int(length.max(initial=0)), 15)  # 15 hex digits fit int64; longer ones below
    digits = _HEX_LUT[raw[:, :, :width]]  # left-aligned, NUL padding reads as digit 0
    value = np.zeros((n, t), np.int64)
    for p in range(width):
        value <<= 4
        value += digits[:, :, p]
    value >>= 4 * np.maximum(width - length, 0)  # drop the padding digits
    ids = value % sizes
    for r, c in np.argwhere(length > 15):
        ids[r, c] = int(cols[r, c], 16) % int(sizes[c])
    ids[length == 0] = 0
    return ids


def _diagnose(line: bytes) -> str:
    """What is wrong with a line that failed the fast check."""
    try:
        text = line.decode("utf-8")
    except UnicodeDecodeError as exc:
        return (f"not UTF-8 text (byte 0x{line[exc.start]:02x} at column {exc.start + 1})")
    fields = text.split("\t")
    if len(fields) != _NUM_FIELDS:
        what = "empty line" if not text else f"got {len(fields)} tab-separated fields"
        return (f"{what}; expected {_NUM_FIELDS} (label, I1..I{NUM_DENSE}, "
                f"C1..C{NUM_CATEGORICAL})")
    if fields[0] not in ("0", "1"):
        return f"label: expected 0 or 1, got {_show(fields[0])}"
    for k, value in enumerate(fields[1:1 + NUM_DENSE], 1):
        if not _DENSE_FIELD.fullmatch(value):
            if re.fullmatch(r"-?[0-9]+", value):
                return f"I{k}: integer out of range (over 18 digits): {_show(value)}"
            return f"I{k}: expected an integer or nothing, got {_show(value)}"
    for k, value in enumerate(fields[1 + NUM_DENSE:], 1):
        if not _HEX_FIELD.fullmatch(value):
            return f"C{k}: expected a hexadecimal string or nothing, got {_show(value)}"
    return "malformed line"


def _show(value: str) -> str:
    return repr(value if len(value) <= 40 else value[:37] + "...")


def _empty(tables: int) -> Batch:
    return Batch(np.zeros((0, NUM_DENSE), np.float32), np.zeros((0, tables), np.int64),
                 np.zeros(0, np.float32))
