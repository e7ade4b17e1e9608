"""`hpctrain bench dlrm` (step against plain torch, MLP bound) and `bench data`, on tiny jobs."""

import json
import sys

import pytest
from harness import run_mpi

HPCTRAIN = [sys.executable, "-m", "hpctrain.cli"]
TINY = ["--set", "data.train_samples=512", "--set", "data.eval_samples=64",
        "--set", "data.table_sizes=[50, 200, 30]"]


def test_bench_dlrm_prints_the_three_cases_and_the_trace_overhead(tmp_path):
    out = tmp_path / "rows.json"
    result = run_mpi([*HPCTRAIN, "bench", "dlrm", "--batch-sizes", "16", "32", "--steps", "2",
                      "--rounds", "1", "--json", str(out), *TINY], ranks=1, timeout=180)
    assert result.returncode == 0, result.stdout
    for case in ("hpctrain", "torch", "MLP only", "hpctrain traced"):
        assert case in result.stdout
    assert "trace overhead at batch 32: traced/untraced step time" in result.stdout
    rows = json.loads(out.read_text())
    assert [(r["batch"], r["case"]) for r in rows] == [
        (b, c) for b in (16, 32) for c in ("hpctrain", "torch", "MLP only", "hpctrain traced")]
    assert all(r["ms_per_step"] > 0 and r["samples_per_s"] > 0 for r in rows)
    assert all(r["vs_torch"] == 1.0 for r in rows if r["case"] == "torch")


def test_bench_dlrm_on_two_ranks_is_a_config_error():
    result = run_mpi([*HPCTRAIN, "bench", "dlrm", *TINY], ranks=2, timeout=120)
    assert result.returncode == 2, result.stdout
    assert "bench dlrm runs in one process, not 2" in result.stdout


def test_bench_data_compares_the_text_reader_with_its_hdf5_file(tmp_path):
    out = tmp_path / "sample.h5"
    job = "jobs/configs/criteo_sample.toml"
    assert run_mpi([*HPCTRAIN, "preprocess", job, "--out", str(out)], ranks=1,
                   timeout=60).returncode == 0
    rows = tmp_path / "rows.json"
    result = run_mpi([*HPCTRAIN, "bench", "data", job, "--hdf5", str(out), "--batch", "16",
                      "--passes", "1", "--json", str(rows)], ranks=1, timeout=120)
    assert result.returncode == 0, result.stdout
    got = json.loads(rows.read_text())
    assert [r["reader"] for r in got] == ["text", "hdf5"]
    assert all(r["samples"] == 180 and r["s_per_pass"] > 0 for r in got)
    assert got[0]["vs_text"] == 1.0
    wrong = run_mpi([*HPCTRAIN, "bench", "data", "--hdf5", str(out)], ranks=1, timeout=60)
    assert wrong.returncode == 2 and "data.source must be 'criteo'" in wrong.stdout


def test_bench_flags_that_measure_nothing_are_refused_before_measuring(tmp_path):
    """Zero steps, rounds, batches or passes measure nothing (or end in a traceback); an
    HDF5 file of other data would time other reads than the text's."""
    import argparse
    import dataclasses

    from mpi4py import MPI

    from hpctrain.bench import data, dlrm
    from hpctrain.config import load_config
    from hpctrain.data.preprocess import preprocess
    from hpctrain.errors import ConfigError
    from hpctrain.runtime.world import build_topology

    config = load_config(env={})
    with pytest.raises(ConfigError, match="bench dlrm: --steps, --rounds and --batch-sizes "
                                          "must be >= 1"):
        dlrm.run(argparse.Namespace(steps=0, rounds=1, batch_sizes=[16]), config,
                 build_topology(config, MPI.COMM_SELF))
    text = load_config("jobs/configs/criteo_sample.toml", env={})
    with pytest.raises(ConfigError, match="bench data: --batch and --passes must be >= 1"):
        data.run(argparse.Namespace(batch=16, passes=0, hdf5="unread.h5"), text)
    other = tmp_path / "half.h5"
    preprocess(dataclasses.replace(text.data, eval_fraction=0.5), str(other))
    with pytest.raises(ConfigError, match=r"half.h5: holds 100 training samples, the job's text "
                                          r"files 180: not the same data"):
        data.run(argparse.Namespace(batch=16, passes=1, hdf5=str(other)), text)
