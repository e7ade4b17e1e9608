"""The parameter server's kernels against plain numpy over the plan's placement."""

import numpy as np
import pytest

from embeddings.optim import SparseOptimizer
from embeddings.sharding import Placement, plan_sharding
from embeddings.tables import TableLayout
from ps import kernels
from ps.store import ShardStore

SIZES = [40, 7, 300, 1000, 5]


@pytest.mark.parametrize("scheme,servers", [("auto", 3), ("row_range", 2), ("row_hash", 3),
                                            ("table", 2)])
def test_route_splits_rows_by_server_and_group_in_order(scheme, servers):
    layout = TableLayout.from_sizes(SIZES, 2)
    placement = Placement(plan_sharding(layout.specs, servers, scheme, table_wise_below=50))
    groups = np.array([0, 1, 0, 1, 1], dtype=np.int64)
    rng = np.random.default_rng(servers)
    rows = np.unique(rng.integers(0, layout.total_rows, 400))
    tables = layout.table_of(rows)
    ids = rows - layout.offsets[tables]
    order, got_ids, start, run_table, run_count, run_start = kernels.route(
        tables, ids, groups, 2, *placement.arrays)
    server = np.array([placement.locate(int(t), np.array([i]))[0][0]
                       for t, i in zip(tables, ids, strict=True)])
    key = server * 2 + groups[tables]
    np.testing.assert_array_equal(order, np.argsort(key, kind="stable"))
    np.testing.assert_array_equal(got_ids, ids[order])
    np.testing.assert_array_equal(np.diff(start), np.bincount(key, minlength=2 * servers))
    for k in range(2 * servers):
        part = order[start[k]: start[k + 1]]
        want_tables, want_counts = np.unique(tables[part], return_counts=True)
        runs = slice(run_start[k], run_start[k + 1])
        np.testing.assert_array_equal(run_table[runs], want_tables)
        np.testing.assert_array_equal(run_count[runs], want_counts)


def test_request_slots_match_placement_and_flag_repeats():
    layout = TableLayout.from_sizes(SIZES, 2)
    placement = Placement(plan_sharding(layout.specs, 2, "row_hash"))
    store = ShardStore(layout, placement, 1, SparseOptimizer(), seed=0)
    mine = [placement.ids_at(1, t)[:6] for t in (1, 3)]
    tables, counts = np.array([1, 3]), np.array([len(m) for m in mine])
    ids = np.concatenate([np.sort(m) for m in mine])
    slots, unique = store.request_slots(tables, counts, ids)
    expected = np.concatenate([placement.locate(t, np.sort(m))[1]
                               for t, m in zip((1, 3), mine, strict=True)])
    np.testing.assert_array_equal(slots, expected)
    assert unique
    repeated = ids.copy()
    repeated[1] = repeated[0]
    assert not store.request_slots(tables, counts, repeated)[1]
    assert not store.request_slots(np.array([3, 1]), counts[::-1], ids[::-1].copy())[1]


def test_gather_and_scatter_rows():
    source = np.arange(30, dtype=np.float32).reshape(10, 3)
    index = np.array([7, 2, 9])
    out = np.zeros((3, 5), np.float32)
    kernels.gather_rows(out, source, index)
    np.testing.assert_array_equal(out[:, :3], source[index])
    assert not out[:, 3:].any()
    back = np.zeros((10, 3), np.float32)
    kernels.scatter_rows(back, index, source[index])
    np.testing.assert_array_equal(back[index], source[index])
