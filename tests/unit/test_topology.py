from itertools import pairwise

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpctrain.data.sharding import batches_per_epoch, local_slice
from hpctrain.errors import ConfigError
from hpctrain.runtime.topology import assign_roles, shard_range, threads_per_rank


def test_roles_put_servers_last():
    roles = assign_roles(5, 2)
    assert list(roles.worker_ranks()) == [0, 1, 2]
    assert list(roles.server_ranks()) == [3, 4]
    assert roles.is_server(3) and not roles.is_server(2)


def test_too_many_servers_is_a_config_error():
    with pytest.raises(ConfigError, match="ps.servers = 2 leaves no worker"):
        assign_roles(2, 2)


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


def test_threads_divide_the_node():
    assert threads_per_rank(16, 4) == 4
    assert threads_per_rank(2, 4) == 1
    assert threads_per_rank(16, 4, requested=3) == 3
