"""alltoallv: every exchange algorithm against numpy for awkward count matrices."""

import dataclasses
import os
import time

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm import Group, alltoall, alltoallv, cma
from hpctrain.comm.alltoall import EXCHANGE_NAMES, Matrix, choose_exchange, compile_kernels
from hpctrain.comm.types import CostParams, Layout
from hpctrain.config import CommConfig
from hpctrain.errors import CommError

WORLD = MPI.COMM_WORLD


def count_matrices(p: int) -> dict[str, np.ndarray]:
    """Row counts ``[i, j]`` from rank ``i`` to rank ``j``."""
    rng = np.random.default_rng(p)
    skew = np.ones((p, p), np.int64)
    skew[0, p - 1] = 200_003  # one large message among tiny ones
    silent = rng.integers(0, 50, (p, p))
    silent[1 % p] = 0  # one rank sends nothing
    return {"zeros": np.zeros((p, p), np.int64), "silent": silent, "skew": skew,
            "diagonal": np.diag(np.arange(1, p + 1) * 7),
            "random": rng.integers(0, 3000, (p, p))}


def rows(src: int, dst: int, n: int, width: int) -> np.ndarray:
    """What ``src`` sends ``dst``: values that name both and the position."""
    return (np.arange(n * width, dtype=np.float64).reshape(n, width) * 1e-3
            + 1000 * src + dst).astype(np.float32)


@pytest.mark.mpi(ranks=(2, 3, 4), timeout=600)
def test_alltoallv_algorithms_match_numpy():
    p, r = WORLD.Get_size(), WORLD.Get_rank()
    compile_kernels()  # as the training warm-up does
    passes = (alltoall._describe, alltoall._shm_exchange, alltoall._copy_out,
              alltoall._pipeline, alltoall._cma_exchange, alltoall._counts_fit)
    compiled = [len(kernel.signatures) for kernel in passes]
    for config in (CommConfig(), CommConfig(check=True)):
        group = Group(WORLD, config)
        algorithms = [a for a in EXCHANGE_NAMES
                      if a == "auto" or alltoall._BY_NAME[a].enabled(group.layout)]
        for name, counts in count_matrices(p).items():
            for width in (1, 3):
                send = np.concatenate([rows(r, j, counts[r, j], width) for j in range(p)])
                expect = np.concatenate([rows(i, r, counts[i, r], width) for i in range(p)])
                for algorithm in algorithms:
                    got, got_counts = alltoallv(send, counts[r], comm=group,
                                                algorithm=algorithm)
                    np.testing.assert_array_equal(got_counts, counts[:, r])
                    np.testing.assert_array_equal(got, expect,
                                                  err_msg=f"{name} {width} {algorithm}")
        # a late rank: the others' polls in numba give up and they wait yielding the core
        for i, algorithm in enumerate(algorithms):
            if r == (p - 1 + i) % p:
                time.sleep(0.05)
            got, _ = alltoallv(send, counts[r], comm=group, algorithm=algorithm)
            np.testing.assert_array_equal(got, expect)
        # ... and piece by piece (a rank sending over 16 MiB: 64-128 steps)
        skew = count_matrices(p)["skew"]
        skew[0, p - 1] = (16 << 20) // 12 + 1
        assert Matrix(skew, 0, 12).pipelined and not Matrix(skew - 1, 0, 12).pipelined
        for late in range(p):
            if r == late:
                time.sleep(0.05)
            send = np.concatenate([rows(r, j, skew[r, j], 3) for j in range(p)])
            got, _ = alltoallv(send, skew[r], comm=group, algorithm="shm")
            np.testing.assert_array_equal(
                got, np.concatenate([rows(i, r, skew[i, r], 3) for i in range(p)]))
        # the warm-up compiled every pass the exchanges ran: none compiles inside a step
        assert [len(kernel.signatures) for kernel in passes] == compiled
        # auto's choice is remembered per size class (every rank sees the same matrices)
        assert group.exchanges
        for exchange in group.exchanges.values():
            assert exchange.enabled(group.layout)
        # int64 rows (ids), 1-D
        ids = np.arange(r * 100, r * 100 + 2 * p, dtype=np.int64)
        got, _ = alltoallv(ids, np.full(p, 2), comm=group, algorithm="pairwise")
        np.testing.assert_array_equal(
            got, np.concatenate([np.arange(i * 100 + 2 * r, i * 100 + 2 * r + 2)
                                 for i in range(p)]))
        # counts that do not describe the rows: one line naming the rank, before any message
        for bad in ([1] * (p - 1), [-1] + [1] * (p - 1), [[1] * p]):
            with pytest.raises(CommError, match=r"alltoallv: rank \d+ passed"):
                alltoallv(np.zeros(p, np.float32), np.array(bad), comm=group)
        group.free()


def test_a_failed_single_copy_read_names_the_rank_and_still_publishes_its_flag():
    """Rank 0 of a two-rank exchange (played in one process) whose peer's published buffer
    cannot be read: the kernel reports the peer, and its flag says it is done, so the
    peer does not wait for it."""
    matrix = Matrix(np.full((2, 2), 4, np.int64), 0, 4)
    words = np.zeros(32, np.int64)  # two ranks' chunks of 16 words (two 64-byte flag lines)
    words[16:19] = (2, 8, os.getpid())  # rank 1: done, its buffer "at" address 8
    send, out = np.arange(8, dtype=np.float32), np.zeros(8, np.float32)
    got = alltoall._cma_exchange(send, out, words, matrix.info, 0, 16, 1, os.getpid(), 0, 0)
    assert got == -2  # -(rank + 1)
    assert words[0] == 2  # rank 0's flag: published "done"
    np.testing.assert_array_equal(out[:4], send[:4])  # its own segment was copied


def test_cma_read_copies_from_a_process_and_reports_a_bad_address():
    src, dst = np.arange(6, dtype=np.int64), np.zeros(8, np.int64)
    iov = np.empty(4, np.int64)
    assert cma.read(os.getpid(), src.ctypes.data + 8, dst, 16, 24, iov)
    np.testing.assert_array_equal(dst, [0, 0, 1, 2, 3, 0, 0, 0])
    assert not cma.read(os.getpid(), 8, dst, 0, 8, iov)


def test_selector_prefers_shared_memory_inside_a_node_and_needs_it_there():
    params = CostParams()
    one = Layout(size=4, rank=0, local_size=4, local_rank=0, nodes=1, uniform=True)
    two = Layout(size=4, rank=0, local_size=2, local_rank=0, nodes=2, uniform=True)
    big = Matrix(np.full((4, 4), 1 << 20, np.int64))
    assert choose_exchange(Matrix(np.full((4, 4), 16 << 10, np.int64)), one,
                           params).name == "shm"
    assert choose_exchange(big, two, params).name in ("pairwise", "native")
    with pytest.raises(Exception, match="one node"):
        choose_exchange(big, two, params, "shm")
    # the pairwise cost sums each round's largest message
    skew = np.zeros((4, 4), np.int64)
    skew[0, 1] = 1000
    cost = choose_exchange(Matrix(skew), two, params, "pairwise").cost(Matrix(skew), two,
                                                                       params)
    assert cost.transfer_s == pytest.approx(params.net.beta * 1000)
    assert cost.latency_s == pytest.approx(3 * params.net.alpha)


def test_exchange_costs_follow_their_fitted_lines_with_the_network_a_floor_across_nodes():
    params = CostParams()
    one = Layout(size=2, rank=0, local_size=2, local_rank=0, nodes=1, uniform=True)
    two = Layout(size=2, rank=0, local_size=1, local_rank=0, nodes=2, uniform=True)
    small = Matrix(np.full((2, 2), 1 << 10, np.int64))
    large = Matrix(np.full((2, 2), 8 << 20, np.int64))
    shm = choose_exchange(small, one, params, "shm")
    near = params.exchange_shm  # through the busiest rank: 2 segments out, 2 in, its own once
    assert shm.cost(small, one, params).seconds == pytest.approx(near.alpha + near.beta * 3072)
    pairwise = choose_exchange(large, one, params, "pairwise")
    line = params.exchange_p2p  # the round's message and the rank's own copy
    assert pairwise.cost(large, one, params).seconds == pytest.approx(
        line.alpha + line.beta * 2 * (8 << 20))
    # on one node the model takes the shared window's one synchronisation for small
    # exchanges, and for large ones a single copy a byte: process_vm_readv's where the ranks
    # may read each other's memory, else MPI's point-to-point messages'
    assert choose_exchange(small, one, params).name == "shm"
    assert choose_exchange(large, one, params).name == "pairwise"
    readable = dataclasses.replace(one, single_copy=True)
    assert choose_exchange(small, readable, params).name == "shm"
    assert choose_exchange(large, readable, params).name == "cma"
    line = params.exchange_cma  # the busiest rank's bytes from the others, and its own copy
    assert choose_exchange(large, readable, params, "cma").cost(
        large, readable, params).seconds == pytest.approx(line.alpha + line.beta * (16 << 20))
    with pytest.raises(CommError, match="process_vm_readv"):
        choose_exchange(large, one, params, "cma")
    # across nodes an exchange is no faster than the network's link
    native = choose_exchange(large, two, params, "native")
    assert native.cost(large, two, params).seconds == pytest.approx(
        params.net.alpha + params.net.beta * (8 << 20))
