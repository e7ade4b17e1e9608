"""Benchmark flags a run cannot use: one line naming the flag and exit 2, found before the
world is laid out (no traceback, no abort); and what each benchmark's layouts set."""

import pytest

from hpctrain import cli
from hpctrain.bench.allreduce import parse_sizes
from hpctrain.bench.embeddings import layouts
from hpctrain.config import load_config


@pytest.mark.parametrize("argv, words", [
    (["bench", "allreduce", "--reps", "0"], "--reps 0: expected at least 1"),
    (["bench", "allreduce", "--reps", "-1"], "--reps -1: expected at least 1"),
    (["bench", "allreduce", "--sizes", "3"], "--sizes 3 bytes is not a whole number of float32"),
    (["bench", "allreduce", "--algorithms", "auto,fastest"], "unknown algorithm(s) fastest"),
    (["bench", "alltoall", "--reps", "0"], "bench alltoall: --reps 0"),
    (["bench", "emulate", "--reps", "0", "--set", "comm.node_size=1", "--set",
      "comm.emulate='20,1'"], "bench emulate: --reps 0"),
    (["bench", "ps", "--steps", "0"], "bench ps: --steps 0"),
    (["bench", "ps", "--batch", "0"], "bench ps: --batch 0"),
    (["bench", "ps", "--tables", "0"], "bench ps: --tables 0"),
    (["bench", "embeddings", "--steps", "0"], "bench embeddings: --steps 0"),
    (["bench", "embeddings", "--hot", "0"], "bench embeddings: --hot 0.0"),
    (["bench", "tiering", "--repeat", "0"], "bench tiering: --repeat 0"),
])
def test_a_value_no_benchmark_can_run_with_is_one_line_and_exit_2(argv, words, capsys):
    assert cli.main(argv) == 2
    err = capsys.readouterr().err
    assert words in err and err.count("\n") == 1 and "Traceback" not in err


def test_trace_summarize_refuses_a_negative_step_count(tmp_path, capsys):
    trace = tmp_path / "t.json"
    trace.write_text('{"traceEvents": []}')
    assert cli.main(["trace", "summarize", str(trace), "--steps", "-1"]) == 2
    assert "--steps -1" in capsys.readouterr().err


@pytest.mark.parametrize("text", ["0", "4KiB,0", "0KiB"])
def test_a_message_size_of_no_bytes_is_refused(text):
    with pytest.raises(ValueError, match="at least one byte"):
        parse_sizes(text)


def test_embeddings_layouts_ignore_a_job_files_servers_and_hot_tier(tmp_path):
    """A job with servers and a hot tier (jobs/configs/tiered.toml) runs replicated and
    all-to-all without them, and PS untiered but for the tiered layout."""
    job = tmp_path / "tiered.toml"
    job.write_text("[ps]\nservers = 1\n[tiering]\nbudget = 0.1\nbudget_unit = 'rows'\n")
    for name, overrides in layouts(4):
        config = load_config(str(job), overrides)  # validates: replicated with servers fails
        if name.startswith(("replicated", "alltoall")):
            assert config.ps.servers == 0 and config.tiering.budget == 0, name
        elif name in ("ps:1", "ps:2"):
            assert config.tiering.budget == 0, name


@pytest.mark.parametrize("job_set", [[], ["tiering.budget=0.2"], ["tiering.budget_unit='rows'"],
                                     ["tiering.budget=5000", "tiering.budget_unit='rows'"]])
def test_bench_tiering_runs_take_the_setting_budget_as_a_share_whatever_the_job_sets(
        job_set, monkeypatch):
    """The untiered baseline is untiered and the tiered run holds --budgets of the rows,
    even where --set (or the job file) names a budget or another unit."""
    from types import SimpleNamespace

    from hpctrain.bench import tiering

    ran = []
    monkeypatch.setattr(tiering, "run_training", lambda job, topo: ran.append(job.tiering))
    sets = ["ps.servers=1", *job_set]
    args = SimpleNamespace(job=None, set=sets, rows=1000, tables=2, train_steps=5,
                           prescan=100)
    topo = SimpleNamespace(rank=1, roles=SimpleNamespace(servers=1))  # not rank 0: no figures
    config = load_config(None, sets)
    for budget in (0.0, 0.1):
        tiering._train(args, config, topo, 1.05, budget, "/nonexistent")
    assert [(t.budget, t.budget_unit) for t in ran] == [(0.0, "fraction"), (0.1, "fraction")]


@pytest.mark.parametrize("width", [0, -1])
def test_bench_pipeline_refuses_a_width_of_no_units(width):
    from hpctrain.bench.pipeline import PipelineBench
    from hpctrain.errors import ConfigError

    with pytest.raises(ConfigError, match="--width"):
        PipelineBench((2,), (1,), ("gpipe",), width, 2, 8, 1).check(2)
