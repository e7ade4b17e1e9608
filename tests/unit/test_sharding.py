import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embeddings.optim import SparseOptimizer
from embeddings.sharding import Placement, ShardingPlan, plan_sharding
from embeddings.tables import TableLayout, init_rows
from hpctrain.errors import ConfigError, EmbeddingError
from ps.store import ShardStore
from ps.types import (
    Op,
    decode_reply,
    decode_request,
    encode_error,
    encode_request,
    encode_rows,
    reply_capacity,
    reply_signal,
    stamp_signal,
)

SIZES = [5, 1000, 37, 250_000, 3]


@pytest.mark.parametrize("scheme", ["auto", "table", "row_range", "row_hash"])
@pytest.mark.parametrize("servers", [1, 2, 3])
def test_every_row_has_exactly_one_slot(scheme, servers):
    layout = TableLayout.from_sizes(SIZES, 4)
    plan = plan_sharding(layout.specs, servers, scheme, table_wise_below=100)
    assert ShardingPlan.from_json(plan.to_json()) == plan
    placement = Placement(plan)
    for t, n in enumerate(SIZES):
        ids = np.arange(n)
        server, slot = placement.locate(t, ids)
        assert ((server >= 0) & (server < servers)).all()
        for s in range(servers):
            mine = ids[server == s]
            base = placement.base[s, t]
            assert len(mine) == placement.counts[s, t]
            np.testing.assert_array_equal(np.sort(slot[server == s] - base), np.arange(len(mine)))
            np.testing.assert_array_equal(placement.ids_at(s, t)[slot[server == s] - base], mine)
    assert sum(placement.server_rows(s) for s in range(servers)) == sum(SIZES)


def test_auto_keeps_small_tables_whole_and_balances():
    layout = TableLayout.from_sizes([10, 20, 30, 40, 500_000], 4)
    plan = plan_sharding(layout.specs, 2, "auto", table_wise_below=1000)
    assert [t.scheme for t in plan.tables] == ["table"] * 4 + ["row_hash"]
    owners = {t.owner for t in plan.tables[:4]}
    assert owners == {0, 1}
    assert plan_sharding(layout.specs, 2, "auto", table_wise_below=1000) == plan
    with pytest.raises(ConfigError, match="ps.sharding"):
        plan_sharding(layout.specs, 2, "diagonal")


def test_hashing_spreads_a_hot_head_over_servers():
    layout = TableLayout.from_sizes([1_000_000], 4)
    placement = Placement(plan_sharding(layout.specs, 4, "row_hash"))
    server, _ = placement.locate(0, np.arange(1000))  # the 1000 hottest rows of a Zipf table
    assert np.bincount(server, minlength=4).min() > 200


@pytest.mark.parametrize("scheme", ["row_range", "row_hash", "table"])
def test_initial_values_do_not_depend_on_sharding(scheme):
    layout = TableLayout.from_sizes(SIZES, 4)
    placement = Placement(plan_sharding(layout.specs, 3, scheme))
    for s in range(3):
        store = ShardStore(layout, placement, s, SparseOptimizer("adagrad"), seed=9)
        for t in range(len(SIZES)):
            ids = placement.ids_at(s, t)
            slots = store.slots(t, ids)
            expected = init_rows(layout, layout.offsets[t] + ids, seed=9)
            np.testing.assert_array_equal(store.tables.weight[slots], expected)
        assert store.resident_bytes() == placement.server_rows(s) * (4 + 1) * 4


def test_store_names_table_and_id_of_bad_rows():
    layout = TableLayout.from_sizes(SIZES, 4)
    placement = Placement(plan_sharding(layout.specs, 2, "row_range"))
    store = ShardStore(layout, placement, 0, SparseOptimizer(), seed=0)
    with pytest.raises(EmbeddingError, match="id 1000 is outside table 't1' of 1000 rows"):
        store.slots(1, np.array([3, 1000]))
    with pytest.raises(EmbeddingError, match="belongs to server 1"):
        store.slots(1, np.array([999]))
    with pytest.raises(EmbeddingError, match="unknown table index 9"):
        store.slots(9, np.array([0]))


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 30), st.lists(st.integers(0, 2**40), max_size=20)),
                max_size=5), st.sampled_from([Op.PULL, Op.PUSH]), st.integers(0, 10**6),
       st.floats(0, 10, allow_nan=False))
def test_messages_round_trip(groups, op, step, lr):
    tables = np.array([t for t, _ in groups], dtype=np.int64)
    counts = np.array([len(ids) for _, ids in groups], dtype=np.int64)
    ids = np.array([i for _, g in groups for i in g], dtype=np.int64)
    grads = np.arange(len(ids) * 3, dtype=np.float32).reshape(-1, 3) if op == Op.PUSH else None
    buf = encode_request(op, step, 7, 1, tables, counts, ids, grads, lr)
    request = decode_request(buf, dim=3)
    assert (request.op, request.step, request.seq, request.slack, request.lr) == (
        op, step, 7, 1, lr)
    decoded = np.split(request.ids, np.cumsum(request.counts)[:-1]) if groups else []
    assert [(t, list(i)) for t, i in zip(request.tables.tolist(), decoded, strict=True)] == \
        [(t, g) for t, g in groups]
    if grads is not None:
        np.testing.assert_array_equal(request.grads, grads)
    rows = np.random.default_rng(0).normal(size=(len(ids), 3)).astype(np.float32)
    reply = np.zeros(reply_capacity(len(ids), 3), dtype=np.uint8)
    encoded = encode_rows(rows)
    reply[: encoded.nbytes] = encoded
    np.testing.assert_array_equal(decode_reply(reply, len(ids), 3), rows)
    assert reply_signal(reply) == 0
    stamp_signal(reply, 15)  # a signalled server's reply: the rows still read
    np.testing.assert_array_equal(decode_reply(reply, len(ids), 3), rows)
    assert reply_signal(reply) == 15
    error = encode_error("table 't1': id 9 is outside")
    stamp_signal(error, 10)
    reply[: error.nbytes] = error
    assert decode_reply(reply, len(ids), 3) == "table 't1': id 9 is outside"
    assert reply_signal(reply) == 10


def test_a_dense_table_gets_its_own_per_value_optimizer():
    """Full mode: the last table's slots update per value, the others row-wise; a write of
    values resets both states."""
    layout = TableLayout.from_sizes([*SIZES, 5], 4)
    placement = Placement(plan_sharding(layout.specs, 2, "row_hash"))
    per_value = SparseOptimizer("adagrad_values", eps=1e-10)
    store = ShardStore(layout, placement, 1, SparseOptimizer("adagrad"), seed=3,
                       dense_optimizer=per_value)
    dense = store.slots(len(SIZES), placement.ids_at(1, len(SIZES)))
    assert len(dense) and (dense >= store.dense_from).all()
    assert store.dense_state.shape == (len(dense), 8)  # accumulator and round sum
    embedding = store.slots(0, placement.ids_at(1, 0)[:2])
    slots = np.concatenate([embedding, dense])
    grads = np.tile(np.array([[1.0, 2.0, 0.0, 4.0]], np.float32), (len(slots), 1))
    before = store.tables.weight[slots].copy()
    store.apply(slots, grads, 0.5)
    moved = before - store.tables.weight[slots]
    np.testing.assert_allclose(moved[:2], 0.5 * grads[:2] / np.sqrt(21 / 4), rtol=1e-5)
    np.testing.assert_allclose(moved[2:], [[0.5, 0.5, 0.0, 0.5]] * len(dense), rtol=1e-5)
    np.testing.assert_allclose(store.tables.state[embedding, 0], 21 / 4)
    np.testing.assert_allclose(store.dense_state[dense - store.dense_from, 4:], grads[2:])
    store.end_round()
    np.testing.assert_allclose(store.dense_state[dense - store.dense_from, :4], grads[2:] ** 2)
    assert not store.dense_state[:, 4:].any()
    store.write_values(slots, np.zeros((len(slots), 4), np.float32))
    assert not store.tables.state[slots].any() and not store.dense_state.any()
    assert store.resident_bytes() == placement.server_rows(1) * 5 * 4 + len(dense) * 8 * 4
