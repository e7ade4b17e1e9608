"""Reduction kernels (numba): every collective reduces buffers through these.

Buffers are 1-D and contiguous. 16-bit floats travel as their ``uint16`` bit patterns
(numpy has no bfloat16 and numba cannot add float16), so a ``kind`` code says how to read
them: :data:`ARITH` (the array's own dtype), :data:`HALF` (IEEE float16 bits) or
:data:`BHALF` (bfloat16 bits). 16-bit values are widened to float32, combined, and rounded
back to nearest-even once per kernel call: float32 accumulation.

``op`` is :data:`SUM`, :data:`MAX` or :data:`MIN`; max and min propagate NaN like
``np.maximum``. Every combination is commutative bit for bit, so algorithms that reduce in
pairs from both ends (recursive doubling) give every rank the same bits.

Kernels are compiled per dtype on first use and cached on disk (``cache=True``), and they
release the GIL so a communication thread can reduce while the main thread computes.
"""

from __future__ import annotations

import numba
import numpy as np

__all__ = ["ARITH", "HALF", "BHALF", "SUM", "MAX", "MIN", "reduce_pair", "reduce_slice",
           "divide", "widen", "narrow"]

ARITH, HALF, BHALF = 0, 1, 2
SUM, MAX, MIN = 0, 1, 2
_BLOCK = 16384  # elements reduced per pass through the rows (stays in L2)

_jit = numba.njit(cache=True, nogil=True)


@numba.njit(cache=True, inline="always")
def _combine(a, b, op):
    if op == SUM:
        return a + b
    if op == MAX:
        return a if (a > b or a != a) else b
    return a if (a < b or a != a) else b


@numba.njit(cache=True, inline="always")
def _half_to_bits32(h):
    """IEEE half bits -> float32 bits (exact, subnormals and NaN payloads kept)."""
    h = np.uint32(h)
    sign = (h & np.uint32(0x8000)) << np.uint32(16)
    exp = h & np.uint32(0x7C00)
    if exp == 0:
        sig = h & np.uint32(0x03FF)
        if sig == 0:
            return sign
        e = np.uint32(0)
        sig <<= np.uint32(1)
        while (sig & np.uint32(0x0400)) == 0:
            sig <<= np.uint32(1)
            e += np.uint32(1)
        return sign | ((np.uint32(112) - e) << np.uint32(23)) | (
            (sig & np.uint32(0x03FF)) << np.uint32(13))
    if exp == 0x7C00:
        return sign | np.uint32(0x7F800000) | ((h & np.uint32(0x03FF)) << np.uint32(13))
    return sign | (((h & np.uint32(0x7FFF)) + np.uint32(0x1C000)) << np.uint32(13))


@numba.njit(cache=True, inline="always")
def _bits32_to_half(f):
    """float32 bits -> IEEE half bits, round to nearest even (numpy's algorithm)."""
    f = np.uint32(f)
    sign = np.uint32((f & np.uint32(0x80000000)) >> np.uint32(16))
    exp = f & np.uint32(0x7F800000)
    if exp >= np.uint32(0x47800000):
        if exp == np.uint32(0x7F800000) and (f & np.uint32(0x007FFFFF)) != 0:
            out = np.uint32(0x7C00) + ((f & np.uint32(0x007FFFFF)) >> np.uint32(13))
            return sign | (out if out != 0x7C00 else np.uint32(0x7C01))
        return sign | np.uint32(0x7C00)
    if exp <= np.uint32(0x38000000):
        if exp < np.uint32(0x33000000):
            return sign
        e = exp >> np.uint32(23)
        sig = np.uint32(0x00800000) + (f & np.uint32(0x007FFFFF))
        sig >>= np.uint32(113) - e
        if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000) or (f & np.uint32(0x7FF)) != 0:
            sig += np.uint32(0x1000)
        return sign + (sig >> np.uint32(13))
    sig = f & np.uint32(0x007FFFFF)
    if (sig & np.uint32(0x3FFF)) != np.uint32(0x1000):
        sig += np.uint32(0x1000)
    return sign + ((exp - np.uint32(0x38000000)) >> np.uint32(13)) + (sig >> np.uint32(13))


@numba.njit(cache=True, inline="always")
def _bits32_to_bhalf(f):
    """float32 bits -> bfloat16 bits, round to nearest even; NaN stays a quiet NaN."""
    f = np.uint32(f)
    if (f & np.uint32(0x7F800000)) == np.uint32(0x7F800000) and (f & np.uint32(0x007FFFFF)):
        return (f >> np.uint32(16)) | np.uint32(0x40)
    return (f + np.uint32(0x7FFF) + ((f >> np.uint32(16)) & np.uint32(1))) >> np.uint32(16)


@numba.njit(cache=True, inline="always")
def _widen_into(dst32, src, kind):
    """float32 values of the 16-bit ``src`` into ``dst32`` (same length)."""
    bits = dst32.view(np.uint32)
    if kind == HALF:
        for i in range(src.size):
            bits[i] = _half_to_bits32(src[i])
    else:
        for i in range(src.size):
            bits[i] = np.uint32(src[i]) << np.uint32(16)


@numba.njit(cache=True, inline="always")
def _narrow_into(dst, src32, kind):
    bits = src32.view(np.uint32)
    if kind == HALF:
        for i in range(dst.size):
            dst[i] = _bits32_to_half(bits[i])
    else:
        for i in range(dst.size):
            dst[i] = _bits32_to_bhalf(bits[i])


@numba.njit(cache=True, inline="always")
def _accumulate(acc, src, op):
    if op == SUM:
        for i in range(acc.size):
            acc[i] += src[i]
    elif op == MAX:
        for i in range(acc.size):
            acc[i] = _combine(acc[i], src[i], MAX)
    else:
        for i in range(acc.size):
            acc[i] = _combine(acc[i], src[i], MIN)


def reduce_pair(dst: np.ndarray, src: np.ndarray, op: int, kind: int) -> None:
    """``dst = dst (op) src`` element-wise, in place."""
    if kind == ARITH:
        _pair_arith(dst, src, op)
    else:
        _pair_wide(dst, src, op, kind)


def reduce_slice(flat: np.ndarray, stride: int, rows: int, own_row: int, own: np.ndarray,
                 lo: int, hi: int, mode: int, op: int, kind: int) -> None:
    """Reduce elements ``[lo, hi)`` over ``rows`` equal-length rows of a shared window.

    Row ``k`` is ``flat[k*stride : k*stride + n]``, except row ``own_row``, which is read
    from ``own`` (this rank's private buffer, or its own row). The result goes to
    ``own[lo:hi]`` and, for ``mode`` 1, to row ``own_row`` of ``flat``; for ``mode`` 2, to
    every row of ``flat`` (a resident bucket: each rank's copy is final). Mode 0 is used
    where every rank reduces the same range itself, so it combines rows in order 0, 1, ...
    and all ranks get the same bits; in modes 1 and 2 one rank reduces the range for all
    (16-bit floats always combine in order, in float32).
    """
    if hi > lo:
        fn = _slice_arith if kind == ARITH else _slice_wide
        fn(flat, stride, rows, own_row, own, lo, hi, mode, op, kind)


def divide(buf: np.ndarray, divisor: int, kind: int) -> None:
    """``buf /= divisor`` in place (the ``avg`` op after a sum); float dtypes only."""
    if kind == ARITH:
        np.divide(buf, divisor, out=buf)
    else:
        _divide_wide(buf, divisor, kind)


@_jit
def _pair_arith(dst, src, op):
    _accumulate(dst, src, op)


@_jit
def _pair_wide(dst, src, op, kind):
    a = np.empty(min(dst.size, _BLOCK), np.float32)
    b = np.empty_like(a)
    for lo in range(0, dst.size, _BLOCK):
        hi = min(dst.size, lo + _BLOCK)
        m = hi - lo
        _widen_into(a[:m], dst[lo:hi], kind)
        _widen_into(b[:m], src[lo:hi], kind)
        _accumulate(a[:m], b[:m], op)
        _narrow_into(dst[lo:hi], a[:m], kind)


@numba.njit(cache=True, inline="always")
def _copy(dst, src):
    for i in range(dst.size):
        dst[i] = src[i]


@numba.njit(cache=True, inline="always")
def _scatter_rows(flat, stride, rows, own_row, out, s, e, mode):
    for k in range(rows):
        if (mode == 1 and k == own_row) or (mode == 2 and k != own_row):
            _copy(flat[k * stride + s: k * stride + e], out)


# The loops below never pick an array with a conditional expression: numba would merge the
# two into a non-contiguous array type and the loops would stop vectorising.

@_jit
def _slice_arith(flat, stride, rows, own_row, own, lo, hi, mode, op, kind):
    ordered = mode == 0 and own_row != 0
    mine = np.empty(min(hi - lo, _BLOCK) if ordered else 0, flat.dtype)
    for s in range(lo, hi, _BLOCK):
        e = min(hi, s + _BLOCK)
        out = own[s:e]
        if ordered:  # every rank reduces this range itself: combine rows 0, 1, ... in order
            m = mine[: e - s]
            _copy(m, out)
            _copy(out, flat[s:e])
            for k in range(1, rows):
                if k == own_row:
                    _accumulate(out, m, op)
                else:
                    _accumulate(out, flat[k * stride + s: k * stride + e], op)
        else:  # this rank alone reduces the range: own row first, then the others in order
            for k in range(rows):
                if k != own_row:
                    _accumulate(out, flat[k * stride + s: k * stride + e], op)
        _scatter_rows(flat, stride, rows, own_row, out, s, e, mode)


@_jit
def _slice_wide(flat, stride, rows, own_row, own, lo, hi, mode, op, kind):
    acc = np.empty(min(hi - lo, _BLOCK), np.float32)
    wide = np.empty_like(acc)
    for s in range(lo, hi, _BLOCK):
        e = min(hi, s + _BLOCK)
        m = e - s
        a, w = acc[:m], wide[:m]
        for k in range(rows):
            if k == own_row:
                _widen_into(w, own[s:e], kind)
            else:
                _widen_into(w, flat[k * stride + s: k * stride + e], kind)
            if k == 0:
                _copy(a, w)
            else:
                _accumulate(a, w, op)
        out = own[s:e]
        _narrow_into(out, a, kind)
        _scatter_rows(flat, stride, rows, own_row, out, s, e, mode)


@_jit
def _divide_wide(buf, divisor, kind):
    tmp = np.empty(min(buf.size, _BLOCK), np.float32)
    for lo in range(0, buf.size, _BLOCK):
        hi = min(buf.size, lo + _BLOCK)
        t = tmp[: hi - lo]
        _widen_into(t, buf[lo:hi], kind)
        for i in range(t.size):
            t[i] = t[i] / np.float32(divisor)
        _narrow_into(buf[lo:hi], t, kind)


@_jit
def widen(src, dst32, kind):
    """float32 copy of 16-bit ``src`` (for collectives that only reduce float32)."""
    _widen_into(dst32, src, kind)


@_jit
def narrow(src32, dst, kind):
    """Round float32 ``src32`` into 16-bit ``dst`` (nearest even)."""
    _narrow_into(dst, src32, kind)
