"""A command whose stdout's reader leaves (``hpctrain ... | head``) ends quietly; any other
broken pipe is still a bug, with its traceback."""

import subprocess
import sys

from hpctrain.runtime.abort import BROKEN_PIPE

PRINTS_FOREVER = """
from hpctrain.runtime.abort import run_guarded
def body():
    while True:
        print("x" * 1000)
run_guarded(body)
"""

RAISES = """
from hpctrain.runtime.abort import run_guarded
def body():
    print("a line")
    raise BrokenPipeError(32, "Broken pipe (a socket, not stdout)")
run_guarded(body)
"""


def test_a_reader_that_leaves_ends_the_command_quietly():
    proc = subprocess.Popen([sys.executable, "-c", PRINTS_FOREVER], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE)
    assert proc.stdout.readline() == b"x" * 1000 + b"\n"
    proc.stdout.close()  # as head does after its lines
    _, err = proc.communicate(timeout=120)
    assert (proc.returncode, err) == (BROKEN_PIPE, b"")


def test_a_broken_pipe_elsewhere_still_aborts_with_its_traceback():
    run = subprocess.run([sys.executable, "-c", RAISES], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 1 and run.stdout == "a line\n"
    assert "rank 0 failed, aborting the job" in run.stderr
    assert "BrokenPipeError: [Errno 32] Broken pipe (a socket, not stdout)" in run.stderr
