"""Communication backends: what they refuse, and the MPI watchdog."""

import subprocess
import sys

import pytest

from deepspeed_gift.comm import make_comm


def test_mpi_backend_without_mpi4py_names_the_key_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py -> ImportError
    with pytest.raises(ValueError, match=r"gift.backend: got 'mpi' but mpi4py cannot be imported.*\[mpi\]"):
        make_comm("mpi")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="gift.backend: got 'nccl'; allowed: 'torch', 'mpi'"):
        make_comm("nccl")


WATCHDOG_SCRIPT = """
import time
from deepspeed_gift.comm import MpiComm
comm = MpiComm(timeout=2.0)
with comm._deadline("all-reduce"):
    time.sleep(30)  # a peer that never answers
print("not reached")
"""


def test_mpi_watchdog_aborts_a_collective_that_waits_too_long():
    pytest.importorskip("mpi4py")
    proc = subprocess.run([sys.executable, "-c", WATCHDOG_SCRIPT], capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0
    assert "waited more than 2 s (gift.comm_timeout_s)" in proc.stderr
    assert "not reached" not in proc.stdout
