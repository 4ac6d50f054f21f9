"""``launch.spawn.run_ranks``: ranks fork from a server that imported the heavy modules once,
yet each run is a new set of processes that sees the caller's environment and nothing an
earlier run left behind; a rank that hangs after another failed does not hold the call."""

import os
import sys
import time

import pytest

from launch import spawn
from launch.spawn import run_ranks


def _look(rank, world, mark):
    import launch.pretrain

    seen = {"env": os.environ.get("GIFT_SPAWN_PROBE"), "rank_env": (os.environ["RANK"], os.environ["WORLD_SIZE"]),
            "left_behind": getattr(launch.pretrain, "_spawn_probe", None), "pid": os.getpid()}
    launch.pretrain._spawn_probe = mark  # a module global a later run must not see
    return seen


def _preloaded(rank, world):
    return sorted(name for name in spawn.PRELOAD if name not in sys.modules)


def test_each_run_is_new_processes_with_the_callers_environment(monkeypatch):
    monkeypatch.setenv("GIFT_SPAWN_PROBE", "first")
    first = run_ranks(_look, 2, "run 1")
    monkeypatch.setenv("GIFT_SPAWN_PROBE", "second")  # changed after the fork server started
    second = run_ranks(_look, 2, "run 2")
    assert [r["env"] for r in first] == ["first"] * 2 and [r["env"] for r in second] == ["second"] * 2
    assert [r["rank_env"] for r in second] == [("0", "2"), ("1", "2")]
    assert all(r["left_behind"] is None for r in first + second)
    assert len({r["pid"] for r in first + second}) == 4


@pytest.mark.skipif(spawn.start_method() != "forkserver", reason="GIFT_START_METHOD=spawn: fresh interpreters")
def test_ranks_start_with_the_heavy_modules_already_imported():
    # If the server's preload broke, every rank would import torch, DeepSpeed and transformers
    # itself again: the suite would still pass, only ~3 s slower per run; this says so.
    assert run_ranks(_preloaded, 2) == [[], []]


def _fail_or_hang(rank, world):
    if rank == 0:
        time.sleep(0.5)
        raise RuntimeError("rank 0 saw its peer go quiet")
    time.sleep(10**6)


def test_a_hung_rank_is_stopped_once_another_reports_its_error():
    started = time.monotonic()
    with pytest.raises(RuntimeError, match="rank 0 saw its peer go quiet") as info:
        run_ranks(_fail_or_hang, 2, timeout=60, stop_on_failure=False)
    assert time.monotonic() - started < 15  # not the 60 s timeout
    assert "rank 1: no result" in str(info.value)


def test_an_unknown_start_method_is_refused(monkeypatch):
    monkeypatch.setenv("GIFT_START_METHOD", "fork")
    with pytest.raises(ValueError, match="GIFT_START_METHOD: got 'fork'; allowed: forkserver, spawn"):
        run_ranks(_preloaded, 1)
