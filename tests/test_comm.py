"""Communication backends: what they refuse, and the MPI watchdog."""

import subprocess
import sys

import pytest

from deepspeed_gift.exchange.comm import make_comm


def test_mpi_backend_without_mpi4py_names_the_key_and_the_fix(monkeypatch):
    monkeypatch.setitem(sys.modules, "mpi4py", None)  # import mpi4py -> ImportError
    with pytest.raises(ValueError, match=r"gift.backend: got 'mpi' but mpi4py cannot be imported.*\[mpi\]"):
        make_comm("mpi")


def test_unknown_backend_is_refused():
    with pytest.raises(ValueError, match="gift.backend: got 'nccl'; allowed: 'torch', 'mpi'"):
        make_comm("nccl")


WATCHDOG_SCRIPT = """
import time
from deepspeed_gift.exchange.comm import MpiComm
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


def test_local_comm_exchanges_like_a_collective_and_a_failing_rank_does_not_hang():
    import torch

    from deepspeed_gift.exchange.comm import run_local

    def body(comm):
        me, world = comm.rank, comm.world_size
        sizes = [0 if dst == me else me + 1 for dst in range(world)]  # rank r sends r + 1 bytes to each other
        send = torch.full((sum(sizes),), me, dtype=torch.uint8)
        recv = comm.all_to_all_bytes(send, sizes, [0 if src == me else src + 1 for src in range(world)])
        total = comm.all_reduce_sum(torch.tensor([float(me)]))
        blobs = comm.all_gather_bytes(torch.tensor([me, me], dtype=torch.uint8))
        return recv.tolist(), float(total), [b.tolist() for b in blobs], comm.bytes_sent["payload"]

    out = run_local(3, body)
    assert out[0][0] == [1, 1, 2, 2, 2] and out[1][0] == [0, 2, 2, 2] and out[2][0] == [0, 1, 1]
    assert all(o[1] == 3.0 and o[2] == [[0, 0], [1, 1], [2, 2]] for o in out)
    assert [o[3] for o in out] == [2, 4, 6]

    def fails_on_rank_1(comm):
        if comm.rank == 1:
            raise ValueError("rank 1 broke")
        comm.all_reduce_sum(torch.zeros(1))  # the others wait here: the failure must release them

    with pytest.raises(ValueError, match="rank 1 broke"):
        run_local(3, fails_on_rank_1)
