"""The collectives on real MPI worlds of 1-4 ranks, against numpy references.

Inputs are a pure function of (seed, rank), so every rank computes the reference for all
ranks without communicating. Checks are grouped so that each world size is one launch.
"""

import hashlib
import time

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.comm import (
    Group,
    allgather,
    allgatherv,
    allreduce,
    alltoallv,
    broadcast,
    gather,
    native,
    reduce,
    reduce_scatter,
    scatter,
)
from hpctrain.comm.fusion import FusedGradients
from hpctrain.comm.select import ALGORITHMS
from hpctrain.comm.types import OP_KERNEL, chunk_bounds
from hpctrain.comm.window import Window, allreduce_pipelined, allreduce_single_copy
from hpctrain.config import CommConfig, load_config
from hpctrain.errors import CommError
from hpctrain.models.dlrm import DLRM
from hpctrain.runtime.world import build_topology
from hpctrain.train.trainer import Trainer

WORLD = MPI.COMM_WORLD
DTYPES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
UNIT_ROUNDOFF = {"float32": 2.0 ** -24, "float64": 2.0 ** -53, "float16": 2.0 ** -11,
                 "bfloat16": 2.0 ** -8}
REDUCE = {"sum": np.sum, "avg": np.mean, "max": np.max, "min": np.min}


BIG = 786_433  # a prime: 3 MiB of float32


def lengths(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), p + 1, 13, 1009, BIG})


def values(rank: int, n: int, dtype: str, seed: int = 0) -> np.ndarray:
    """Rank ``rank``'s input: float64 values exactly representable in ``dtype``."""
    rng = np.random.default_rng([seed, rank, n])
    if dtype.startswith("int"):
        return rng.integers(-1000, 1000, n).astype(np.float64)
    x = rng.standard_normal(n).astype(np.float32) * 10
    if dtype == "float16":
        return x.astype(np.float16).astype(np.float64)
    if dtype == "bfloat16":
        return torch.from_numpy(x).bfloat16().double().numpy()
    return x.astype(dtype).astype(np.float64)


def buffer(x: np.ndarray, dtype: str):
    """The buffer a caller would pass: numpy, or a torch tensor for bfloat16."""
    if dtype == "bfloat16":
        return torch.from_numpy(x).bfloat16()
    return x.astype(dtype)


def as_float64(buf) -> np.ndarray:
    return buf.double().numpy() if isinstance(buf, torch.Tensor) else buf.astype(np.float64)


def raw(buf) -> bytes:
    return (buf.view(torch.int16).numpy() if isinstance(buf, torch.Tensor) else buf).tobytes()


def check_reduced(got: np.ndarray, inputs: list[np.ndarray], op: str, dtype: str,
                  what: str) -> None:
    """Exact for integers, max and min; within a rounding bound for float sums: one unit
    roundoff of the accumulated magnitude per rank (each step may round once)."""
    expect = REDUCE[op](np.stack(inputs), axis=0)
    if dtype.startswith("int") or op in ("max", "min"):
        np.testing.assert_array_equal(got, expect, err_msg=what)
        return
    scale = np.sum(np.abs(np.stack(inputs)), axis=0) / (len(inputs) if op == "avg" else 1)
    bound = (len(inputs) + 1) * UNIT_ROUNDOFF[dtype] * scale + 1e-300
    bad = np.abs(got - expect) > bound
    assert not bad.any(), f"{what}: {got[bad][:4]} vs {expect[bad][:4]}"


def same_on_every_rank(comm: MPI.Intracomm, blob: bytes, what: str) -> None:
    digest = hashlib.sha1(blob).digest()
    assert all(d == digest for d in comm.allgather(digest)), f"{what}: ranks differ"


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=600)
def test_every_algorithm_dtype_op_and_length_matches_numpy():
    group = Group(WORLD, CommConfig(check=True))
    p, r = group.size, group.rank
    served = set()
    for dtype in DTYPES:
        for n in lengths(p):
            inputs = [values(k, n, dtype) for k in range(p)]
            for algorithm in ALGORITHMS:
                for op in REDUCE:
                    if (op == "avg" and dtype.startswith("int")) or (n == BIG and op != "sum"):
                        continue  # a few MiB once per dtype and algorithm keeps this short
                    what = f"{algorithm} {dtype} {op} n={n} p={p}"
                    buf = buffer(inputs[r], dtype)
                    try:
                        out = allreduce(buf, op, comm=group, algorithm=algorithm)
                    except CommError as exc:
                        assert "cannot serve" in str(exc), exc  # shm/hierarchical layouts
                        continue
                    assert out is buf
                    check_reduced(as_float64(buf), inputs, op, dtype, what)
                    same_on_every_rank(group.comm, raw(buf), what)
                    served.add(algorithm)
    assert served == set(ALGORITHMS) - {"hierarchical"}  # one node here


@pytest.mark.mpi(ranks=(1, 2, 3, 4), timeout=600)
def test_the_other_primitives_match_numpy():
    group = Group(WORLD, CommConfig(check=True))
    p, r = group.size, group.rank
    for n in lengths(p):
        b = chunk_bounds(n, p)
        mine = slice(b[r], b[r + 1])
        for dtype in DTYPES if n != BIG else ("float32", "bfloat16"):
            inputs = [values(k, n, dtype, seed=1) for k in range(p)]
            for algorithm in ("auto", "shm", "ring", "native"):
                what = f"{algorithm} {dtype} n={n}"
                part = reduce_scatter(buffer(inputs[r], dtype), "sum", comm=group,
                                      algorithm=algorithm)
                check_reduced(as_float64(part), [x[mine] for x in inputs], "sum", dtype, what)
                full = buffer(inputs[r], dtype)
                allgather(full, comm=group, algorithm=algorithm)
                whole = np.concatenate([inputs[k][b[k]:b[k + 1]] for k in range(p)])
                np.testing.assert_array_equal(as_float64(full), whole, err_msg=what)
            for algorithm in ("auto", "shm", "tree", "native", "torch"):
                for root in {0, p - 1}:
                    got = broadcast(buffer(inputs[r], dtype), root, comm=group,
                                    algorithm=algorithm)
                    np.testing.assert_array_equal(as_float64(got), inputs[root])
            for algorithm in ("tree", "native"):
                root = p // 2
                got = reduce(buffer(inputs[r], dtype), "max", root, comm=group,
                             algorithm=algorithm)
                if r == root:
                    check_reduced(as_float64(got), inputs, "max", dtype, algorithm)
    # Back-to-back shared-memory allreduces: equal sizes (which may reuse the window's
    # half), a size change, and the one-synchronisation path in between.
    for step in range(40):
        n = (262_144, 262_144, 262_145, 1000)[step % 4]
        x = np.full(n, float(r + step), np.float32)
        x[step % n] += r
        allreduce(x, comm=group, algorithm="shm")
        expect = np.full(n, sum(range(p)) + p * step, np.float32)
        expect[step % n] += sum(range(p))
        np.testing.assert_array_equal(x, expect, err_msg=f"step {step}")
    # The slices path in one call, whole and piece by piece (256 KiB pieces, whatever
    # piece_bytes would choose on this machine): every op and numeric width, on lengths
    # that leave a short last piece (and, over 3 ranks, empty slices in it).
    for dtype, n in (("float32", 300_007), ("float64", 131_073), ("int32", 262_145)):
        inputs = [values(k, n, dtype, seed=2) for k in range(p)]
        for op in ("sum", "max", "min"):
            buf = buffer(inputs[r], dtype)
            allreduce(buf, op, comm=group, algorithm="shm")
            check_reduced(as_float64(buf), inputs, op, dtype, f"shm {dtype} {op} n={n}")
            same_on_every_rank(group.comm, raw(buf), f"shm {dtype} {op}")
            for piece in (buf.nbytes, 256 << 10):
                buf = buffer(inputs[r], dtype)
                allreduce_pipelined(buf, group.arena(buf.nbytes), OP_KERNEL[op], piece)
                check_reduced(as_float64(buf), inputs, op, dtype, f"{piece} B pieces {dtype} "
                              f"{op} n={n}")
                same_on_every_rank(group.comm, raw(buf), f"{piece} B pieces {dtype} {op}")
            if group.layout.single_copy:  # slices over several 256 KiB reads (float32)
                buf = buffer(inputs[r], dtype)
                allreduce_single_copy(buf, group.arena(0), OP_KERNEL[op])
                check_reduced(as_float64(buf), inputs, op, dtype, f"single copy {dtype} "
                              f"{op} n={n}")
                same_on_every_rank(group.comm, raw(buf), f"single copy {dtype} {op}")
    # The single copy with each rank late in turn (the others wait in each stage), and on
    # lengths shorter than the ranks (empty slices)
    for late in range(p if group.layout.single_copy else 0):
        for n in (p - 1, 1009):
            x = np.full(n, float(r + late), np.float32)
            if r == late:
                time.sleep(0.05)
            allreduce_single_copy(x, group.arena(0), OP_KERNEL["sum"])
            np.testing.assert_array_equal(x, np.full(n, sum(range(p)) + p * late, np.float32))
    part = np.arange(r + 2, dtype=np.int64) * (r + 1)
    whole = [np.arange(k + 2, dtype=np.int64) * (k + 1) for k in range(p)]
    gathered = gather(part, root=p - 1, comm=group)
    if r == p - 1:
        np.testing.assert_array_equal(gathered, np.concatenate(whole))
    else:
        assert gathered is None
    np.testing.assert_array_equal(allgatherv(part, comm=group), np.concatenate(whole))
    rows = np.stack([part, -part], axis=1)  # the yielding form, on 2-D rows as tiering's
    np.testing.assert_array_equal(native.allgatherv(rows, group.comm, yielding=True),
                                  np.concatenate([np.stack([w, -w], axis=1) for w in whole]))
    source = np.arange(101, dtype=np.float32) if r == 0 else None
    b = chunk_bounds(101, p)
    np.testing.assert_array_equal(scatter(source, 101, "float32", comm=group),
                                  np.arange(b[r], b[r + 1], dtype=np.float32))
    counts = np.array([(r + k) % 3 for k in range(p)])  # rows for rank k, some empty
    send = np.concatenate([np.full((c, 2), 10 * r + k) for k, c in enumerate(counts)])
    got, got_counts = alltoallv(send, counts, comm=group)
    np.testing.assert_array_equal(got_counts, [(k + r) % 3 for k in range(p)])
    np.testing.assert_array_equal(got, np.concatenate(
        [np.full(((k + r) % 3, 2), 10 * k + r) for k in range(p)]))


def small_job(tmp_path, *extra: str):
    return load_config(overrides=[
        "data.table_sizes=[50, 200, 1000, 7]", "data.train_samples=3000",
        "data.eval_samples=500", "model.embedding_dim=8", "model.bottom_mlp=[16, 8]",
        "model.top_mlp=[16, 1]", "train.progress=false", "train.batch_size=24",
        "train.steps=3", "train.optimizer=sgd", "train.lr=0.5",
        f"train.run_dir={str(tmp_path)!r}", *extra])


@pytest.mark.mpi(ranks=(2, 3), timeout=600)
def test_bucketed_gradients_equal_unbucketed_ones(tmp_path):
    """Fused buckets (resident or not, overlapped or not) give the same summed gradients
    as one allreduce per tensor, and a short training run the same parameters."""
    job = small_job(tmp_path)
    r = WORLD.Get_rank()
    variants = [dict(resident=True, overlap=True), dict(resident=False, overlap=True),
                dict(resident=True, overlap=False)]
    reference = None
    for variant in variants:
        group = Group(WORLD, CommConfig(check=True))
        torch.manual_seed(0)
        model = DLRM(job.model, 4)
        fused = FusedGradients(list(model.parameters()), group, bucket_bytes=256, extra=2,
                               **variant)
        assert len(fused.buckets) >= 3
        assert (fused.residents[0] is not None) == variant["resident"]
        rng = np.random.default_rng(r)
        dense = torch.from_numpy(rng.standard_normal((16, 13)).astype(np.float32))
        embedded = torch.from_numpy(rng.standard_normal((16, 4, 8)).astype(np.float32))
        for step in range(2):  # the second step checks that buckets rearm cleanly
            fused.zero()
            loss = model(dense, embedded).square().sum() * (step + 1)
            fused.arm([16.0, float(loss)])
            loss.backward()
            stats = fused.finish()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()]).numpy().copy()
        plain = DLRM(job.model, 4)
        plain.load_state_dict(model.state_dict())
        (plain(dense, embedded).square().sum() * 2).backward()
        expect = torch.cat([allreduce(p.grad.contiguous(), comm=group, algorithm="native")
                            .reshape(-1) for p in plain.parameters()]).numpy()
        np.testing.assert_allclose(grads, expect, rtol=1e-5, atol=1e-6, err_msg=str(variant))
        assert stats[0] == 16.0 * WORLD.Get_size()
        reference = grads if reference is None else reference
        np.testing.assert_allclose(grads, reference, rtol=1e-5, atol=1e-6)
        fused.close()
    runs = []
    for bucket_kib in (1, 100_000):
        config = small_job(tmp_path, f"comm.bucket_kib={bucket_kib}")
        trainer = Trainer(config, build_topology(config))
        trainer.fit()
        runs.append(trainer.dense_parameters())
        buckets = trainer.gradient_buckets()
        assert buckets == 1 if bucket_kib > 1000 else buckets >= 2
    np.testing.assert_allclose(runs[0], runs[1], rtol=1e-5, atol=1e-6)


@pytest.mark.mpi(ranks=(2, 3))
def test_a_tail_rides_in_the_last_bucket_of_the_first_buffer():
    """A tail of values that are not gradients (the tiered store's hot rows) is summed with
    the gradients; its bucket waits for tail_ready(); scale() and zero() leave it alone."""
    group = Group(WORLD, CommConfig(check=True))
    p, r = group.size, group.rank
    for resident, overlap in ((True, True), (False, True), (True, False)):
        params = [torch.nn.Parameter(torch.zeros(n)) for n in (300, 5, 1000, 77)]
        fused = FusedGradients(params, group, bucket_bytes=1024, extra=1, resident=resident,
                               overlap=overlap, tail=9)
        assert fused.buckets[-1].tail and len(fused.buckets) >= 2
        for step in range(2):
            fused.zero()
            fused.arm([1.0])
            sum((w * (r + 1)).sum() for w in params).backward()
            assert fused._launched < len(fused.buckets)  # the tail's bucket waits
            fused.tail.copy_(torch.arange(9, dtype=torch.float32) * (r + 1) + step)
            fused.tail_ready()
            assert fused.finish()[0] == p
            expect = np.arange(9) * p * (p + 1) / 2 + step * p
            np.testing.assert_array_equal(fused.tail.numpy(), expect)
            for w in params:
                np.testing.assert_array_equal(w.grad.numpy(), np.full(w.numel(), p * (p + 1) / 2))
            fused.scale(0.5)
            fused.zero()
            np.testing.assert_array_equal(fused.tail.numpy(), expect)
            for w in params:
                assert not w.grad.any()
        fused.close()
    with pytest.raises(CommError, match="tail travels as float32"):
        FusedGradients([torch.nn.Parameter(torch.zeros(8))], group, 1024, wire="bf16", tail=4)


@pytest.mark.mpi(ranks=(3, 4), timeout=600)
def test_hierarchical_with_a_forced_two_node_layout():
    """``comm.node_size = 2`` makes ranks {0, 1} and {2, 3} two nodes: the hierarchical
    algorithm runs its inter-node ring; three ranks make unequal nodes, where it is refused
    and the rest still works."""
    group = Group(WORLD, CommConfig(check=True, node_size=2))
    p, r = group.size, group.rank
    assert group.layout.nodes == 2 and group.layout.local_size == (2 if r < 2 else p - 2)
    uniform = p == 4
    for dtype in ("float32", "float16", "int64"):
        for n in lengths(p):
            inputs = [values(k, n, dtype, seed=2) for k in range(p)]
            for algorithm in ("auto", "hierarchical"):
                buf = buffer(inputs[r], dtype)
                if algorithm == "hierarchical" and not uniform:
                    with pytest.raises(CommError, match="two or more nodes of equal size"):
                        allreduce(buf, comm=group, algorithm=algorithm)
                    continue
                allreduce(buf, comm=group, algorithm=algorithm)
                check_reduced(as_float64(buf), inputs, "sum", dtype, f"{algorithm} n={n}")
                same_on_every_rank(group.comm, raw(buf), algorithm)
    resident = group.resident(5000)
    inputs = [values(k, 5000, "float32", seed=3) for k in range(p)]
    resident[:] = inputs[r]
    allreduce(resident[7:4007], comm=group)  # a resident slice, reduced in place
    expect = np.concatenate([inputs[r][:7], np.sum(inputs, axis=0)[7:4007], inputs[r][4007:]])
    np.testing.assert_allclose(resident, expect, rtol=1e-5, atol=1e-5)
    params = [torch.nn.Parameter(torch.zeros(n)) for n in (300, 5, 1000, 77)]
    fused = FusedGradients(params, group, bucket_bytes=1024)
    assert (fused.residents[0] is not None) == uniform
    for _ in range(2):
        fused.zero()
        fused.arm()
        sum((w * (r + 1)).sum() for w in params).backward()
        fused.finish()
        for w in params:
            np.testing.assert_array_equal(w.grad.numpy(), np.full(w.numel(), p * (p + 1) / 2))


@pytest.mark.mpi(ranks=(2,))
def test_where_ranks_outnumber_cores_a_flag_wait_leaves_the_core():
    """With ``spin=0`` (ranks outnumber cores) a rank that waits on the shared window's flags
    for a peer still busy yields briefly, then sleeps: its thread takes a small share of the
    wait's CPU, where yielding throughout took all of it (a yielding process stays
    runnable) and so slowed the peer it waited for."""
    node = WORLD.Split_type(MPI.COMM_TYPE_SHARED)
    win = Window(node, 64, spin=0)
    try:
        win.sync()
        if node.Get_rank() == 1:
            time.sleep(0.5)  # the peer is busy elsewhere
        wall, cpu = time.perf_counter(), time.thread_time()
        win.sync()
        wall, cpu = time.perf_counter() - wall, time.thread_time() - cpu
        if node.Get_rank() == 0:
            assert wall > 0.4, wall
            assert cpu < 0.2 * wall, (cpu, wall)
    finally:
        win.free()
        node.Free()


@pytest.mark.mpi(ranks=(2, 3))
def test_mismatches_raise_the_same_error_on_every_rank():
    group = Group(WORLD, CommConfig(check=True))
    r = group.rank
    cases = {
        "length": lambda: allreduce(np.ones(10 + r, np.float32), comm=group),
        "dtype": lambda: allreduce(np.ones(10, np.float32 if r else np.float64), comm=group),
        "op": lambda: allreduce(np.ones(10), "max" if r else "sum", comm=group),
        "root": lambda: broadcast(np.ones(4), root=r % 2, comm=group),
        "local": lambda: allreduce(np.ones((4, 4))[:, : 2 if r == 1 else 4], comm=group),
        "buckets": lambda: FusedGradients([torch.nn.Parameter(torch.zeros(8 + r))], group,
                                          1024),
    }
    words = {"length": ["ranks disagree", "allreduce of 10 x float32 sum",
                        "rank 1: allreduce of 11 x float32"],
             "dtype": ["rank 0: allreduce of 10 x float64", "rank 1: allreduce of 10 x float32"],
             "op": ["float64 sum", "float64 max"], "root": ["root 0", "root 1"],
             "local": ["rank 1: allreduce: numpy array of float64 of shape (4, 2) is not "
                       "contiguous"],
             "buckets": ["FusedGradients", "ranks disagree"]}
    for name, call in cases.items():
        with pytest.raises(CommError) as info:
            call()
        message = str(info.value)
        same_on_every_rank(group.comm, message.encode(), name)
        for word in words[name]:
            assert word in message, (name, message)
    x = np.full(10, r + 1.0)
    allreduce(x, comm=group)  # the group still works after the refused calls
    np.testing.assert_array_equal(x, np.full(10, sum(range(1, group.size + 1))))
    quiet = Group(WORLD, CommConfig(check=False))
    with pytest.raises(CommError, match="unknown op 'prod'"):
        allreduce(np.ones(3), "prod", comm=quiet)  # local check: before any message
    with pytest.raises(CommError, match="op 'avg' needs a floating dtype, got int32"):
        allreduce(np.ones(3, np.int32), "avg", comm=quiet)
    with pytest.raises(CommError, match=r"comm.algorithm = 'hierarchical': .*two or more"):
        allreduce(np.ones(3), comm=Group(WORLD, CommConfig(algorithm="hierarchical")))
