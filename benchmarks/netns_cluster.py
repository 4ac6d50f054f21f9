r"""    sudo .venv/bin/python benchmarks/netns_cluster.py --json runs/netns/results.json

A bandwidth-limited cluster on one machine: every rank runs ``launch/pretrain.py`` in a
network namespace of its own ("host"), joined to the others through a bridge in one more
namespace ("switch"), each host's link limited by ``tc`` (token bucket: the rate each
way, as a NIC would be; optional ``netem`` delay). DeepSpeed and GIFT talk gloo over
those links. For every bandwidth x config it runs a few steps and reports the median step
time, the speedup over the first config (the bf16 baseline), and the bytes each host
actually put on its link per step (the interface's counters: payload and the headers the
veth counts, once per GSO packet; read while the job runs and cut at the step boundaries
it logs), and GIFT's own timers (time in its all-to-all, codec, transforms).

Needs root (namespaces, tc); addresses live only inside the namespaces it creates
(``--subnet``, default 10.77.0.0/24); everything is torn down on exit, on error and on
Ctrl-C. A run killed hard leaves namespaces named ``--prefix``-*: ``--cleanup`` removes
them. Smoke run (as in CI, 20 s): ``--preset tiny --steps 24 --skip 4 --repeats 1 --bandwidths
1gbit --configs ds_configs/bf16_baseline_zero2.json ds_configs/gift_fp8_zero2.json``.

What the numbers are: on this machine the ranks share the CPU cores, so compute does not
shrink with bandwidth, and the step time at a bandwidth is compute + codec + the time the
bytes take on the link (no overlap on CPU). ``benchmarks/scale_model.py`` fits its
alpha-beta model to the JSON written here and carries it to cluster scale.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.scale_model import set_gift_keys  # noqa: E402
from launch.pretrain import read_metrics  # noqa: E402
IFNAME = "gift0"  # the host side of every link (each in its own namespace, so one name serves all)
UPLINK = "uplink"  # the host link, when the ranks of a host have namespaces and in-host links of their own
DEFAULT_CONFIGS = [
    "ds_configs/bf16_baseline_zero2.json",
    "ds_configs/euclid_fp8_e4m3_block_zero2.json",
    "ds_configs/gift_fp8_zero2.json",
    "ds_configs/gift_fp8_all_zero2.json",
    "ds_configs/euclid_nvfp4_zero2.json",
    "ds_configs/gift_nvfp4_ef_zero2.json",
]
DEFAULT_BANDWIDTHS = ["100mbit", "300mbit", "1gbit", "10gbit"]
RATE_UNITS = {"kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
COUNTER_PERIOD_S = 0.02


def parse_rate(text: str) -> Optional[float]:
    """'100mbit' -> 1e8 bits/s; 'unlimited' -> None."""
    if text == "unlimited":
        return None
    m = re.fullmatch(r"(\d+(?:\.\d+)?)(kbit|mbit|gbit)", text.strip().lower())
    if not m:
        raise argparse.ArgumentTypeError(f"bandwidth {text!r}: use e.g. 100mbit, 2.5gbit, 10gbit or unlimited")
    return float(m.group(1)) * RATE_UNITS[m.group(2)]


def rate_label(bps: Optional[float]) -> str:
    if bps is None:
        return "unlimited"
    return f"{bps / 1e9:g} Gbit/s" if bps >= 1e9 else f"{bps / 1e6:g} Mbit/s"


def run_cmd(args: List[str], check: bool = True) -> subprocess.CompletedProcess:
    p = subprocess.run(args, capture_output=True, text=True)
    if check and p.returncode != 0:
        raise RuntimeError(f"`{' '.join(args)}` failed ({p.returncode}): {p.stderr.strip() or p.stdout.strip()}")
    return p


def tbf_args(bps: float) -> List[str]:
    """Token bucket for ``bps``: a bucket of ~4 ms of traffic (at least 64 KiB) so the kernel's
    timer granularity does not cap the rate, and a queue of 200 ms before drops."""
    burst = max(64 * 1024, int(bps / 8 * 0.004))
    return ["tbf", "rate", f"{int(bps)}bit", "burst", str(burst), "latency", "200ms"]


def namespaces_with_prefix(prefix: str) -> List[str]:
    out = run_cmd(["ip", "netns", "list"]).stdout
    names = [line.split()[0] for line in out.splitlines() if line.strip()]
    return [n for n in names if n.startswith(prefix + "-")]


class Cluster:
    """``hosts`` hosts (namespaces ``<prefix>-h<i>``, interface ``gift0``, address
    ``subnet``+i+1) on a bridge in ``<prefix>-switch``. Use as a context manager; ``close``
    deletes every namespace it made (their veths go with them)."""

    def __init__(self, prefix: str, hosts: int, subnet: str, ranks_per_host: int = 1, in_host: bool = False) -> None:
        net = ipaddress.ip_network(subnet)
        ends = hosts * ranks_per_host if in_host else hosts
        if net.num_addresses < ends + 2:
            raise ValueError(f"--subnet {subnet} has room for {net.num_addresses - 2} addresses, need {ends}")
        self.prefix = prefix
        self.hosts = [f"{prefix}-h{i}" for i in range(hosts)]
        self.switch = f"{prefix}-switch"
        self.prefixlen = net.prefixlen
        self.created: List[str] = []
        self.sleepers: List[subprocess.Popen] = []
        # in_host: every rank in a namespace of its own (``<prefix>-h<i>r<j>``), joined to its
        # host's bridge by a link of its own (the in-host link, NVLink's stand-in); the host's
        # namespace holds that bridge and the host link (``uplink``) to the switch
        self.in_host, self.ranks_per_host = in_host, ranks_per_host
        self.ranks = ([f"{h}r{j}" for h in self.hosts for j in range(ranks_per_host)] if in_host
                      else [h for h in self.hosts for _ in range(ranks_per_host)])
        self.addrs = [str(net.network_address + i + 1) for i in range(ends)]  # per host, or per rank (in_host)

    def rank_namespace(self, rank: int) -> str:
        return self.ranks[rank]

    def rank_addr(self, rank: int) -> str:
        return self.addrs[rank if self.in_host else rank // self.ranks_per_host]

    def __enter__(self) -> "Cluster":
        left = namespaces_with_prefix(self.prefix)
        if left:
            raise RuntimeError(f"namespaces {left} exist already (a killed run?): remove them with --cleanup "
                               f"or choose another --prefix")
        try:
            self._create()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _ns(self, name: str) -> None:
        run_cmd(["ip", "netns", "add", name])
        self.created.append(name)

    def _bridge(self, ns: str) -> None:
        run_cmd(["ip", "-n", ns, "link", "add", "br0", "type", "bridge"])
        run_cmd(["ip", "-n", ns, "link", "set", "br0", "up"])

    def _link(self, ns: str, dev: str, bridge_ns: str, port: str, addr: Optional[str]) -> None:
        """A veth from ``dev`` in ``ns`` to ``port`` on ``bridge_ns``'s bridge; ``addr`` on ``dev``
        (None: ``dev`` joins ``ns``'s own bridge)."""
        run_cmd(["ip", "link", "add", dev, "netns", ns, "type", "veth", "peer", "name", port, "netns", bridge_ns])
        run_cmd(["ip", "-n", bridge_ns, "link", "set", port, "master", "br0"])
        run_cmd(["ip", "-n", bridge_ns, "link", "set", port, "up"])
        if addr is None:
            run_cmd(["ip", "-n", ns, "link", "set", dev, "master", "br0"])
        else:
            run_cmd(["ip", "-n", ns, "addr", "add", f"{addr}/{self.prefixlen}", "dev", dev])
        run_cmd(["ip", "-n", ns, "link", "set", dev, "up"])
        run_cmd(["ip", "-n", ns, "link", "set", "lo", "up"])

    def _create(self) -> None:
        self._ns(self.switch)
        self._bridge(self.switch)
        for r, host in enumerate(self.hosts):
            self._ns(host)
            if self.in_host:
                self._bridge(host)
                self._link(host, UPLINK, self.switch, f"port{r}", None)
                for j in range(self.ranks_per_host):
                    rank = r * self.ranks_per_host + j
                    self._ns(self.ranks[rank])
                    self._link(self.ranks[rank], IFNAME, host, f"rport{j}", self.addrs[rank])
            else:
                self._link(host, IFNAME, self.switch, f"port{r}", self.addrs[r])
            # a process that lives in the namespace for the cluster's life: /proc/<pid>/net/dev
            # is then that namespace's interface table, readable from here without entering it
            # (own session: a Ctrl-C for this script must not kill it before teardown reads it)
            self.sleepers.append(subprocess.Popen(["ip", "netns", "exec", host, "sleep", "1000000"],
                                                  start_new_session=True))

    def set_link(self, bps: Optional[float], delay_ms: float, in_host_bps: Optional[float] = None) -> None:
        """Limit every host's link to ``bps`` each way (host egress on ``gift0`` or ``uplink``,
        host ingress as the switch port's egress) and add ``delay_ms`` one-way delay on host
        egress; with ranks in namespaces of their own, every rank's in-host link to ``in_host_bps``
        each way (rank egress on ``gift0``, ingress as its host-bridge port's egress)."""
        def shape(ns: str, dev: str, rate: Optional[float]) -> None:
            run_cmd(["ip", "netns", "exec", ns, "tc", "qdisc", "del", "dev", dev, "root"], check=False)
            if rate is not None:
                run_cmd(["ip", "netns", "exec", ns, "tc", "qdisc", "add", "dev", dev, "root", "handle", "1:"]
                        + tbf_args(rate))

        out = UPLINK if self.in_host else IFNAME
        for r, host in enumerate(self.hosts):
            for ns, dev in ((host, out), (self.switch, f"port{r}")):
                shape(ns, dev, bps)
            if self.in_host:
                for j in range(self.ranks_per_host):
                    shape(self.ranks[r * self.ranks_per_host + j], IFNAME, in_host_bps)
                    shape(host, f"rport{j}", in_host_bps)
            if delay_ms > 0:
                parent = ["parent", "1:1"] if bps is not None else ["root"]
                p = run_cmd(["ip", "netns", "exec", host, "tc", "qdisc", "add", "dev", out] + parent
                            + ["handle", "10:", "netem", "delay", f"{delay_ms}ms", "limit", "100000"], check=False)
                if p.returncode != 0:
                    raise RuntimeError(f"--delay-ms {delay_ms}: tc netem failed ({p.stderr.strip()}); this kernel "
                                       f"may lack sch_netem: run with --delay-ms 0")

    def counters(self) -> List[Dict[str, int]]:
        """tx/rx bytes of every host's link and its TCP retransmitted segments, now."""
        out = []
        for sleeper in self.sleepers:
            with open(f"/proc/{sleeper.pid}/net/dev") as f:
                for line in f:
                    name, _, rest = line.partition(":")
                    if name.strip() == (UPLINK if self.in_host else IFNAME):
                        v = rest.split()
                        out.append({"rx": int(v[0]), "tx": int(v[8])})
                        break
                else:
                    raise RuntimeError(f"the host link not found in /proc/{sleeper.pid}/net/dev")
            with open(f"/proc/{sleeper.pid}/net/snmp") as f:
                tcp = [line.split()[1:] for line in f if line.startswith("Tcp:")]
            out[-1]["retrans"] = int(dict(zip(tcp[0], tcp[1]))["RetransSegs"])
        return out

    def close(self) -> None:
        with signals_held():
            for s in self.sleepers:
                s.kill()
            for s in self.sleepers:
                s.wait()
            self.sleepers = []
            delete_namespaces(reversed(self.created))
            self.created = []


class signals_held:
    """Defer SIGINT/SIGTERM for the block (teardown must run to its end), then deliver them."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __enter__(self):
        self.pending, self.previous = [], {}
        if threading.current_thread() is threading.main_thread():
            for sig in self.SIGNALS:
                self.previous[sig] = signal.signal(sig, lambda num, _frame: self.pending.append(num))
        return self

    def __exit__(self, *exc) -> None:
        for sig, handler in self.previous.items():
            signal.signal(sig, handler)
        for num in self.pending[:1]:
            signal.raise_signal(num)


def delete_namespaces(names) -> List[str]:
    """Kill every process still inside each namespace, then delete it; the names that could not
    be deleted (reported, never silently kept)."""
    left = []
    for name in names:
        pids = run_cmd(["ip", "netns", "pids", name], check=False).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
        if run_cmd(["ip", "netns", "del", name], check=False).returncode != 0:
            left.append(name)
    if left:
        print(f"netns_cluster.py: could not delete namespaces {left}; remove them with --cleanup", file=sys.stderr)
    return left


class CounterSampler(threading.Thread):
    """(time, counters) every ``COUNTER_PERIOD_S`` while a job runs; a failed read stops the
    sampling and is raised again by :meth:`stop`, never papered over by interpolation."""

    def __init__(self, cluster: Cluster) -> None:
        super().__init__(daemon=True)
        self.cluster, self.samples, self.stop_event, self.error = cluster, [], threading.Event(), None

    def run(self) -> None:
        try:
            while not self.stop_event.is_set():
                self.samples.append((time.time(), self.cluster.counters()))
                time.sleep(COUNTER_PERIOD_S)
        except Exception as e:  # noqa: BLE001 - handed to the caller in stop()
            self.error = e

    def stop(self) -> None:
        self.stop_event.set()
        self.join()
        if self.error is not None:
            raise RuntimeError(f"reading the link counters failed: {self.error}") from self.error
        self.samples.append((time.time(), self.cluster.counters()))

    def at(self, t: float) -> List[Dict[str, float]]:
        """Counters at time ``t``, linearly interpolated between the samples around it."""
        s = self.samples
        if t <= s[0][0]:
            return [dict(c) for c in s[0][1]]
        for (t0, c0), (t1, c1) in zip(s, s[1:]):
            if t0 <= t <= t1:
                w = (t - t0) / max(t1 - t0, 1e-9)
                return [{k: a[k] + w * (b[k] - a[k]) for k in a} for a, b in zip(c0, c1)]
        return [dict(c) for c in s[-1][1]]


def run_job(cluster: Cluster, config: str, args, port: int, workdir: str) -> dict:
    """One config on the cluster as it is now: ``pretrain.py`` on every host, rank 0's
    metrics, link bytes over the timed steps."""
    metrics = os.path.join(workdir, f"metrics_{port}.jsonl")
    cmd = [sys.executable, str(ROOT / "launch" / "pretrain.py"), "--ds-config", config_file(config, workdir),
           "--preset", args.preset, "--steps", str(args.steps), "--eval-every", "0", "--eval-batches", "1",
           "--no-progress", "--log-every", str(10 ** 9), "--metrics", metrics, "--dist-backend", "gloo",
           "--compute-dtype", args.compute_dtype]
    if args.seq_len:
        cmd += ["--seq-len", str(args.seq_len)]
    procs, logs = [], []
    sampler = CounterSampler(cluster)
    sampler.start()
    t_start = time.time()
    try:
        for r in range(args.ranks):  # ranks r*G .. r*G+G-1 share host r // G: a node of G GPUs
            host = cluster.rank_namespace(r)
            env = dict(os.environ, RANK=str(r), WORLD_SIZE=str(args.ranks), LOCAL_RANK=str(r % args.ranks_per_host),
                       LOCAL_WORLD_SIZE=str(args.ranks_per_host), MASTER_ADDR=cluster.rank_addr(0),
                       MASTER_PORT=str(port), GLOO_SOCKET_IFNAME=IFNAME, OMP_NUM_THREADS=str(args.threads),
                       PYTHONUNBUFFERED="1")
            log = open(os.path.join(workdir, f"rank{r}_{port}.log"), "w")
            logs.append(log)
            procs.append(subprocess.Popen(["ip", "netns", "exec", host] + cmd, env=env, stdout=log,
                                          stderr=subprocess.STDOUT, cwd=str(ROOT), start_new_session=True))
        deadline = time.time() + args.timeout
        while any(p.poll() is None for p in procs):
            if time.time() > deadline or any(p.poll() not in (None, 0) for p in procs):
                break
            time.sleep(0.2)
    finally:
        with signals_held():
            running = [p for p in procs if p.poll() is None]
            for p in running:
                os.killpg(p.pid, signal.SIGKILL)
            for p in running:
                p.wait()
            for log in logs:
                log.close()
        sampler.stop()
    codes = [p.returncode for p in procs]
    if any(codes):
        # the log of a rank that failed by itself, not of one this script killed afterwards
        first = next((r for r, c in enumerate(codes) if c and c > 0), next(r for r, c in enumerate(codes) if c))
        tail = Path(workdir, f"rank{first}_{port}.log").read_text()[-3000:]
        timed_out = time.time() - t_start > args.timeout
        return {"status": "timeout" if timed_out else "failed", "returncodes": codes, "log_tail": tail}
    try:
        return job_result(metrics, sampler, args)
    except (OSError, ValueError, KeyError, IndexError) as e:  # no or broken metrics: this job, not the sweep
        return {"status": "error", "returncodes": codes,
                "log_tail": f"{type(e).__name__}: {e}\n" + Path(workdir, f"rank0_{port}.log").read_text()[-2000:]}


def job_result(metrics: str, sampler: CounterSampler, args) -> dict:
    """Step times, link bytes over the timed steps and GIFT's telemetry from rank 0's metrics."""
    m = read_metrics(metrics)
    train, end = m["train"], m["end"]
    timed = train[args.skip:]
    if not timed:
        status = (end or {}).get("status", "no end record")
        raise ValueError(f"{len(train)} steps logged ({status}), none after --skip {args.skip}")
    t0, t1 = train[args.skip - 1]["time"] if args.skip else timed[0]["time"] - timed[0]["step_time_s"], \
        timed[-1]["time"]
    c0, c1 = sampler.at(t0), sampler.at(t1)
    n = len(timed)
    tx = [(b["tx"] - a["tx"]) / n for a, b in zip(c0, c1)]
    rx = [(b["rx"] - a["rx"]) / n for a, b in zip(c0, c1)]
    retrans = [(b["retrans"] - a["retrans"]) / n for a, b in zip(c0, c1)]
    last = train[-1]
    return {
        "status": "ok" if end and end.get("status") == "ok" else (end or {}).get("status", "no end record"),
        "step_times_s": [r["step_time_s"] for r in timed],
        "tx_bytes_per_step": statistics.fmean(tx),  # mean over hosts
        "rx_bytes_per_step": statistics.fmean(rx),
        "rx_max_bytes_per_step": max(rx),  # the busiest host's link (a bucket with few owners loads theirs)
        "tcp_retransmits_per_step": statistics.fmean(retrans),
        "gift_bytes_per_elem": last.get("bytes_per_elem_run", last.get("bytes_per_elem")),
        "wire": last.get("wire"),
        "geometry_layers": last.get("geometry_layers"),
        "hierarchy": last.get("hierarchy"),
        # GIFT's gradient bytes that left the host, from its own count (rank 0's x ranks per host)
        "gift_internode_bytes_per_step": (statistics.fmean(r["bytes_internode"] for r in timed) * args.ranks_per_host
                                          if all("bytes_internode" in r for r in timed) else None),
        # the same for the compressed parameter all-gather (gift.params)
        "gift_param_internode_bytes_per_step": (
            statistics.fmean(r["params_bytes_internode"] for r in timed) * args.ranks_per_host
            if all("params_bytes_internode" in r for r in timed) else None),
        # GIFT's own split of the gradient reduction (rank 0, per step): waiting in the
        # all-to-all, encode/decode/sum, whitening and inverse
        **{f"gift_{k}": [r[k] for r in timed] for k in ("comm_s", "codec_s", "transform_s", "node_s")
           if all(k in r for r in timed)},
        "final_loss": last["loss"],
    }


def merge_repeats(runs: List[dict]) -> dict:
    """One point from the repeats of a config at a bandwidth: medians over the pooled timed
    steps of every repeat, bytes averaged, each repeat's median kept to show the spread."""
    ok = [r for r in runs if r["status"] == "ok"]
    if len(ok) < len(runs):
        bad = next(r for r in runs if r["status"] != "ok")
        return dict(bad, repeats=len(runs))
    steps = [t for r in ok for t in r["step_times_s"]]
    out = {"status": "ok", "repeats": len(ok), "median_step_s": statistics.median(steps),
           "repeat_medians_s": [statistics.median(r["step_times_s"]) for r in ok], "step_times_s": steps}
    for key in ("tx_bytes_per_step", "rx_bytes_per_step", "rx_max_bytes_per_step", "tcp_retransmits_per_step"):
        out[key] = statistics.fmean(r[key] for r in ok)
    for key in ("gift_comm_s", "gift_codec_s", "gift_transform_s", "gift_node_s"):
        if key in ok[0]:
            out[key] = statistics.median(t for r in ok for t in r[key])
    for key in ("gift_bytes_per_elem", "wire", "geometry_layers", "hierarchy", "final_loss",
                "gift_internode_bytes_per_step", "gift_param_internode_bytes_per_step"):
        out[key] = ok[-1].get(key)
    return out


def interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


def config_label(spec: str) -> str:
    """``ds_configs/gift_fp8_zero2.json:hierarchy=flat`` -> ``gift_fp8_zero2:hierarchy=flat``."""
    path, _, overrides = spec.partition(":")
    return Path(path).stem + (f":{overrides}" if overrides else "")


def config_file(spec: str, workdir: str) -> str:
    """The DeepSpeed config a ``--configs`` entry names: a file, or ``FILE:key=value,...`` - the
    file with those keys of its gift block set (dotted keys reach nested blocks; values are read
    as JSON, else as strings), written to ``workdir``."""
    path, _, overrides = spec.partition(":")
    if not overrides:
        return str(ROOT / path)
    with open(ROOT / path) as f:
        cfg = set_gift_keys(json.load(f), overrides)
    out = os.path.join(workdir, config_label(spec).replace(":", "__").replace("=", "-").replace(",", "_") + ".json")
    with open(out, "w") as f:
        json.dump(cfg, f)
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Step time of each config over bandwidth-limited links between "
                                            "network namespaces (see the module docstring).")
    p.add_argument("--ranks", type=int, default=2, help="ranks in all")
    p.add_argument("--ranks-per-host", type=int, default=1,
                   help="ranks sharing a host and its link (a node of G GPUs; they talk to each other "
                        "inside the host's namespace, off the link)")
    p.add_argument("--in-host-times", type=float,
                   help="with --ranks-per-host > 1: every rank in a namespace of its own, joined to its host's "
                        "bridge by an in-host link of this many times the host link's rate (8: NVLink against a "
                        "NIC); default: the ranks of a host share its namespace, unshaped loopback between them")
    p.add_argument("--bandwidths", nargs="+", default=DEFAULT_BANDWIDTHS,
                   help="link rate each way: 100mbit, 1gbit, ..., or unlimited")
    p.add_argument("--delay-ms", type=float, default=0.0, help="one-way netem delay on each host's egress")
    p.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS,
                   help="DeepSpeed configs, each FILE or FILE:key=value,... (gift keys set, e.g. "
                        "ds_configs/gift_fp8_all_zero2.json:hierarchy=flat); the first is the baseline of the "
                        "speedup column")
    p.add_argument("--preset", default="small", help="launch/pretrain.py --preset")
    p.add_argument("--seq-len", type=int, help="launch/pretrain.py --seq-len")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--compute-dtype", default="bf16", choices=("auto", "bf16", "fp32"),
                   help="launch/pretrain.py --compute-dtype. bf16: the links carry what the configs send on a GPU "
                        "(bf16 replicas in the parameter all-gather), also on a CPU whose bf16 matmul is slow; "
                        "auto there computes in fp32 and all-gathers fp32 replicas, 1.5x native's bytes")
    p.add_argument("--skip", type=int, default=4, help="warm-up steps left out of the timing and the bytes")
    p.add_argument("--repeats", type=int, default=2, help="runs of each config per bandwidth (interleaved); "
                                                          "the timed steps of all are pooled")
    p.add_argument("--threads", type=int, default=1, help="OMP threads per rank (the ranks share this machine)")
    p.add_argument("--timeout", type=float, default=600.0, help="seconds per job before it is killed")
    p.add_argument("--prefix", default="giftnet", help="namespace name prefix")
    p.add_argument("--subnet", default="10.77.0.0/24", help="addresses of the hosts (only inside the namespaces)")
    p.add_argument("--json", help="write the results here")
    p.add_argument("--cleanup", action="store_true", help="delete namespaces named <prefix>-* and exit")
    args = p.parse_args(argv)
    rates = [parse_rate(b) for b in args.bandwidths]
    if args.ranks < 2 or args.ranks_per_host < 1 or args.ranks % args.ranks_per_host:
        p.error(f"--ranks {args.ranks} / --ranks-per-host {args.ranks_per_host}: need >= 2 ranks, a whole "
                f"number of hosts")
    if args.skip < 0 or args.skip >= args.steps:
        p.error(f"--skip {args.skip}: must be in [0, --steps {args.steps})")
    if os.geteuid() != 0:
        raise SystemExit("netns_cluster.py needs root (ip netns, tc); run it with sudo")
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            raise SystemExit(f"netns_cluster.py needs `{tool}` (iproute2)")
    if args.cleanup:
        names = namespaces_with_prefix(args.prefix)
        left = delete_namespaces(names)
        print(f"deleted {[n for n in names if n not in left]}")
        if left:
            raise SystemExit(1)
        return {}

    # SIGTERM (a job scheduler, `timeout`) unwinds like Ctrl-C, so the finally blocks tear down
    signal.signal(signal.SIGTERM, interrupt)
    if args.repeats < 1:
        p.error(f"--repeats {args.repeats}: must be >= 1")
    if args.in_host_times is not None and (args.ranks_per_host < 2 or args.in_host_times <= 0):
        p.error(f"--in-host-times {args.in_host_times}: needs --ranks-per-host >= 2 and a rate factor > 0")
    results = {"preset": args.preset, "ranks": args.ranks, "ranks_per_host": args.ranks_per_host,
               "in_host_times": args.in_host_times,
               "steps": args.steps, "skip": args.skip,
               "repeats": args.repeats,
               "delay_ms": args.delay_ms, "threads": args.threads, "configs": [config_label(c) for c in args.configs],
               "points": []}
    workdir = tempfile.mkdtemp(prefix="gift_netns_")
    port = 29700
    try:
        run_all(args, rates, results, workdir, port)
    except RuntimeError as e:  # a namespace, link, qdisc or counter that failed (already torn down)
        results["stopped"] = str(e)
        raise SystemExit(f"netns_cluster.py: {e}") from None
    finally:  # whatever finished is kept, also after Ctrl-C
        results["params"] = read_params(workdir)
        if results["points"]:
            print_table(results)
        if args.json:
            os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
            with open(args.json, "w") as f:
                json.dump(results, f, indent=1)
            print(f"wrote {args.json}")
        shutil.rmtree(workdir, ignore_errors=True)
    failed = [f"{p['config']} at {p['bandwidth']}" for p in results["points"] if p["status"] != "ok"]
    if failed:
        raise SystemExit(f"netns_cluster.py: {len(failed)} run(s) did not finish: {', '.join(failed)}")
    return results


def run_all(args, rates, results: dict, workdir: str, port: int) -> None:
    """Every bandwidth x repeat x config on one cluster, set up and torn down here."""
    in_host = args.in_host_times is not None
    with Cluster(args.prefix, args.ranks // args.ranks_per_host, args.subnet, args.ranks_per_host,
                 in_host) as cluster:
        for bps, text in zip(rates, args.bandwidths):
            cluster.set_link(bps, args.delay_ms, bps * args.in_host_times if in_host and bps else None)
            runs: Dict[str, List[dict]] = {c: [] for c in args.configs}
            for rep in range(args.repeats):  # configs interleaved, so a slow spell of the machine hits all
                for config in args.configs:
                    port += 1
                    t = time.time()
                    res = run_job(cluster, config, args, port, workdir)
                    runs[config].append(res)
                    print(f"{rate_label(bps):>12} {config_label(config):32} #{rep + 1} " + (
                        f"{statistics.median(res['step_times_s']):.3f} s/step, "
                        f"{res['tx_bytes_per_step'] / 1e6:.2f} MB/step/host sent, {time.time() - t:.0f} s"
                        if res["status"] == "ok" else f"{res['status']}: {res.get('log_tail', '')[-500:]}"),
                        flush=True)
            for config in args.configs:
                pt = merge_repeats(runs[config])
                pt.update(config=config_label(config), bandwidth=text, bandwidth_bps=bps)
                results["points"].append(pt)


def read_params(workdir: str) -> Optional[int]:
    """Parameter count from the first job's start record that has one."""
    for name in sorted(os.listdir(workdir)):
        if name.startswith("metrics_"):
            try:
                start = read_metrics(os.path.join(workdir, name))["start"] or {}
            except (OSError, ValueError):  # a job killed mid-write: look at the next one
                continue
            if start.get("params"):
                return int(start["params"])
    return None


def print_table(results: dict) -> None:
    points = results["points"]
    base_name = results["configs"][0]
    bands = list(dict.fromkeys(pt["bandwidth"] for pt in points))
    print(f"\n{results['ranks']} ranks, {results.get('ranks_per_host', 1)} per host, preset {results['preset']} ({results['params']} params), median step time "
          f"of steps {results['skip'] + 1}..{results['steps']} of {results['repeats']} runs (in brackets: the "
          f"range of the runs' medians); speedup = {base_name} step time / this one; "
          f"MB = bytes each host's interface counted as sent per step (payload and the headers it counts); "
          f"grad MB / param MB = GIFT's own count of its gradient / compressed parameter bytes that left the "
          f"host (rank 0's x ranks per host)\n")
    head = "| config | " + " | ".join(f"{b} s/step | x | MB | grad MB | param MB" for b in bands) + " |"
    print(head)
    print("|---|" + "---:|---:|---:|---:|---:|" * len(bands))
    by = {(x["config"], x["bandwidth"]): x for x in points}
    for name in results["configs"]:
        cells = []
        for b in bands:
            pt, base = by.get((name, b)), by.get((base_name, b))
            if pt is None or pt["status"] != "ok":
                cells.append(f"{pt['status'] if pt else 'not run'} | - | - | - | -")
                continue
            sp = base["median_step_s"] / pt["median_step_s"] if base and base["status"] == "ok" else float("nan")
            reps = pt["repeat_medians_s"]
            spread = f" ({min(reps):.2f}-{max(reps):.2f})" if len(reps) > 1 else ""
            grad, param = pt.get("gift_internode_bytes_per_step"), pt.get("gift_param_internode_bytes_per_step")
            cells.append(f"{pt['median_step_s']:.3f}{spread} | {sp:.2f} | {pt['tx_bytes_per_step'] / 1e6:.2f} | "
                         + " | ".join(f"{x / 1e6:.2f}" if x is not None else "-" for x in (grad, param)))
        print(f"| {name} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    try:
        main()
    except KeyboardInterrupt as e:
        raise SystemExit(f"netns_cluster.py: interrupted ({e or 'Ctrl-C'}); namespaces torn down, "
                         f"finished points kept") from None
