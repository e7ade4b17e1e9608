import numpy as np
import pytest
import torch

from hpctrain.comm.wire import FP16_MAX, UNIT_ROUNDOFF, decode, encode, fp16_scale
from hpctrain.config import load_config
from hpctrain.errors import ConfigError
from ps.types import Op, decode_reply, decode_request, encode_request, encode_rows, reply_bytes


@pytest.mark.parametrize("wire", ["float32", "bf16", "fp16"])
def test_encode_decode_within_one_rounding(wire):
    rng = np.random.default_rng(0)
    x = (rng.standard_normal(1000) * 10.0 ** rng.uniform(-6, 6, 1000)).astype(np.float32)
    payload, scale = encode(x, wire)
    assert payload.nbytes == x.size * (4 if wire == "float32" else 2)
    back = decode(payload, wire, scale)
    assert back.dtype == np.float32
    err = np.abs(back.astype(np.float64) - x)
    floor = 2.0**-25 / scale if wire == "fp16" else 0.0  # fp16's subnormal spacing / 2
    assert np.all(err <= UNIT_ROUNDOFF[wire] * np.abs(x) + floor)
    if wire == "bf16":  # the same rounding as torch's
        np.testing.assert_array_equal(back, torch.from_numpy(x).bfloat16().float().numpy())


def test_fp16_scale_keeps_sums_in_range():
    for peak in (1e-9, 0.37, 3e4, 1e12):
        for terms in (1, 2, 3):
            s = fp16_scale(peak, terms)
            assert terms * peak * s <= FP16_MAX < 2 * terms * peak * s
            assert np.log2(s) == int(np.log2(s))
    assert fp16_scale(0.0) == fp16_scale(float("inf")) == fp16_scale(float("nan")) == 1.0


@pytest.mark.parametrize("wire", ["float32", "bf16", "fp16"])
def test_push_and_pull_messages_carry_the_wire(wire):
    tables, counts, ids = np.array([0, 2]), np.array([2, 1]), np.array([4, 7, 1])
    grads = np.linspace(-1e-6, 2e-6, 3 * 4, dtype=np.float32).reshape(3, 4)
    push = encode_request(Op.PUSH, 3, 9, 0, tables, counts, ids, grads, 0.5, wire)
    request = decode_request(push, dim=4)
    assert request.wire == wire and request.lr == 0.5
    np.testing.assert_allclose(request.grads, grads, rtol=UNIT_ROUNDOFF[wire], atol=1e-12)
    float_push = encode_request(Op.PUSH, 3, 9, 0, tables, counts, ids, grads, 0.5)
    size = 2 if wire != "float32" else 4
    assert float_push.nbytes - push.nbytes == grads.size * (4 - size)
    rows = np.arange(12, dtype=np.float32).reshape(3, 4) / 7
    reply = encode_rows(rows, wire)
    assert reply_bytes(reply) == reply.nbytes == 32 + rows.size * size
    np.testing.assert_allclose(decode_reply(reply, 3, 4), rows, rtol=UNIT_ROUNDOFF[wire])


@pytest.mark.parametrize("overrides,words", [
    (["comm.wire_dtype='bf16'", "comm.algorithm='native'"],
     ["comm.wire_dtype", "native", "cannot carry"]),
    (["comm.wire_dtype='fp16'", "comm.algorithm='torch'"], ["comm.wire_dtype", "torch"]),
    (["comm.wire_dtype='bf16'", "ps.servers=1", "ps.mode='full'", "train.optimizer='sgd'"],
     ["comm.wire_dtype", "ps.wire_dtype"]),
    (["ps.wire_dtype='bf16'"], ["ps.wire_dtype", "ps.servers = 0"]),
    (["comm.wire_dtype='int8'"], ["comm.wire_dtype", "'bf16'"]),
])
def test_wire_settings_that_cannot_work_are_one_line(overrides, words):
    with pytest.raises(ConfigError) as err:
        load_config(overrides=overrides, env={})
    assert "\n" not in str(err.value)
    for word in words:
        assert word in str(err.value)
