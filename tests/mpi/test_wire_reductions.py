"""The 16-bit wire: the dense reduction within its error bound at 2 and 3 ranks, the same
bits on every rank, exact step statistics, half the bytes; PS payloads at half the bytes."""

import numpy as np
import pytest
import torch
from mpi4py import MPI

from hpctrain.comm import Group
from hpctrain.comm.fusion import FusedGradients
from hpctrain.comm.wire import UNIT_ROUNDOFF, fp16_scale
from hpctrain.config import CommConfig

WORLD = MPI.COMM_WORLD
SHAPES = [(300,), (17, 9), (4000,), (5,)]
EXTRA = 3


def gradient(rank: int, index: int, shape) -> np.ndarray:
    """Rank ``rank``'s gradient of tensor ``index``: magnitudes from 1e-9 to 1e5, both signs
    (fp16 without scaling would overflow and underflow)."""
    rng = np.random.default_rng([rank, index])
    mags = 10.0 ** rng.uniform(-9, 5, shape)
    return (rng.choice([-1.0, 1.0], shape) * mags).astype(np.float32)


def reduce_once(wire: str, algorithm: str) -> tuple[np.ndarray, np.ndarray, int]:
    params = [torch.nn.Parameter(torch.zeros(s)) for s in SHAPES]
    group = Group(WORLD, CommConfig(algorithm=algorithm, wire_dtype=wire, check=True))
    fused = FusedGradients(params, group, bucket_bytes=4096, extra=EXTRA, overlap=False,
                           wire=wire)
    assert len(fused.buckets) >= 2
    for i, p in enumerate(params):
        p.grad.copy_(torch.from_numpy(gradient(WORLD.Get_rank(), i, p.shape)))
    stats = fused.finish([1.0 + WORLD.Get_rank(), 1000.5, 3.0])
    grads = np.concatenate([p.grad.numpy().reshape(-1) for p in params])
    fused.close()
    return grads, stats, fused.reduced_bytes


@pytest.mark.mpi(ranks=(2, 3), timeout=300)
def test_wire_reduction_is_within_its_bound_on_every_rank():
    p = WORLD.Get_size()
    inputs = [np.concatenate([gradient(r, i, s).reshape(-1) for i, s in enumerate(SHAPES)])
              .astype(np.float64) for r in range(p)]
    exact, magnitude = np.sum(inputs, axis=0), np.sum(np.abs(inputs), axis=0)
    base, _, base_bytes = reduce_once("float32", "auto")
    np.testing.assert_allclose(base, exact, rtol=1e-5)
    for wire in ("bf16", "fp16"):
        for algorithm in ("auto", "ring"):
            grads, stats, nbytes = reduce_once(wire, algorithm)
            where = f"{wire} {algorithm} at {p} ranks"
            assert np.all(np.isfinite(grads)), where
            # fp16: plus half the subnormal spacing at the agreed scale, per rounding
            scale = fp16_scale(max(float(np.abs(x).max()) for x in inputs), p)
            floor = 2 * p * 2.0**-25 / scale if wire == "fp16" else 0.0
            bound = 2 * p * UNIT_ROUNDOFF[wire] * magnitude + floor
            worst = np.max(np.abs(grads - exact) / bound)
            assert worst <= 1.0, f"{where}: error {worst:.2f} x the bound"
            assert np.max(np.abs(grads - exact) / np.maximum(magnitude, 1e-30)) > 2.0**-24, \
                f"{where}: no rounding at all: the wire is not 16-bit"
            # the statistics are exact, and every rank holds the same bits
            np.testing.assert_array_equal(
                stats, [sum(1.0 + r for r in range(p)), p * (1000.5), 3.0 * p])
            digests = WORLD.allgather(grads.tobytes())
            assert all(d == digests[0] for d in digests), where
            ratio = nbytes / base_bytes
            assert 0.5 <= ratio < 0.51, f"{where}: bytes ratio {ratio}"


@pytest.mark.mpi(ranks=(3,), timeout=300)
def test_ps_payloads_halve_and_training_stays_close(tmp_path):
    """Two workers and one server, hybrid and full mode: with ps.wire_dtype bf16 the pulled
    rows and pushed gradients take half the bytes and the model stays close to float32's."""
    from hpctrain.config import load_config
    from hpctrain.runtime.world import build_topology
    from hpctrain.train.job import run_training

    results = {}
    for mode in ("hybrid", "full"):
        for wire in ("float32", "bf16", "fp16"):
            run_dir = str(tmp_path / f"{mode}-{wire}")
            config = load_config(overrides=[
                "ps.servers=1", f"ps.mode={mode!r}", f"ps.wire_dtype={wire!r}",
                "data.table_sizes=[50, 200, 1000, 7]", "data.train_samples=2000",
                "data.eval_samples=400", "model.embedding_dim=8", "model.bottom_mlp=[16, 8]",
                "model.top_mlp=[16, 1]", "train.progress=false", "train.optimizer='sgd'",
                "train.lr=0.3", "train.batch_size=50", "train.steps=10",
                "sync.deterministic=true", f"train.run_dir={run_dir!r}"], env={})
            summary = run_training(config, build_topology(config))
            results[mode, wire] = summary
    if WORLD.Get_rank() != 0:
        return
    for mode in ("hybrid", "full"):
        base = results[mode, "float32"]
        for wire in ("bf16", "fp16"):
            low = results[mode, wire]
            for key in ("pull_payload_bytes", "push_payload_bytes"):
                ours = sum(getattr(c, key) for c in low.ps_clients)
                theirs = sum(getattr(c, key) for c in base.ps_clients)
                assert theirs > 0 and ours / theirs == 0.5, (mode, wire, key)
            pulled = sum(c.pull_bytes_received for c in low.ps_clients) / sum(
                c.pull_bytes_received for c in base.ps_clients)
            assert pulled < 0.6, (mode, wire, pulled)
            assert abs(low.eval["log_loss"] - base.eval["log_loss"]) < 0.01 * \
                base.eval["log_loss"], (mode, wire)
