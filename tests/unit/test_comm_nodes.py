"""Emulated nodes (``comm.node_size``) must lie inside real ones."""

from hpctrain.comm.group import emulated_node_error


def test_an_emulated_node_spanning_real_nodes_is_named():
    assert emulated_node_error([0, 0, 0, 0], 2) is None
    assert emulated_node_error([0, 0, 2, 2], 2) is None
    assert emulated_node_error([0, 0, 2, 2], 4) == (
        "comm.node_size = 4: ranks 0-3 would form one node but share no memory (they sit on "
        "2 real nodes); use at most the ranks of one real node")
    assert emulated_node_error([0, 0, 0, 3, 3, 3], 2).startswith("comm.node_size = 2: ranks 2-3")
