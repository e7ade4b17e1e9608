"""``TrainingJob(config, topo)`` checks what it can before any rank builds its role: the run
directory and whether the tables fit (README, "From Python"). One process, ``COMM_SELF``."""

import pytest
from mpi4py import MPI

from hpctrain.config import load_config
from hpctrain.errors import HpctrainError
from hpctrain.runtime.world import build_topology
from hpctrain.train.job import TrainingJob


def job(tmp_path, *overrides):
    config = load_config(overrides=[f"train.run_dir='{tmp_path / 'run'}'", *overrides], env={})
    return TrainingJob(config, build_topology(config, MPI.COMM_SELF))


def test_a_directory_holding_another_run_is_refused_when_the_job_is_built(tmp_path):
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "metrics.jsonl").write_text('{"step": 1}\n')
    with pytest.raises(HpctrainError, match=r"holds another run \(metrics.jsonl\)"):
        job(tmp_path)
    assert [p.name for p in (tmp_path / "run").iterdir()] == ["metrics.jsonl"]


def test_tables_that_do_not_fit_are_refused_when_the_job_is_built(tmp_path):
    with pytest.raises(HpctrainError, match=r"data.table_sizes: 2 tables of 4,000,000,000 rows "
                                            r"x model.embedding_dim = 16 need .* GiB on this "
                                            r"node"):
        job(tmp_path, "data.table_sizes=[2000000000, 2000000000]")


def test_a_refused_resume_is_not_listed_as_a_resume_in_meta_json(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    (run / "config.toml").write_text("")
    (run / "meta.json").write_text('{"world": {"ranks": 2}}\n')
    config = load_config(overrides=[f"train.run_dir='{run}'"], env={})
    with pytest.raises(HpctrainError, match="no complete checkpoint"):
        TrainingJob(config, build_topology(config, MPI.COMM_SELF), resume=True)
    assert (run / "meta.json").read_text() == '{"world": {"ranks": 2}}\n'


def test_a_run_dir_where_meta_json_cannot_be_written_is_one_user_error(tmp_path, monkeypatch):
    import errno

    from hpctrain.train import meta

    def read_only(path, text):
        raise OSError(errno.EROFS, "Read-only file system", str(path))

    monkeypatch.setattr(meta, "write_text_atomic", read_only)
    with pytest.raises(HpctrainError, match=r"train.run_dir = '.*run': cannot write there "
                                            r"\(Read-only file system\)"):
        job(tmp_path)


def test_the_final_table_of_a_run_stopped_by_a_signal_does_not_say_finished(capsys):
    """A preempted run (exit 75, no summary.json) is not finished: a log grepped for
    'training finished' must not count it."""
    from hpctrain.train.report import Summary, print_summary

    print_summary(Summary(steps=40, peak_rss_mb=[1.0], stopped_at=40), 1)
    head = capsys.readouterr().out.splitlines()[0]
    assert head == "hpctrain: training stopped by a signal", head
    print_summary(Summary(steps=40, peak_rss_mb=[1.0]), 1)
    assert capsys.readouterr().out.splitlines()[0] == "hpctrain: training finished"
