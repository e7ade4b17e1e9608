"""A traced run under real ``mpiexec``: one merged Chrome trace file, then its summary."""

import json
import sys

from harness import run_mpi

HPCTRAIN = [sys.executable, "-m", "hpctrain.cli"]
SMALL = ["--set", "train.progress=false", "--set", "train.steps=4",
         "--set", "data.train_samples=4096", "--set", "data.eval_samples=256",
         "--set", "train.batch_size=256"]


def _spans(path):
    events = json.loads(path.read_text())["traceEvents"]
    assert all(e["ph"] in ("X", "M") for e in events)
    spans = [e for e in events if e["ph"] == "X"]
    assert all(e["dur"] >= 0 for e in spans)
    return events, spans


def test_two_worker_trace_has_both_ranks_and_summarizes(tmp_path):
    path = tmp_path / "trace.json"
    result = run_mpi([*HPCTRAIN, "train", *SMALL, "--set", f"runtime.trace={str(path)!r}",
                      "--set", f"train.run_dir={str(tmp_path / 'run')!r}"], ranks=2,
                     timeout=120)
    assert result.returncode == 0, result.stdout
    events, spans = _spans(path)
    for rank in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"data", "lookup", "forward", "backward", "dense_sync", "optimizer", "push",
                "step", "reduce", "reduction wait"} <= names, (rank, names)
        steps = sorted(e["args"]["step"] for e in spans if e["pid"] == rank and
                       e["name"] == "step")
        assert steps == [0, 1, 2, 3]
    tracks = {(e["pid"], e["args"]["name"]) for e in events if e["name"] == "thread_name"}
    assert {(0, "main"), (1, "main"), (0, "bucket 0"), (1, "bucket 0")} <= tracks
    summary = run_mpi([*HPCTRAIN, "trace", "summarize", str(path)], ranks=1, timeout=60)
    assert summary.returncode == 0, summary.stdout
    assert "critical path over 4 steps" in summary.stdout
    assert "backward" in summary.stdout and "hidden" in summary.stdout
    assert "slowest rank per step" in summary.stdout


def test_parameter_server_trace_has_server_handling_and_pull_waits(tmp_path):
    path = tmp_path / "trace.json"
    result = run_mpi([*HPCTRAIN, "train", *SMALL, "--set", "ps.servers=1",
                      "--set", f"runtime.trace={str(path)!r}",
                      "--set", f"train.run_dir={str(tmp_path / 'run')!r}"], ranks=3,
                     timeout=120)
    assert result.returncode == 0, result.stdout
    events, spans = _spans(path)
    roles = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert roles == {0: "rank 0 (worker)", 1: "rank 1 (worker)", 2: "rank 2 (server)"}
    server = {e["name"] for e in spans if e["pid"] == 2}
    assert {"serve pull", "serve push", "serve done", "serve read"} <= server, server
    for rank in (0, 1):
        names = {e["name"] for e in spans if e["pid"] == rank}
        assert {"wait pull", "ps push", "step", "wait servers"} <= names, names
    # the workers wait for the server's shard before their first step, which then does not
    # count that wait as a pull: the server answers the probe's read before any step starts
    first_read = min(e["ts"] for e in spans if e["pid"] == 2 and e["name"] == "serve read")
    for rank in (0, 1):
        first_step = min(e["ts"] for e in spans if e["pid"] == rank and e["name"] == "step")
        ready = next(e for e in spans if e["pid"] == rank and e["name"] == "wait servers")
        assert ready["ts"] + ready["dur"] <= first_step
        assert first_read < first_step
    assert "parameter servers ready" in result.stdout


def test_zero2_trace_has_reduce_scatter_spans_on_every_rank(tmp_path):
    """Under ``train.zero = 2`` each gradient bucket's reduction is a ``reduce_scatter``
    span on the main thread (hpctrain/parallel/sharded.py), not a ``reduce`` span on a
    bucket's track."""
    path = tmp_path / "trace.json"
    result = run_mpi([*HPCTRAIN, "train", *SMALL, "--set", "train.steps=2",
                      "--set", "train.zero=2", "--set", "comm.bucket_kib=64",
                      "--set", f"runtime.trace={str(path)!r}",
                      "--set", f"train.run_dir={str(tmp_path / 'run')!r}"], ranks=2,
                     timeout=120)
    assert result.returncode == 0, result.stdout
    events, spans = _spans(path)
    threads = {(e["pid"], e["tid"]): e["args"]["name"] for e in events
               if e["name"] == "thread_name"}
    for rank in (0, 1):
        scatters = [e for e in spans if e["pid"] == rank and e["name"] == "reduce_scatter"]
        assert scatters, (rank, {e["name"] for e in spans if e["pid"] == rank})
        assert {threads[rank, e["tid"]] for e in scatters} == {"main"}
        buckets = sorted(e["args"]["bucket"] for e in scatters)
        count = len(set(buckets))
        assert count >= 2 and buckets == sorted(list(range(count)) * 2)  # every bucket, 2 steps
        assert not any(e["pid"] == rank and e["name"] == "reduce" for e in spans)
