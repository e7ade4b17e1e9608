"""Named step statistics: laid out in registration order, read back by name."""

import numpy as np
import pytest

from hpctrain.train.stats import StepStats


def test_slots_are_filled_from_the_step_and_read_back_by_name():
    stats = StepStats()
    seen = []
    stats.add("samples", lambda step: [step["count"]])
    stats.add("hot", lambda step: step["hot"], size=3, then=seen.append)
    stats.add("loss", lambda step: [step["loss"]])
    assert stats.size == 5
    values = stats.values({"count": 4, "hot": [0, 2, 0], "loss": 1.5})
    assert values == [4, 0, 2, 0, 1.5]
    sums = stats.read(np.array(values) * 2)  # as if summed over two identical workers
    assert sums["samples"] == 8 and sums["loss"] == 3.0
    np.testing.assert_array_equal(sums.vector("hot"), [0, 4, 0])
    np.testing.assert_array_equal(seen[0], [0, 4, 0])


def test_a_name_twice_or_a_wrong_count_is_an_error():
    stats = StepStats()
    stats.add("flag", lambda step: [step])
    with pytest.raises(ValueError, match="registered twice"):
        stats.add("flag", lambda step: [step])
    stats.add("pair", lambda step: [step], size=2)
    with pytest.raises(ValueError, match="'pair': 1 values, expected 2"):
        stats.values(1.0)
