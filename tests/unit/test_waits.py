"""The main thread's blocked seconds, which the straggler injection leaves out of a
step's own work; each waiting thread's slot on the watchdog's board."""

import threading
import time

import numpy as np
from mpi4py import MPI

from hpctrain.runtime import waiting as board
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
