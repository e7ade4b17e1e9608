"""``hpctrain bench allreduce`` and ``hpctrain bench calibrate`` under real launches."""

import json
import math
import sys

import pytest
from harness import run_mpi

HPCTRAIN = [sys.executable, "-m", "hpctrain.cli"]


def test_calibrate_then_bench_with_json_and_plot(tmp_path):
    cal = tmp_path / "cal.json"
    result = run_mpi([*HPCTRAIN, "bench", "calibrate", "--out", str(cal)], ranks=2,
                     timeout=240)
    assert result.returncode == 0, result.stdout
    params = json.loads(cal.read_text())["params"]
    exchanges = ("exchange_shm", "exchange_cma", "exchange_p2p", "exchange_native")
    assert {"p2p", "shm", "gamma", "native", "torch", "single_copy", *exchanges} <= set(params)
    assert all(params[k]["alpha"] > 0 and params[k]["beta"] > 0
               for k in ("p2p", "native", "single_copy", *exchanges))

    out, png = tmp_path / "rows.json", tmp_path / "busbw.png"
    result = run_mpi([*HPCTRAIN, "bench", "allreduce", "--sizes", "4KiB,256KiB", "--reps", "2",
                      "--algorithms", "auto,resident,shm,ring,torch", "--json", str(out),
                      "--plot", str(png), "--set", f"comm.calibration={str(cal)!r}"],
                     ranks=2, timeout=240)
    assert result.returncode == 0, result.stdout
    assert "x native" in result.stdout and "cost model: " + str(cal) in result.stdout
    assert "fusion: 50 gradients of 64 KiB" in result.stdout
    data = json.loads(out.read_text())
    rows = data["rows"]
    assert {r["algorithm"] for r in rows} == {"native", "auto", "resident", "shm", "ring",
                                              "torch"}
    for r in rows:
        assert {"size_bytes", "algorithm", "ranks", "median_s", "busbw_gbs",
                "ratio_to_native"} <= set(r) and r["ranks"] == 2 and r["median_s"] > 0
    assert all(r["ratio_to_native"] == 1.0 for r in rows if r["algorithm"] == "native")
    assert data["memcpy_gbs"] > 0 and data["fusion"]["buckets"] >= 1
    assert "x bound" in result.stdout  # one node: the memory bound is reported
    for r in rows:
        assert r["bound_s"] > 0
        assert r["ratio_to_bound"] == pytest.approx(r["median_s"] / r["bound_s"])
    for size in (4096, 262144):  # one bound per size, the same for every case
        assert len({r["bound_s"] for r in rows if r["size_bytes"] == size}) == 1
    assert png.stat().st_size > 1000


def test_bench_rejects_unknown_algorithms_and_sizes():
    result = run_mpi([*HPCTRAIN, "bench", "allreduce", "--sizes", "4XB"], ranks=1, timeout=60)
    assert result.returncode == 2 and "bad size '4XB'" in result.stdout
    result = run_mpi([*HPCTRAIN, "bench", "allreduce", "--algorithms", "fastest",
                      "--sizes", "4KiB"], ranks=2, timeout=120)
    assert result.returncode == 2 and "unknown algorithm(s) fastest" in result.stdout


def test_bench_alltoall_and_embeddings_print_ratios_in_one_launch(tmp_path):
    out = tmp_path / "a2a.json"
    result = run_mpi([*HPCTRAIN, "bench", "alltoall", "--sizes", "4KiB,64KiB", "--reps", "2",
                      "--json", str(out)], ranks=3, timeout=240)
    assert result.returncode == 0, result.stdout
    rows = json.loads(out.read_text())
    algorithms = {"MPI_Alltoallv", "native", "auto", "shm", "pairwise"}
    # cma where this machine lets ranks read each other's memory
    assert {r["algorithm"] for r in rows} - {"cma"} == algorithms
    assert all(r["ratio_to_native"] == 1.0 for r in rows if r["algorithm"] == "MPI_Alltoallv")
    assert all(r["selected"] for r in rows if r["algorithm"] == "auto")

    out, png = tmp_path / "e.json", tmp_path / "e.png"
    small = ["--set", "data.table_sizes=[500, 40, 3000, 7]", "--set", "data.train_samples=4000",
             "--set", "data.eval_samples=300", "--set", "model.embedding_dim=8", "--set",
             "model.bottom_mlp=[16, 8]", "--set", "model.top_mlp=[16, 1]", "--set",
             "train.batch_size=64"]
    result = run_mpi([*HPCTRAIN, "bench", "embeddings", "--steps", "4", "--repeat", "2",
                      *small, "--json", str(out), "--plot", str(png)], ranks=3, timeout=400)
    assert result.returncode == 0, result.stdout
    assert "Student t interval of their logarithms over 2 rounds" in result.stdout
    rows = {r["layout"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"replicated", "alltoall:table_wise", "alltoall:row_wise",
                         "alltoall:column_wise", "alltoall:table_row_wise", "ps:1", "ps:2",
                         "ps:1+tiering"}
    base = rows["replicated"]
    assert base["step_ratio"] == base["memory_ratio"] == 1.0 and base["workers"] == 3
    assert rows["ps:2"]["workers"] == 1
    for name, r in rows.items():
        assert r["bytes_per_step"] >= r["min_bytes_per_step"] > 0 or name == "ps:2", name
        assert r["samples_per_s"] > 0 and r["table_mb_per_rank"] > 0, name
        # each round's ratio to that round's replicated run; their geometric mean, inside
        # its interval
        first, second = r["round_speed_ratios"]
        assert r["speed_ratio"] == pytest.approx(math.sqrt(first * second)), name
        assert r["speed_ratio_lo"] <= r["speed_ratio"] <= r["speed_ratio_hi"], name
    # a sharded worker holds about a third of the rows (the largest table decides table-wise)
    assert rows["alltoall:row_wise"]["memory_ratio"] < 0.4
    assert png.stat().st_size > 1000
