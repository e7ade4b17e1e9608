import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from embeddings.collection import EmbeddingCollection, sorted_unique, unique_rows
from embeddings.optim import SparseOptimizer, coalesce
from embeddings.tables import LocalTables, TableLayout, init_rows, pack_rows, unpack_rows
from hpctrain.errors import EmbeddingError

LAYOUT = TableLayout.from_sizes([7, 100, 3], dim=4)


def reference_update(kind, weight, state, rows, grads, lr, eps=1e-8, b1=0.9, b2=0.999):
    w, s = weight.astype(np.float64), state.astype(np.float64)
    for r, g in zip(rows, grads.astype(np.float64), strict=True):
        if kind == "sgd":
            w[r] -= lr * g
        elif kind == "adagrad":
            s[r, 0] += np.mean(g * g)
            w[r] -= lr * g / (np.sqrt(s[r, 0]) + eps)
        else:
            d = len(g)
            s[r, 2 * d] += 1
            t = s[r, 2 * d]
            s[r, :d] = b1 * s[r, :d] + (1 - b1) * g
            s[r, d:2 * d] = b2 * s[r, d:2 * d] + (1 - b2) * g * g
            w[r] -= lr * (s[r, :d] / (1 - b1**t)) / (np.sqrt(s[r, d:2 * d] / (1 - b2**t)) + eps)
    return w, s


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_kernels_match_a_numpy_reference(kind):
    rng = np.random.default_rng(0)
    opt = SparseOptimizer(kind)
    weight = rng.normal(size=(50, 4)).astype(np.float32)
    state = opt.new_state(50, 4)
    expected_w, expected_s = weight.copy(), state.copy()
    for _ in range(3):
        rows = rng.choice(50, size=10, replace=False).astype(np.int64)
        grads = rng.normal(size=(10, 4)).astype(np.float32)
        expected_w, expected_s = reference_update(kind, expected_w, expected_s, rows, grads, 0.1)
        opt.apply(weight, state, rows, grads, 0.1)
    np.testing.assert_allclose(weight, expected_w, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state, expected_s, rtol=1e-5, atol=1e-6)


@settings(deadline=None)  # the first example may compile the kernels
@given(st.lists(st.sets(st.integers(0, 40)), min_size=1, max_size=12), st.integers(0, 2**31))
def test_coalesce_of_sorted_runs_is_the_stable_sums(parts, seed):
    """A gathered push is one sorted run per worker: up to 8 runs are merged, more are
    sorted; either way each row's gradients are summed in the order they come (the same
    bits as summing them one by one)."""
    rows = np.concatenate([np.array(sorted(p), np.int64) for p in parts])
    grads = np.random.default_rng(seed).normal(size=(len(rows), 3)).astype(np.float32)
    expected_rows = np.unique(rows)
    expected = np.zeros((len(expected_rows), 3), np.float32)
    for row, grad in zip(np.searchsorted(expected_rows, rows), grads, strict=True):
        expected[row] += grad
    # as given, and read in place from the lines of a gathered push (strided views)
    for uniq, summed in (coalesce(rows, grads), coalesce(*unpack_rows(pack_rows(rows, grads)))):
        assert uniq.flags.c_contiguous and summed.flags.c_contiguous
        np.testing.assert_array_equal(uniq, expected_rows)
        np.testing.assert_array_equal(summed, expected)


def test_coalesce_sums_duplicates():
    rows = np.array([5, 2, 5, 9, 2, 5])
    grads = np.arange(12, dtype=np.float32).reshape(6, 2)
    uniq, summed = coalesce(rows, grads)
    np.testing.assert_array_equal(uniq, [2, 5, 9])
    np.testing.assert_array_equal(summed, [[2 + 8, 3 + 9], [0 + 4 + 10, 1 + 5 + 11], [6, 7]])
    empty_rows, empty = coalesce(np.empty(0, np.int64), np.empty((0, 2), np.float32))
    assert empty_rows.shape == (0,) and empty.shape == (0, 2)
    unique = unique_rows(np.array([7, 3, 7]))[0]  # sorted and unique, made by numba
    assert coalesce(unique, np.ones((2, 2), np.float32))[0] is unique  # not a copy or view


def test_initial_rows_do_not_depend_on_sharding():
    whole = LocalTables(LAYOUT, SparseOptimizer(), seed=3)
    shard = LocalTables(LAYOUT, SparseOptimizer(), seed=3, count=40,
                        rows_of=lambda lo, hi: np.arange(50 + lo, 50 + hi))
    np.testing.assert_array_equal(shard.weight, whole.weight[50:90])
    np.testing.assert_array_equal(init_rows(LAYOUT, np.array([60, 8]), 3), whole.weight[[60, 8]])
    bound = 1 / np.sqrt(LAYOUT.sizes[LAYOUT.table_of(np.arange(LAYOUT.total_rows))])
    assert (np.abs(whole.weight) <= bound[:, None]).all()


def test_out_of_range_ids_name_table_and_id():
    with pytest.raises(EmbeddingError, match="id 3 is outside table 't2' of 3 rows"):
        LAYOUT.global_rows(np.array([[0, 0, 3]]))
    with pytest.raises(EmbeddingError, match="shape"):
        LAYOUT.global_rows(np.array([[0, 0]]))


def test_collection_gradients_equal_dense_embedding_bags():
    """Pull-dedup-scatter gives the gradient torch's own EmbeddingBag computes."""
    tables = LocalTables(LAYOUT, SparseOptimizer("sgd"), seed=1)
    collection = EmbeddingCollection(LAYOUT, tables)
    ids = np.array([[1, 5, 2], [1, 99, 2], [6, 5, 0]])
    embedded, lookup = collection.lookup(ids)
    weights = torch.arange(embedded.numel(), dtype=torch.float32).reshape(embedded.shape)
    (embedded * weights).sum().backward()

    bag = torch.nn.EmbeddingBag.from_pretrained(torch.from_numpy(tables.weight.copy()),
                                                freeze=False, mode="sum")
    rows = torch.from_numpy(LAYOUT.global_rows(ids))
    out = bag(rows.reshape(-1, 1)).reshape(embedded.shape)
    torch.testing.assert_close(out, embedded.detach())
    (out * weights).sum().backward()
    dense_grad = bag.weight.grad.numpy()
    np.testing.assert_allclose(lookup.grads(), dense_grad[lookup.rows], rtol=1e-6)

    before = tables.weight.copy()
    tables.push(*collection.gradients([lookup], scale=1.0), lr=0.5)
    np.testing.assert_allclose(tables.weight, before - 0.5 * dense_grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_torch_updates_equal_the_kernels(kind):
    """The device path of the hot tier (torch ops) matches the numba kernels (on more rows
    than the kernels prefetch ahead)."""
    rng = np.random.default_rng(1)
    opt = SparseOptimizer(kind)
    weight = rng.normal(size=(300, 4)).astype(np.float32)
    state = opt.new_state(300, 4)
    w_t, s_t = torch.from_numpy(weight.copy()), torch.from_numpy(state.copy())
    for _ in range(3):
        rows = rng.choice(300, size=80, replace=False).astype(np.int64)
        grads = rng.normal(size=(80, 4)).astype(np.float32)
        opt.apply(weight, state, rows, grads, 0.1)
        opt.apply_torch(w_t, s_t, torch.from_numpy(rows), torch.from_numpy(grads), 0.1)
    # float32 in a different order of operations: Adam's steps differ by up to ~1e-6
    np.testing.assert_allclose(w_t.numpy(), weight, rtol=1e-5, atol=5e-6)
    np.testing.assert_allclose(s_t.numpy(), state, rtol=1e-5, atol=1e-6)


def test_local_tables_hand_rows_out_and_back_with_their_state():
    tables = LocalTables(LAYOUT, SparseOptimizer("adagrad"), seed=2)
    tables.push(np.array([3, 9]), np.ones((2, 4), np.float32), 0.5)
    block = tables.read(np.array([3, 9]))
    assert block.shape == (2, 5) and (block[:, 4] == 1.0).all()
    other = LocalTables(LAYOUT, SparseOptimizer("adagrad"), seed=2)
    other.write(np.array([3, 9]), block)
    np.testing.assert_array_equal(other.weight, tables.weight)
    np.testing.assert_array_equal(other.state, tables.state)
    with pytest.raises(ValueError, match=r"block of \[1, 5\]"):
        other.write(np.array([1]), block)


@given(st.lists(st.integers(0, 2**62), max_size=300), st.integers(1, 1 << 40))
def test_unique_rows_give_what_torch_unique_gives(values, modulus):
    rows = np.array(values, dtype=np.int64) % modulus  # few distinct values when small
    unique, inverse, counts = unique_rows(rows)
    want = torch.unique(torch.from_numpy(rows), return_inverse=True, return_counts=True)
    for got, expect in zip((unique, inverse, counts), want, strict=True):
        np.testing.assert_array_equal(got, expect.numpy())


@given(st.lists(st.integers(0, 2**62), max_size=300), st.integers(1, 1 << 40))
def test_sorted_unique_gives_what_np_unique_gives(values, modulus):
    rows = np.array(values, dtype=np.int64) % modulus
    np.testing.assert_array_equal(sorted_unique(rows), np.unique(rows))


def _resident_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith("VmRSS:"))


def test_optimizer_state_is_resident_when_made():
    """Zeroed state, its pages written at once: lazily mapped zeros made the first steps
    page-fault on every row they touched, and resident memory understate the state."""
    before = _resident_bytes()
    state = SparseOptimizer("adagrad").new_state(16 << 20, 4)  # 64 MiB of zeros
    assert _resident_bytes() - before > 0.9 * state.nbytes
    assert not state.any()
