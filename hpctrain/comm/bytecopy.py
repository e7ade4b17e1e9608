"""Byte copies inside numba code, between contiguous arrays of any dtype.

:func:`copy_bytes` is ``memcpy`` (numba's slice assignment checks for overlap and copies a
byte at a time); :func:`stream_bytes` writes the whole cache lines of its destination by
non-temporal stores, for buffers in shared memory that another core reads next (the
shared-window collectives' copies into the window, :mod:`hpctrain.comm.window`, and the
all-to-all's, :mod:`hpctrain.comm.alltoall`). Offsets and lengths are in bytes.
"""

from __future__ import annotations

import numba
from llvmlite import ir
from numba.core import cgutils, types
from numba.extending import intrinsic

__all__ = ["copy_bytes", "stream_bytes"]

_LINE = 64  # bytes of a cache line


def _byte_pointer(context, builder, array_type, array, at):
    """LLVM ``i8*`` to byte ``at`` of a numba array's data, whatever its dtype."""
    data = context.make_array(array_type)(context, builder, array).data
    return builder.gep(builder.bitcast(data, ir.IntType(8).as_pointer()), [at])


@intrinsic
def copy_bytes(typingctx, dst, dst_at, src, src_at, n):  # noqa: ARG001 - numba's signature
    """``memcpy`` of ``n`` bytes from byte ``src_at`` of ``src`` to byte ``dst_at`` of
    ``dst`` (contiguous arrays of any dtype, not overlapping), in numba code: numba's slice
    assignment checks for overlap and copies a byte at a time (the exchange of 1 MiB took
    3-5x as long)."""
    def codegen(context, builder, signature, args):
        dst_v, dst_at_v, src_v, src_at_v, n_v = args
        cgutils.raw_memcpy(builder, _byte_pointer(context, builder, signature.args[0], dst_v,
                                                  dst_at_v),
                           _byte_pointer(context, builder, signature.args[2], src_v, src_at_v),
                           n_v, 1)
        return context.get_dummy_value()
    return types.void(dst, dst_at, src, src_at, n), codegen


@intrinsic
def _address(typingctx, arr):  # noqa: ARG001 - numba's signature
    """The address of an array's data, as an integer."""
    def codegen(context, builder, signature, args):
        data = context.make_array(signature.args[0])(context, builder, args[0]).data
        return builder.ptrtoint(data, ir.IntType(64))
    return types.int64(arr), codegen


@intrinsic
def _stream_lines(typingctx, dst, dst_at, src, src_at, n):  # noqa: ARG001 - numba's signature
    """``n`` bytes (a multiple of 64) from byte ``src_at`` of ``src`` to byte ``dst_at`` of
    ``dst`` (a 64-byte aligned address) by 64-byte non-temporal stores (``vmovntdq`` on
    x86, split into narrower ones where the vector unit is narrower)."""
    def codegen(context, builder, signature, args):
        dst_v, dst_at_v, src_v, src_at_v, n_v = args
        to = _byte_pointer(context, builder, signature.args[0], dst_v, dst_at_v)
        of = _byte_pointer(context, builder, signature.args[2], src_v, src_at_v)
        line, word = ir.VectorType(ir.IntType(64), _LINE // 8), ir.IntType(64)
        hint = builder.module.add_metadata([ir.Constant(ir.IntType(32), 1)])
        lines = builder.udiv(n_v, ir.Constant(word, _LINE))
        with cgutils.for_range(builder, lines) as loop:
            at = builder.mul(loop.index, ir.Constant(word, _LINE))
            value = builder.load(builder.bitcast(builder.gep(of, [at]), line.as_pointer()),
                                 align=1)
            store = builder.store(value, builder.bitcast(builder.gep(to, [at]),
                                                         line.as_pointer()), align=_LINE)
            store.set_metadata("nontemporal", hint)
        return context.get_dummy_value()
    return types.void(dst, dst_at, src, src_at, n), codegen


@numba.njit(cache=True, nogil=True, inline="always")
def stream_bytes(dst, dst_at, src, src_at, n):
    """:func:`copy_bytes` into shared memory that another core reads next: the whole
    cache lines by non-temporal stores, the ragged ends by ``memcpy``. A plain store must
    first take each line back from the cache of the core that read it last; on the 2-core
    VM this project is measured on, 32 KiB copied into a window row took 15 us that way
    and 1.9 us by streaming stores. The fence before a flag is published
    (:func:`~hpctrain.comm.window.publish_flag`, a sequentially consistent fence) orders them
    like plain stores."""
    head = min(n, (-(_address(dst) + dst_at)) % _LINE)
    if head:
        copy_bytes(dst, dst_at, src, src_at, head)
    body = (n - head) // _LINE * _LINE
    if body:
        _stream_lines(dst, dst_at + head, src, src_at + head, body)
    if n > head + body:
        copy_bytes(dst, dst_at + head + body, src, src_at + head + body, n - head - body)
