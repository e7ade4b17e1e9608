"""release_free_memory: what a phase freed leaves the resident memory (glibc)."""

import numpy as np
import pytest

from hpctrain.runtime import env


@pytest.mark.skipif(env._TRIM is None, reason="the C library has no malloc_trim")
def test_freed_heap_pages_leave_the_resident_memory():
    # 64 KiB arrays come from the heap, not from their own mappings; the last one keeps
    # the heap's top in place, so free() alone returns nothing to the system
    scratch = [np.ones(16384, np.float32) for _ in range(1024)]  # 64 MiB
    pin = np.ones(16384, np.float32)
    held = env.current_rss_bytes()
    del scratch
    freed = env.current_rss_bytes()
    env.release_free_memory()
    released = env.current_rss_bytes()
    assert freed > held - (16 << 20)  # still resident after free()
    assert released < freed - (48 << 20)  # gone after the release
    assert pin.sum() == 16384
