"""alltoallv: every exchange algorithm against numpy for awkward count matrices."""

import time

import numpy as np
import pytest
from mpi4py import MPI

from hpctrain.comm import Group, alltoall, alltoallv
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
              alltoall._pipeline, alltoall._counts_fit)
    compiled = [len(kernel.signatures) for kernel in passes]
    for config in (CommConfig(), CommConfig(check=True)):
        group = Group(WORLD, config)
        for name, counts in count_matrices(p).items():
            for width in (1, 3):
                send = np.concatenate([rows(r, j, counts[r, j], width) for j in range(p)])
                expect = np.concatenate([rows(i, r, counts[i, r], width) for i in range(p)])
                for algorithm in EXCHANGE_NAMES:
                    got, got_counts = alltoallv(send, counts[r], comm=group,
                                                algorithm=algorithm)
                    np.testing.assert_array_equal(got_counts, counts[:, r])
                    np.testing.assert_array_equal(got, expect,
                                                  err_msg=f"{name} {width} {algorithm}")
        # a late rank: the others' polls in numba give up and they wait yielding the core
        if r == p - 1:
            time.sleep(0.05)
        got, _ = alltoallv(send, counts[r], comm=group, algorithm="shm")
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
        assert any(key[0] == "alltoallv" for key in group.plans)
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
    # on one node the model takes the shared-memory exchange at both sizes (its fitted line is
    # the cheaper; at 16 MiB totals, beyond the fitted range, pairwise's single copy measured
    # 0.8-0.85x its time at 2 ranks)
    assert choose_exchange(small, one, params).name == "shm"
    assert choose_exchange(large, one, params).name == "shm"
    # across nodes an exchange is no faster than the network's link
    native = choose_exchange(large, two, params, "native")
    assert native.cost(large, two, params).seconds == pytest.approx(
        params.net.alpha + params.net.beta * (8 << 20))
