import numpy as np

from hpctrain.config import NUM_DENSE
from hpctrain.data.synthetic import SyntheticClicks


def make(**kw):
    args = dict(table_sizes=(1000, 50, 3, 100_000), train_samples=20_000, eval_samples=2000,
                zipf=1.05, seed=5)
    args.update(kw)
    return SyntheticClicks(**args)


def test_samples_are_a_function_of_their_index():
    data = make()
    whole = data.read("train", 0, 1000)
    part = data.read("train", 300, 420)
    np.testing.assert_array_equal(part.sparse, whole.sparse[300:420])
    np.testing.assert_array_equal(part.dense, whole.dense[300:420])
    np.testing.assert_array_equal(part.labels, whole.labels[300:420])
    again = make().read("train", 0, 1000)
    np.testing.assert_array_equal(again.sparse, whole.sparse)
    other_seed = make(seed=6).read("train", 0, 1000)
    assert not np.array_equal(other_seed.sparse, whole.sparse)


def test_splits_differ_and_shapes_dtypes_ranges_hold():
    data = make()
    train, held = data.read("train", 0, 5000), data.read("eval", 0, 2000)
    assert not np.array_equal(train.sparse[:2000], held.sparse)
    assert train.dense.shape == (5000, NUM_DENSE) and train.dense.dtype == np.float32
    assert train.sparse.shape == (5000, 4) and train.sparse.dtype == np.int64
    assert (train.sparse >= 0).all() and (train.sparse < np.array(data.table_sizes)).all()
    assert set(np.unique(train.labels)) == {0.0, 1.0}
    assert (train.dense >= 0).all()
    assert 0.15 < train.labels.mean() < 0.6


def test_ids_follow_a_power_law():
    data = make(zipf=1.2)
    ids = data.read("train", 0, 20_000).sparse[:, 3]
    _, counts = np.unique(ids, return_counts=True)
    top = np.sort(counts)[::-1]
    # The hottest 1% of the 100k rows take most lookups; a uniform draw would give ~1%.
    assert top[:1000].sum() / len(ids) > 0.6
    flat = make(zipf=0.0).read("train", 0, 20_000).sparse[:, 3]
    assert np.unique(flat).size > 15_000


def test_sparse_alone_equals_the_ids_of_read():
    data = make()
    np.testing.assert_array_equal(data.sparse("eval", 10, 400), data.read("eval", 10, 400).sparse)


def test_cached_row_effects_are_the_drawn_ones_bit_for_bit(monkeypatch):
    """Small tables keep every row's label effect, drawn once; the labels must be those
    of the generator that draws each sample's effects afresh."""
    cached = make()
    monkeypatch.setattr("hpctrain.data.synthetic._CACHED_EFFECTS", 0)
    drawn = make()
    assert cached._effects is not None and drawn._effects is None
    for split, start, stop in (("train", 0, 3000), ("eval", 17, 1500)):
        a, b = cached.read(split, start, stop), drawn.read(split, start, stop)
        np.testing.assert_array_equal(a.labels, b.labels)
        np.testing.assert_array_equal(cached._row_effect(a.sparse), drawn._row_effect(b.sparse))
