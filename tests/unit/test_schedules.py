"""Pipeline schedules and stage splitting as pure functions (no MPI)."""

import pytest
from hypothesis import given
from hypothesis import strategies as st
from torch import nn

from hpctrain.errors import ConfigError
from hpctrain.parallel.pipeline import micro_sizes
from hpctrain.parallel.schedules import (
    SCHEDULES,
    Action,
    bubble,
    forward_only,
    gpipe,
    ideal_bubble,
    one_f_one_b,
    peak_held,
    slot_table,
    timeline,
)
from hpctrain.parallel.stages import balanced_cuts, layers_of, split_sequential
from hpctrain.train.dense_grid import top_cuts


def names(order):
    return " ".join(map(str, order))


def rows(table):
    return [" ".join(cell or "." for cell in row) for row in table]


def test_one_f_one_b_reads_as_warm_up_steady_cool_down():
    assert names(one_f_one_b(4, 8, 0)) == \
        "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7"
    assert names(one_f_one_b(4, 8, 3)) == \
        "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7"
    assert names(one_f_one_b(4, 2, 0)) == "F0 F1 B0 B1"  # warm-up capped at m
    assert names(gpipe(2, 3, 1)) == "F0 F1 F2 B0 B1 B2"
    assert names(forward_only(3, 2, 1)) == "F0 F1"


def test_slot_tables_p3_m4():
    """Which micro-batch each stage runs in each slot, forward and backward costing 1."""
    assert rows(slot_table("1f1b", 3, 4)) == [
        "F0 F1 F2 . . B0 F3 B1 . B2 . B3",
        ". F0 F1 . B0 F2 B1 F3 B2 . B3 .",
        ". . F0 B0 F1 B1 F2 B2 F3 B3 . .",
    ]
    assert rows(slot_table("gpipe", 3, 4)) == [
        "F0 F1 F2 F3 . . . . B0 B1 B2 B3",
        ". F0 F1 F2 F3 . . B0 B1 B2 B3 .",
        ". . F0 F1 F2 F3 B0 B1 B2 B3 . .",
    ]


@given(st.sampled_from(sorted(SCHEDULES)), st.integers(1, 6), st.integers(1, 12),
       st.sampled_from([1.0, 2.0, 3.5]))
def test_equal_stages_idle_the_ideal_bubble(schedule, p, m, backward_cost):
    orders = [SCHEDULES[schedule](p, m, s) for s in range(p)]
    for order in orders:  # every micro-batch once each way, forward first
        assert sorted(map(str, order)) == sorted([f"F{i}" for i in range(m)] +
                                                 [f"B{i}" for i in range(m)])
        assert all(order.index(Action("F", i)) < order.index(Action("B", i)) for i in range(m))
    spans = timeline(orders, lambda s, a: 1.0 if a.kind == "F" else backward_cost)
    assert bubble(spans) == pytest.approx(ideal_bubble(p, m))
    held = [peak_held(order) for order in orders]
    if schedule == "gpipe":
        assert held == [m] * p
    else:
        assert held == [min(p - s, m) for s in range(p)] and max(held) <= p


def test_a_slow_stage_widens_the_bubble():
    """Stage 1 twice as slow: the makespan is 1 + 32 + 1 slots; stage 0 idles 18, stage 1 2."""
    orders = [one_f_one_b(2, 8, s) for s in range(2)]
    slow = bubble(timeline(orders, lambda s, a: 2.0 if s == 1 else 1.0))
    assert slow == pytest.approx((18 / 34 + 2 / 34) / 2)


def test_orders_that_deadlock_are_reported():
    orders = [[Action("F", 0), Action("B", 0)], [Action("B", 0), Action("F", 0)]]
    with pytest.raises(ValueError, match="deadlock"):
        timeline(orders)


def test_ideal_bubble_matches_the_background_numbers():
    assert ideal_bubble(8, 32) == pytest.approx(0.179, abs=1e-3)
    assert ideal_bubble(4, 8) == pytest.approx(0.273, abs=1e-3)


def mlp(widths):
    layers = []
    for a, b in zip(widths[:-1], widths[1:], strict=False):
        layers += [nn.Linear(a, b), nn.ReLU()]
    return nn.Sequential(*layers[:-1])


def test_stages_split_by_layer_count_or_cuts():
    model = mlp([8, 7, 6, 5, 4, 3])  # 5 layers, ReLU attached to the layer before it
    assert [len(layer) for layer in layers_of(model)] == [2, 2, 2, 2, 1]
    assert balanced_cuts(5, 2) == [3] and balanced_cuts(5, 3) == [2, 4]
    stages = split_sequential(model, 3)
    assert [[m.in_features for m in s if isinstance(m, nn.Linear)] for s in stages] == \
        [[8, 7], [6, 5], [4]]
    stages = split_sequential(model, 2, cuts=[1])
    assert stages[1][0].in_features == 7 and len(stages[0]) == 2
    with pytest.raises(ConfigError, match="cannot split 5 layers into 6"):
        split_sequential(model, 6)
    with pytest.raises(ConfigError, match=r"stage cuts \[3, 2\]"):
        split_sequential(model, 3, cuts=[3, 2])


def test_micro_batches_and_dlrm_stage_cuts():
    assert micro_sizes(10, 4) == [3, 3, 2, 2] and micro_sizes(2, 4) == [1, 1, 0, 0]
    # the features part counts as one layer: [features, t0 | t1, t2] for pp = 2
    assert top_cuts(3, 2) == [1] and top_cuts(3, 3) == [1, 2] and top_cuts(3, 4) == [0, 1, 2]
    assert top_cuts(3, 2, (2,)) == [2]
