"""The main thread's blocked seconds, which the straggler injection leaves out of a
step's own work; each waiting thread's slot on the watchdog's board."""

import threading
import time

import numpy as np
from mpi4py import MPI

from hpctrain.runtime import waiting as board
from hpctrain.runtime import watchdog
from hpctrain.runtime.waits import Wait, wait_all, waited_s, waiting


def test_waits_on_the_main_thread_are_counted_and_others_are_not():
    before = waited_s()
    with waiting(Wait("pull", MPI.COMM_SELF)):
        time.sleep(0.05)
    wait_all([MPI.COMM_SELF.Ibarrier()], Wait("barrier", MPI.COMM_SELF))
    on_main = waited_s() - before
    assert on_main >= 0.05

    def helper() -> None:
        with waiting(Wait("pull", MPI.COMM_SELF)):
            time.sleep(0.05)

    thread = threading.Thread(target=helper)
    thread.start()
    thread.join()
    assert waited_s() - before == on_main


def test_the_main_comm_and_retiering_threads_publish_their_waits_side_by_side():
    """The comm thread and the tiered store's planning thread can wait at the same time
    (a bucket's allreduce while the count merge runs): each has a slot of its own, so the
    watchdog sees both waits, with their ops and communicators."""
    entry = np.zeros(board.FIELDS, dtype=np.int64)
    board.attach(entry)
    inside, leave = threading.Barrier(3), threading.Event()

    def wait_in(op: str) -> None:
        with board.watching(op, MPI.COMM_SELF):
            inside.wait()
            leave.wait()

    threads = [threading.Thread(target=wait_in, args=("allreduce",), name="hpctrain-comm_0"),
               threading.Thread(target=wait_in, args=("allgather",),
                                name=f"{board.RETIER_THREAD}_0")]
    try:
        with board.watching("push", MPI.COMM_SELF):
            for thread in threads:
                thread.start()
            inside.wait()
            ops = [None if w is None else w.op for w in board.active()]
            published = [entry[board.HEAD + s * board.SLOT_FIELDS: board.HEAD
                               + (s + 1) * board.SLOT_FIELDS].copy() for s in range(board.SLOTS)]
            leave.set()
        for thread in threads:
            thread.join()
    finally:
        board.attach(None)
    assert ops == ["push", "allreduce", "allgather"]
    assert [int(s[0]) for s in published] == [1, 1, 1]
    assert [board.OPS[s[1]] for s in published] == ops


def test_a_wait_on_computing_peers_gets_four_times_the_abort_limit(monkeypatch):
    """Past ``watchdog_abort_s`` a wait whose missing peers are all alive and computing (a
    first step's compilation) is let run to four times the limit; one whose peers wait
    elsewhere or have stopped is ended at the limit. The board's read of the peers is
    replaced by the verdict under test, and the abort by a note."""
    assert watchdog.COMPUTING_FACTOR == 4
    dog = watchdog.Board.__new__(watchdog.Board)  # no window: nothing here reads peers
    dog.warn_s, dog.abort_s = 0.0, 2.0
    verdict, aborted = [False, False], []  # dead, computing
    monkeypatch.setattr(dog, "stalled", lambda wait, waited: ("msg", *verdict))
    monkeypatch.setattr(dog, "abort", aborted.append)

    def ends(waited: float, dead: bool, computing: bool, idle: bool = False) -> bool:
        verdict[:] = [dead, computing]
        aborted.clear()
        with board.watching("allreduce", MPI.COMM_SELF, idle=idle) as wait:
            wait.start, wait.looked = time.monotonic() - waited, 0.0
            dog.check()
        return aborted == ["msg"]

    board.attach(np.zeros(board.FIELDS, dtype=np.int64))
    try:
        assert not ends(1.9, dead=False, computing=False)  # within the limit
        assert ends(2.1, dead=False, computing=False)  # a peer waiting in another call
        assert ends(2.1, dead=True, computing=False)  # a peer stopped
        assert not ends(2.1, dead=False, computing=True)
        assert not ends(7.9, dead=False, computing=True)
        assert ends(8.1, dead=False, computing=True)
        assert not ends(100.0, dead=False, computing=True, idle=True)  # a server's wait
        assert ends(2.1, dead=True, computing=False, idle=True)
    finally:
        board.attach(None)
