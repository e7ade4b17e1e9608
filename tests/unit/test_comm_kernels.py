"""The reduction kernels against numpy (and torch for bfloat16), and the single-copy
allreduce with its ranks played in one process, without MPI."""

import os

import numba
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hpctrain.comm import kernels as K
from hpctrain.comm import window
from hpctrain.comm.bytecopy import copy_bytes, stream_bytes

OPS = {K.SUM: np.add, K.MAX: np.fmax, K.MIN: np.fmin}


def bf16_bits(values: np.ndarray) -> np.ndarray:
    t = torch.from_numpy(np.ascontiguousarray(values, np.float32)).to(torch.bfloat16)
    return t.view(torch.int16).numpy().view(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return torch.from_numpy(bits.view(np.int16)).view(torch.bfloat16).float().numpy()


SPECIALS = np.array([0.0, -0.0, np.inf, -np.inf, 65504, 65520, 65519.99, 6e-8, 3e-8, 2.98e-8,
                     1e-40, 3.4e38, -1.5, 2.0 ** -14, 2.0 ** -24], np.float32)


def test_half_widening_is_exact_for_every_bit_pattern():
    bits = np.arange(1 << 16, dtype=np.uint16)
    out = np.empty(bits.size, np.float32)
    K.widen(bits, out, K.HALF)
    ref = bits.view(np.float16).astype(np.float32)
    nan = np.isnan(ref)
    assert np.array_equal(out.view(np.uint32)[~nan], ref.view(np.uint32)[~nan])
    assert np.isnan(out[nan]).all()


def test_rounding_to_half_and_bfloat16_matches_numpy_and_torch():
    rng = np.random.default_rng(0)
    f = np.concatenate([rng.standard_normal(50_000).astype(np.float32) * s
                        for s in (1e-7, 1e-5, 1e-2, 1.0, 1e3, 6e4)] + [SPECIALS])
    half = np.empty(f.size, np.uint16)
    K.narrow(f, half, K.HALF)
    with np.errstate(over="ignore"):
        assert np.array_equal(half, f.astype(np.float16).view(np.uint16))
    bhalf = np.empty(f.size, np.uint16)
    K.narrow(f, bhalf, K.BHALF)
    assert np.array_equal(bhalf, bf16_bits(f))
    back = np.empty(f.size, np.float32)
    K.widen(bhalf, back, K.BHALF)
    assert np.array_equal(back, from_bf16_bits(bhalf))
    nan = np.full(3, np.nan, np.float32)
    for kind in (K.HALF, K.BHALF):
        out = np.empty(3, np.uint16)
        K.narrow(nan, out, kind)
        wide = np.empty(3, np.float32)
        K.widen(out, wide, kind)
        assert np.isnan(wide).all()


@settings(max_examples=40, deadline=None)
@given(n=st.integers(0, 9000), seed=st.integers(0, 2**32 - 1),
       dtype=st.sampled_from(["float32", "float64", "int32", "int64"]),
       op=st.sampled_from([K.SUM, K.MAX, K.MIN]))
def test_reduce_pair_matches_numpy(n, seed, dtype, op):
    rng = np.random.default_rng(seed)
    a = (rng.standard_normal(n) * 1000).astype(dtype)
    b = (rng.standard_normal(n) * 1000).astype(dtype)
    ref = OPS[op](a, b)
    K.reduce_pair(a, b, op, K.ARITH)
    assert np.array_equal(a, ref)


@pytest.mark.parametrize("kind", [K.HALF, K.BHALF])
@pytest.mark.parametrize("op", [K.SUM, K.MAX, K.MIN])
def test_sixteen_bit_pairs_reduce_in_float32_and_round_once(kind, op):
    rng = np.random.default_rng(1)
    x, y = rng.standard_normal(10_001).astype(np.float32), rng.standard_normal(10_001)
    a, b = np.empty(x.size, np.uint16), np.empty(x.size, np.uint16)
    K.narrow(x, a, kind)
    K.narrow(y.astype(np.float32), b, kind)
    wa, wb = np.empty(x.size, np.float32), np.empty(x.size, np.float32)
    K.widen(a, wa, kind)
    K.widen(b, wb, kind)
    expect = np.empty(x.size, np.uint16)
    K.narrow(OPS[op](wa, wb), expect, kind)
    K.reduce_pair(a, b, op, kind)
    assert np.array_equal(a, expect)


def test_max_and_min_propagate_nan_symmetrically():
    a = np.array([1.0, np.nan, 2.0, np.nan], np.float32)
    b = np.array([np.nan, 1.0, 3.0, np.nan], np.float32)
    for op in (K.MAX, K.MIN):
        x, y = a.copy(), b.copy()
        K.reduce_pair(x, b, op, K.ARITH)
        K.reduce_pair(y, a, op, K.ARITH)
        assert np.array_equal(np.isnan(x), [True, True, False, True])
        assert np.array_equal(x, y, equal_nan=True)


@pytest.mark.parametrize("mode", [0, 1, 2])
@pytest.mark.parametrize("dtype, kind", [("float32", K.ARITH), ("int64", K.ARITH),
                                         ("uint16", K.BHALF)])
def test_reduce_slice_reads_own_row_from_own_and_writes_by_mode(mode, dtype, kind):
    rng = np.random.default_rng(2)
    rows, n, stride, me, lo, hi = 3, 9001, 9100, 1, 5, 8000
    values = rng.standard_normal((rows, stride)) * 100
    if kind == K.BHALF:
        flat = bf16_bits(values.reshape(-1).astype(np.float32))
        own = bf16_bits(rng.standard_normal(n).astype(np.float32))
        dense = [from_bf16_bits(flat[k * stride: k * stride + n]) for k in range(rows)]
        dense[me] = from_bf16_bits(own)
        expect = bf16_bits(np.sum(dense, axis=0, dtype=np.float32))
    else:
        flat = values.reshape(-1).astype(dtype)
        own = (rng.standard_normal(n) * 100).astype(dtype)
        dense = [flat[k * stride: k * stride + n].copy() for k in range(rows)]
        dense[me] = own.copy()
        expect = np.sum(dense, axis=0, dtype=dtype)
    before, own_before = flat.copy(), own.copy()
    K.reduce_slice(flat, stride, rows, me, own, lo, hi, mode, K.SUM, kind)
    assert np.array_equal(own[lo:hi], expect[lo:hi])
    assert np.array_equal(own[:lo], own_before[:lo]) and np.array_equal(own[hi:], own_before[hi:])
    for k in range(rows):
        row, old = flat[k * stride: k * stride + n], before[k * stride: k * stride + n]
        written = (mode == 1 and k == me) or (mode == 2 and k != me)
        assert np.array_equal(row[lo:hi], expect[lo:hi] if written else old[lo:hi])
        assert np.array_equal(row[:lo], old[:lo]) and np.array_equal(row[hi:], old[hi:])


def test_divide_for_wide_and_sixteen_bit_floats():
    x = np.arange(10, dtype=np.float64)
    K.divide(x, 4, K.ARITH)
    assert np.array_equal(x, np.arange(10) / 4)
    h = np.arange(10, dtype=np.float16).view(np.uint16).copy()
    K.divide(h, 4, K.HALF)
    assert np.array_equal(h.view(np.float16), (np.arange(10) / 4).astype(np.float16))


@numba.njit(cache=False)
def _copies(dst, dst_at, src, src_at, n, stream):
    if stream:
        stream_bytes(dst, dst_at, src, src_at, n)
    else:
        copy_bytes(dst, dst_at, src, src_at, n)


def test_byte_copies_match_numpy_at_every_alignment_and_dtype():
    """Both copies, byte offsets into arrays of any dtype: the streaming one's ragged head
    and tail (destination not on a cache line) and its whole lines between."""
    src = np.arange(1000, dtype=np.float32)
    raw = src.view(np.uint8)
    for stream in (False, True):
        for dst_at in (0, 1, 63, 64, 100):
            for src_at in (0, 3, 64):
                for n in (0, 1, 63, 64, 65, 200, 1000):
                    dst = np.zeros(2000, np.uint8)
                    _copies(dst, dst_at, src, src_at, n, stream)
                    expect = np.zeros(2000, np.uint8)
                    expect[dst_at:dst_at + n] = raw[src_at:src_at + n]
                    assert np.array_equal(dst, expect), (stream, dst_at, src_at, n)
    rows = np.zeros((4, 16), np.float32)  # a 2-D destination, whole rows
    _copies(rows, 64, src, 0, 128, True)
    assert np.array_equal(rows[1:3].reshape(-1), src[:32]) and not rows[0].any()


def _play_single_copy(buffers, words, pieces, bad_address=None):
    """Run :func:`window._single_copy` for ``len(buffers)`` ranks played in this process
    (a process may always read itself), round robin, each going on from the stage where
    it stopped for want of the others' flags: the final stage of each rank."""
    p, pid, stride = len(buffers), os.getpid(), words.size // len(buffers)
    tmps = [np.empty(pieces, b.dtype) for b in buffers]
    stages, done = [0] * p, [False] * p
    for _ in range(10 * p):
        for r in range(p):
            if not done[r]:
                stages[r] = window._single_copy(buffers[r], tmps[r], words, stride, r, p, 1,
                                                pid, stages[r], 0, K.SUM)
                if r == 0 and bad_address is not None:
                    words[1] = bad_address  # what the others read of rank 0
                done[r] = stages[r] <= 0
    return stages


def test_the_single_copy_allreduce_reduces_every_slice_through_small_pieces():
    for p, n in ((2, 11), (3, 11), (4, 3)):  # uneven slices; at 4 ranks one is empty
        inputs = [np.arange(n, dtype=np.float64) * (k + 1) + k for k in range(p)]
        buffers = [x.copy() for x in inputs]
        assert _play_single_copy(buffers, np.zeros(16 * p, np.int64), pieces=2) == [0] * p
        for b in buffers:
            np.testing.assert_array_equal(b, np.sum(inputs, axis=0))


def test_a_failed_single_copy_read_names_the_rank_and_releases_the_others():
    buffers = [np.ones(8, np.float32) for _ in range(2)]
    words = np.zeros(32, np.int64)
    stages = _play_single_copy(buffers, words, pieces=4, bad_address=8)
    assert stages == [0, -1]  # rank 1 could not read rank 0: -(0 + 1)
    assert words[16] == 3  # ... and published its last flag, so rank 0 finished


def _llvm_ir(kernel, *args) -> str:
    """LLVM IR of ``kernel`` compiled afresh for ``args``' types: numba shows none for code
    loaded from its cache (the helpers it calls are inlined, so their stores are in it)."""
    fresh = numba.njit(cache=False, nogil=True)(kernel.py_func)
    fresh.compile(tuple(numba.typeof(a) for a in args))
    return "\n".join(fresh.inspect_llvm().values())


def test_sixteen_bit_reduced_slices_are_written_by_plain_stores(monkeypatch):
    """The widening reduction writes float16/bfloat16 slices back (to ``own`` and, modes 1
    and 2, the window's rows) with plain stores, not the non-temporal ones of every other
    copy into the window; ``Window.fill``'s streaming copy shows what those look like.
    (:class:`~hpctrain.comm.shm.Shm` sends such buffers down the slices path: see
    test_comm_select.)"""
    flat, own = np.zeros(300, np.uint16), np.zeros(100, np.uint16)
    taken = {}
    for kernel in (K._slice_arith, K._slice_wide):
        monkeypatch.setattr(K, kernel.__name__,
                            lambda *a, k=kernel: taken.setdefault(a[-1], k))
    for kind in (K.HALF, K.BHALF):
        K.reduce_slice(flat, 100, 3, 1, own, 0, 100, 1, K.SUM, kind)
    monkeypatch.undo()
    assert set(taken) == {K.HALF, K.BHALF}
    for kernel in set(taken.values()):  # ``kind`` is a run-time argument: one compile
        ir = _llvm_ir(kernel, flat, 100, 3, 1, own, 0, 100, 1, K.SUM, K.HALF)
        assert "store" in ir and "!nontemporal" not in ir, kernel.__name__
    streamed = _llvm_ir(window._fill, np.zeros(64, np.uint8), 0, own, 0, 64)
    assert "!nontemporal" in streamed
