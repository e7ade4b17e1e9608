"""The command line under real ``mpiexec`` launches: errors, failures, real data, info."""

import json
import sys
import time

import numpy as np
import pytest
from harness import run_mpi

from hpctrain.config import load_config
from hpctrain.train.optim import sparse_optimizer
from ps.types import Op, encode_request, rows_reply

HPCTRAIN = [sys.executable, "-m", "hpctrain.cli"]
QUIET = ["--set", "train.progress=false"]


def test_config_error_is_one_line_and_exit_2_on_every_rank():
    result = run_mpi([*HPCTRAIN, "train", "--set", "no.such_key=1"], ranks=2, timeout=60)
    assert result.returncode == 2
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1 and "no.such_key" in lines[0] and lines[0].startswith("hpctrain:")


def test_world_too_small_for_servers_is_a_config_error():
    result = run_mpi([*HPCTRAIN, "train", "--set", "ps.servers=2"], ranks=2, timeout=60)
    assert result.returncode == 2
    assert "ps.servers = 2 leaves no worker in a world of 2 ranks" in result.stdout


def test_an_exception_on_one_rank_ends_the_job(tmp_path):
    script = tmp_path / "boom.py"
    script.write_text(
        "from mpi4py import MPI\n"
        "from hpctrain.errors import DataError\n"
        "from hpctrain.runtime.abort import run_guarded\n"
        "import sys\n"
        "def body():\n"
        "    if MPI.COMM_WORLD.Get_rank() == 1:\n"
        "        raise (ValueError if sys.argv[1] == 'bug' else DataError)('broken on purpose')\n"
        "    MPI.COMM_WORLD.Barrier()\n"
        "run_guarded(body)\n")
    for kind, code in (("bug", 1), ("user", 2)):
        start = time.monotonic()
        result = run_mpi([sys.executable, str(script), kind], ranks=3, timeout=60)
        assert time.monotonic() - start < 60
        assert result.returncode == code, result.stdout
        assert "rank 1" in result.stdout and "broken on purpose" in result.stdout
        if kind == "bug":
            assert "Traceback" in result.stdout and "ValueError" in result.stdout


def test_train_on_the_real_criteo_sample(tmp_path):
    result = run_mpi([*HPCTRAIN, "train", "jobs/configs/criteo_sample.toml", *QUIET,
                      "--set", f"train.run_dir={str(tmp_path)!r}"], ranks=2, timeout=120)
    assert result.returncode == 0, result.stdout
    assert "eval AUC" in result.stdout and "samples/s step only" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 30 and summary["eval"]["samples"] == 20


def test_preprocess_then_train_from_hdf5_on_three_ranks(tmp_path):
    out = tmp_path / "sample.h5"
    pre = run_mpi([*HPCTRAIN, "preprocess", "jobs/configs/criteo_sample.toml", "--out",
                   str(out)], ranks=1, timeout=60)
    assert pre.returncode == 0 and out.exists(), pre.stdout
    result = run_mpi([*HPCTRAIN, "train", "jobs/configs/criteo_sample.toml", *QUIET,
                      "--set", "data.source='hdf5'", "--set", f"data.paths=[{str(out)!r}]",
                      "--set", "data.eval_paths=['tests/data/criteo_kaggle_sample.txt']",
                      "--set", "data.eval_fraction=0",
                      "--set", f"train.run_dir={str(tmp_path / 'run')!r}"], ranks=3,
                     timeout=120)
    assert result.returncode == 0, result.stdout
    assert "on 3 workers" in result.stdout
    # the file's own eval group is the held-out data: eval_paths is said to be unread
    assert result.stdout.count("data.eval_paths is not read with data.source = 'hdf5'") == 1


def test_info_prints_the_world():
    result = run_mpi([*HPCTRAIN, "info"], ranks=2, timeout=60)
    assert result.returncode == 0, result.stdout
    for fact in ("MPI library", "MPICH", "2 ranks on 1 node(s)", "2 workers, 0 parameter",
                 "thread level", "torch", "CUDA", "NCCL", "allocation"):
        assert fact in result.stdout, fact


def _check_server_bytes(summary, run_dir):
    """The server line's counters in ``summary.json``, bytes in and out included, against
    the workers' client counts. The server counts every message it receives and every reply
    it sends; the clients leave out their readiness probe (a READ of one row, and its reply),
    their DONE, and their SAVE for each checkpoint, so those make up the difference."""
    [server], clients = summary["ps_servers"], summary["ps_clients"]
    assert len(clients) == 2

    def total(key):
        return sum(c[key] for c in clients)

    assert server["bytes_in"] > 0 and server["bytes_out"] > 0
    assert server["pulls"] == total("pulls") and server["pushes"] == total("pushes")
    assert server["rows_out"] == total("rows_pulled") > 0
    assert server["rows_in"] == total("rows_pushed") > 0
    assert server["rows_read"] == total("rows_read") + len(clients)  # + the probes' rows
    config = load_config(run_dir / "config.toml", env={})
    dim = config.model.embedding_dim
    width = dim + sparse_optimizer(config.train).state_width(dim)
    one = np.zeros(1, np.int64)
    probe = encode_request(Op.READ, 0, 0, 0, one, one + 1, one).nbytes
    empty = np.zeros(0, np.int64)
    control = encode_request(Op.DONE, 0, 0, 0, empty, empty, empty).nbytes  # DONE, SAVE
    saves = len(list((run_dir / "checkpoints").iterdir()))
    assert saves == 1  # checkpoint.at_end
    sent = total("pull_bytes_sent") + total("push_bytes_sent") + total("move_bytes_sent")
    assert server["bytes_in"] == sent + len(clients) * (probe + control * (1 + saves))
    received = total("pull_bytes_received") + total("move_bytes_received")
    assert server["bytes_out"] == received + len(clients) * rows_reply(1, width)[0].nbytes


def test_train_with_a_parameter_server_and_bench_it(tmp_path):
    result = run_mpi([*HPCTRAIN, "train", "jobs/configs/ps_hybrid.toml", *QUIET,
                      "--set", "data.train_samples=20000", "--set", "data.eval_samples=2000",
                      "--set", "runtime.threads=2",
                      "--set", f"train.run_dir={str(tmp_path)!r}"], ranks=3, timeout=120)
    assert result.returncode == 0, result.stdout
    assert "on 2 workers" in result.stdout and "server rank 2" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ps_servers"][0]["pushes"] == 2 * summary["steps"]
    assert summary["ps_servers"][0]["threads"] == 2  # the rank's runtime.threads
    assert summary["ps_clients"][0]["prefetch_hits"] == summary["steps"] - 1
    assert json.loads((tmp_path / "plan.json").read_text())["servers"] == 1
    _check_server_bytes(summary, tmp_path)

    out = tmp_path / "bench.json"
    bench = run_mpi([*HPCTRAIN, "bench", "ps", "--servers", "2", "--tables", "3", "--rows",
                     "5000", "--batch", "256", "--steps", "4", "--set", "runtime.threads=2",
                     "--json", str(out)], ranks=4, timeout=120)
    assert bench.returncode == 0, bench.stdout
    rows = json.loads(out.read_text())
    servers = [r for r in rows if r["mode"] == "server"]
    rows = [r for r in rows if r["mode"] != "server"]
    assert {(r["mode"], r["prefetch"]) for r in rows} == {
        (m, p) for m in ("pull", "push") for p in (False, True)}
    for row in rows:
        assert 1.0 <= row["bytes_ratio"] <= 1.05 and row["rows_per_s"] > 0
        assert row["baseline_rows_per_s"] > 0 and row["servers"] == 2
    assert sorted(s["rank"] for s in servers) == [2, 3]
    for server in servers:  # every worker pulled and pushed in 2 modes, warm-up included
        assert server["pulls"] == server["pushes"] == 2 * (2 * 4 + 1)
        assert 0 < server["busy_s"] <= server["serve_s"] and 0 < server["busy_fraction"] <= 1
        assert server["threads"] == 2
        assert server["rows_per_s"] == pytest.approx(
            (server["rows_in"] + server["rows_out"]) / server["serve_s"])


TINY = ["--set", "data.train_samples=6000", "--set", "data.eval_samples=600",
        "--set", "data.table_sizes=[100, 1000, 30]", "--set", "train.batch_size=128",
        "--set", "train.log_every=5"]


def test_compare_sync_writes_a_table_a_summary_and_a_plot(tmp_path):
    result = run_mpi([*HPCTRAIN, "compare-sync", "--models", "bsp,ssp:1,asp,local:4", *TINY,
                      "--repeats", "1", "--stragglers", "transient:0.2:2", "--out",
                      str(tmp_path)], ranks=3,
                     timeout=240)
    assert result.returncode == 0, result.stdout
    assert "one run of each model (--repeats 1): no intervals" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [m["model"] for m in summary["models"]] == ["bsp", "ssp:1", "asp", "local:4"]
    # local SGD beside them (in hybrid mode): a dense average every 4 steps and at the end
    syncs = [m["dense_syncs"] for m in summary["models"]]
    assert syncs[3] == -(-syncs[0] // 4), syncs
    # The default target is 1.01 x the first model's final loss, so bsp reaches it; each
    # model's time to target is its curve's first point at or below it, else "not reached".
    assert summary["models"][0]["time_to_target_s"] is not None
    printed = {line.split()[0]: line for line in result.stdout.splitlines() if line.strip()}
    for row in summary["models"]:
        hit = next((r for r in row["curve"] if r["train_loss"] <= summary["target_loss"]), None)
        assert row["time_to_target_s"] == (hit["time_s"] if hit else None)
        assert ("not reached" in printed[row["model"]]) == (hit is None)
        assert 0.0 <= row["final_auc"] <= 1.0 and row["curve"]
    assert summary["models"][0]["staleness_max"] == 0
    assert summary["models"][1]["staleness_max"] <= 1
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert (tmp_path / "ssp1" / "metrics.jsonl").exists()

    never = run_mpi([*HPCTRAIN, "compare-sync", "--models", "bsp", *TINY, "--target-loss",
                     "0.001", "--repeats", "1", "--out", str(tmp_path / "never")], ranks=3,
                    timeout=120)
    assert never.returncode == 0 and "not reached" in never.stdout, never.stdout


def test_compare_sync_repeats_interleave_models_with_seeds_and_report(tmp_path):
    result = run_mpi([*HPCTRAIN, "compare-sync", "--models", "bsp,asp", *TINY, "--repeats",
                      "2", "--set", "train.eval_subset=300", "--out", str(tmp_path)],
                     ranks=3, timeout=300)
    assert result.returncode == 0, result.stdout
    assert "Student t" in result.stdout and "sync.model=asp" in result.stdout
    report = json.loads((tmp_path / "report.json").read_text())
    assert report["baseline"] == "sync.model=bsp" and [g["n"] for g in report["groups"]] == [2, 2]
    assert [r["seed"] for r in report["groups"][1]["runs"]] == [0, 1]
    starts = [json.loads((tmp_path / name / "meta.json").read_text())["start_time"]
              for name in ("bsp-r0", "asp-r0", "bsp-r1", "asp-r1")]
    assert starts == sorted(starts)  # interleaved: every model once per repeat
    assert (tmp_path / "curves.png").exists() and (tmp_path / "time_to_target.png").exists()


def test_compare_sync_bad_input_exits_2_with_one_line():
    for args, words in ((["--models", "bsp,fast"], "unknown sync model 'fast'"),
                        (["--models", "ssp:-1"], "non-negative integer"),
                        (["--models", "ssp:1.5"], "non-negative integer"),
                        (["--stragglers", "persistent:5:3"], "sync.slow_workers names worker 5"),
                        (["--stragglers", "sometimes"], "--stragglers 'sometimes'"),
                        (["--repeats", "0"], "--repeats 0")):
        result = run_mpi([*HPCTRAIN, "compare-sync", *args], ranks=3, timeout=60)
        assert result.returncode == 2, (args, result.stdout)
        lines = result.stdout.strip().splitlines()
        assert len(lines) == 1 and words in lines[0], (args, result.stdout)


def test_benchmarks_refuse_zero_repeats_with_one_line():
    for bench in ("tiering", "embeddings"):
        result = run_mpi([*HPCTRAIN, "bench", bench, "--repeat", "0"], ranks=3, timeout=60)
        assert result.returncode == 2, (bench, result.stdout)
        assert result.stdout.strip().splitlines() == [
            f"hpctrain: error: bench {bench}: --repeat 0: expected at least 1"], result.stdout
