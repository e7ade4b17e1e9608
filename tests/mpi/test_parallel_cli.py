"""The parallel modes from the command line: grid errors, the pipeline job, the benchmark."""

import json
import sys

import pytest
from harness import run_mpi

from hpctrain.bench.pipeline import PipelineBench
from hpctrain.errors import ConfigError

HPCTRAIN = [sys.executable, "-m", "hpctrain.cli"]
PIPELINE_JOB = "jobs/configs/pipeline_pp2_dp2.toml"


def test_a_grid_that_does_not_fit_the_world_is_one_line_and_exit_2():
    result = run_mpi([*HPCTRAIN, "train", "--set", "parallel.pp=2"], ranks=3, timeout=60)
    assert result.returncode == 2
    lines = result.stdout.strip().splitlines()
    assert len(lines) == 1, lines
    assert "3 worker ranks" in lines[0] and "pp = 2" in lines[0]


def test_the_pipeline_job_trains_on_four_ranks(tmp_path):
    result = run_mpi([*HPCTRAIN, "train", PIPELINE_JOB, "--set", "train.progress=false",
                      "--set", "train.steps=40", "--set", "data.eval_samples=4000",
                      "--set", "train.lr=0.05", "--set", "train.warmup_steps=10",
                      "--set", f"train.run_dir={str(tmp_path)!r}"], ranks=4, timeout=150)
    assert result.returncode == 0, result.stdout
    assert "on 4 workers" in result.stdout
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 40 and summary["samples"] == 40 * 512
    assert summary["eval"]["samples"] == 4000
    assert summary["eval"]["log_loss"] < summary["eval"]["base_rate_log_loss"]


@pytest.mark.slow
def test_the_pipeline_job_learns_the_embedded_default(tmp_path):
    """The whole embedded default (781 steps) as pp = 2 x dp = 2."""
    result = run_mpi([*HPCTRAIN, "train", PIPELINE_JOB, "--set", "train.progress=false",
                      "--set", f"train.run_dir={str(tmp_path)!r}"], ranks=4, timeout=900)
    assert result.returncode == 0, result.stdout
    ev = json.loads((tmp_path / "summary.json").read_text())["eval"]
    assert ev["log_loss"] < 0.9 * ev["base_rate_log_loss"] and ev["auc"] > 0.75, ev


def gpipe_bubble(stage_s, m):
    """Idle fraction of GPipe with stage ``s`` taking ``f_s`` per forward and ``b_s`` per
    backward: identical micro-batches through a flow shop, all forwards then all backwards,
    so each phase lasts the sum of its stage costs plus ``m - 1`` times the largest."""
    f, b = [c[0] for c in stage_s], [c[1] for c in stage_s]
    makespan = sum(f) + (m - 1) * max(f) + sum(b) + (m - 1) * max(b)
    return 1 - m * (sum(f) + sum(b)) / (len(stage_s) * makespan)


def test_bench_pipeline_reports_bubble_and_held_activations(tmp_path):
    out = tmp_path / "pipeline.json"
    result = run_mpi([*HPCTRAIN, "bench", "pipeline", "--m", "1", "4", "--repeats", "1",
                      "--width", "64", "--layers", "4", "--micro-batch", "8",
                      "--json", str(out)], ranks=4, timeout=120)
    assert result.returncode == 0, result.stdout
    assert "(p-1)/(m+p-1)" in result.stdout
    rows = json.loads(out.read_text())["rows"]
    assert {(r["schedule"], r["p"], r["m"]) for r in rows} == {
        (s, p, m) for s in ("gpipe", "1f1b") for p in (2, 4) for m in (1, 4)}
    for r in rows:
        assert r["peak_held"] == (r["m"] if r["schedule"] == "gpipe" else min(r["p"], r["m"]))
        assert r["ideal"] == pytest.approx((r["p"] - 1) / (r["m"] + r["p"] - 1))
        if r["schedule"] == "gpipe":  # against the measured stage costs, every m
            assert r["bubble"] == pytest.approx(gpipe_bubble(r["stage_s"], r["m"]), abs=1e-9)
    by = {(r["schedule"], r["p"], r["m"]): r["bubble"] for r in rows}
    assert all(by[(s, p, 4)] < by[(s, p, 1)] for s in ("gpipe", "1f1b") for p in (2, 4))


def test_bench_pipeline_needs_enough_workers():
    result = run_mpi([*HPCTRAIN, "bench", "pipeline", "--p", "4"], ranks=2, timeout=60)
    assert result.returncode == 2
    assert "p = 4 stages need as many workers, the job has 2" in result.stdout


@pytest.mark.parametrize(("bench", "words"), [
    (PipelineBench(stages=(2, 4), layers=3), r"p = \[2, 4\] must lie in \[1, --layers = 3\]"),
    (PipelineBench(stages=(0, 2)), r"p = \[0, 2\] must lie in \[1, --layers = 8\]"),
    (PipelineBench(micro_batches=(0, 4)), "--m, --repeats and --micro-batch must be >= 1"),
    (PipelineBench(repeats=0), "--m, --repeats and --micro-batch must be >= 1"),
])
def test_bench_pipeline_flags_are_checked_before_any_message(bench, words):
    """Each rank checks alone, so a bad flag is the same error everywhere, not a hang."""
    with pytest.raises(ConfigError, match=words):
        bench.check(4)
