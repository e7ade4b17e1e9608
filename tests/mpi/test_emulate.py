"""The emulated network (``comm.emulate``) on real MPI worlds: delays as the model says.

Delays are 30 ms of latency plus tens of milliseconds of bytes per message, so that they
dwarf the shared machine's noise; the extra time is the median emulated round less the
fastest plain one (the delay runs from the send, so it absorbs the real transfer: the
fastest plain round absorbs least), checked as a ratio to the expected delay, never as a
time.
"""

import json
import sys
import time

import numpy as np
import pytest
from harness import run_mpi
from mpi4py import MPI

from embeddings.optim import SparseOptimizer
from embeddings.replicated import ReplicatedTables
from embeddings.tables import LocalTables, TableLayout
from hpctrain.comm import Group, allreduce, emulate
from hpctrain.comm.alltoall import alltoallv
from hpctrain.comm.native import allgatherv
from hpctrain.config import CommConfig, load_config
from hpctrain.runtime.waits import Wait
from hpctrain.runtime.world import build_topology
from hpctrain.train.job import run_training

WORLD = MPI.COMM_WORLD
LATENCY_S = 0.03
GBPS = 0.4  # 50 MB/s: 2 MB take 40 ms
EMULATE = f"{LATENCY_S * 1e6:g},{GBPS:g}"
BANDWIDTH = GBPS * 1e9 / 8
NBYTES = 2_000_000
REPEATS = 5
CROWDED = 1.3
"""Upper bound of the ratio over three ranks on this 2-core machine: every emulated wait ends
in a wake-up that competes for a core, measured 1.11-1.19 (fastest rounds) on a busy VM
where two ranks stay within 1.1. Still below what one more round of the pairwise
exchange would add (1.36), and a missing delay reads far under 0.9."""


def delay(nbytes: float) -> float:
    return LATENCY_S + nbytes / BANDWIDTH


def times(run, repeats: int = REPEATS) -> list[float]:
    """The slowest rank's seconds of ``run()`` in each of ``repeats`` rounds (ranks start
    together)."""
    out = []
    for _ in range(repeats):
        WORLD.Barrier()
        start = time.perf_counter()
        run()
        out.append(WORLD.allreduce(time.perf_counter() - start, op=MPI.MAX))
    return out


def extra_time(emulated, plain) -> float:
    """The fastest round of ``emulated()`` less the fastest of ``plain()``: the emulated
    delay is a sleep, so no round can beat it, and on a busy machine (3 ranks on 2 cores)
    the other rounds lose a time slice now and then (medians 14-30% over the delay)."""
    return min(times(emulated)) - min(times(plain))


def ratio(measured_extra: float, expected: float) -> float:
    return measured_extra / expected


def ping_pong(link, buf: np.ndarray, peer: int, first: bool) -> None:
    if first:
        link.Send(buf, peer, 5)
        link.Recv(buf, peer, 5)
    else:
        link.Recv(buf, peer, 5)
        link.Send(buf, peer, 5)


@pytest.mark.mpi(ranks=(2,))
def test_ping_pong_and_allreduce_are_delayed_by_latency_plus_bytes_over_bandwidth():
    plain = Group(WORLD, CommConfig(node_size=1))
    emulated = Group(WORLD, CommConfig(node_size=1, emulate=EMULATE))
    buf = np.zeros(NBYTES, np.uint8)
    peer, first = 1 - WORLD.rank, WORLD.rank == 0
    before = emulate.totals()
    extra = extra_time(lambda: ping_pong(emulated.link, buf, peer, first),
                       lambda: ping_pong(plain.link, buf, peer, first))
    got = emulate.totals() - before
    assert 0.9 <= ratio(extra, 2 * delay(NBYTES)) <= 1.1, (extra, 2 * delay(NBYTES))
    assert got.messages == REPEATS and got.bytes == REPEATS * NBYTES
    assert got.emulated_s > 0.5 * REPEATS * delay(NBYTES)

    data = np.ones(NBYTES // 4, np.float32)
    # (algorithm, expected delay): the ring's 2 steps of half the buffer, recursive
    # doubling's one exchange of all of it, and MPI's own allreduce by the model
    # latency * ceil(log2 2) + 2 (2-1)/2 * bytes / bandwidth.
    for algorithm, expected in (("ring", 2 * delay(NBYTES / 2)),
                                ("recursive_doubling", delay(NBYTES)),
                                ("native", delay(NBYTES))):
        def run(group, algorithm=algorithm):
            data[:] = 1.0
            allreduce(data, comm=group, algorithm=algorithm)
            assert data[0] == 2.0
        extra = extra_time(lambda: run(emulated), lambda: run(plain))
        assert 0.9 <= ratio(extra, expected) <= 1.1, (algorithm, extra, expected)
    for group in (plain, emulated):
        group.free()


@pytest.mark.mpi(ranks=(2,))
def test_the_stores_own_mpi_calls_wait_out_the_emulated_network():
    """An MPI library call on a component's own communicator (the replicated store's push,
    the tiered store's count merges and hot sums) waits, through a channel beside the
    group's, latency * ceil(log2 2) + the half of the gathered bytes each node receives."""
    emulated = Group(WORLD, CommConfig(node_size=1, emulate=EMULATE))
    comm = WORLD.Dup()
    link = emulated.link.beside(comm)
    part = np.zeros(NBYTES // 4, np.float32)  # gathered: 2 x NBYTES
    extra = extra_time(lambda: allgatherv(part, comm, link=link), lambda: allgatherv(part, comm))
    assert 0.9 <= ratio(extra, delay(NBYTES)) <= 1.1, (extra, delay(NBYTES))
    layout = TableLayout.from_sizes([64], 4)
    store = ReplicatedTables(LocalTables(layout, SparseOptimizer("sgd"), 0), comm, link)
    before = emulate.totals()
    store.push(np.arange(8, dtype=np.int64), np.ones((8, 4), np.float32), 0.1)
    got = emulate.totals() - before
    assert got.messages == 1 and got.bytes > 0 and got.emulated_s > 0, got
    store.close()
    comm.Free()
    emulated.free()


@pytest.mark.mpi(ranks=(3,))
def test_ranks_on_one_emulated_node_are_not_delayed_and_three_nodes_are():
    """node_size 2 over 3 ranks: {0, 1} share a node, rank 2 is alone. A ping-pong inside
    the node waits for nothing; one across nodes waits latency + bytes / bandwidth. Then
    over 3 nodes (node_size 1, a non-power of two): a ring allreduce (4 steps of a third
    each) and the all-to-all."""
    two = Group(WORLD, CommConfig(node_size=2, emulate=EMULATE))
    two_plain = Group(WORLD, CommConfig(node_size=2))
    assert two.layout.nodes == 2 and two.link.remote(2 - WORLD.rank) is (WORLD.rank != 1)
    buf = np.zeros(NBYTES, np.uint8)

    def pair(group: Group, a: int, b: int) -> None:
        if WORLD.rank in (a, b):
            ping_pong(group.link, buf, b if WORLD.rank == a else a, WORLD.rank == a)

    before = emulate.totals()
    inside = min(times(lambda: pair(two, 0, 1)))
    inside_count = emulate.totals() - before
    assert inside_count.messages == 0 and inside_count.emulated_s == 0.0
    inside_extra = inside - min(times(lambda: pair(two_plain, 0, 1)))
    assert ratio(inside_extra, 2 * delay(NBYTES)) < 0.1, inside_extra
    across = extra_time(lambda: pair(two, 0, 2), lambda: pair(two_plain, 0, 2))
    assert 0.9 <= ratio(across, 2 * delay(NBYTES)) <= 1.1, across
    for group in (two, two_plain):
        group.free()

    plain = Group(WORLD, CommConfig(node_size=1))
    three = Group(WORLD, CommConfig(node_size=1, emulate=EMULATE))
    data = np.ones(3 * (NBYTES // 12), np.float32)

    def run(group):
        data[:] = 1.0
        allreduce(data, comm=group, algorithm="ring")
        assert data[-1] == 3.0

    extra = extra_time(lambda: run(three), lambda: run(plain))
    expected = 4 * delay(data.nbytes / 3)
    assert 0.9 <= ratio(extra, expected) <= CROWDED, (extra, expected)

    # All-to-all, each rank sending m bytes to each other rank: the counts' MPI_Allgather
    # by the model (ceil(log2 3) = 2 latencies, 96 bytes), then the pairwise exchange's 2
    # rounds of one message each way, or MPI_Alltoallv by the model (2 latencies and the
    # busiest node's 2 m bytes).
    m = NBYTES // 4
    send = np.full(3 * m, WORLD.rank, np.uint8)
    counts = np.full(3, m)
    count_exchange = 2 * LATENCY_S + 96 / BANDWIDTH
    for algorithm, expected in (("pairwise", count_exchange + 2 * delay(m)),
                                ("native", count_exchange + 2 * LATENCY_S
                                 + 2 * m / BANDWIDTH)):
        def exchange(group, algorithm=algorithm):
            got, _ = alltoallv(send, counts, comm=group, algorithm=algorithm)
            np.testing.assert_array_equal(got, np.repeat(np.arange(3, dtype=np.uint8), m))
        extra = extra_time(lambda: exchange(three), lambda: exchange(plain))
        assert 0.9 <= ratio(extra, expected) <= CROWDED, (algorithm, extra, expected)
    for group in (plain, three):
        group.free()


@pytest.mark.mpi(ranks=(2,))
def test_a_nonblocking_receive_completed_after_its_arrival_waits_no_more():
    """What prefetch relies on: the delay runs from the send, not from the wait."""
    group = Group(WORLD, CommConfig(node_size=1, emulate=EMULATE))
    link, buf = group.link, np.zeros(NBYTES, np.uint8)
    wait = Wait("test", group.comm)
    for late in (False, True):
        if WORLD.rank == 0:
            sent = time.perf_counter()
            link.Isend(buf, 1, 9).Wait()
            WORLD.send(sent, dest=1, tag=10)  # one clock: the receiver can compare
        else:
            request = link.Irecv(buf, 0, 9)
            sent = WORLD.recv(source=0, tag=10)
            if late:  # computing while the message travels, past its arrival
                time.sleep(max(0.0, sent + 1.5 * delay(NBYTES) - time.perf_counter()))
            waited = link.wait_all([request], wait)
            done = time.perf_counter()
            if late:
                assert waited == 0.0
            else:
                assert waited > 0.0 and 1.0 <= ratio(done - sent, delay(NBYTES)) <= 1.1
        WORLD.Barrier()  # the first message has arrived: rank 0's link is free again
    group.free()


@pytest.mark.mpi(ranks=(3,))
def test_training_under_bsp_is_the_same_with_the_network_emulated(tmp_path):
    """Deterministic BSP on a parameter server, two workers on two emulated nodes: the
    emulated network changes when things happen, not what is computed."""
    common = ["data.table_sizes=[50, 200, 1000, 7]", "data.train_samples=2000",
              "data.eval_samples=200", "model.embedding_dim=8", "model.bottom_mlp=[16, 8]",
              "model.top_mlp=[16, 1]", "train.progress=false", "train.log_every=1",
              "train.batch_size=32", "train.steps=5", "ps.servers=1",
              "sync.deterministic=true", "ps.prefetch=false", "comm.node_size=1"]
    runs = {}
    timeline = WORLD.bcast(str(tmp_path / "trace.json"))
    # 5 ms a message: a worker descheduled on these oversubscribed cores still waits for
    # its pull replies (at 200 us one of them once never did, and measured no emulated wait)
    for name, extra in (("plain", []), ("emulated", ["comm.emulate='5000,1'",
                                                     f"runtime.trace={timeline!r}"])):
        run_dir = WORLD.bcast(str(tmp_path / name))
        config = load_config(overrides=[*common, *extra, f"train.run_dir={run_dir!r}"])
        runs[name] = run_training(config, build_topology(config))
    if WORLD.rank == 0:
        plain, emulated = runs["plain"], runs["emulated"]
        assert emulated.train_loss == plain.train_loss
        assert emulated.eval == plain.eval
        assert not plain.emulated and len(emulated.emulated) == 3
        assert all(e.messages > 0 for e in emulated.emulated)
        workers = emulated.emulated[:2]
        assert min(e.emulated_s for e in workers) > 0.0
        spans = {e["name"] for e in json.loads((tmp_path / "trace.json").read_text())[
            "traceEvents"] if e.get("ph") == "X"}
        assert {"emulated transfer", "wait pull"} <= spans
        written = json.loads((tmp_path / "emulated" / "summary.json").read_text())
        assert [e["messages"] for e in written["emulated"]] == \
            [e.messages for e in emulated.emulated]


HPCTRAIN = [sys.executable, "-m", "hpctrain.cli"]


@pytest.mark.parametrize("value, words", [
    ("abc", "comm.emulate: expected 'LATENCY_US,GBPS' (two numbers, e.g. '20,10'), got 'abc'"),
    ("-5,10", "comm.emulate: the latency must be a finite number >= 0 (microseconds), got "
              "'-5'"),
    ("20", "comm.emulate: expected 'LATENCY_US,GBPS'"),
])
def test_bad_values_end_a_launch_with_one_line_and_exit_2(tmp_path, value, words):
    result = run_mpi([*HPCTRAIN, "train", "--set", f"comm.emulate={value!r}", "--set",
                      f"train.run_dir={str(tmp_path)!r}"], ranks=2, timeout=120)
    ours = [line for line in result.stdout.splitlines() if line.startswith("hpctrain")]
    assert result.returncode == 2 and len(ours) == 1 and words in ours[0], result.stdout


def test_bench_emulate_prints_ratios_near_one(tmp_path):
    out = tmp_path / "emulate.json"
    result = run_mpi([*HPCTRAIN, "bench", "emulate", "--set", "comm.node_size=1", "--set",
                      f"comm.emulate={EMULATE!r}", "--sizes", "512KiB", "--reps", "3",
                      "--json", str(out)], ranks=2, timeout=120)
    assert result.returncode == 0, result.stdout
    rows = {r["case"]: r for r in json.loads(out.read_text())}
    assert set(rows) == {"ping-pong", "allreduce ring", "allreduce native",
                         "allreduce recursive_doubling"}
    assert 0.8 <= rows["ping-pong"]["ratio"] <= 1.25, rows
    result = run_mpi([*HPCTRAIN, "bench", "emulate", "--set", f"comm.emulate={EMULATE!r}"],
                     ranks=2, timeout=60)
    assert result.returncode == 2 and [line for line in result.stdout.splitlines()
                                       if line.startswith("hpctrain")] == [
        "hpctrain: error: bench emulate: set comm.emulate (e.g. '20000,0.4') and "
        "comm.node_size (ranks per emulated node)"], result.stdout
    result = run_mpi([*HPCTRAIN, "bench", "allreduce", "--set", f"comm.emulate={EMULATE!r}"],
                     ranks=2, timeout=60)
    ours = [line for line in result.stdout.splitlines() if line.startswith("hpctrain")]
    assert result.returncode == 2 and ours == [
        "hpctrain: error: bench allreduce: comm.emulate is set, but this benchmark measures "
        "against MPI_Allreduce called directly, which the emulated network does not delay; "
        "use hpctrain bench emulate"], result.stdout
