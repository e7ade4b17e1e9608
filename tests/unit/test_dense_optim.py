import math

import numpy as np
import pytest
import torch

from hpctrain.config import TrainConfig, load_config
from hpctrain.errors import ConfigError
from hpctrain.train import checkpointing
from hpctrain.train.optim import (
    DENSE_OPTIMIZERS,
    DenseOptimizer,
    clip_grad_norm,
    dense_table_optimizer,
    scaled_lr,
    scheduled_lr,
    sparse_optimizer,
)

REFERENCES = {
    "sgd": (torch.optim.SGD, {}, {}),
    "sgd-momentum": (torch.optim.SGD, {"momentum": 0.9, "weight_decay": 0.01},
                     {"momentum": 0.9, "weight_decay": 0.01}),
    "sgd-nesterov": (torch.optim.SGD, {"momentum": 0.8, "nesterov": True},
                     {"momentum": 0.8, "nesterov": True}),
    "adagrad": (torch.optim.Adagrad, {}, {}),
    "adam": (torch.optim.Adam, {"weight_decay": 0.01}, {"weight_decay": 0.01}),
    "adamw": (torch.optim.AdamW, {"weight_decay": 0.1, "betas": (0.8, 0.99)},
              {"weight_decay": 0.1, "betas": (0.8, 0.99)}),
}


def _models():
    torch.manual_seed(0)
    ours, theirs = torch.nn.Linear(5, 3), torch.nn.Linear(5, 3)
    theirs.load_state_dict(ours.state_dict())
    return ours, theirs


def _backward(model, x):
    model.zero_grad()
    (model(x) ** 2).sum().backward()


@pytest.mark.parametrize("name", sorted(REFERENCES))
def test_matches_torch_optim(name):
    cls, theirs_kw, ours_kw = REFERENCES[name]
    ours, theirs = _models()
    mine = DenseOptimizer(ours.parameters(), name.split("-")[0], **ours_kw)
    reference = cls(theirs.parameters(), lr=0.03, **theirs_kw)
    for _ in range(5):
        x = torch.randn(8, 5)
        for model in (ours, theirs):
            _backward(model, x)
        mine.step(lr=0.03)
        reference.step()
        for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def _numpy_lars(ws, gs, bufs, lr, mu, wd):
    for w, g, b in zip(ws, gs, bufs, strict=True):
        wn, gn = np.linalg.norm(w), np.linalg.norm(g)
        trust = wn / (gn + wd * wn) if wn > 0 and gn > 0 else 1.0
        b *= mu
        b += lr * trust * (g + wd * w)
        w -= b


def _numpy_lamb(ws, gs, ms, vs, t, lr, b1, b2, eps, wd):
    for w, g, m, v in zip(ws, gs, ms, vs, strict=True):
        m[:] = b1 * m + (1 - b1) * g
        v[:] = b2 * v + (1 - b2) * g * g
        u = (m / (1 - b1**t)) / (np.sqrt(v / (1 - b2**t)) + eps) + wd * w
        wn, un = np.linalg.norm(w), np.linalg.norm(u)
        trust = wn / un if wn > 0 and un > 0 else 1.0
        w -= lr * trust * u


@pytest.mark.parametrize("kind", ["lars", "lamb"])
def test_trust_ratio_optimizers_match_numpy(kind):
    ours, _ = _models()
    with torch.no_grad():
        ours.bias.zero_()  # a zero-norm tensor: trust ratio 1
    ws = [p.detach().double().numpy().copy() for p in ours.parameters()]
    extra = {"momentum": 0.9} if kind == "lars" else {}
    mine = DenseOptimizer(ours.parameters(), kind, weight_decay=0.01, **extra)
    ms = [np.zeros_like(w) for w in ws]
    vs = [np.zeros_like(w) for w in ws]
    for t in range(1, 6):
        _backward(ours, torch.randn(8, 5))
        gs = [p.grad.double().numpy().copy() for p in ours.parameters()]
        mine.step(lr=0.1)
        if kind == "lars":
            _numpy_lars(ws, gs, ms, 0.1, 0.9, 0.01)
        else:
            _numpy_lamb(ws, gs, ms, vs, t, 0.1, 0.9, 0.999, 1e-8, 0.01)
        for p, w in zip(ours.parameters(), ws, strict=True):
            np.testing.assert_allclose(p.detach().numpy(), w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("max_norm", [0.05, 100.0])
def test_clip_matches_torch(max_norm):
    ours, theirs = _models()
    x = torch.randn(8, 5)
    for model in (ours, theirs):
        _backward(model, x)
    norm = clip_grad_norm(list(ours.parameters()), max_norm)
    expected = torch.nn.utils.clip_grad_norm_(theirs.parameters(), max_norm)
    assert norm == pytest.approx(float(expected), rel=1e-6)
    for a, b in zip(ours.parameters(), theirs.parameters(), strict=True):
        torch.testing.assert_close(a.grad, b.grad)


@pytest.mark.parametrize("kind", ["adam", "lars", "adagrad"])
def test_state_survives_a_checkpoint(tmp_path, kind):
    """Three steps, write the dense state, read it into a fresh model and optimizer: both
    continue identically (the Adam step count and the moments are in ``state``)."""
    extra = {"momentum": 0.9} if kind == "lars" else {}
    ours, other = _models()
    with torch.no_grad():
        for p in other.parameters():
            p.add_(1.0)  # a different start, overwritten by the restore
    first = DenseOptimizer(ours.parameters(), kind, **extra)
    xs = [torch.randn(8, 5) for _ in range(5)]
    for x in xs[:3]:
        _backward(ours, x)
        first.step(0.05)
    checkpointing.write_dense(tmp_path / "dense.h5", first.params, first.state)
    second = DenseOptimizer(other.parameters(), kind, **extra)
    checkpointing.read_dense(tmp_path / "dense.h5", second.params, second.state)
    for x in xs[3:]:
        for model, opt in ((ours, first), (other, second)):
            _backward(model, x)
            opt.step(0.05)
    for a, b in zip(ours.parameters(), other.parameters(), strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_lr_scaling_rules():
    base = TrainConfig(lr=0.1, batch_size=2048, accumulate=2)
    assert scaled_lr(base) == 0.1
    linear = TrainConfig(lr=0.1, batch_size=2048, accumulate=2, lr_scaling="linear",
                         lr_base_batch=256)
    assert scaled_lr(linear) == pytest.approx(1.6)
    root = TrainConfig(lr=0.1, batch_size=2048, lr_scaling="sqrt", lr_base_batch=512)
    assert scaled_lr(root) == pytest.approx(0.2)
    warm = TrainConfig(lr=0.1, batch_size=2048, lr_scaling="linear", lr_base_batch=256,
                       warmup_steps=4)
    assert [scheduled_lr(warm, s) for s in range(5)] == pytest.approx(
        [0.2, 0.4, 0.6, 0.8, 0.8])
    assert math.isclose(scheduled_lr(TrainConfig(warmup_steps=0, lr=0.3), 0), 0.3)


def test_table_optimizer_pairs():
    pairs = {"sgd": "sgd", "lars": "sgd", "adagrad": "adagrad", "adam": "adam",
             "adamw": "adam", "lamb": "adam"}
    for dense, table in pairs.items():
        assert TrainConfig(optimizer=dense).table_optimizer == table
    assert TrainConfig(optimizer="sgd", sparse_optimizer="adam").table_optimizer == "adam"


@pytest.mark.parametrize("overrides,words", [
    (["train.optimizer='lamb'", "ps.servers=1", "ps.mode='full'"],
     ["train.optimizer", "servers"]),
    (["train.optimizer='sgd'", "train.clip_norm=1.0", "ps.servers=1", "ps.mode='full'"],
     ["train.clip_norm"]),
    (["train.optimizer='adam'", "train.momentum=0.9"], ["train.momentum"]),
    (["train.optimizer='sgd'", "train.nesterov=true"], ["train.nesterov"]),
    (["train.optimizer='sgd'", "train.eps=1e-6"], ["train.betas/train.eps"]),
    (["train.optimizer='adam'", "train.betas=[0.9]"],
     ["train.betas: expected two values", "[0.9]"]),
    (["train.lr_base_batch=256"], ["train.lr_base_batch"]),
    (["train.optimizer='lars'", "parallel.tp=2"], ["train.optimizer", "tp"]),
    (["train.clip_norm=1.0", "parallel.pp=2"], ["train.clip_norm"]),
    (["sync.dense='local:0'"], ["sync.dense", "local:H"]),
    (["train.optimizer='adam'", "train.on_nonfinite='skip'", "ps.servers=1",
      "tiering.budget=0.1"], ["train.on_nonfinite", "lazy adam"]),
    (["sync.dense='local:4'", "ps.servers=1", "ps.mode='full'", "train.optimizer='sgd'"],
     ["sync.dense", "full"]),
    (["sync.dense='local:4'", "parallel.pp=2"], ["sync.dense", "pp"]),
])
def test_optimizer_settings_a_mode_cannot_run(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides, env={})
    message = str(err.value)
    assert "\n" not in message
    for word in words:
        assert word in message


@pytest.mark.parametrize("overrides,words", [
    (["train.zero=3"], ["train.zero = 3", "not built"]),
    (["train.zero=2", "comm.wire_dtype='bf16'"], ["train.zero = 2", "float32"]),
    (["train.zero=1", "ps.servers=1", "ps.mode='full'", "train.optimizer='sgd'"],
     ["train.zero = 1", "full"]),
    (["train.zero=1", "train.optimizer='lamb'"], ["train.zero = 1", "lamb"]),
])
def test_zero_settings_not_built_are_one_line(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides, env={})
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)


@pytest.mark.parametrize("kind", ["sgd", "adagrad", "adam"])
def test_full_mode_dense_table_updates_as_the_dense_optimizer(kind):
    """The servers' per-value optimizer of full mode's dense table makes hybrid mode's dense
    update: the flattened parameters as rows, pushed once per step, as DenseOptimizer steps."""
    tc = TrainConfig(optimizer=kind)
    rows_opt = dense_table_optimizer(tc)
    assert rows_opt.state_width(4) == {"sgd": 0, "adagrad": 8, "adam": 9}[kind]
    rng = np.random.default_rng(3)
    weight = rng.normal(size=(6, 4)).astype(np.float32)
    state = rows_opt.new_state(6, 4)
    param = torch.nn.Parameter(torch.from_numpy(weight.copy()))
    ours = DenseOptimizer([param], kind, betas=tc.betas, eps=tc.eps)
    for _ in range(5):
        grads = rng.normal(size=(6, 4)).astype(np.float32)
        rows_opt.apply(weight, state, np.arange(6), grads, 0.1)
        rows_opt.end_round(state)  # one push a round: the plain update, bit for bit
        param.grad = torch.from_numpy(grads)
        ours.step(0.1)
    np.testing.assert_allclose(weight, param.detach().numpy(), rtol=1e-5, atol=1e-6)


def test_a_rounds_parts_move_adagrad_values_as_their_sum_would():
    """Three workers' pushes of one step, applied one by one under the round rule, land
    where one update of their sum lands (and where plain per-push steps would not)."""
    tc = TrainConfig(optimizer="adagrad")
    rows_opt = dense_table_optimizer(tc)
    rng = np.random.default_rng(5)
    start = rng.normal(size=(3, 4)).astype(np.float32)
    parts, summed, plain = start.copy(), start.copy(), start.copy()
    state_parts, state_sum = rows_opt.new_state(3, 4), rows_opt.new_state(3, 4)
    plain_acc = np.zeros((3, 4), np.float32)
    rows = np.arange(3)
    for _ in range(4):
        pushes = [rng.normal(size=(3, 4)).astype(np.float32) for _ in range(3)]
        for g in pushes:
            rows_opt.apply(parts, state_parts, rows, g, 0.1)
            plain_acc += g * g
            plain -= 0.1 * g / (np.sqrt(plain_acc) + 1e-10)
        rows_opt.end_round(state_parts)
        rows_opt.apply(summed, state_sum, rows, sum(pushes), 0.1)
        rows_opt.end_round(state_sum)
    np.testing.assert_allclose(parts, summed, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state_parts, state_sum, rtol=1e-5)
    assert np.abs(plain - summed).max() > 0.05
    # one part a round is the plain Adagrad update, bit for bit
    one, state = start.copy(), rows_opt.new_state(3, 4)
    g = rng.normal(size=(3, 4)).astype(np.float32)
    rows_opt.apply(one, state, rows, g, 0.1)
    lr, eps = np.float32(0.1), np.float32(1e-10)
    np.testing.assert_array_equal(one, start - lr * g / (np.sqrt(g * g) + eps))


def test_the_tables_keep_row_wise_adagrad_beside_a_per_value_dense_table():
    tc = TrainConfig(optimizer="adagrad")
    assert sparse_optimizer(tc).state_width(16) == 1
    assert dense_table_optimizer(tc).kind == "adagrad_values"
    load_config(None, ["ps.servers=1", "ps.mode='full'", "train.optimizer='adam'",
                       "train.sparse_optimizer='adagrad'"])  # one optimizer each, no refusal


@pytest.mark.parametrize("kind", DENSE_OPTIMIZERS)
def test_an_empty_shard_steps_without_a_parameter(kind):
    """A ZeRO worker whose chunk holds no element (fewer elements than workers) steps like
    the others: nothing to update, but Adam's step count, which every worker's shard
    carries, moves on."""
    empty = DenseOptimizer([], kind)
    empty.step(0.1)
    empty.step(0.1)
    if kind in ("adam", "adamw", "lamb"):
        assert float(empty.state[-1]) == 2.0
