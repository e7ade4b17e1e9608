"""ZeRO-2's buckets (:func:`hpctrain.parallel.sharded.cut`): every value in exactly one
bucket, in order; a large parameter in pieces of its own, small ones grouped into buckets of
at most 1/16 of the bucket size (all the staging buffer has to hold)."""

from hypothesis import given
from hypothesis import strategies as st

from hpctrain.parallel.sharded import cut


@given(st.lists(st.integers(1, 5000), min_size=1, max_size=30), st.integers(1, 4096))
def test_buckets_cover_each_parameter_once_and_keep_groups_small(sizes, bucket):
    buckets = cut(sizes, bucket)
    pieces = [piece for b in buckets for piece in b]
    seen = {}
    for i, a, b in pieces:  # consecutive pieces of each parameter, parameters in order
        assert a == seen.get(i, 0) and a < b
        seen[i] = b
    assert [i for i, _, _ in pieces] == sorted(i for i, _, _ in pieces)
    assert seen == dict(enumerate(sizes))
    small = max(1, bucket // 16)
    for b in buckets:
        if len(b) > 1:  # a group: whole small parameters only
            assert all(sizes[i] < small and (x, y) == (0, sizes[i]) for i, x, y in b)
            assert sum(y - x for _, x, y in b) <= small
        else:
            (i, x, y), = b
            assert y - x <= max(bucket, sizes[i] if sizes[i] < small else 0)
        for i, _, _ in b:
            if sizes[i] >= small:
                assert len(b) == 1  # a large parameter's pieces are buckets of their own


def test_the_reference_mlps_keep_a_staging_buffer_of_3_percent_of_a_half_shard():
    """dlrm_reference's dense parameters in backward order, 512 KiB buckets: ten buckets,
    and the largest group (the first bottom layer) is 7,168 values: 3.0% of the shard of
    two workers."""
    sizes = [1, 256, 256, 131072, 512, 187904, 16, 1024, 64, 16384, 256, 131072, 512, 6656]
    buckets = cut(sizes, 512 * 1024 // 4)
    assert len(buckets) == 10
    assert max(sum(y - x for _, x, y in b) for b in buckets if len(b) > 1) == 7168
