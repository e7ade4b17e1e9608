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

