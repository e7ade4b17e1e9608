"""release_free_memory: what a phase freed leaves the resident memory; share_one_heap: a
thread started after it takes no heap of its own (glibc)."""

import subprocess
import sys

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


THREAD_THEN_HEAPS = """
import ctypes, sys, threading
import numpy as np
from hpctrain.runtime import env
if sys.argv[1] == "share":
    env.share_one_heap()
held = []  # 64 KiB arrays come from a heap, not from mappings of their own
worker = threading.Thread(target=lambda: held.extend(np.ones(16384, np.float32)
                                                     for _ in range(64)))
worker.start()
worker.join()
ctypes.CDLL(None).malloc_stats()  # one "Arena N:" block per heap, on stderr
"""


@pytest.mark.skipif(env._MALLOPT is None, reason="the C library has no mallopt")
def test_a_thread_started_after_share_one_heap_takes_no_heap_of_its_own():
    def heaps(mode: str) -> int:
        run = subprocess.run([sys.executable, "-c", THREAD_THEN_HEAPS, mode],
                             capture_output=True, text=True, check=True)
        return sum(line.startswith("Arena ") for line in run.stderr.splitlines())

    assert heaps("share") == heaps("own") - 1
