"""Cost model, selection, calibration files, buffer checks and bench helpers, without MPI."""

import dataclasses
import json
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from hpctrain.bench.allreduce import parse_sizes
from hpctrain.comm import calibration, select
from hpctrain.comm import shm as shm_module
from hpctrain.comm.calibration import fit
from hpctrain.comm.collectives import as_storage
from hpctrain.comm.shm import SHM, Shm, small_limit, sync_cost
from hpctrain.comm.types import DTYPES, Cost, CostParams, Layout, Link, Request, chunk_bounds
from hpctrain.config import CommConfig
from hpctrain.errors import CommError

ONE_NODE = Layout(size=4, rank=0, local_size=4, local_rank=0, nodes=1, uniform=True)
TWO_NODES = Layout(size=8, rank=0, local_size=4, local_rank=0, nodes=2, uniform=True)
F32 = DTYPES["float32"]
# A machine whose shared window synchronises slowly and whose MPI allreduce is slow, so
# that the choice among the message-passing families shows.
SLOW_SHM = CostParams(p2p=Link(5e-6, 1e-10), shm=Link(1e-3, 1e-10), native=Link(1e-3, 1e-8),
                      torch=Link(1e-3, 1e-8))


def allreduce(nbytes: int) -> Request:
    return Request("allreduce", nbytes // 4, F32)


def test_costs_add_and_scale():
    a, b = Cost(1.0, 2.0, 3.0), Cost(0.5, 0.25, 0.125)
    assert a + b == Cost(1.5, 2.25, 3.125) and (a + b).seconds == pytest.approx(6.875)


def test_auto_picks_latency_algorithms_for_tiny_and_bandwidth_ones_for_large():
    tiny = select.choose(allreduce(8), ONE_NODE, SLOW_SHM)
    large = select.choose(allreduce(64 << 20), ONE_NODE, SLOW_SHM)
    assert tiny.name == "recursive_doubling"
    assert large.name in ("ring", "halving_doubling")
    ranked = dict((a.name, c.seconds) for a, c in select.ranking(allreduce(8), ONE_NODE,
                                                                 SLOW_SHM))
    assert ranked["recursive_doubling"] < ranked["ring"] < ranked["shm"]
    assert "hierarchical" not in ranked  # one node
    # Across nodes the hierarchical algorithm wins the bandwidth regime.
    assert select.choose(allreduce(64 << 20), TWO_NODES, CostParams()).name == "hierarchical"
    assert "shm" not in dict((a.name, c) for a, c in select.ranking(
        allreduce(8), TWO_NODES, CostParams()))


def test_shared_memory_uses_its_one_sync_path_only_for_small_buffers():
    params, sync = CostParams(), sync_cost(ONE_NODE, CostParams())
    small, large = 256, 16 << 20
    assert Shm.small_cost(small, 4, params, sync).seconds < \
        Shm.slices_cost(small, 4, params, sync, False).seconds
    assert Shm.small_cost(large, 4, params, sync).seconds > \
        Shm.slices_cost(large, 4, params, sync, False).seconds
    assert SHM.cost(dataclasses.replace(allreduce(small), resident=True), ONE_NODE,
                    params) == Shm.small_cost(small, 4, params, sync)
    resident = dataclasses.replace(allreduce(large), resident=True)
    assert SHM.cost(resident, ONE_NODE, params).seconds < \
        SHM.cost(allreduce(large), ONE_NODE, params).seconds
    oversubscribed = dataclasses.replace(ONE_NODE, oversubscribed=True)
    assert sync_cost(oversubscribed, params) == params.oversubscribed * params.shm.alpha


def test_two_ranks_take_the_slices_path_for_large_buffers_even_when_copying_costs_reducing():
    """With ``gamma == beta`` (as calibrated on a 2-core Xeon) the one-synchronisation path
    reads twice as much and must still give way: it once ran every 2-rank buffer, 1.3x
    slower than the slices at 4 MiB."""
    two = Layout(size=2, rank=0, local_size=2, local_rank=0, nodes=1, uniform=True)
    params = dataclasses.replace(CostParams(), shm=Link(2e-6, 7e-11), gamma=7e-11)
    limit = small_limit(two, params)
    assert 8 << 10 < limit < 256 << 10
    sync = sync_cost(two, params)
    for nbytes in (int(limit) // 2, int(limit) * 2):
        small = Shm.small_cost(4 * (nbytes // 4), 2, params, sync)
        slices = Shm.slices_cost(4 * (nbytes // 4), 2, params, sync, False)
        assert SHM.cost(allreduce(nbytes), two, params) == \
            (small if small.seconds < slices.seconds else slices)


def test_where_ranks_may_read_each_other_large_private_buffers_take_the_single_copy():
    """It saves the copy of this rank's slice into the window: taken where its fitted line
    costs less than the slices path, for private buffers of arithmetic dtypes only."""
    params = CostParams()
    for layout in (ONE_NODE, dataclasses.replace(ONE_NODE, oversubscribed=True)):
        readable = dataclasses.replace(layout, single_copy=True)
        sync, p = sync_cost(layout, params), layout.size
        taken = []
        for nbytes in (1 << 18, 1 << 20, 1 << 22, 1 << 24, 1 << 26):
            req = allreduce(nbytes)
            slices = Shm.slices_cost(nbytes, p, params, sync, False)
            single = Shm.single_copy_cost(nbytes, p, params, layout)
            assert SHM.cost(req, readable, params) == min(single, slices,
                                                          key=lambda c: c.seconds)
            taken.append(single.seconds < slices.seconds)
            assert SHM.cost(req, layout, params) == slices  # not where reads are refused
            assert SHM.cost(dataclasses.replace(req, dtype=DTYPES["bfloat16"]), readable,
                            params).seconds == pytest.approx(
                Shm.slices_cost(nbytes // 2, p, params, sync, False).seconds)
            resident = dataclasses.replace(req, resident=True)
            assert SHM.cost(resident, readable, params) == SHM.cost(resident, layout, params)
        assert taken == sorted(taken) and taken[-1] and not taken[0]  # one switch, upwards
    # the defaults' switch lies where 2 ranks measured it: the window path to 1 MiB, the
    # single copy from 4 MiB
    two = dataclasses.replace(ONE_NODE, size=2, local_size=2, single_copy=True)
    assert SHM.cost(allreduce(1 << 20), two, params).latency_s == \
        pytest.approx(2 * sync_cost(two, params))
    assert SHM.cost(allreduce(4 << 20), two, params) == \
        Shm.single_copy_cost(4 << 20, 2, params, two)
    # and at 4 ranks on fewer cores about 16 MB: the window path at 8 MiB, the single copy
    # at 32 MiB
    four = dataclasses.replace(ONE_NODE, single_copy=True, oversubscribed=True)
    assert SHM.cost(allreduce(8 << 20), four, params).latency_s == \
        pytest.approx(2 * sync_cost(four, params))
    assert SHM.cost(allreduce(32 << 20), four, params) == \
        Shm.single_copy_cost(32 << 20, 4, params, four)


def test_forcing_an_algorithm_that_cannot_serve_says_why():
    with pytest.raises(CommError, match="needs all ranks on one node"):
        select.choose(allreduce(64), TWO_NODES, CostParams(), "shm")
    with pytest.raises(CommError, match="two or more nodes"):
        select.choose(allreduce(64), ONE_NODE, CostParams(), "hierarchical")
    with pytest.raises(CommError, match="ring implements allgather, allreduce, reduce_scatter"):
        select.choose(Request("broadcast", 4, F32), ONE_NODE, CostParams(), "ring")
    with pytest.raises(CommError, match="unknown algorithm 'fast'"):
        select.choose(allreduce(64), ONE_NODE, CostParams(), "fast")
    assert select.choose(allreduce(64), ONE_NODE, CostParams(), "tree").name == "tree"


def test_config_offers_exactly_the_selectable_algorithms():
    choices = dataclasses.fields(CommConfig)[0].metadata["choices"]
    assert set(choices) == set(select.ALGORITHMS)


def test_calibration_file_round_trip_and_errors(tmp_path):
    params = dataclasses.replace(CostParams(), gamma=1e-9, p2p=Link(7e-6, 3e-10))
    path = tmp_path / "cal.json"
    calibration.write_params(path, params, {"ranks": 4})
    back = calibration.read_params(path)
    assert back == params and back.source == str(path)
    assert json.loads(path.read_text())["ranks"] == 4
    with pytest.raises(CommError, match="cannot read"):
        calibration.read_params(tmp_path / "missing.json")
    path.write_text("{nope")
    with pytest.raises(CommError, match="invalid JSON"):
        calibration.read_params(path)
    path.write_text(json.dumps({"format": "other", "params": {}}))
    with pytest.raises(CommError, match="not a calibration file"):
        calibration.read_params(path)
    path.write_text(json.dumps({"format": calibration.CALIBRATION_FORMAT,
                                "params": {"p2p": {"alpha": "x"}}}))
    with pytest.raises(CommError, match=r"params.p2p must be \{alpha, beta\}"):
        calibration.read_params(path)


def test_a_job_naming_a_bad_calibration_file_names_the_key(tmp_path):
    """The file is read when the job's groups are made, far from the key that named it."""
    from mpi4py import MPI

    from hpctrain.comm.group import Group

    missing = tmp_path / "missing.json"
    with pytest.raises(CommError, match=r"^comm.calibration: .*missing.json: cannot read the "
                                        r"calibration file"):
        Group(MPI.COMM_SELF, CommConfig(calibration=str(missing)))


def test_fit_recovers_alpha_and_beta():
    def time(nbytes: float) -> float:
        return 2e-6 * 3 + 4e-10 * nbytes
    link = fit((8, time(8)), [(n, time(n)) for n in (1 << 20, 16 << 20)], latency_weight=3)
    assert link.alpha == pytest.approx(2e-6, rel=1e-6)
    assert link.beta == pytest.approx(4e-10, rel=1e-6)
    dearer = fit((8, time(8)), [(1 << 20, 2 * time(1 << 20)), (16 << 20, time(16 << 20))])
    assert dearer.beta > 4e-10  # the dearest per-byte point is kept


@given(count=st.integers(0, 10_000), parts=st.integers(1, 17))
def test_chunks_are_balanced_and_cover_the_buffer(count, parts):
    b = chunk_bounds(count, parts)
    sizes = np.diff(b)
    assert b[0] == 0 and b[-1] == count and len(b) == parts + 1
    assert sizes.min() >= 0 and sizes.max() - sizes.min() <= 1
    assert list(sizes) == sorted(sizes, reverse=True)


def test_local_checks_name_the_problem():
    with pytest.raises(CommError, match="allreduce: numpy array of uint8: dtype not supported"):
        as_storage(np.zeros(3, np.uint8), "allreduce")
    with pytest.raises(CommError, match=r"shape \(4, 2\) is not contiguous"):
        as_storage(np.zeros((4, 4), np.float32)[:, :2], "allreduce")
    frozen = np.zeros(3, np.float32)
    frozen.flags.writeable = False
    with pytest.raises(CommError, match="read-only"):
        as_storage(frozen, "broadcast")
    with pytest.raises(CommError, match="expected a numpy array or a torch tensor, got list"):
        as_storage([1.0], "allreduce")
    with pytest.raises(CommError, match="not contiguous"):
        as_storage(torch.zeros(4, 4).t(), "allreduce")


def test_storage_views_share_memory():
    t = torch.zeros(2, 3, dtype=torch.bfloat16)
    arr, dtype, device = as_storage(t, "allreduce")
    arr[:] = 0x3F80  # bfloat16 bits of 1.0
    assert dtype.name == "bfloat16" and device == "cpu" and (t == 1).all()
    h = np.zeros(5, np.float16)
    arr, dtype, _ = as_storage(h, "allreduce")
    assert arr.dtype == np.uint16 and np.shares_memory(arr, h) and dtype.name == "float16"


def test_parse_sizes():
    assert parse_sizes("4KiB-64KiB") == [4096, 8192, 16384, 32768, 65536]
    assert parse_sizes("4096,1MiB, 2m") == [4096, 1 << 20, 2 << 20]
    for bad in ("4XB", "64KiB-4KiB", "", "0-4KiB"):
        with pytest.raises(ValueError):
            parse_sizes(bad)


def test_sixteen_bit_allreduces_take_the_slices_path_not_the_streaming_one(monkeypatch):
    """Above the small path, numeric dtypes take the one-call slices path, whose reduced
    slices go into the window by streaming stores (``allreduce_pipelined``); float16 and
    bfloat16 take ``allreduce_slices``, where the widening reduction writes them back with
    plain stores (test_comm_kernels checks that kernel's stores)."""
    taken = []
    monkeypatch.setattr(shm_module, "allreduce_pipelined",
                        lambda arr, arena, op, piece: taken.append((arr.dtype, "pipelined")))
    monkeypatch.setattr(shm_module, "allreduce_slices",
                        lambda arr, arena, op, kind: taken.append((arr.dtype, kind)))
    params = CostParams()
    two = Layout(size=2, rank=0, local_size=2, local_rank=0, nodes=1, uniform=True)

    def bind(req, layout):
        group = SimpleNamespace(layout=layout, params=params, arena=lambda nbytes: None)
        taken.clear()
        SHM.bind(req, group)(np.zeros(4, req.dtype.storage))
        return list(taken)

    for layout in (two, dataclasses.replace(two, single_copy=True)):  # no single copy either
        for name in ("float16", "bfloat16"):
            dtype = DTYPES[name]
            for nbytes in (1 << 20, 64 << 20):
                assert nbytes > small_limit(layout, params)
                assert bind(Request("allreduce", nbytes // 2, dtype), layout) == \
                    [(dtype.storage, dtype.kind)], (name, nbytes, layout)
    assert bind(allreduce(1 << 20), two) == [(np.dtype(np.float32), "pipelined")]
