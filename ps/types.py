"""Parameter-server messages: what travels between workers and servers, and its byte layout.

Every request is one byte buffer, sent with tag :data:`TAG_REQUEST`:

    int64  op, step, seq, slack, ntables, wire; float64 lr (PUSH: the learning rate to
           apply), scale (PUSH: what the gradients were multiplied by)
    int64  table[ntables], count[ntables]
    int64  ids[sum(count)]                  (ids within each table, grouped by table)
    wire   grads[sum(count), dim]           (PUSH: gradients in the wire format)
    float32 values[sum(count), ..]          (WRITE: new values, or new values then
                                            optimizer state [.., dim + state])

Every reply is one byte buffer, sent with tag ``reply_tag(seq)`` so that a worker with
several requests in flight matches each reply to its request:

    int64  status (bit 0: 0 = rows follow, 1 = UTF-8 error message follows; the bits from 8
           up: the signal the server had received, 0 for none), payload bytes, wire;
    float64 scale
    wire   rows[n, dim] (PULL: in the request's wire format)  or  float32 rows[n, dim + state]
           (READ)  or  nothing (WRITE)  or  UTF-8 message

``wire`` is the payload's format (:mod:`hpctrain.comm.wire`: 0 float32, 1 bf16, 2 fp16; a
PULL's reply comes in the format of its request, ``ps.wire_dtype``), and ``scale`` the power
of two fp16 values were multiplied by. Rows and optimizer state moved with READ/WRITE stay
float32. The layout keeps every array aligned, so float32 decoding is zero-copy views into
the buffer.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum

import numpy as np

from hpctrain.comm.wire import decode, encode, wire_code, wire_of

__all__ = ["Op", "Request", "TAG_REQUEST", "reply_tag", "encode_request", "decode_request",
           "encode_rows", "rows_reply", "encode_error", "reply_capacity", "decode_reply",
           "reply_bytes", "reply_signal", "stamp_signal", "HEADER"]

TAG_REQUEST = 7
_TAG_REPLY_BASE = 1024
_TAG_REPLY_SPAN = 16384
HEADER = 8
_STATUS_BYTES = 32
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
    wire: str = "float32"  # PUSH payload and PULL reply format


def encode_request(op: Op, step: int, seq: int, slack: int, tables: np.ndarray,
                   counts: np.ndarray, ids: np.ndarray, grads: np.ndarray | None = None,
                   lr: float = 0.0, wire: str = "float32",
                   positions: np.ndarray | None = None) -> np.ndarray:
    """A request; PUSH gradients travel in ``wire`` format, WRITE values in float32, and a
    PULL asks for its reply in ``wire``. ``positions``: the rows of ``grads`` to send (all
    by default); float32 rows are copied from there straight into the message."""
    n_ints = HEADER + 2 * len(tables) + len(ids)
    scale, payload, size = 1.0, None, 0
    if grads is not None:
        if op == Op.PUSH and wire != "float32":
            payload, scale = encode(grads if positions is None else grads[positions], wire)
            size = payload.nbytes
        else:
            size = len(ids) * grads.shape[1] * 4
    buf = np.empty(n_ints * 8 + size, dtype=np.uint8)
    ints = buf[: n_ints * 8].view(np.int64)
    ints[: HEADER - 2] = (int(op), step, seq, slack, len(tables), wire_code(wire))
    ints[HEADER - 2: HEADER].view(np.float64)[:] = (lr, scale)
    ints[HEADER: HEADER + len(tables)] = tables
    ints[HEADER + len(tables): HEADER + 2 * len(tables)] = counts
    ints[HEADER + 2 * len(tables):] = ids
    if payload is not None:
        buf[n_ints * 8:] = payload.view(np.uint8)
    elif grads is not None:
        rows = buf[n_ints * 8:].view(np.float32).reshape(len(ids), grads.shape[1])
        if positions is None:
            rows[:] = grads
        else:
            np.take(np.asarray(grads, dtype=np.float32), positions, axis=0, out=rows)
    return buf


def decode_request(buf: np.ndarray, dim: int) -> Request:
    head = buf[: HEADER * 8].view(np.int64)
    op, step, seq, slack, ntables, code = (int(x) for x in head[: HEADER - 2])
    lr, scale = (float(x) for x in head[HEADER - 2:].view(np.float64))
    wire = wire_of(code)
    ints = buf[: (HEADER + 2 * ntables) * 8].view(np.int64)
    tables = ints[HEADER: HEADER + ntables]
    counts = ints[HEADER + ntables:]
    n = int(counts.sum())
    end = (HEADER + 2 * ntables + n) * 8
    ids = buf[(HEADER + 2 * ntables) * 8: end].view(np.int64)
    grads = None
    if op == Op.PUSH:
        grads = decode(buf[end:], wire, scale).reshape(n, dim)
    elif op == Op.WRITE:  # values alone, or values then optimizer state
        grads = buf[end:].view(np.float32).reshape(n, -1 if n else dim)
    return Request(Op(op), step, seq, slack, lr, tables, counts, ids, grads, wire)


def reply_capacity(rows: int, dim: int) -> int:
    """Bytes a worker must post for the reply to a pull of ``rows`` rows of ``dim`` values."""
    return _STATUS_BYTES + max(rows * dim * 4, _MIN_ERROR_ROOM)


def rows_reply(rows: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """A reply of ``rows`` float32 rows of ``width`` values, and the ``[rows, width]`` view of
    its payload for the server to fill in place (no intermediate array)."""
    buf = np.empty(_STATUS_BYTES + rows * width * 4, dtype=np.uint8)
    head = buf[:_STATUS_BYTES].view(np.int64)
    head[:3] = (0, rows * width * 4, 0)
    head[3:].view(np.float64)[0] = 1.0
    return buf, buf[_STATUS_BYTES:].view(np.float32).reshape(rows, width)


def encode_rows(rows: np.ndarray, wire: str = "float32") -> np.ndarray:
    payload, scale = encode(rows, wire)
    buf = np.empty(_STATUS_BYTES + payload.nbytes, dtype=np.uint8)
    head = buf[:_STATUS_BYTES].view(np.int64)
    head[:3] = (0, payload.nbytes, wire_code(wire))
    head[3:].view(np.float64)[0] = scale
    buf[_STATUS_BYTES:] = payload.view(np.uint8)
    return buf


def encode_error(message: str) -> np.ndarray:
    text = message.encode("utf-8")[:_MIN_ERROR_ROOM]
    buf = np.zeros(_STATUS_BYTES + len(text), dtype=np.uint8)
    buf[:_STATUS_BYTES].view(np.int64)[:3] = (1, len(text), 0)
    buf[_STATUS_BYTES:] = np.frombuffer(text, dtype=np.uint8)
    return buf


def decode_reply(buf: np.ndarray, rows: int, dim: int) -> np.ndarray | str:
    """The pulled rows ``[rows, dim]`` as float32 (a view into ``buf`` when they travelled
    as float32), or the server's error text."""
    head = buf[:_STATUS_BYTES].view(np.int64)
    status, size, code = (int(x) for x in head[:3])
    body = buf[_STATUS_BYTES: _STATUS_BYTES + size]
    if status & 1:
        return body.tobytes().decode("utf-8", errors="replace")
    return decode(body, wire_of(code), float(head[3:].view(np.float64)[0])).reshape(rows, dim)


def stamp_signal(buf: np.ndarray, signum: int) -> None:
    """Mark a reply as coming from a server that received ``signum`` (SIGTERM or SIGUSR1):
    the status word's bits above the error flag."""
    buf[:_STATUS_BYTES].view(np.int64)[0] |= signum << 8


def reply_signal(buf: np.ndarray) -> int:
    """The signal a reply's server had received (0: none)."""
    return int(buf[:_STATUS_BYTES].view(np.int64)[0]) >> 8


def reply_bytes(buf: np.ndarray) -> int:
    """Bytes of the reply in ``buf`` as sent (status block and payload)."""
    return _STATUS_BYTES + int(buf[:_STATUS_BYTES].view(np.int64)[1])
