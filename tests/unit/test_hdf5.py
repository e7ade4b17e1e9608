"""The preprocessed HDF5 click log: round trip, broken and foreign files, atomic writes."""

from __future__ import annotations

import os
from pathlib import Path

import h5py
import numpy as np
import pytest

from hpctrain.config import DataConfig
from hpctrain.data.criteo import CriteoText
from hpctrain.data.hdf5 import FORMAT, HDF5Dataset, write_hdf5
from hpctrain.data.preprocess import preprocess
from hpctrain.data.types import SPLITS, Batch, Dataset
from hpctrain.errors import ConfigError, DataError

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "criteo_kaggle_sample.txt"
SIZES = DataConfig().table_sizes


def config(**kw) -> DataConfig:
    return DataConfig(source="criteo", paths=(str(SAMPLE),), **kw)


def assert_same(a: Batch, b: Batch) -> None:
    for x, y in [(a.dense, b.dense), (a.sparse, b.sparse), (a.labels, b.labels)]:
        assert x.dtype == y.dtype and x.shape == y.shape
        np.testing.assert_array_equal(x, y)


@pytest.fixture
def written(tmp_path) -> str:
    out = str(tmp_path / "sample.h5")
    preprocess(config(), out)
    return out


def test_preprocess_round_trip(tmp_path):
    out = str(tmp_path / "sample.h5")
    summary = preprocess(config(), out)
    assert summary == {"path": out, "train": 180, "eval": 20, "skipped": 0,
                       "bytes": os.path.getsize(out)}
    text, h5 = CriteoText([str(SAMPLE)], SIZES), HDF5Dataset(out)
    assert h5.table_sizes == SIZES and h5.skipped == 0
    for split in SPLITS:
        n = text.num_samples(split)
        assert h5.num_samples(split) == n
        assert_same(h5.read(split, 0, n), text.read(split, 0, n))
        assert_same(h5.read(split, 3, 11), text.read(split, 3, 11))  # a rank's slice
    with h5py.File(out, "r") as f:
        assert f.attrs["format"] == FORMAT and f.attrs["version"] == 1
        assert f["train/sparse"].dtype == np.int32 and f["train/labels"].dtype == np.uint8
    assert [p.name for p in tmp_path.iterdir()] == ["sample.h5"]  # no temporary left


def test_small_chunks_eval_paths_and_wide_ids(tmp_path):
    sizes = SIZES[:-1] + (2**40,)
    text = CriteoText([str(SAMPLE)], sizes, eval_paths=[str(SAMPLE)])
    out = str(tmp_path / "wide.h5")
    assert write_hdf5(text, out, chunk_rows=7)["eval"] == 200
    h5 = HDF5Dataset(out)
    with h5py.File(out, "r") as f:
        assert f["eval/sparse"].dtype == np.int64
    for split in SPLITS:
        assert_same(h5.read(split, 0, 200), text.read(split, 0, 200))


def test_skipped_lines_shorten_the_file(tmp_path):
    lines = SAMPLE.read_bytes().split(b"\n")[:20]
    lines[4] = lines[11] = b"broken"
    (tmp_path / "bad.txt").write_bytes(b"\n".join(lines) + b"\n")
    cfg = DataConfig(source="criteo", paths=(str(tmp_path / "bad.txt"),), on_bad_line="skip",
                     eval_fraction=0.5)
    summary = preprocess(cfg, str(tmp_path / "bad.h5"))
    assert (summary["train"], summary["eval"], summary["skipped"]) == (9, 9, 2)
    h5 = HDF5Dataset(tmp_path / "bad.h5")
    assert (h5.num_samples("train"), h5.num_samples("eval"), h5.skipped) == (9, 9, 2)
    with pytest.raises(DataError, match=r"bad\.txt:5: "):
        preprocess(DataConfig(source="criteo", paths=cfg.paths), str(tmp_path / "x.h5"))
    assert not (tmp_path / "x.h5").exists()


def test_truncated_file(written):
    data = Path(written).read_bytes()
    Path(written).write_bytes(data[: len(data) - 1000])
    with pytest.raises(DataError) as err:
        HDF5Dataset(written).read("train", 0, 180)
    assert str(err.value).startswith(f"{written}: not a readable HDF5 file (")
    assert "truncated file" in str(err.value) and "hpctrain preprocess" in str(err.value)


def test_foreign_hdf5_file(tmp_path):
    path = str(tmp_path / "other.h5")
    with h5py.File(path, "w") as f:
        f["train/dense"] = np.zeros((3, 13), np.float32)
    with pytest.raises(DataError, match="not an hpctrain click log") as err:
        HDF5Dataset(path)
    assert str(err.value).startswith(path)


def test_empty_files(written, tmp_path):
    empty = tmp_path / "empty.h5"
    empty.write_bytes(b"")
    with pytest.raises(DataError, match="not a readable HDF5 file") as err:
        HDF5Dataset(empty)
    assert str(err.value).startswith(str(empty))
    with h5py.File(written, "a") as f:
        for key in ("dense", "sparse", "labels"):
            f[f"train/{key}"].resize(0, axis=0)
    with pytest.raises(DataError, match=r"/train holds no samples"):
        HDF5Dataset(written)


def test_not_hdf5_and_missing(tmp_path):
    with pytest.raises(DataError, match="not a readable HDF5 file") as err:
        HDF5Dataset(SAMPLE)
    assert str(SAMPLE) in str(err.value)
    with pytest.raises(DataError, match="no such file"):
        HDF5Dataset(tmp_path / "missing.h5")


@pytest.mark.parametrize(("damage", "what"), [
    (lambda f: f.__delitem__("eval/labels"), "/eval/labels is missing"),
    (lambda f: (f.__delitem__("train/dense"), f.create_dataset("train/dense", (180, 12), "f4")),
     "/train/dense has shape (180, 12), expected (n, 13)"),
    (lambda f: (f.__delitem__("train/labels"), f.create_dataset("train/labels", (179,), "u1")),
     "disagree on the sample count"),
    (lambda f: (f.__delitem__("train/dense"), f.create_dataset("train/dense", (180, 13), "i4")),
     "/train/dense has dtype int32, not a float type"),
    (lambda f: f.attrs.__setitem__("version", 7), "version 7 is not supported"),
    (lambda f: f.attrs.__setitem__("table_sizes", [4, 0]), "table_sizes must list positive"),
])
def test_damaged_layout(written, damage, what):
    with h5py.File(written, "a") as f:
        damage(f)
    with pytest.raises(DataError) as err:
        HDF5Dataset(written)
    assert str(err.value).startswith(written) and what in str(err.value)


def test_hdf5_source_reads_exactly_one_file(written):
    """One preprocessed file holds both splits; a second one would be silently ignored."""
    from hpctrain.data import open_dataset

    with pytest.raises(ConfigError, match=r"data.paths: data.source = 'hdf5' reads one file "
                                          r"from `hpctrain preprocess`, got 2"):
        open_dataset(DataConfig(source="hdf5", paths=(written, written + ".2")))


def test_id_outside_table(written):
    with h5py.File(written, "a") as f:
        f["eval/sparse"][4, 8] = SIZES[8]
    h5 = HDF5Dataset(written)
    h5.read("eval", 0, 4)
    with pytest.raises(DataError, match=r"/eval/sparse\[4, 8\] = 3 is outside table 8"):
        h5.read("eval", 2, 6)


class Failing(Dataset):
    """Gives the sample's first chunk, then fails as an interrupted or broken source would."""

    def __init__(self, error: BaseException) -> None:
        self.inner, self.error, self.table_sizes = CriteoText([str(SAMPLE)], SIZES), error, SIZES
        self.reads = 0

    def num_samples(self, split: str) -> int:
        return self.inner.num_samples(split)

    def read(self, split: str, start: int, stop: int) -> Batch:
        self.reads += 1
        if self.reads > 1:
            raise self.error
        return self.inner.read(split, start, stop)


@pytest.mark.parametrize("error", [KeyboardInterrupt(), DataError("x.txt:9: broken")])
def test_failed_write_keeps_existing_file(written, error):
    before = Path(written).read_bytes()
    with pytest.raises(type(error)):
        write_hdf5(Failing(error), written, chunk_rows=50)
    assert Path(written).read_bytes() == before
    assert os.listdir(Path(written).parent) == ["sample.h5"]
    assert HDF5Dataset(written).num_samples("train") == 180


def test_failed_replace_keeps_existing_file(written, monkeypatch):
    before = Path(written).read_bytes()

    def refuse(src, dst):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(os, "replace", refuse)
    with pytest.raises(DataError, match="cannot write"):
        preprocess(config(eval_fraction=0.5), written)
    assert Path(written).read_bytes() == before
    assert os.listdir(Path(written).parent) == ["sample.h5"]


def test_bad_output_paths(tmp_path):
    with pytest.raises(DataError, match="does not exist"):
        preprocess(config(), str(tmp_path / "no" / "out.h5"))
    with pytest.raises(ConfigError, match="also an input"):
        preprocess(config(), str(SAMPLE))


def test_labels_other_than_0_or_1(written):
    with h5py.File(written, "r+") as f:
        f["train/labels"][7] = 3
    with pytest.raises(DataError, match=r"/train/labels\[7\] = 3; a click label is 0 or 1"):
        HDF5Dataset(written).read("train", 0, 20)
