from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpctrain.data.sharding import batches_per_epoch, local_slice
from hpctrain.errors import ConfigError
from hpctrain.runtime.topology import (
    Grid,
    assign_roles,
    make_grid,
    place_grid,
    shard_range,
    threads_per_rank,
)


def test_roles_put_servers_last():
    roles = assign_roles(5, 2)
    assert list(roles.worker_ranks()) == [0, 1, 2]
    assert list(roles.server_ranks()) == [3, 4]
    assert roles.is_server(3) and not roles.is_server(2)


def test_too_many_servers_is_a_config_error():
    with pytest.raises(ConfigError, match="ps.servers = 2 leaves no worker"):
        assign_roles(2, 2)


def test_full_mode_without_servers_is_a_config_error():
    """Full mode keeps the dense parameters on the servers: without one nothing holds them."""
    from mpi4py import MPI

    from hpctrain.config import load_config
    from hpctrain.runtime.world import build_topology

    with pytest.raises(ConfigError, match=r"ps.mode = 'full' keeps the dense parameters on the "
                                          r"servers: set ps.servers >= 1"):
        build_topology(load_config(overrides=["ps.mode='full'"], env={}), MPI.COMM_SELF)


def test_asking_for_cuda_where_torch_sees_none_is_a_config_error(monkeypatch):
    """runtime.device = 'cuda' is a demand, unlike auto: no silent fallback to the CPU."""
    import torch
    from mpi4py import MPI

    from hpctrain.config import load_config
    from hpctrain.runtime.world import build_topology

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(ConfigError, match=r"runtime.device = 'cuda' but torch sees no CUDA "
                                          r"device on this node"):
        build_topology(load_config(overrides=["runtime.device='cuda'"], env={}), MPI.COMM_SELF)


@given(st.integers(0, 10_000), st.integers(1, 64))
def test_shards_cover_the_range_once_and_balance(n, parts):
    ranges = [shard_range(n, parts, i) for i in range(parts)]
    assert ranges[0][0] == 0 and ranges[-1][1] == n
    assert all(a[1] == b[0] for a, b in pairwise(ranges))
    sizes = [hi - lo for lo, hi in ranges]
    assert max(sizes) - min(sizes) <= 1


@given(st.integers(1, 5000), st.integers(1, 300), st.integers(1, 7), st.integers(0, 50))
def test_workers_read_exactly_the_global_batch(n, batch, workers, step):
    slices = [local_slice(step, n, batch, w, workers) for w in range(workers)]
    start, stop = slices[0][0], slices[-1][1]
    assert all(a[1] == b[0] for a, b in pairwise(slices))
    assert stop - start == min(batch, n) and start >= 0 and stop <= n
    assert start % min(batch, n) == 0
    assert batches_per_epoch(n, batch) >= 1


def test_threads_divide_the_cores_a_rank_shares():
    node = frozenset(range(16))
    assert threads_per_rank(node, [node] * 4) == 4  # four ranks on the node's 16 cores
    assert threads_per_rank(frozenset({0, 1}), [frozenset({0, 1})] * 4) == 1
    assert threads_per_rank(node, [node] * 4, requested=3) == 3
    bound = [frozenset({2 * r, 2 * r + 1}) for r in range(4)]  # srun --cpu-bind: 2 each
    assert all(threads_per_rank(mask, bound) == 2 for mask in bound)
    halves = [frozenset(range(8))] * 2 + [frozenset(range(8, 16))] * 2  # two per socket
    assert threads_per_rank(halves[0], halves) == 4


@given(st.integers(1, 4), st.integers(1, 4), st.integers(1, 4))
def test_grid_groups_partition_the_positions(dp, tp, pp):
    grid = make_grid(dp * tp * pp, tp, pp)
    assert (grid.dp, grid.size) == (dp, dp * tp * pp)
    for groups, size, axis in ((grid.tensor_groups(), tp, 2), (grid.pipeline_groups(), pp, 1),
                               (grid.data_groups(), dp, 0)):
        assert sorted(p for g in groups for p in g) == list(range(grid.size))
        for group in groups:
            assert len(group) == size
            coords = [grid.coords(p) for p in group]
            # members differ only on their axis, and are ranked by it
            assert [c[axis] for c in coords] == list(range(size))
            assert len({tuple(v for i, v in enumerate(c) if i != axis) for c in coords}) == 1
    assert all(grid.position(*grid.coords(p)) == p for p in range(grid.size))


def test_grid_order_is_tensor_fastest_then_data_then_pipeline():
    grid = Grid(dp=2, tp=2, pp=2)
    assert grid.tensor_groups() == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert grid.data_groups() == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert grid.pipeline_groups() == [[0, 4], [1, 5], [2, 6], [3, 7]]
    assert grid.coords(5) == (0, 1, 1)


@pytest.mark.parametrize("workers, tp, pp, dp, words", [
    (6, 4, 1, 0, ["6 worker ranks", "tp = 4 x pp = 1 = 4"]),
    (4, 1, 3, 0, ["4 worker ranks", "pp = 3"]),
    (8, 2, 2, 3, ["dp = 3 x tp = 2 x pp = 2 = 12", "8 worker ranks"]),
    (4, 0, 1, 0, ["tp = 0"]),
])
def test_an_invalid_grid_names_its_sizes(workers, tp, pp, dp, words):
    with pytest.raises(ConfigError) as info:
        make_grid(workers, tp, pp, dp)
    for word in words:
        assert word in str(info.value)


def test_tensor_groups_stay_inside_nodes_when_the_layout_allows():
    grid = Grid(dp=2, tp=2, pp=1)
    # ranks placed round-robin over two nodes (0, 1, 0, 1): sort by node first
    order, local = place_grid(grid, [0, 1, 0, 1])
    assert order == [0, 2, 1, 3] and local
    assert place_grid(grid, [0, 0, 0, 0]) == ([0, 1, 2, 3], True)
    # three ranks on one node, one on another: some tensor group must span nodes
    assert place_grid(grid, [0, 0, 0, 3])[1] is False
