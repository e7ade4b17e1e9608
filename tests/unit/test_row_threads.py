"""A server's row passes split over threads: chunks cover the rows once, errors surface."""

import threading

import numpy as np
import pytest

from ps.threads import RowThreads


def test_chunks_cover_every_row_once_and_only_big_passes_split():
    rows = RowThreads(3, min_rows=10)
    assert rows.chunks(0) == [(0, 0)]
    assert rows.chunks(19) == [(0, 19)]  # under two chunks' worth: one pass
    assert rows.chunks(20) == [(0, 10), (10, 20)]
    assert rows.chunks(1001) == [(0, 333), (333, 667), (667, 1001)]
    assert RowThreads(1, min_rows=1).chunks(1000) == [(0, 1000)]
    rows.close()


def test_a_split_pass_runs_its_chunks_at_once_each_on_its_own_thread():
    rows, seen, names = RowThreads(3, min_rows=4), np.zeros(100, np.int64), set()
    together = threading.Barrier(3, timeout=30)  # passes only if all three chunks run at once

    def work(lo: int, hi: int) -> None:
        together.wait()
        seen[lo:hi] += 1
        names.add(threading.current_thread().name)

    rows.run(work, 100)
    assert (seen == 1).all() and len(names) == 3
    rows.close()


@pytest.mark.parametrize("failing", [0, 50])
def test_an_error_in_any_chunk_is_raised_after_every_chunk_ended(failing):
    rows, done = RowThreads(2, min_rows=10), []

    def work(lo: int, hi: int) -> None:
        if lo == failing:
            raise ValueError(f"chunk {lo}")
        done.append(lo)

    with pytest.raises(ValueError, match=f"chunk {failing}"):
        rows.run(work, 100)
    assert done == [50 - failing]  # the other chunk ran to its end
    rows.close()
