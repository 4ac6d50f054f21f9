"""Spawning real ranks on one machine: each rank is a fresh process on gloo (CPU).

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in
``world_size`` spawned processes with the torch.distributed environment set, and returns
the per-rank results in rank order. A rank that raises makes the call raise with that
rank's traceback; a run that exceeds ``timeout`` is killed and fails the test instead of
hanging the suite.
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import traceback

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank, world_size, port, outdir, fn, args):
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_SIZE": str(world_size),
                       "OMP_NUM_THREADS": "1"})
    import time

    import torch

    started = time.monotonic()
    torch.set_num_threads(1)
    try:
        result = ("ok", fn(rank, world_size, *args))
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
    except BaseException as exc:  # report every failure to the parent, with its traceback
        result = ("error", f"rank {rank} (after {time.monotonic() - started:.1f} s): {type(exc).__name__}: {exc}\n"
                           f"{traceback.format_exc()}")
    with open(os.path.join(outdir, f"rank{rank}.pkl"), "wb") as f:
        pickle.dump(result, f)
    if result[0] == "error":
        os._exit(1)  # do not wait in a collective the others will never finish


def run_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S, stop_on_failure: bool = True):
    """``stop_on_failure=False`` lets the surviving ranks run on after one dies (tests of
    how the others notice)."""
    outdir = tempfile.mkdtemp(prefix="gift-ranks-")
    ctx = mp.get_context("spawn")
    port = free_port()
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, outdir, fn, args)) for r in range(world_size)]
    for p in procs:
        p.start()
    import time

    deadline = time.monotonic() + timeout
    errors = []
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            break
        for r, p in enumerate(procs):
            if not p.is_alive() and p.exitcode not in (0, None):
                errors.append(r)
        if errors and stop_on_failure:
            time.sleep(1.0)  # let the failing rank's report land, then stop the rest
            break
        time.sleep(0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    results, failures = [], []
    for r in range(world_size):
        path = os.path.join(outdir, f"rank{r}.pkl")
        if not os.path.exists(path):
            failures.append(f"rank {r}: no result (exit code {procs[r].exitcode}; killed after timeout or crash)")
            results.append(None)
            continue
        with open(path, "rb") as f:
            status, value = pickle.load(f)
        if status == "error":
            failures.append(value)
        results.append(value)
    if failures:
        raise RuntimeError("distributed run failed:\n" + "\n".join(failures))
    return results
