"""Readers that keep up: the HDF5 reader's block cache and gzipped Criteo text files."""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np
import pytest

from hpctrain.config import DataConfig
from hpctrain.data import hdf5
from hpctrain.data.criteo import CriteoText
from hpctrain.data.hdf5 import HDF5Dataset
from hpctrain.data.preprocess import preprocess
from hpctrain.data.types import SPLITS, Batch
from hpctrain.errors import DataError

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "criteo_kaggle_sample.txt"
SIZES = DataConfig().table_sizes


def assert_same(a: Batch, b: Batch) -> None:
    for x, y in [(a.dense, b.dense), (a.sparse, b.sparse), (a.labels, b.labels)]:
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


def slices(n: int, batch: int) -> list[tuple[int, int]]:
    """Forward batches, then a read back at the start and one across the whole split."""
    return [(a, min(n, a + batch)) for a in range(0, n, batch)] + [(3, 9), (0, n)]


@pytest.mark.parametrize("block", [7, 64, 1 << 16])
def test_hdf5_blocks_serve_the_same_batches_as_direct_reads(tmp_path, monkeypatch, block):
    out = str(tmp_path / "sample.h5")
    preprocess(DataConfig(source="criteo", paths=(str(SAMPLE),)), out)
    direct = HDF5Dataset(out)
    monkeypatch.setattr(hdf5, "BLOCK_ROWS", block)
    cached = HDF5Dataset(out)
    for split in SPLITS:
        n = cached.num_samples(split)
        for a, b in slices(n, 5):
            got = cached.read(split, a, b)
            want = direct._load(split, a, b)
            assert_same(got, want)
            got.dense[:] = -1  # a caller's changes do not reach the cache
            assert_same(cached.read(split, a, b), want)


def test_gzipped_criteo_text_gives_identical_batches(tmp_path):
    packed = tmp_path / "day_0.gz"
    with open(SAMPLE, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    plain, compressed = CriteoText([str(SAMPLE)], SIZES), CriteoText([str(packed)], SIZES)
    for split in SPLITS:
        n = plain.num_samples(split)
        assert compressed.num_samples(split) == n
        for a, b in slices(n, 32):
            assert_same(compressed.read(split, a, b), plain.read(split, a, b))


def test_a_damaged_gz_file_names_itself(tmp_path):
    packed = tmp_path / "day_1.gz"
    with open(SAMPLE, "rb") as src, gzip.open(packed, "wb") as dst:
        shutil.copyfileobj(src, dst)
    packed.write_bytes(packed.read_bytes()[:200])
    with pytest.raises(DataError, match=r"day_1\.gz: cannot read"):
        CriteoText([str(packed)], SIZES)
