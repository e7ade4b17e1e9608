"""All-to-all sharding plans (pure) and the [embeddings] config section."""

import numpy as np
import pytest

from embeddings.tables import TableLayout
from embeddings.worker_sharding import SHARDINGS, WorkerPlacement, WorkerPlan, plan_workers
from hpctrain.config import load_config
from hpctrain.errors import ConfigError

SIZES = [2500, *(7 + 4 * t for t in range(25))]  # the first larger than the rest together


@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("workers", [1, 2, 3, 4])
def test_every_row_has_its_place_and_the_inverse_finds_it(sharding, workers):
    layout = TableLayout.from_sizes(SIZES, 8)
    node = 2 if workers % 2 == 0 else workers
    plan = WorkerPlan.from_json(plan_workers(layout.specs, workers, sharding, node,
                                             seed=3).to_json())
    place = WorkerPlacement(plan)
    rows = np.arange(layout.total_rows, dtype=np.int64)
    owner, slot = place.locate(rows)
    if plan.by_columns:
        assert all(place.rows_on(w) == layout.total_rows for w in range(workers))
        widths = [hi - lo for lo, hi in (plan.columns(w) for w in range(workers))]
        assert sum(widths) == 8 and max(widths) - min(widths) <= 1
        np.testing.assert_array_equal(slot, rows)
        return
    assert sum(place.rows_on(w) for w in range(workers)) == layout.total_rows
    for w in range(workers):
        mine = owner == w
        assert np.array_equal(np.sort(slot[mine]), np.arange(place.rows_on(w)))
        back = place.rows_of(w)(0, place.rows_on(w))
        np.testing.assert_array_equal(back[slot[mine]], rows[mine])
    tables = layout.table_of(rows)
    if sharding == "table_wise":  # each table whole on one worker
        assert all(len(np.unique(owner[tables == t])) == 1 for t in range(len(SIZES)))
        if workers > 1:  # the big table alone on its worker
            big = owner[0]
            assert set(np.unique(tables[owner == big])) == {0}
    if sharding == "table_row_wise" and workers > node:  # a table stays inside one node
        assert all(len(np.unique(owner[tables == t] // node)) == 1 for t in range(len(SIZES)))
    if sharding == "row_wise" and workers > 1:  # rows spread evenly
        counts = np.bincount(owner, minlength=workers)
        assert counts.max() - counts.min() <= len(SIZES)


def test_table_row_wise_needs_equal_nodes():
    layout = TableLayout.from_sizes(SIZES, 8)
    with pytest.raises(ConfigError, match="nodes of equal size"):
        plan_workers(layout.specs, 3, "table_row_wise", 2)
    with pytest.raises(ConfigError, match="embeddings.sharding"):
        plan_workers(layout.specs, 3, "diagonal", 1)


@pytest.mark.parametrize("overrides,message", [
    (['embeddings.mode="ps"'], "'ps' needs ps.servers >= 1"),
    (['embeddings.mode="replicated"', "ps.servers=1"], "need mode 'ps'"),
    (['embeddings.mode="alltoall"', "ps.servers=1"], "need mode 'ps'"),
    (['embeddings.sharding="row_wise"'], "applies to embeddings.mode = 'alltoall' only"),
    (['embeddings.mode="alltoall"', "parallel.tp=2"], "does not combine"),
    (["parallel.pp=2", "ps.servers=1"], "keeps the tables on pipeline stage 0"),
])
def test_inconsistent_layouts_are_one_line_errors(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config(overrides=overrides)


def test_todays_keys_keep_choosing_the_layout():
    assert load_config().embeddings.layout(0) == "replicated"
    job = load_config(overrides=["ps.servers=2"])
    assert job.embeddings.layout(job.ps.servers) == "ps"
    job = load_config(overrides=['embeddings.mode="alltoall"', 'embeddings.sharding="column_wise"'])
    assert job.embeddings.layout(job.ps.servers) == "alltoall"


@pytest.mark.parametrize("sharding", SHARDINGS)
@pytest.mark.parametrize("workers", [1, 3, 4])
def test_routing_groups_rows_by_owner_in_order_and_finds_the_first_bad_row(sharding, workers):
    layout = TableLayout.from_sizes(SIZES, 8)
    place = WorkerPlacement(plan_workers(layout.specs, workers, sharding,
                                         2 if workers % 2 == 0 else workers, seed=3))
    rows = np.random.default_rng(workers).integers(0, layout.total_rows, 500)  # unsorted
    order, counts, slots, bad = place.route(rows)
    assert bad == -1
    # the placement rule in numpy (module doc), independent of the numba pass
    t = np.searchsorted(place.offsets, rows, side="right") - 1
    p = (place.mult[t] * (rows - place.offsets[t]) + place.shift[t]) % place.n[t]
    owner = place.first[t] + p % place.owners[t]
    slot = place.base[owner, t] + p // place.owners[t]
    if not place.plan.by_columns:
        np.testing.assert_array_equal(place.locate(rows), (owner, slot))
    if place.plan.by_columns:  # every row to every worker
        np.testing.assert_array_equal(counts, np.full(workers, len(rows)))
        np.testing.assert_array_equal(slots, np.tile(rows, workers))
    else:
        np.testing.assert_array_equal(order, np.argsort(owner, kind="stable"))
        np.testing.assert_array_equal(counts, np.bincount(owner, minlength=workers))
        np.testing.assert_array_equal(slots, slot[order])
    for outside in (-1, layout.total_rows, layout.total_rows + 9):
        wrong = rows.copy()
        wrong[[17, 40]] = outside
        assert place.route(wrong)[3] == 17
