import numpy as np
import pytest

from hpctrain.runtime import rng


def splitmix64(keys, seed):
    """SplitMix64's finaliser as numpy's whole-array uint64 operations (the reference)."""
    z = np.asarray(keys, dtype=np.uint64) ^ np.uint64(int(seed) * 0xD1B54A32D192ED03 % 2**64)
    z = z + np.uint64(0x9E3779B97F4A7C15)
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


@pytest.mark.parametrize("shape", [(0,), (1,), (7,), (64, 33), (3, 5, 2)])
@pytest.mark.parametrize("seed", [0, 1234, 2**40 + 3, -5])
def test_draws_are_the_reference_bit_for_bit(shape, seed):
    """Synthetic samples and initial rows must not change with the implementation."""
    keys = np.random.default_rng(7).integers(0, 2**64 - 1, size=shape, dtype=np.uint64,
                                             endpoint=True)
    np.testing.assert_array_equal(rng.mix64(keys, seed), splitmix64(keys, seed))
    expected = ((splitmix64(keys, seed) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53
    got = rng.uniform(keys, seed)
    assert got.shape == shape and got.dtype == np.float64
    np.testing.assert_array_equal(got, expected)
    assert ((got > 0) & (got < 1)).all()


def test_strided_and_signed_keys_are_hashed_as_uint64():
    keys = np.arange(40, dtype=np.int64).reshape(8, 5)[:, ::2]
    np.testing.assert_array_equal(rng.mix64(keys, 3), splitmix64(keys.astype(np.uint64), 3))
