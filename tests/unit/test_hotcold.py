"""Frequency sketches, hot-set selection and the re-tiering schedule (pure, no MPI)."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from embeddings.freq import (
    CountMinSketch,
    ExactCounts,
    FrequencyTracker,
    LookupTotals,
    oracle_hit_rate,
)
from embeddings.hotcold import (
    HotSetPlanner,
    _union,
    _within,
    best,
    hot_capacity,
    merge_seen,
    retier_due,
)
from hpctrain.config import load_config
from hpctrain.data.synthetic import SyntheticClicks
from hpctrain.errors import ConfigError

STREAM = st.lists(st.tuples(st.integers(0, 5000), st.integers(1, 20)), max_size=300)


def exact(stream):
    truth: dict[int, float] = {}
    for key, count in stream:
        truth[key] = truth.get(key, 0.0) + count
    return truth


@settings(max_examples=60, deadline=None)
@given(STREAM, st.integers(1, 64), st.integers(1, 5), st.floats(0.0, 1.0))
def test_sketch_never_undercounts_even_after_decay(stream, width, depth, factor):
    sketch = CountMinSketch(width, depth, seed=3)
    for key, count in stream:  # one key per call, and all of them at once below
        sketch.add(np.array([key]), np.array([count], np.float32))
    truth = exact(stream)
    keys = np.array(sorted(truth), dtype=np.int64)
    true = np.array([truth[k] for k in keys], dtype=np.float32)
    assert (sketch.estimate(keys) >= true).all()
    sketch.decay(factor)
    assert (sketch.estimate(keys) >= true * np.float32(factor) * (1 - 1e-6)).all()
    batch = CountMinSketch(width, depth, seed=3)
    batch.add(keys, true)
    assert (batch.estimate(keys) >= true).all()


@pytest.mark.parametrize("seed", range(3))
def test_sketch_overcount_bound_holds_with_its_probability(seed):
    """Count-min: P[estimate > true + e/width * total] <= exp(-depth), per key."""
    rng = np.random.default_rng(seed)
    keys = np.unique(rng.integers(0, 1 << 40, size=4000))
    counts = rng.zipf(1.3, size=len(keys)).astype(np.float32)
    width, depth = 128, 3
    sketch = CountMinSketch(width, depth, seed=seed)
    sketch.add(keys, counts)
    excess = sketch.estimate(keys) - counts
    assert (excess >= 0).all()
    share_over = float(np.mean(excess > math.e / width * counts.sum()))
    assert share_over <= math.exp(-depth), share_over
    # Conservative update beats the textbook bound by a wide margin on skewed counts.
    assert float(np.median(excess)) < 0.25 * math.e / width * counts.sum()


@settings(max_examples=40, deadline=None)
@given(STREAM)
def test_tracker_counts_small_tables_exactly_and_sketches_large_ones(stream):
    tracker = FrequencyTracker([100, 4900, 1], exact_below=1000, width=32, depth=2)
    assert [type(t) for t in tracker.tables] == [ExactCounts, CountMinSketch, ExactCounts]
    truth = exact(stream)
    rows = np.array(sorted(truth), dtype=np.int64)
    true = np.array([truth[r] for r in rows], dtype=np.float32)
    tracker.add(rows, true)
    estimate = tracker.estimate(rows)
    small = (rows < 100) | (rows >= 5000)
    np.testing.assert_array_equal(estimate[small], true[small])
    assert (estimate[~small] >= true[~small]).all()
    tracker.decay(0.5)
    np.testing.assert_allclose(tracker.estimate(rows)[small], true[small] / 2)


def test_sketches_widen_for_the_hot_set_and_give_way_to_exact_counts():
    narrow = FrequencyTracker([10**6, 500], exact_below=1000, width=1024, depth=4)
    assert narrow.tables[0].width == 1024 and isinstance(narrow.tables[1], ExactCounts)
    wide = FrequencyTracker([10**6], exact_below=1000, width=1024, depth=4, hot_rows=5000)
    assert wide.tables[0].width == 4 * 5000
    assert isinstance(FrequencyTracker([10**6], 1000, 1024, 4, hot_rows=300_000).tables[0],
                      ExactCounts)  # a sketch as large as exact counts is not worth it


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, 50), min_size=1, max_size=40), st.integers(0, 45))
def test_oracle_is_the_best_static_set(counts, capacity):
    counts = np.array(counts, dtype=np.float64)
    best = sorted(counts, reverse=True)[:capacity]
    expected = sum(best) / counts.sum() if counts.sum() else 0.0
    assert oracle_hit_rate(counts, capacity) == pytest.approx(expected)


def test_budget_units_and_limits():
    assert hot_capacity(0.1, "fraction", 1000, 72) == 100
    assert hot_capacity(250, "rows", 1000, 72) == 250
    assert hot_capacity(72 * 30 + 71, "bytes", 1000, 72) == 30
    assert hot_capacity(0, "fraction", 1000, 72) == 0
    assert hot_capacity(1.5, "fraction", 1000, 72) == 1000  # larger than the table: all hot
    assert hot_capacity(10**9, "rows", 1000, 72) == 1000
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="budget"):
            hot_capacity(bad, "rows", 1000, 72)


def test_retier_schedule_warms_up_then_follows_the_interval():
    due = [s for s in range(130) if retier_due(s, 50)]
    assert due == [0, 1, 3, 7, 15, 31, 49, 99]
    assert [s for s in range(130) if retier_due(s, 50, warm_up=False)] == [49, 99]
    assert [s for s in range(5) if retier_due(s, 1)] == [0, 1, 2, 3, 4]


def test_merge_seen_sums_counts_and_keeps_the_latest_step():
    rows, counts, last = merge_seen(np.array([7, 3, 7, 9]), np.array([1, 2, 3, 4]),
                                    np.array([5, 1, 2, 8]))
    np.testing.assert_array_equal(rows, [3, 7, 9])
    np.testing.assert_array_equal(counts, [2, 4, 4])
    np.testing.assert_array_equal(last, [1, 5, 8])
    empty = merge_seen(np.empty(0, np.int64), np.empty(0, np.float32), np.empty(0, np.int64))
    assert [len(a) for a in empty] == [0, 0, 0]


@settings(max_examples=60, deadline=None)  # the first example may compile the kernel
@given(st.lists(st.tuples(st.integers(0, 1 << 23), st.integers(1, 9), st.integers(0, 99)),
                max_size=60))
def test_merge_seen_matches_a_numpy_reference(entries):
    rows = np.array([r for r, _, _ in entries], np.int64)
    counts = np.array([c for _, c, _ in entries], np.float32)
    last = np.array([s for _, _, s in entries], np.int64)
    got = merge_seen(rows, counts, last)
    unique, inverse = np.unique(rows, return_inverse=True)
    np.testing.assert_array_equal(got[0], unique)
    np.testing.assert_array_equal(got[1], np.bincount(inverse, counts, len(unique)))
    latest = np.full(len(unique), -1, np.int64)
    np.maximum.at(latest, inverse, last)
    np.testing.assert_array_equal(got[2], latest)


@settings(max_examples=80, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 5), st.integers(0, 3)), max_size=40),
       st.integers(0, 45))
def test_best_picks_the_lexicographic_top(entries, count):
    first = np.array([f for f, _ in entries], dtype=np.float32)
    second = np.array([s for _, s in entries], dtype=np.int64)
    reference = np.lexsort((np.arange(len(entries)), -second, -first))[:count]
    assert sorted(best(first, second, count).tolist()) == sorted(reference.tolist())


def planner(capacity, **kw):
    return HotSetPlanner(FrequencyTracker([1000], exact_below=10**6, width=1, depth=1),
                         capacity, **kw)


def record(p, rows, counts, step):
    p.record(*merge_seen(np.array(rows), np.array(counts), np.full(len(rows), step)))


def test_lfu_lru_and_admission_choose_as_documented():
    lfu, lru, picky = planner(2), planner(2, policy="lru"), planner(2, admission=3)
    for p in (lfu, lru, picky):
        record(p, [10, 11, 12], [5, 4, 1], step=0)
        record(p, [13], [2], step=1)
    assert lfu.plan().hot.tolist() == [10, 11]
    assert lru.plan().hot.tolist() == [10, 13]  # 13 is the most recent, then the most counted
    assert picky.plan().hot.tolist() == [10, 11]
    record(picky, [12, 13], [1, 1], step=2)
    retier = picky.plan()  # 13 (count 3) is admitted now, but 11 (4) holds its place
    assert retier.hot.tolist() == [10, 11] and retier.promoted.size == 0
    record(picky, [13], [3], step=3)
    assert picky.plan().hot.tolist() == [10, 11]  # 6 lookups, not more than 4 + 3
    record(picky, [13], [2], step=4)
    assert picky.plan().hot.tolist() == [10, 13]  # 8 > 4 + 3: now it displaces 11


@settings(max_examples=40, deadline=None)
@given(st.lists(st.lists(st.tuples(st.integers(0, 999), st.integers(1, 9)), max_size=30),
                min_size=1, max_size=12),
       st.integers(0, 20), st.sampled_from(["lfu", "lru"]), st.floats(0.0, 1.0))
def test_retiers_stay_in_budget_and_account_for_every_move(rounds, capacity, policy, decay):
    p = planner(capacity, policy=policy, decay=decay)
    hot = np.empty(0, np.int64)
    for step, seen in enumerate(rounds):
        if seen:
            rows, counts = zip(*seen, strict=True)
            record(p, list(rows), list(counts), step)
        retier = p.plan()
        assert len(retier.hot) <= capacity and (np.diff(retier.hot) > 0).all()
        assert not np.intersect1d(retier.promoted, hot).size
        assert np.isin(retier.demoted, hot).all()
        moved = np.union1d(np.setdiff1d(hot, retier.demoted), retier.promoted)
        np.testing.assert_array_equal(moved, retier.hot)
        hot = retier.hot


def test_decay_lets_the_hot_set_follow_drift():
    p = planner(1, decay=0.5)
    record(p, [1, 2], [100, 1], step=0)
    assert p.plan().hot.tolist() == [1]
    for step in range(1, 6):
        record(p, [2], [40], step)
        p.plan()
    assert p.hot.tolist() == [2]  # 100 * 0.5**5 < 200 recent lookups


def simulate(sizes, zipf, fraction, policy, steps=300, batch=512, interval=10):
    """Hit rate of a planner over a synthetic Zipf stream, and the stream's oracle."""
    data = SyntheticClicks(sizes, steps * batch, 1, zipf, seed=7)
    offsets = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    capacity = int(fraction * sum(sizes))
    p = HotSetPlanner(FrequencyTracker(sizes, 5000, 1 << 12, 4), capacity, policy, decay=0.9)
    total = np.zeros(sum(sizes))
    hits = lookups = 0
    for step in range(steps):
        rows, counts = np.unique(data.sparse("train", step * batch, (step + 1) * batch)
                                 + offsets, return_counts=True)
        hits += int(counts[np.isin(rows, p.hot, assume_unique=True)].sum())
        lookups += int(counts.sum())
        total[rows] += counts
        record(p, rows, counts, step)
        if retier_due(step, interval):
            p.plan()
    return hits / lookups, oracle_hit_rate(total, capacity)


def test_lfu_hit_rate_is_near_the_oracle_on_a_zipf_stream():
    lfu, oracle = simulate([20_000, 3000], 1.05, 0.1, "lfu")
    lru, _ = simulate([20_000, 3000], 1.05, 0.1, "lru")
    assert oracle - 0.05 <= lfu <= oracle, (lfu, oracle)
    assert lru < lfu


@pytest.mark.parametrize("override, words", [
    ("tiering.budget=-0.1", ["tiering.budget", ">= 0.0", "-0.1"]),
    ("tiering.budget='lots'", ["tiering.budget", "a number", "lots"]),
    ("tiering.budget_unit='pages'", ["tiering.budget_unit", "'fraction', 'rows', 'bytes'"]),
    ("tiering.policy='fifo'", ["tiering.policy", "'lfu', 'lru'"]),
    ("tiering.decay=1.5", ["tiering.decay", "[0.0, 1.0]"]),
    ("tiering.interval=0", ["tiering.interval", ">= 1"]),
])
def test_bad_tiering_keys_name_the_key(override, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=["ps.servers=1", override])
    for word in words:
        assert word in str(info.value)


def test_tiering_needs_servers_and_zero_is_off():
    with pytest.raises(ConfigError, match="tiering.budget = 0.1: the cold tier lives on"):
        load_config(overrides=["tiering.budget=0.1"])
    assert load_config(overrides=["tiering.budget=0"]).tiering.budget == 0.0
    assert load_config(overrides=["ps.servers=1", "tiering.budget=7"]).tiering.budget == 7.0


def test_tiering_needs_hybrid_mode():
    """The hot tier's counts ride in the dense allreduce, which full mode does not run."""
    with pytest.raises(ConfigError, match=r"tiering.budget > 0 needs ps.mode = 'hybrid'"):
        load_config(overrides=["ps.servers=1", "ps.mode='full'", "tiering.budget=0.1"])


@settings(max_examples=30, deadline=None)
@given(st.lists(st.lists(st.integers(0, 199), max_size=40), min_size=1, max_size=8),
       st.integers(1, 50))
def test_lookup_totals_dense_and_sparse_count_alike(batches, capacity):
    """The oracle's totals over the rows seen (sparse, merged per batch), and over all rows
    once that takes less memory (dense, when allowed), give the same hit rate as counting
    every lookup by hand."""
    dense, sparse = LookupTotals(200, 10**6), LookupTotals(200, 10)
    total = np.zeros(200)
    for batch in batches:
        rows, counts = np.unique(np.array(batch, dtype=np.int64), return_counts=True)
        for totals in (dense, sparse):
            totals.add(rows, counts.astype(np.float32))
        total[rows] += counts
    seen = int((total > 0).sum())
    assert not sparse.dense and sparse.rows.dtype == np.int32
    np.testing.assert_array_equal(sparse.rows, np.flatnonzero(total))
    np.testing.assert_array_equal(sparse.counts, total[total > 0])
    assert dense.dense == (8 * seen >= 4 * 200)  # pairs of 8 bytes against 4 a row
    expected = oracle_hit_rate(total, capacity)
    assert dense.hit_rate(capacity) == pytest.approx(expected)
    assert sparse.hit_rate(capacity) == pytest.approx(expected)


@given(st.sets(st.integers(0, 60)), st.sets(st.integers(0, 60)))
def test_sorted_set_passes_agree_with_numpy(a, b):
    """The planner's one-pass kernels on sorted unique rows: membership, and the union with
    each row's latest step."""
    a, b = np.array(sorted(a), np.int64), np.array(sorted(b), np.int64)
    np.testing.assert_array_equal(_within(a, b), np.isin(a, b))
    rows, last = _union(a, (a % 7).astype(np.int32), b, (b % 5).astype(np.int32))
    np.testing.assert_array_equal(rows, np.union1d(a, b))
    want = np.full(61, -1)
    want[a] = a % 7
    want[b] = np.maximum(want[b], b % 5)
    np.testing.assert_array_equal(last, want[rows])
