"""The Criteo text reader on the real 200-row sample and on hand-made broken files."""

from __future__ import annotations

import logging
import math
from pathlib import Path

import numpy as np
import pytest

from hpctrain.config import DataConfig
from hpctrain.data.criteo import CriteoText, held_out
from hpctrain.errors import ConfigError, DataError

SAMPLE = Path(__file__).resolve().parents[1] / "data" / "criteo_kaggle_sample.txt"
SIZES = DataConfig().table_sizes
LINES = SAMPLE.read_bytes().split(b"\n")[:-1]


def reference(lines: list[bytes], sizes=SIZES):
    """A plain-Python parse of good lines, to compare the vectorised reader against."""
    dense, sparse, labels = [], [], []
    for line in lines:
        f = line.decode().split("\t")
        labels.append(float(f[0]))
        dense.append([math.log1p(max(int(x), 0)) if x else 0.0 for x in f[1:14]])
        sparse.append([int(x, 16) % s if x else 0 for x, s in zip(f[14:], sizes, strict=True)])
    return (np.array(dense, np.float32), np.array(sparse, np.int64),
            np.array(labels, np.float32))


def write(path: Path, lines: list[bytes], end: bytes = b"\n") -> str:
    path.write_bytes(end.join(lines) + end)
    return str(path)


def test_sample_layout_and_labels():
    assert len(LINES) == 200 and all(len(line.split(b"\t")) == 40 for line in LINES)
    data = CriteoText([str(SAMPLE)], SIZES)
    assert (data.num_samples("train"), data.num_samples("eval")) == (180, 20)
    labels = np.concatenate([data.read("train", 0, 180).labels, data.read("eval", 0, 20).labels])
    assert labels.dtype == np.float32 and (labels == 0).sum() == 151 and (labels == 1).sum() == 49
    assert data.skipped == 0


def test_whole_sample_matches_reference():
    data = CriteoText([str(SAMPLE)], SIZES, eval_fraction=0.0)
    batch = data.read("train", 0, 200)
    dense, sparse, labels = reference(LINES)
    assert batch.dense.dtype == np.float32 and batch.dense.shape == (200, 13)
    assert batch.sparse.dtype == np.int64 and batch.sparse.shape == (200, 26)
    np.testing.assert_allclose(batch.dense, dense, rtol=1e-6)
    np.testing.assert_array_equal(batch.sparse, sparse)
    np.testing.assert_array_equal(batch.labels, labels)


def test_known_values_empty_and_negative_fields():
    batch = CriteoText([str(SAMPLE)], SIZES).read("train", 0, 3)
    # line 1: label 0, I1 empty, I2 = 3, I3 = 260, I4 empty, I5 = 17668, C1 = 05db9164, C26 empty
    np.testing.assert_allclose(batch.dense[0, :5],
                               [0, math.log(4), math.log(261), 0, math.log(17669)], rtol=1e-6)
    assert batch.sparse[0, 0] == 0x05DB9164 % SIZES[0] == 684
    assert batch.sparse[0, 25] == 0 and batch.labels[0] == 0
    # line 2: I2 = -1 clips to 0, I5 = 30251
    assert batch.dense[1, 1] == 0.0
    assert batch.dense[1, 4] == pytest.approx(math.log(30252), rel=1e-6)
    # line 3: I1 = 0 and I2 = 0 give 0
    assert batch.dense[2, 0] == 0.0 and batch.dense[2, 1] == 0.0


def test_hashing_stays_in_table_ranges():
    sizes = (1, 2, 3, 5, 7, 11, 13, 17, 19, 23, 29, 31, 37, 41, 43, 47, 53, 59, 61, 67, 71, 73,
             79, 83, 89, 2**40)
    sparse = CriteoText([str(SAMPLE)], sizes, eval_fraction=0).read("train", 0, 200).sparse
    assert (sparse >= 0).all() and (sparse < np.array(sizes)).all()
    assert (sparse[:, 0] == 0).all() and len(np.unique(sparse[:, 24])) > 10
    np.testing.assert_array_equal(sparse, reference(LINES, sizes)[1])


def test_long_and_uppercase_hex(tmp_path):
    fields = LINES[0].split(b"\t")
    fields[14], fields[15] = b"FFFFFFFFFFFFFFFFFFFF", b"00AbCd"
    path = write(tmp_path / "x.txt", [b"\t".join(fields)])
    sparse = CriteoText([path], SIZES, eval_fraction=0).read("train", 0, 1).sparse
    assert sparse[0, 0] == (16**20 - 1) % SIZES[0] and sparse[0, 1] == 0xABCD % SIZES[1]


@pytest.mark.parametrize(("fraction", "train", "eval"),
                         [(0.1, 180, 20), (0.25, 150, 50), (0.0, 200, 0), (0.001, 199, 1)])
def test_eval_fraction_split(fraction, train, eval):
    data = CriteoText([str(SAMPLE)], SIZES, eval_fraction=fraction)
    assert (data.num_samples("train"), data.num_samples("eval")) == (train, eval)
    whole = CriteoText([str(SAMPLE)], SIZES, eval_fraction=0).read("train", 0, 200)
    np.testing.assert_array_equal(data.read("eval", 0, eval).sparse, whole.sparse[train:])


def test_held_out_rule():
    assert [held_out(n, 0.1) for n in (0, 1, 2, 5, 10, 19, 20)] == [0, 0, 1, 1, 1, 1, 2]
    assert held_out(100, 0.29) == 29 and held_out(10, 0.9) == 9 and held_out(3, 0.0) == 0


def test_eval_paths_and_reads_across_files(tmp_path):
    held = write(tmp_path / "held.txt", LINES[:7])
    data = CriteoText([str(SAMPLE), str(SAMPLE)], SIZES, eval_paths=[held], eval_fraction=0.5)
    assert (data.num_samples("train"), data.num_samples("eval")) == (400, 7)
    across = data.read("train", 195, 205)
    np.testing.assert_array_equal(across.sparse, reference(LINES[195:] + LINES[:5])[1])
    np.testing.assert_array_equal(data.read("eval", 2, 7).labels, reference(LINES[2:7])[2])
    assert len(data.read("eval", 3, 3)) == 0


def test_line_ends_missing_newline_crlf_trailing_blank(tmp_path):
    expected = reference(LINES[:5])[1]
    for name, body in [("nofinal", b"\n".join(LINES[:5])),
                       ("crlf", b"\r\n".join(LINES[:5]) + b"\r\n"),
                       ("blank", b"\n".join(LINES[:5]) + b"\n\n\n"),
                       ("crlf_blank", b"\r\n".join(LINES[:5]) + b"\r\n\r\n\r\n")]:
        (tmp_path / name).write_bytes(body)
        data = CriteoText([str(tmp_path / name)], SIZES, eval_fraction=0)
        assert data.num_samples("train") == 5, name
        np.testing.assert_array_equal(data.read("train", 0, 5).sparse, expected)


def _with_field(index: int, value: bytes) -> bytes:
    fields = LINES[5].split(b"\t")
    fields[index] = value
    return b"\t".join(fields)


@pytest.mark.parametrize(("bad", "what"), [
    (b"\t".join(LINES[5].split(b"\t")[:39]), "got 39 tab-separated fields"),
    (LINES[5] + b"\t", "got 41 tab-separated fields"),
    (b"", "empty line"),
    (_with_field(0, b"2"), "label: expected 0 or 1, got '2'"),
    (_with_field(5, b"abc"), "I5: expected an integer"),
    (_with_field(5, b"1.5"), "I5: expected an integer"),
    (_with_field(13, b"-"), "I13: expected an integer"),
    (_with_field(3, b"1" * 25), "I3: integer out of range"),
    (_with_field(14 + 11, b"zz12"), "C12: expected a hexadecimal string"),
    (_with_field(14 + 25, b"0x1f"), "C26: expected a hexadecimal string"),
    (_with_field(14 + 2, b"ab\xffcd"), "not UTF-8 text"),
])
def test_malformed_line_names_file_line_and_field(tmp_path, bad, what):
    path = write(tmp_path / "bad.txt", LINES[:5] + [bad] + LINES[6:10])
    data = CriteoText([str(SAMPLE), path], SIZES, eval_fraction=0)
    data.read("train", 0, 205)  # lines before the bad one parse
    with pytest.raises(DataError) as err:
        data.read("train", 203, 210)
    assert str(err.value).startswith(f"{path}:6: ") and what in str(err.value)


def test_skip_mode_drops_and_counts_once(tmp_path, caplog):
    """Skipped lines leave their batch and are counted once; the first is a warning naming
    file, line and fault, the others (and re-reads) do not flood the log."""
    lines = list(LINES[:10])
    lines[2], lines[5], lines[9] = b"junk", _with_field(0, b"x"), _with_field(20, b"g")
    path = write(tmp_path / "bad.txt", lines)
    data = CriteoText([path], SIZES, eval_fraction=0, on_bad_line="skip")
    with caplog.at_level(logging.DEBUG, logger="hpctrain.data.criteo"):
        batch = data.read("train", 0, 10)
        assert len(batch) == 7 and data.skipped == 3
        good = [line for i, line in enumerate(lines) if i not in (2, 5, 9)]
        np.testing.assert_array_equal(batch.sparse, reference(good)[1])
        data.read("train", 0, 10)
        data.read("train", 5, 6)
    assert data.skipped == 3  # each line counted once, however often it is read
    logged = [(r.levelno, r.getMessage()) for r in caplog.records
              if r.name == "hpctrain.data.criteo"]
    assert logged[0] == (logging.WARNING, f"skipping malformed line {path}:3: got 1 "
                         f"tab-separated fields; expected 40 (label, I1..I13, C1..C26)")
    assert [level for level, _ in logged] == [logging.WARNING, logging.DEBUG, logging.DEBUG]
    assert logged[1][1].startswith(f"skipping malformed line {path}:6: label: ")


@pytest.mark.parametrize(("body", "what"), [(b"", "empty file"), (b"\n\n", "no complete line")])
def test_empty_files(tmp_path, body, what):
    (tmp_path / "e.txt").write_bytes(body)
    with pytest.raises(DataError, match=what) as err:
        CriteoText([str(SAMPLE), str(tmp_path / "e.txt")], SIZES)
    assert str(tmp_path / "e.txt") in str(err.value)


def test_missing_file(tmp_path):
    missing = str(tmp_path / "nope.txt")
    with pytest.raises(DataError, match="cannot read") as err:
        CriteoText([str(SAMPLE)], SIZES, eval_paths=[missing])
    assert str(err.value).startswith(missing)


def test_bad_arguments():
    with pytest.raises(ConfigError, match="data.table_sizes.*26"):
        CriteoText([str(SAMPLE)], SIZES[:5])
    with pytest.raises(ConfigError, match="data.table_sizes"):
        CriteoText([str(SAMPLE)], (0,) * 26)
    with pytest.raises(ConfigError, match="data.on_bad_line"):
        CriteoText([str(SAMPLE)], SIZES, on_bad_line="ignore")
    with pytest.raises(ConfigError, match="data.paths"):
        CriteoText([], SIZES)
    data = CriteoText([str(SAMPLE)], SIZES)
    with pytest.raises(ValueError):
        data.read("train", 170, 181)
    with pytest.raises(ValueError):
        data.num_samples("test")


def test_a_file_changed_or_removed_after_indexing_is_named(tmp_path):
    """Lines are read by the offsets of the first scan: a file rewritten since (or gone)
    must fail naming it, not return other samples."""
    path = write(tmp_path / "day.txt", LINES[:8])
    data = CriteoText([path], SIZES, eval_fraction=0)
    write(tmp_path / "day.txt", LINES[:4])
    with pytest.raises(DataError, match=r"day.txt: the file changed since it was indexed"):
        data.read("train", 0, 8)
    (tmp_path / "day.txt").unlink()
    with pytest.raises(DataError, match=r"day.txt: cannot read \(No such file or directory\)"):
        data.read("train", 0, 8)


def test_file_cut_mid_line(tmp_path):
    """A truncated file: its last line fails the field count (and is skipped in skip mode)."""
    path = str(tmp_path / "cut.txt")
    Path(path).write_bytes(b"\n".join(LINES[:5]) + b"\n" + LINES[5][:60])
    data = CriteoText([path], SIZES, eval_fraction=0)
    assert data.num_samples("train") == 6
    with pytest.raises(DataError) as err:
        data.read("train", 0, 6)
    assert str(err.value).startswith(f"{path}:6: got ") and "tab-separated fields" in str(
        err.value)
    skipping = CriteoText([path], SIZES, eval_fraction=0, on_bad_line="skip")
    assert len(skipping.read("train", 0, 6)) == 5 and skipping.skipped == 1
