"""ZeRO-2's buckets (:func:`hpctrain.parallel.sharded.cut`): every value in exactly one
bucket; the large parameters first, in order, in pieces of their own, then the small ones,
in order, grouped into buckets of at most 1/16 of a bucket or of a shard (all the staging
buffer has to hold)."""

from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from hpctrain.config import load_config
from hpctrain.models.dlrm import DLRM
from hpctrain.parallel.sharded import cut

ROOT = Path(__file__).resolve().parents[2]


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=30), st.integers(1, 4096),
       st.integers(1, 8))
def test_buckets_cover_each_parameter_once_and_keep_groups_small(sizes, bucket, workers):
    buckets = cut(sizes, bucket, workers)
    pieces = [piece for b in buckets for piece in b]
    seen = {}
    for i, a, b in pieces:  # consecutive pieces of each parameter, parameters in order
        assert a == seen.get(i, 0) and a < b
        seen[i] = b
    assert seen == dict(enumerate(sizes))
    small = max(1, min(bucket, sum(sizes) // workers) // 16)
    order = list(dict.fromkeys(i for i, _, _ in pieces))
    assert order == [i for i, n in enumerate(sizes) if n >= small] + \
        [i for i, n in enumerate(sizes) if n < small]
    for b in buckets:
        if len(b) > 1:  # a group: whole small parameters only
            assert all(sizes[i] < small and (x, y) == (0, sizes[i]) for i, x, y in b)
            assert sum(y - x for _, x, y in b) <= small
        else:
            (i, x, y), = b
            assert y - x <= bucket
        for i, _, _ in b:
            if sizes[i] >= small:
                assert len(b) == 1  # a large parameter's pieces are buckets of their own


@pytest.mark.parametrize(("bucket_kib", "count", "largest"), [(25600, 5, 9553), (512, 7, 2897)])
def test_the_reference_mlps_keep_a_staging_buffer_of_4_percent_of_a_half_shard(
        bucket_kib, count, largest):
    """dlrm_reference's dense parameters in backward order over two workers: at the default
    25 MiB buckets five (the four weights of at least 1/16 of a shard, then the biases and
    small layers as one group, 9,553 values: 4.0% of a worker's shard), at 512 KiB seven (the
    largest weight in two pieces, the small ones cut at 1/16 of a bucket: a group of 2,897
    values, and the first bottom layer alone, reduced from its gradient)."""
    config = load_config(ROOT / "jobs" / "configs" / "dlrm_reference.toml")
    model = DLRM(config.model, len(config.data.table_sizes))
    sizes = [p.numel() for p in reversed(list(model.parameters())) if p.requires_grad]
    buckets = cut(sizes, bucket_kib * 1024 // 4, 2)
    assert len(buckets) == count
    assert max(sum(y - x for _, x, y in b) for b in buckets if len(b) > 1) == largest
    assert largest / (sum(sizes) / 2) < 0.041
