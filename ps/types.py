"""Parameter-server messages: what travels between workers and servers, and its byte layout.

Every request is one byte buffer, sent with tag :data:`TAG_REQUEST`:

    int64  op, step, seq, slack, ntables; float64 lr (PUSH: the learning rate to apply)
    int64  table[ntables], count[ntables]
    int64  ids[sum(count)]                  (ids within each table, grouped by table)
    float32 grads[sum(count), dim]          (PUSH: gradients; WRITE: new values, or new
                                            values then optimizer state [.., dim + state])

Every reply is one byte buffer, sent with tag ``reply_tag(seq)`` so that a worker with
several requests in flight matches each reply to its request:

    int64  status (0 = rows follow, 1 = UTF-8 error message follows), payload bytes
    float32 rows[n, dim]  or  rows[n, dim + state] (READ)  or  nothing (WRITE)  or  UTF-8 message

The layout keeps every array aligned, so decoding is zero-copy views into the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

__all__ = ["Op", "Request", "TAG_REQUEST", "reply_tag", "encode_request", "decode_request",
           "encode_rows", "encode_error", "reply_capacity", "decode_reply", "HEADER"]

TAG_REQUEST = 7
_TAG_REPLY_BASE = 1024
_TAG_REPLY_SPAN = 16384
HEADER = 6
_STATUS_BYTES = 16
_MIN_ERROR_ROOM = 1024


class Op(IntEnum):
    PULL = 1  # read rows; the reply may be deferred until the sync model allows it
    PUSH = 2  # apply summed gradients of unique rows; advances the sender's clock
    DONE = 3  # the sender will send nothing more
    WRITE = 4  # overwrite rows (optimizer state reset); answered with an empty reply
    SAVE = 5  # checkpoint at the sender's clock, once every running worker has asked
    READ = 6  # read rows with their optimizer state under BSP's rule (tiering: rows go hot)


def reply_tag(seq: int) -> int:
    return _TAG_REPLY_BASE + seq % _TAG_REPLY_SPAN


@dataclass
class Request:
    op: Op
    step: int
    seq: int
    slack: int  # extra staleness this read accepts (1 for a prefetch)
    lr: float
    tables: np.ndarray  # int64 [ntables]
    counts: np.ndarray  # int64 [ntables]
    ids: np.ndarray  # int64 [n]
    grads: np.ndarray | None = None  # float32 [n, dim] (PUSH), [n, dim + state] (WRITE)

    def table_ids(self):
        """(table, ids) groups in message order."""
        start = 0
        for table, count in zip(self.tables.tolist(), self.counts.tolist(), strict=True):
            yield table, self.ids[start: start + count]
            start += count


def encode_request(op: Op, step: int, seq: int, slack: int, tables: np.ndarray,
                   counts: np.ndarray, ids: np.ndarray, grads: np.ndarray | None = None,
                   lr: float = 0.0) -> np.ndarray:
    n_ints = HEADER + 2 * len(tables) + len(ids)
    payload = 0 if grads is None else grads.size * 4
    buf = np.empty(n_ints * 8 + payload, dtype=np.uint8)
    ints = buf[: n_ints * 8].view(np.int64)
    ints[: HEADER - 1] = (int(op), step, seq, slack, len(tables))
    ints[HEADER - 1: HEADER].view(np.float64)[0] = lr
    ints[HEADER: HEADER + len(tables)] = tables
    ints[HEADER + len(tables): HEADER + 2 * len(tables)] = counts
    ints[HEADER + 2 * len(tables):] = ids
    if grads is not None:
        buf[n_ints * 8:].view(np.float32)[:] = grads.reshape(-1)
    return buf


def decode_request(buf: np.ndarray, dim: int) -> Request:
    head = buf[: HEADER * 8].view(np.int64)
    op, step, seq, slack, ntables = (int(x) for x in head[: HEADER - 1])
    lr = float(head[HEADER - 1:].view(np.float64)[0])
    ints = buf[: (HEADER + 2 * ntables) * 8].view(np.int64)
    tables = ints[HEADER: HEADER + ntables]
    counts = ints[HEADER + ntables:]
    n = int(counts.sum())
    end = (HEADER + 2 * ntables + n) * 8
    ids = buf[(HEADER + 2 * ntables) * 8: end].view(np.int64)
    grads = None
    if op == Op.PUSH:
        grads = buf[end:].view(np.float32).reshape(n, dim)
    elif op == Op.WRITE:  # values alone, or values then optimizer state
        grads = buf[end:].view(np.float32).reshape(n, -1 if n else dim)
    return Request(Op(op), step, seq, slack, lr, tables, counts, ids, grads)


def reply_capacity(rows: int, dim: int) -> int:
    """Bytes a worker must post for the reply to a pull of ``rows`` rows of ``dim`` values."""
    return _STATUS_BYTES + max(rows * dim * 4, _MIN_ERROR_ROOM)


def encode_rows(rows: np.ndarray) -> np.ndarray:
    buf = np.empty(_STATUS_BYTES + rows.size * 4, dtype=np.uint8)
    buf[:_STATUS_BYTES].view(np.int64)[:] = (0, rows.size * 4)
    buf[_STATUS_BYTES:].view(np.float32)[:] = rows.reshape(-1)
    return buf


def encode_error(message: str) -> np.ndarray:
    text = message.encode("utf-8")[:_MIN_ERROR_ROOM]
    buf = np.zeros(_STATUS_BYTES + len(text), dtype=np.uint8)
    buf[:_STATUS_BYTES].view(np.int64)[:] = (1, len(text))
    buf[_STATUS_BYTES:] = np.frombuffer(text, dtype=np.uint8)
    return buf


def decode_reply(buf: np.ndarray, rows: int, dim: int) -> np.ndarray | str:
    """The pulled rows ``[rows, dim]`` (a view into ``buf``), or the server's error text."""
    status, size = (int(x) for x in buf[:_STATUS_BYTES].view(np.int64))
    body = buf[_STATUS_BYTES: _STATUS_BYTES + size]
    if status:
        return body.tobytes().decode("utf-8", errors="replace")
    return body.view(np.float32).reshape(rows, dim)
