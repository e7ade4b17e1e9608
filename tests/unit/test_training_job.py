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


def test_sync_and_server_keys_without_servers_are_named_as_unused():
    from hpctrain.train.job import unused_settings

    assert unused_settings(load_config(None)) == []
    assert unused_settings(load_config(None, ["ps.servers=1", "sync.model='asp'",
                                              "ps.prefetch=true"])) == []
    (note,) = unused_settings(load_config(None, ["sync.model='ssp:4'", "ps.prefetch=true",
                                                 "embeddings.mode='alltoall'"]))
    assert note.startswith("sync.model, ps.prefetch govern parameter-server tables")
    assert "(tables alltoall)" in note
    (note,) = unused_settings(load_config(None, ["sync.table_models=['t3=asp']"]))
    assert note.startswith("sync.table_models governs") and "it is not used" in note
    paths = ["data.source='criteo'", "data.paths=['a.txt']", "data.eval_paths=['b.txt']"]
    (note,) = unused_settings(load_config(None, [*paths, "data.eval_fraction=0.3"]))
    assert note == "data.eval_fraction = 0.3 is not used: data.eval_paths holds the held-out data"
    assert unused_settings(load_config(None, paths)) == []
