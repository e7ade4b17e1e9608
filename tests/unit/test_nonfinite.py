"""Finding NaN and Inf in a step, naming them, and the one-worker verdicts (one process here;
the agreement across ranks is tested in tests/mpi/test_bad_input.py)."""

import logging
import math

import numpy as np
import pytest
import torch
from mpi4py import MPI
from poisoned import Poisoned

from embeddings.collection import Lookup
from embeddings.tables import TableLayout
from hpctrain.config import load_config
from hpctrain.data import open_dataset
from hpctrain.data.types import Batch
from hpctrain.errors import NonFiniteError
from hpctrain.runtime.abort import _ranks
from hpctrain.runtime.world import build_topology
from hpctrain.train.nonfinite import NonFiniteGuard, finite_samples
from hpctrain.train.report import Summary, format_summary
from hpctrain.train.trainer import Trainer

LAYOUT = TableLayout.from_sizes([10, 20], dim=2)


def test_features_name_sample_and_feature():
    guard = NonFiniteGuard("stop", None)
    dense = np.zeros((4, 13), np.float32)
    guard.features(dense, 100)
    assert guard.finding is None and guard.flag == 0.0
    dense[2, 6], dense[3, 0] = np.inf, np.nan
    guard.features(dense, 100)
    assert guard.finding == "dense features: train sample 102, I7 = inf" and guard.flag == 1.0
    guard.loss(float("nan"))  # the first finding is kept
    assert guard.finding.startswith("dense features")


def test_loss_and_dense_gradients():
    guard = NonFiniteGuard("stop", None)
    guard.loss(12.5)
    assert guard.finding is None
    guard.loss(float("inf"))
    assert guard.finding == "loss = inf"

    model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    guard = NonFiniteGuard("stop", None)
    guard.gradients(model.named_parameters())
    assert guard.finding is None
    model[1].weight.grad[0, 1] = float("nan")
    guard.gradients(model.named_parameters())
    assert guard.finding == "gradient of 1.weight"


def test_embedding_gradients_name_table_and_row():
    guard = NonFiniteGuard("skip", None)
    values = torch.zeros(3, 2, requires_grad=True)
    values.grad = torch.zeros(3, 2)
    lookup = Lookup(np.array([4, 12, 25]), values)  # t0 row 4, t1 rows 2 and 15
    guard.embedding_gradients([lookup], LAYOUT)
    assert guard.finding is None
    values.grad[:, 0] = 3e38  # finite, though their sum overflows
    guard.embedding_gradients([lookup], LAYOUT)
    assert guard.finding is None
    values.grad[2, 1] = -float("inf")
    guard.embedding_gradients([Lookup(np.array([1]), torch.zeros(1, 2)), lookup], LAYOUT)
    assert guard.finding == "embedding gradient of table 't1', row 15"

    guard.finding = None  # after a verdict: this worker's rows alone are dropped, or it stops
    assert guard.embedding_share(3, [lookup], LAYOUT) is False and guard.finding is None
    with pytest.raises(NonFiniteError, match="step 3: non-finite embedding gradient of table"):
        NonFiniteGuard("stop", None).embedding_share(3, [lookup], LAYOUT)
    values.grad[2, 1] = 0.0
    assert guard.embedding_share(4, [lookup], LAYOUT) is True


def test_verdicts_of_one_worker():
    skip = NonFiniteGuard("skip", None)
    assert skip.settle(0, 0.0) is False and skip.skipped == 0
    skip.loss(math.nan)
    assert skip.settle(1, skip.flag) is True and skip.skipped == 1
    assert skip.finding is None  # each step starts clean
    assert skip.settle(2, 3.0) is True and skip.skipped == 2  # flagged by other workers

    stop = NonFiniteGuard("stop", None)
    stop.loss(math.nan)
    with pytest.raises(NonFiniteError,
                       match=r'^step 7: non-finite loss = nan; set train.on_nonfinite = "skip"'):
        stop.settle(7, stop.flag)
    with pytest.raises(ValueError, match="on_nonfinite"):
        NonFiniteGuard("ignore", None)


def test_finite_samples_leaves_out_bad_rows():
    dense = np.ones((5, 13), np.float32)
    dense[1, 2], dense[4, 12] = np.nan, -np.inf
    batch = Batch(dense, np.arange(10).reshape(5, 2), np.arange(5, dtype=np.float32))
    kept, dropped = finite_samples(batch)
    assert dropped == 2 and kept.labels.tolist() == [0, 2, 3]
    assert kept.sparse.tolist() == [[0, 1], [4, 5], [6, 7]]
    same, none = finite_samples(kept)
    assert same is kept and none == 0


def test_evaluation_leaves_out_nonfinite_samples_with_a_warning(tmp_path, caplog):
    """Held-out samples with NaN/Inf features are left out of the metrics and the evaluation
    says how many (one worker over COMM_SELF; no watchdog)."""
    config = load_config(overrides=[
        "data.table_sizes=[50, 200, 7]", "data.train_samples=100", "data.eval_samples=40",
        "train.eval_batch_size=16", "model.embedding_dim=4", "model.bottom_mlp=[8, 4]",
        "model.top_mlp=[8, 1]", "train.progress=false",
        f"train.run_dir={str(tmp_path / 'run')!r}"], env={})
    data = Poisoned(open_dataset(config.data), {3, 17, 30})
    trainer = Trainer(config, build_topology(config, MPI.COMM_SELF), data)
    with caplog.at_level(logging.WARNING, logger="hpctrain.train.trainer"):
        assert trainer.evaluate()["samples"] == 37
        data.samples = set()
        assert trainer.evaluate()["samples"] == 40
    warnings = [r.getMessage() for r in caplog.records if r.name == "hpctrain.train.trainer"]
    assert warnings == ["evaluation left out 3 samples with non-finite dense features"]


def test_rank_lists():
    assert _ranks([3]) == "rank 3"
    assert _ranks([0, 1, 2, 5, 7, 8]) == "ranks 0-2, 5, 7-8"


def test_the_final_table_shows_skipped_steps():
    summary = Summary(peak_rss_mb=[1.0, 1.0], skipped_steps=[2, 0])
    assert "skipped steps (NaN/Inf)  2, 0 (per worker)" in format_summary(summary, 2)
    assert "skipped steps" not in format_summary(Summary(peak_rss_mb=[1.0]), 1)


def test_checkpoint_writes_are_seconds_beside_the_run_clock_not_a_share_of_it():
    """The run's clock leaves checkpoint writes out, so a share of it added up past 100%."""
    summary = Summary(peak_rss_mb=[1.0], wall_s=10.0,
                      phase_s={"data": 1.0, "compute": 9.0, "checkpoint": 4.4})
    assert "data 10%  compute 90%  (and 4.4 s writing checkpoints)" in format_summary(summary, 1)
