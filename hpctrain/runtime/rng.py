"""Counter-based randomness: a value is a pure function of (seed, key).

Synthetic samples and embedding-row initial values are drawn this way so that they do not
depend on which rank produces them or in which order: sample ``i`` is the same on 1 or 64
workers, and row ``r`` of a table starts with the same value on any sharding.
"""

from __future__ import annotations

import numpy as np

__all__ = ["mix64", "uniform", "normal"]

_GOLDEN = np.uint64(0x9E3779B97F4A7C15)
_M1 = np.uint64(0xBF58476D1CE4E5B9)
_M2 = np.uint64(0x94D049BB133111EB)


def mix64(keys: np.ndarray, seed: int) -> np.ndarray:
    """SplitMix64 finaliser of ``keys ^ seed'`` (uint64 in, uint64 out, well mixed)."""
    z = np.asarray(keys, dtype=np.uint64) ^ np.uint64(int(seed) * 0xD1B54A32D192ED03 % 2**64)
    z = z + _GOLDEN
    z = (z ^ (z >> np.uint64(30))) * _M1
    z = (z ^ (z >> np.uint64(27))) * _M2
    return z ^ (z >> np.uint64(31))


def uniform(keys: np.ndarray, seed: int) -> np.ndarray:
    """Uniform float64 in the open interval (0, 1), one per key."""
    return ((mix64(keys, seed) >> np.uint64(11)).astype(np.float64) + 0.5) * 2.0**-53


def normal(keys: np.ndarray, seed: int) -> np.ndarray:
    """Standard normal float64, one per key (Box-Muller over two derived uniforms)."""
    keys = np.asarray(keys, dtype=np.uint64)
    u1 = uniform(keys, seed)
    u2 = uniform(keys, seed + 0x5851F42D)
    return np.sqrt(-2.0 * np.log(u1)) * np.cos(2.0 * np.pi * u2)
