"""Spawning real ranks on one machine: each rank is a fresh process on gloo (CPU).

``run_ranks(fn, world_size, *args)`` runs ``fn(rank, world_size, *args)`` in
``world_size`` new processes with the torch.distributed environment set, and returns
the per-rank results in rank order. A rank that raises makes the call raise with that
rank's traceback; a run that exceeds ``timeout`` is killed and fails the call instead of
hanging it.

Ranks are forked from a fork server that imported torch, DeepSpeed and transformers once
(``PRELOAD``): a rank starts in milliseconds instead of the ~3 s (2 ranks on 2 cores; more
at 4-6) that a fresh interpreter spends importing them before it can build an engine. Each
rank is still a new process: no process group, engine, patch or module state of an earlier
run reaches it, and it sees the caller's environment as of the call. ``GIFT_START_METHOD=spawn``
starts every rank as a fresh interpreter instead (to check that nothing depends on the server).
"""

from __future__ import annotations

import os
import pickle
import socket
import tempfile
import time
import traceback

import torch.multiprocessing as mp

DEFAULT_TIMEOUT_S = 240
START_METHODS = ("forkserver", "spawn")
# Imported once by the fork server. Only imports: the server runs no torch op (a forked child
# must not inherit a started OpenMP pool) and builds nothing. A module that fails to import is
# skipped by the server and imported by the rank that needs it.
PRELOAD = ("torch", "deepspeed", "deepspeed.comm.torch", "deepspeed.runtime.engine",
           "deepspeed.runtime.zero.stage_1_and_2", "transformers", "transformers.models.llama.modeling_llama",
           "transformers.trainer", "accelerate", "deepspeed_gift", "launch.data", "launch.pretrain")
# After the first rank reports an error (run_ranks(stop_on_failure=False)), the others get this
# long to report theirs before they are stopped.
REPORT_GRACE_S = 1.0


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_method() -> str:
    method = os.environ.get("GIFT_START_METHOD", "forkserver")
    if method not in START_METHODS:
        raise ValueError(f"GIFT_START_METHOD: got {method!r}; allowed: {', '.join(START_METHODS)}")
    return method


def _context():
    method = start_method()
    ctx = mp.get_context(method)
    if method == "forkserver":
        ctx.set_forkserver_preload(list(PRELOAD))  # takes effect when the server first starts
    return ctx


def _entry(rank, world_size, port, outdir, environ, fn, args):
    # A forked rank inherits the server's environment (from when it started): take the caller's.
    os.environ.clear()
    os.environ.update(environ)
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_SIZE": str(world_size),
                       "OMP_NUM_THREADS": "1"})
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
    path = os.path.join(outdir, f"rank{rank}.pkl")
    with open(path + ".part", "wb") as f:
        pickle.dump(result, f)
    os.replace(path + ".part", path)  # the parent never reads half a report
    if result[0] == "error":
        os._exit(1)  # do not wait in a collective the others will never finish


def _reported_error(outdir: str, world_size: int) -> bool:
    for r in range(world_size):
        path = os.path.join(outdir, f"rank{r}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                if pickle.load(f)[0] == "error":
                    return True
    return False


def run_ranks(fn, world_size: int, *args, timeout: float = DEFAULT_TIMEOUT_S, stop_on_failure: bool = True):
    """``stop_on_failure=False`` lets the surviving ranks run on after one dies, until one of
    them reports an error of its own (tests of how the others notice); a rank that neither
    ends nor reports (it hangs) is then stopped."""
    outdir = tempfile.mkdtemp(prefix="gift-ranks-")
    ctx = _context()
    port = free_port()
    environ = dict(os.environ)
    procs = [ctx.Process(target=_entry, args=(r, world_size, port, outdir, environ, fn, args))
             for r in range(world_size)]
    for p in procs:
        p.start()
    deadline = time.monotonic() + timeout
    while any(p.is_alive() for p in procs):
        if time.monotonic() > deadline:
            break
        if stop_on_failure and any(not p.is_alive() and p.exitcode not in (0, None) for p in procs):
            time.sleep(REPORT_GRACE_S)  # let the failing rank's report land, then stop the rest
            break
        if not stop_on_failure and _reported_error(outdir, world_size):
            time.sleep(REPORT_GRACE_S)
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
