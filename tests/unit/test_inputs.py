"""Ranks' views of their inputs: the first difference names the key or file and the ranks."""

from hpctrain.config import load_config
from hpctrain.train.inputs import disagreement, rank_view


def test_views_name_the_key_and_the_ranks():
    a = rank_view(load_config(), None)
    b = rank_view(load_config(overrides=["train.lr=0.5"]), None)
    assert disagreement([a, a, a]) is None
    message = disagreement([a, b, a])
    assert message.startswith("ranks disagree on config key train.lr: ")
    assert "on ranks 0, 2" in message and "0.5 on rank 1" in message


def test_a_file_seen_differently_is_named_and_servers_are_left_out():
    worker = {"config key train.lr": "0.1", "data file day_0.txt": "100 bytes"}
    grown = dict(worker, **{"data file day_0.txt": "180 bytes"})
    server = {"config key train.lr": "0.1"}
    assert disagreement([worker, worker, server]) is None
    assert disagreement([worker, grown, server]) == (
        "ranks disagree on data file day_0.txt: 100 bytes on rank 0; 180 bytes on rank 1 "
        "(same launch, environment and files on every rank?)")


def test_tables_that_cannot_fit_the_node_are_refused_before_allocation():
    import pytest

    from hpctrain.errors import ConfigError
    from hpctrain.train.inputs import check_memory, table_bytes

    sizes = "data.table_sizes=[1000000000, 1000000000]"
    config = load_config(overrides=[sizes])
    assert table_bytes(config, config.data.table_sizes, 2) == 2 * 10**9 * 17 * 4
    with pytest.raises(ConfigError, match=r"data.table_sizes: 2 tables of 2,000,000,000 rows "
                                          r"x model.embedding_dim = 16 need 253.3 GiB on this "
                                          r"node \(2 holding ranks\), 64.0 GiB available"):
        check_memory(config, config.data.table_sizes, 2, 2, 64 * 2**30)
    served = load_config(overrides=[sizes, "ps.servers=8"])
    check_memory(served, served.data.table_sizes, 2, 2, 64 * 2**30)  # 31.7 GiB: fits
    sharded = load_config(overrides=[sizes, "embeddings.mode='alltoall'"])
    assert table_bytes(sharded, sharded.data.table_sizes, 8) == 2 * 10**9 * 17 * 4 // 8
    check_memory(sharded, sharded.data.table_sizes, 8, 2, 64 * 2**30)  # 31.7 GiB: fits
    adam = load_config(overrides=[sizes, "train.optimizer='adam'"])  # lazy Adam: 2 dim + 1
    assert table_bytes(adam, adam.data.table_sizes, 2) == 2 * 10**9 * (16 + 33) * 4
