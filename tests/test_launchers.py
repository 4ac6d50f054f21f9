"""Real launchers: ``mpirun`` with the mpi4py backend, ``deepspeed --hostfile`` (pdsh-free,
single machine) and the deepspeed launcher's openmpi mode. Each run is bounded by a
timeout so a hang fails the test instead of the suite."""

import json
import os
import shutil
import subprocess
import sys

import pytest

from launch.spawn import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
LAUNCH_TIMEOUT_S = 300
SPEC = {"stage": 2, "steps": 3, "bucket": 20000,
        "gift": {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 8, "refresh_interval": 2},
                 "telemetry": {"every": 1}}}


def _env():
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"})
    return env


def _run(cmd, out_dir, world):
    proc = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=LAUNCH_TIMEOUT_S)
    assert proc.returncode == 0, f"{' '.join(cmd)}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    results = []
    for r in range(world):
        with open(os.path.join(out_dir, f"rank{r}.json")) as f:
            results.append(json.load(f))
    return results


def _check(results, world):
    assert [r["rank"] for r in results] == list(range(world))
    assert all(r["world_size"] == world for r in results)
    first = results[0]
    assert first["gift"] and len(first["records"]) == 3
    assert max(rec["fidelity_rel_err"] for rec in first["records"]) < 0.0625
    for r in results:  # ZeRO all-gathers the updated parameters: every rank holds the same model
        assert r["param_sum"] == first["param_sum"] and r["digests"] == first["digests"]
        assert r["whitener_digest"] == first["whitener_digest"]


def _mpirun():
    path = shutil.which("mpirun", path=BIN + os.pathsep + os.environ.get("PATH", ""))
    if path is None:
        pytest.skip("mpirun not installed (pip install 'deepspeed-gift[mpi]')")
    return path


def test_mpirun_with_mpi_backend(tmp_path):
    spec = json.loads(json.dumps(SPEC))
    spec["gift"]["backend"] = "mpi"
    cmd = [_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", "2", "--mca", "btl_tcp_if_include", "lo",
           sys.executable, "tests/launched.py", "--spec", json.dumps(spec), "--out", str(tmp_path)]
    results = _run(cmd, str(tmp_path), 2)
    _check(results, 2)
    assert all(r["backend"] == "mpi" for r in results)


def test_mpirun_two_level_with_mpi_backend(tmp_path):
    # 4 ranks posing as 2 nodes x 2: MPI communicators split by node and by slot, for the
    # gradients and for the compressed parameter all-gather
    spec = json.loads(json.dumps(SPEC))
    # buckets cut into pieces: their node stages are MPI's non-blocking all-to-alls under way beside
    # the exchange among the nodes
    spec["gift"].update(backend="mpi", hierarchy="two_level", ranks_per_node=2, params={"format": "nvfp4"},
                        node_pieces=3, node_piece_min_elements=1000)
    # --map-by slot: Open MPI's default mapping numbers local ranks out of rank order at 4 ranks on 2
    # cores, which DeepSpeed's MPI discovery rejects (LOCAL_RANK != OMPI_COMM_WORLD_LOCAL_RANK)
    cmd = [_mpirun(), "--allow-run-as-root", "--oversubscribe", "--map-by", "slot", "-np", "4",
           "--mca", "btl_tcp_if_include", "lo",
           sys.executable, "tests/launched.py", "--spec", json.dumps(spec), "--out", str(tmp_path)]
    results = _run(cmd, str(tmp_path), 4)
    _check(results, 4)
    assert all(r["backend"] == "mpi" for r in results)
    assert all(rec["hierarchy"] == "two_level" and rec["bytes_node"] > 0 for rec in results[0]["records"])
    assert all(rec["pieces"] >= 3 for r in results for rec in r["records"])
    # nvfp4 deltas: 4.5 bits + headers per element. Two-level: a rank sends its blob to the other
    # node once, then both nodes' blobs to its node peer: 1 of the 3 blobs leaves the node.
    assert all(0.55 < rec["params_bytes_per_elem"] < 0.6 and rec["params_bytes"] == 3 * rec["params_bytes_internode"]
               for rec in results[0]["records"])


def test_mpirun_with_mpi_backend_over_one_data_parallel_group_of_two(tmp_path):
    # DP = 2 x TP = 2 under mpirun (the harness's mpu): GIFT's MPI communicators are cut out of
    # COMM_WORLD per data-parallel group ({0, 2}, {1, 3}), and two-level splits each again (nodes of
    # one rank); each group's ranks end with the same model, the groups (other data) with others
    spec = json.loads(json.dumps(SPEC))
    spec.update(tp=2)
    spec["gift"].update(backend="mpi", hierarchy="two_level", ranks_per_node=1, comm_timeout_s=120)
    cmd = [_mpirun(), "--allow-run-as-root", "--oversubscribe", "--map-by", "slot", "-np", "4",
           "--mca", "btl_tcp_if_include", "lo",
           sys.executable, "tests/launched.py", "--spec", json.dumps(spec), "--out", str(tmp_path)]
    results = _run(cmd, str(tmp_path), 4)
    assert all(r["backend"] == "mpi" and len(r["records"]) == 3 for r in results)
    assert all(rec["hierarchy"] == "two_level" for r in results for rec in r["records"])
    for group in ((0, 2), (1, 3)):
        a, b = (results[r] for r in group)
        assert a["digests"] == b["digests"] and a["losses"] != b["losses"]  # one model, each rank its data
    assert results[0]["digests"] != results[1]["digests"]


def test_deepspeed_launcher_with_hostfile(tmp_path):
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--no_ssh",
           "--node_rank", "0", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "tests/launched.py", "--spec", json.dumps(SPEC), "--out", str(tmp_path)]
    _check(_run(cmd, str(tmp_path), 2), 2)


def test_deepspeed_openmpi_launcher(tmp_path):
    _mpirun()
    hostfile = tmp_path / "hostfile"
    hostfile.write_text("localhost slots=2\n")
    cmd = [sys.executable, "-m", "deepspeed.launcher.runner", "--hostfile", str(hostfile), "--launcher", "openmpi",
           "--force_multi", "--no_ssh_check", "--launcher_args", "--allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo",
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
           "tests/launched.py", "--spec", json.dumps(SPEC), "--out", str(tmp_path)]
    _check(_run(cmd, str(tmp_path), 2), 2)
