"""The main thread's blocked seconds, which the straggler injection leaves out of a
step's own work."""

import threading
import time

from mpi4py import MPI

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
