"""The emulated network's pure parts: the key's values, emulated nodes, what it leaves out."""

import pytest

from hpctrain.comm.emulate import NetStats, network, ps_nodes
from hpctrain.config import CommConfig, load_config
from hpctrain.errors import ConfigError
from hpctrain.runtime.topology import assign_roles
from hpctrain.runtime.world import check_emulation_fits, emulation_notes


def test_the_key_reads_microseconds_and_gigabits():
    assert network(CommConfig()) is None
    net = network(CommConfig(emulate=" 20 , 10 "))
    assert (net.latency_s, net.bandwidth) == (pytest.approx(20e-6), 1.25e9)
    assert net.transfer_s(1.25e9) == 1.0


@pytest.mark.parametrize("value, words", [
    ("abc", "comm.emulate: expected 'LATENCY_US,GBPS' (two numbers, e.g. '20,10'), got 'abc'"),
    ("20", "expected 'LATENCY_US,GBPS'"),
    ("20;10", "expected 'LATENCY_US,GBPS'"),
    ("20,10,5", "expected 'LATENCY_US,GBPS'"),
    ("-1,10", "comm.emulate: the latency must be a finite number >= 0 (microseconds), got '-1'"),
    ("20,0", "comm.emulate: the bandwidth must be a finite number > 0 (Gb/s), got '0'"),
    ("20,-3", "the bandwidth must be"),
    ("inf,10", "the latency must be"),
    ("20,nan", "the bandwidth must be"),
])
def test_bad_values_name_the_key(value, words):
    with pytest.raises(ConfigError) as info:
        load_config(overrides=[f"comm.emulate={value!r}"])
    assert words in str(info.value)


def test_the_torch_algorithm_is_refused_since_its_messages_cannot_be_delayed():
    with pytest.raises(ConfigError, match="comm.algorithm = 'torch' reduces through gloo"):
        load_config(overrides=["comm.emulate='20,10'", "comm.algorithm='torch'"])


def test_parameter_servers_sit_on_nodes_of_their_own():
    assert ps_nodes(4, 2, 2) == [0, 0, 1, 1, 2, 3]
    assert ps_nodes(3, 1, 1) == [0, 1, 2, 3]
    assert ps_nodes(3, 1, 0) == [0, 0, 0, 1]  # node_size 0: one machine, one worker node
    assert ps_nodes(2, 0, 4) == [0, 0]


def test_counters_subtract():
    assert NetStats(3.0, 5, 100) - NetStats(1.0, 2, 40) == NetStats(2.0, 3, 60)


def test_a_job_where_nothing_would_be_delayed_is_warned_about():
    quiet = load_config(overrides=["comm.emulate='20,10'", "comm.node_size=1"])
    assert emulation_notes(quiet, assign_roles(2, 0), "mpi") == []
    one_node = load_config(overrides=["comm.emulate='20,10'", "comm.node_size=2"])
    [note] = emulation_notes(one_node, assign_roles(2, 0), "mpi")
    assert "no message is delayed" in note and "comm.node_size = 2" in note
    assert emulation_notes(one_node, assign_roles(3, 1), "mpi") == []  # the server is a node
    pipeline = load_config(overrides=["comm.emulate='20,10'", "comm.node_size=1",
                                      "parallel.pp=2"])
    [note] = emulation_notes(pipeline, assign_roles(2, 0), "mpi")
    assert "pipeline-parallel messages" in note
    tensor = load_config(overrides=["comm.emulate='20,10'", "comm.node_size=1",
                                    "parallel.tp=2"])  # backend auto: torch on CUDA
    assert emulation_notes(tensor, assign_roles(2, 0), "mpi") == []
    [note] = emulation_notes(tensor, assign_roles(2, 0), "torch")
    assert "torch.distributed" in note


def test_bench_emulate_refuses_a_job_where_nothing_is_delayed():
    """One emulated node: the emulated and plain runs would be the same measurement."""
    import argparse

    from mpi4py import MPI

    from hpctrain.bench import emulate
    from hpctrain.runtime.world import build_topology

    one_node = load_config(overrides=["comm.emulate='20,10'", "comm.node_size=1"], env={})
    with pytest.raises(ConfigError, match=r"bench emulate: comm.emulate = '20,10' with "
                                          r"comm.node_size = 1 delays nothing"):
        emulate.run(argparse.Namespace(sizes=[1024], reps=1),
                    build_topology(one_node, MPI.COMM_SELF))


def test_a_job_spanning_real_nodes_cannot_emulate_a_network():
    """Send and arrival times are compared on one machine's clock."""
    check_emulation_fits("20,10", 4, 4)
    check_emulation_fits("", 2, 4)  # off: anything goes
    with pytest.raises(ConfigError, match=r"^comm.emulate = '20,10' compares send and arrival "
                                          r"times on one clock, so every rank must run on one "
                                          r"machine; this job spans real nodes of 2 of its 4 "
                                          r"ranks$"):
        check_emulation_fits("20,10", 2, 4)
