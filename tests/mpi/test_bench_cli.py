"""``hpctrain bench allreduce`` and ``hpctrain bench calibrate`` under real launches."""

import json
import sys

from harness import run_mpi

HPCTRAIN = [sys.executable, "-m", "hpctrain.cli"]


def test_calibrate_then_bench_with_json_and_plot(tmp_path):
    cal = tmp_path / "cal.json"
    result = run_mpi([*HPCTRAIN, "bench", "calibrate", "--out", str(cal)], ranks=2,
                     timeout=240)
    assert result.returncode == 0, result.stdout
    params = json.loads(cal.read_text())["params"]
    assert {"p2p", "shm", "gamma", "native", "torch"} <= set(params)
    assert all(params[k]["alpha"] > 0 and params[k]["beta"] > 0 for k in ("p2p", "native"))

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
    assert png.stat().st_size > 1000


def test_bench_rejects_unknown_algorithms_and_sizes():
    result = run_mpi([*HPCTRAIN, "bench", "allreduce", "--sizes", "4XB"], ranks=1, timeout=60)
    assert result.returncode == 2 and "bad size '4XB'" in result.stdout
    result = run_mpi([*HPCTRAIN, "bench", "allreduce", "--algorithms", "fastest",
                      "--sizes", "4KiB"], ranks=2, timeout=120)
    assert result.returncode == 2 and "unknown algorithm(s) fastest" in result.stdout
