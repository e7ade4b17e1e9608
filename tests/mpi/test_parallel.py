"""Tensor, pipeline and data parallelism against the single-process model, on MPI and on
torch.distributed (gloo), in real worlds of 2, 3 and 4 ranks."""

import copy
import json
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from mpi4py import MPI
from torch import nn

from hpctrain.comm.owner import communicators
from hpctrain.config import load_config
from hpctrain.parallel.cross_entropy import parallel_cross_entropy
from hpctrain.parallel.engine import ParallelEngine
from hpctrain.parallel.groups import TorchGroup, parallel_groups
from hpctrain.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    tensor_parallel_mlp,
)
from hpctrain.parallel.mappings import own_slice
from hpctrain.parallel.pipeline import micro_sizes
from hpctrain.parallel.stages import split_sequential
from hpctrain.runtime import trace
from hpctrain.runtime.topology import shard_range
from hpctrain.runtime.world import build_topology
from hpctrain.train.trainer import Trainer

BACKENDS = ("mpi", "torch")
TOL = {"rtol": 1e-5, "atol": 1e-6}


def topology(backend, *overrides, **grid):
    config = load_config(overrides=[f"parallel.backend={backend!r}", *overrides,
                                    *(f"parallel.{k}={v}" for k, v in grid.items())])
    return build_topology(config)


def mlp(widths):
    layers = []
    for a, b in zip(widths[:-1], widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def assert_shard_grads(parallel: nn.Module, dense: nn.Module, tp_rank: int, tp: int,
                       scale: float = 1.0) -> None:
    """Every parameter of ``parallel`` holds its shard of ``dense``'s gradient (x scale)."""
    for mine, ref in zip(parallel.modules(), dense.modules(), strict=True):
        if isinstance(mine, ColumnParallelLinear):
            lo, hi = shard_range(ref.out_features, tp, tp_rank)
            expected = [ref.weight.grad[lo:hi], ref.bias.grad[lo:hi]]
        elif isinstance(mine, RowParallelLinear):
            lo, hi = shard_range(ref.in_features, tp, tp_rank)
            expected = [ref.weight.grad[:, lo:hi], ref.bias.grad]
        elif isinstance(mine, nn.Linear):
            expected = [ref.weight.grad, ref.bias.grad]
        else:
            continue
        for p, g in zip(mine.parameters(), expected, strict=True):
            torch.testing.assert_close(p.grad, g * scale, **TOL)


@pytest.mark.mpi(ranks=(2,))
def test_tensor_parallel_layers_equal_their_dense_counterparts():
    for backend in BACKENDS:
        # the job's comm settings reach the tensor axis's collectives (ring: asked for)
        topo = topology(backend, "comm.algorithm='ring'", tp=2)
        group = parallel_groups(topo.grid, communicators(topo)).tensor
        assert isinstance(group, TorchGroup) == (backend == "torch")
        if backend == "mpi":
            assert group.group.config.algorithm == "ring"
        torch.manual_seed(3)
        x = torch.randn(7, 12)

        # an MLP of two column/row blocks (odd widths: uneven shards), one allreduce each way
        dense = mlp([12, 9, 8, 5, 3])
        parallel = tensor_parallel_mlp(copy.deepcopy(dense), group)
        assert [type(m).__name__ for m in parallel][::2] == [
            "ColumnParallelLinear", "RowParallelLinear", "ColumnParallelLinear",
            "RowParallelLinear"]
        xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
        torch.testing.assert_close(parallel(xp), dense(xd), **TOL)
        dense(xd).square().sum().backward()
        parallel(xp).square().sum().backward()
        torch.testing.assert_close(xp.grad, xd.grad, **TOL)
        assert_shard_grads(parallel, dense, group.rank, 2)

        # column with gathered output, row with a whole input (scatter_to / gather_from)
        for cls, kwargs in ((ColumnParallelLinear, {"gather_output": True}),
                            (RowParallelLinear, {"input_is_parallel": False})):
            ref = nn.Linear(12, 5)
            layer = cls(12, 5, group, master=ref, **kwargs)
            xd, xp = x.clone().requires_grad_(), x.clone().requires_grad_()
            torch.testing.assert_close(layer(xp), ref(xd), **TOL)
            (ref(xd) * torch.arange(5.0)).sum().backward()
            (layer(xp) * torch.arange(5.0)).sum().backward()
            torch.testing.assert_close(xp.grad, xd.grad, **TOL)
            assert_shard_grads(nn.Sequential(layer), nn.Sequential(ref), group.rank, 2)

        # vocabulary-parallel embedding: rows split 6 / 5, foreign ids look up zeros
        table = nn.Embedding(11, 4)
        emb = VocabParallelEmbedding(11, 4, group, master=table)
        ids = torch.tensor([[0, 5, 6, 10], [10, 10, 3, 7]])
        torch.testing.assert_close(emb(ids), table(ids), **TOL)
        emb(ids).pow(3).sum().backward()
        table(ids).pow(3).sum().backward()
        torch.testing.assert_close(emb.weight.grad, table.weight.grad[emb.lo:emb.hi], **TOL)

        # cross-entropy over class-sharded logits
        logits = (10 * torch.randn(9, 11)).requires_grad_()
        target = torch.randint(0, 11, (9,))
        local = own_slice(logits.detach(), group).requires_grad_()
        lo = shard_range(11, 2, group.rank)[0]
        loss = parallel_cross_entropy(local, target, group, lo)
        ref = F.cross_entropy(logits, target, reduction="none")
        torch.testing.assert_close(loss, ref, **TOL)
        (loss * torch.arange(9.0)).sum().backward()
        (ref * torch.arange(9.0)).sum().backward()
        torch.testing.assert_close(local.grad, own_slice(logits.grad, group), **TOL)
        topo.free()


def squared_error(x, y, lo, sizes):
    """Micro-batch ``i``'s inputs and summed squared error, rows from ``lo`` on."""
    starts = lo + np.cumsum([0, *sizes[:-1]])

    def inputs(i):
        return x[starts[i]: starts[i] + sizes[i]]

    def loss(i, out):
        return (out.squeeze(1) - y[starts[i]: starts[i] + sizes[i]]).square().sum()

    return inputs, loss


GRIDS = {2: [{"pp": 2}, {"tp": 2}], 3: [{"pp": 3}], 4: [{"pp": 2}, {"tp": 2, "pp": 2}]}


@pytest.mark.mpi(ranks=(2, 3, 4))
def test_pipelines_equal_the_single_process_model(mpi_ranks):
    """pp = 2, 3 and dp = 2 x pp = 2 (and tp = 2, tp x pp): outputs and gradients of every
    stage and shard equal the single-process model's, for both schedules and backends."""
    torch.manual_seed(0)
    dense = mlp([10, 16, 12, 9, 6, 1])
    x, y, n = torch.randn(25, 10), torch.randn(25), 25
    ref_out = dense(x).squeeze(1)
    (ref_out - y).square().sum().backward()
    for grid in GRIDS[mpi_ranks]:
        for backend in BACKENDS:
            topo = topology(backend, **grid)
            d, s, t = topo.grid.coords
            shape = topo.grid.grid
            groups = parallel_groups(topo.grid, communicators(topo))
            lo, hi = shard_range(n, shape.dp, d)  # uneven replicas (13 / 12) and micro-batches
            sizes = micro_sizes(hi - lo, 4)
            inputs, loss = squared_error(x, y, lo, sizes)
            for schedule in ("gpipe", "1f1b"):
                stage = tensor_parallel_mlp(split_sequential(copy.deepcopy(dense), shape.pp)[s],
                                            groups.tensor)
                engine = ParallelEngine(stage, groups, schedule, torch.device("cpu"))
                count, total, _ = engine.backward(sizes, inputs, loss)
                assert count == n
                assert total == pytest.approx(((ref_out - y) ** 2).sum().item(), rel=1e-5)
                assert_shard_grads(stage, split_sequential(dense, shape.pp)[s], t, shape.tp,
                                   scale=1.0 / n)
                held = engine.pipeline.peak_held
                assert held == (4 if schedule == "gpipe" else min(shape.pp - s, 4))
                outputs = engine.infer(sizes, inputs)
                if engine.last:
                    torch.testing.assert_close(torch.cat(outputs).squeeze(1), ref_out[lo:hi],
                                               **TOL)
                else:
                    assert outputs == []
            topo.free()


SMALL = ["data.table_sizes=[50, 200, 1000, 7]", "data.train_samples=3000",
         "data.eval_samples=500", "model.embedding_dim=8", "model.bottom_mlp=[16, 8]",
         "model.top_mlp=[16, 12, 1]", "train.progress=false", "train.log_every=2",
         "train.optimizer=adagrad", "train.lr=0.05", "train.batch_size=26",
         "train.accumulate=2", "train.steps=4"]


GRID_JOBS = [
    ["parallel.pp=2", "parallel.dp=2", "parallel.schedule='1f1b'"],
    ["parallel.tp=2", "parallel.pp=2", "parallel.schedule='gpipe'", "parallel.backend='torch'",
     "parallel.micro_batches=3"],
]


@pytest.mark.mpi(ranks=(4,))
def test_model_parallel_trainer_follows_the_one_process_run(tmp_path):
    """DLRM trained with its dense part pipelined over a data-parallel grid (pp2 x dp2,
    1F1B, MPI) and pipelined and tensor-parallel (tp2 x pp2, GPipe, gloo) ends where one
    process ends: same tables, same loss, same held-out scores. The tp2 x pp2 run is traced:
    every rank's pipeline actions and tensor-parallel collectives are spans of its steps."""
    world = MPI.COMM_WORLD
    ref_config = load_config(overrides=[*SMALL, f"train.run_dir={str(tmp_path / 'ref')!r}"])
    if world.Get_rank() == 0:
        ref = Trainer(ref_config, build_topology(ref_config, MPI.COMM_SELF))
        ref_summary = ref.fit()
        assert not np.allclose(ref.table_rows(), Trainer(
            ref_config, build_topology(ref_config, MPI.COMM_SELF)).table_rows())
    for k, grid in enumerate(GRID_JOBS):
        run_dir = str(tmp_path / f"grid{k}")
        config = load_config(overrides=[*SMALL, *grid, f"train.run_dir={run_dir!r}"])
        topo = build_topology(config)
        traced = k == 1
        if traced:
            trace.start(str(tmp_path / "grid.json"), world, "worker")
        trainer = Trainer(config, topo)
        summary = trainer.fit()
        if traced and (path := trace.finish(world)) is not None:
            spans = [e for e in json.loads(Path(path).read_text())["traceEvents"]
                     if e["ph"] == "X"]
            for rank in range(4):
                names = {e["name"] for e in spans if e["pid"] == rank}
                assert {"step", "forward", "backward", "tensor allreduce"} <= names, names
        rows = trainer.table_rows()
        assert (rows is not None) == (topo.grid.coords[1] == 0)  # the tables on stage 0 only
        if world.Get_rank() == 0:
            np.testing.assert_allclose(rows, ref.table_rows(), rtol=1e-4, atol=1e-6)
            assert summary.samples == ref_summary.samples == 4 * 2 * 26
            assert summary.train_loss == pytest.approx(ref_summary.train_loss, rel=1e-5)
            for key in ("log_loss", "auc", "accuracy", "samples"):
                assert summary.eval[key] == pytest.approx(ref_summary.eval[key], rel=1e-5), key
        topo.free()


@pytest.mark.mpi(ranks=(2,))
def test_16_bit_pipeline_messages_halve_the_bytes_and_train_alike(tmp_path):
    """pp = 2: bf16 (MPI backend) and fp16 (gloo) activations and input gradients. Stage 0
    sends half float32's bytes (fp16: plus a 4-byte scale a message) and the model trains
    close to the float32 run, not bitwise as it (the values did travel rounded)."""
    runs = {}
    for wire, backend in (("float32", "mpi"), ("bf16", "mpi"), ("fp16", "torch")):
        config = load_config(overrides=[
            *SMALL, "parallel.pp=2", f"parallel.wire_dtype={wire!r}",
            f"parallel.backend={backend!r}", f"train.run_dir={str(tmp_path / wire)!r}"])
        topo = build_topology(config)
        trainer = Trainer(config, topo)
        runs[wire] = (trainer.fit(), trainer.dense_parameters())
        topo.free()
    (f32, p32), (bf16, pb), (fp16, ph) = runs["float32"], runs["bf16"], runs["fp16"]
    if MPI.COMM_WORLD.Get_rank() == 0:
        assert bf16.pipeline_sent_bytes * 2 == f32.pipeline_sent_bytes > 0
        assert 0 < fp16.pipeline_sent_bytes - bf16.pipeline_sent_bytes <= \
            bf16.pipeline_sent_bytes // 10
        assert (fp16.pipeline_sent_bytes - bf16.pipeline_sent_bytes) % 4 == 0
        for summary in (bf16, fp16):
            assert summary.train_loss == pytest.approx(f32.train_loss, rel=1e-2)
    for got in (pb, ph):
        assert not np.array_equal(got, p32)
        np.testing.assert_allclose(got, p32, rtol=0, atol=5e-3)
