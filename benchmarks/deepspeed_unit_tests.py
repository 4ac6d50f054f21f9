""".venv/bin/python benchmarks/deepspeed_unit_tests.py --tests DEEPSPEED/tests/unit --files v1/zero/test_zero.py v1/moe/test_moe.py v1/half_precision/test_bf16.py runtime/zero/test_zero_grad_clip.py checkpoint/test_zero_optimizer.py -k "not Zero3" --json runs/deepspeed_unit_tests.json

DeepSpeed's own unit tests, run twice on CPU ranks (``DS_ACCELERATOR=cpu``, gloo): natively, and
with ``-p benchmarks.inject_gift``, which gives every ZeRO stage 1/2/3 engine the tests build a
lossless GIFT block (fp32, identity geometry, all layers). Prints the outcome counts of each mode,
every test whose outcome differs, and the injection log's counts (engines attached, refused by
GIFT with each message, built natively because of their stage).

``--tests`` is a DeepSpeed ``tests/unit`` directory (``DEEPSPEED``: a checkout of DeepSpeed's
repository) of the installed version's era (its parent,
with ``conftest.py`` and ``pytest.ini``, is where pytest runs); ``--files`` are paths under it.
``--ranks`` (``LOCAL_SIZE``, default 4) is how many CPU devices DeepSpeed reports, so tests of
world size up to it run instead of skipping. ``--modes`` runs one mode only; ``-k`` is handed to pytest in both modes.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def outcomes(junit_path):
    """node id -> (outcome, first lines of its message) from a pytest junit xml."""
    result = {}
    if not os.path.exists(junit_path):
        return result
    root = ET.parse(junit_path).getroot()
    for case in root.iter("testcase"):
        classname, name = case.get("classname", ""), case.get("name", "")
        node = f"{classname}::{name}"
        outcome, message = "passed", ""
        for tag in ("failure", "error", "skipped"):
            el = case.find(tag)
            if el is not None:
                outcome = {"failure": "failed", "error": "error", "skipped": "skipped"}[tag]
                if tag == "skipped" and el.get("type") == "pytest.xfail":
                    outcome = "xfailed"
                message = (el.get("message") or "") + "\n" + (el.text or "")
                break
        if outcome == "passed" and case.find("properties") is not None:
            pass
        if node in result and result[node][0] != "passed" and outcome == "passed":
            continue  # a teardown error is reported as a second testcase entry
        result[node] = (outcome, "\n".join(line for line in message.strip().splitlines()[:6]))
    return result


def run_mode(mode, args, workdir):
    junit = os.path.join(args.out_dir, f"junit_{mode}.xml")
    log = os.path.join(args.out_dir, f"inject_{mode}.jsonl")
    for path in (junit, log, log + ".current"):
        if os.path.exists(path):
            os.remove(path)
    env = dict(os.environ)
    env.setdefault("DS_ACCELERATOR", "cpu")
    # DeepSpeed's cpu accelerator reports LOCAL_SIZE devices (else one per NUMA node), and
    # DistributedTest skips a test whose world size exceeds that
    env["LOCAL_SIZE"] = str(args.ranks)
    env["PYTHONPATH"] = os.pathsep.join([REPO] + [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p])
    env.pop("GIFT_INJECT", None)
    env.pop("DEEPSPEED_GIFT", None)
    cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", f"--junitxml={junit}", "-rA",
           f"--timeout={args.timeout}"]
    if mode == "injected":
        cmd += ["-p", "benchmarks.inject_gift"]
        env["GIFT_INJECT_LOG"] = log
        env["GIFT_INJECT_SITEDIR"] = os.path.join(args.out_dir, "site")
    if args.k:
        cmd += ["-k", args.k]
    cmd += [os.path.join(os.path.basename(os.path.normpath(args.tests)), f) for f in args.files]
    cmd += args.pytest_args
    print(f"[{mode}] cd {workdir} && {' '.join(cmd)}", flush=True)
    start = time.time()
    with open(os.path.join(args.out_dir, f"pytest_{mode}.log"), "w") as out:
        rc = subprocess.call(cmd, cwd=workdir, env=env, stdout=out, stderr=subprocess.STDOUT)
    return {"rc": rc, "seconds": round(time.time() - start, 1), "tests": outcomes(junit), "log": log}


def injection_counts(log):
    counts = collections.Counter()
    refusals = collections.Counter()
    errors = collections.Counter()
    per_test = collections.defaultdict(collections.Counter)
    if os.path.exists(log):
        with open(log) as f:
            for line in f:
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                counts[rec.get("outcome")] += 1
                per_test[rec.get("test")][rec.get("outcome")] += 1
                if rec.get("outcome") == "refused":
                    refusals[rec.get("message", "")] += 1
                elif rec.get("outcome") in ("error", "not_attached"):
                    errors[f"{rec.get('outcome')}: {rec.get('exception', '')}: {rec.get('message', '')}"] += 1
    return counts, refusals, errors, per_test


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
    p.add_argument("--tests", required=True, help="DeepSpeed tests/unit directory")
    p.add_argument("--files", nargs="+", required=True, help="test files, relative to --tests")
    p.add_argument("-k", default=None, help="pytest -k expression, both modes")
    p.add_argument("--modes", nargs="+", default=["native", "injected"], choices=["native", "injected"])
    p.add_argument("--ranks", type=int, default=4, help="CPU 'devices' DeepSpeed sees (LOCAL_SIZE)")
    p.add_argument("--timeout", type=int, default=300, help="pytest-timeout seconds per test")
    p.add_argument("--out-dir", default="runs/deepspeed_unit_tests")
    p.add_argument("--json", default=None, help="write the summary here")
    p.add_argument("pytest_args", nargs="*", help="after --: more pytest arguments")
    args = p.parse_args(argv)
    args.out_dir = os.path.abspath(args.out_dir)  # pytest runs in the tests' parent, not here
    os.makedirs(args.out_dir, exist_ok=True)
    workdir = os.path.dirname(os.path.normpath(os.path.abspath(args.tests)))

    results = {mode: run_mode(mode, args, workdir) for mode in args.modes}
    summary = {"files": args.files, "k": args.k, "modes": {}}
    for mode, res in results.items():
        tally = collections.Counter(o for o, _ in res["tests"].values())
        summary["modes"][mode] = {"rc": res["rc"], "seconds": res["seconds"], "counts": dict(tally),
                                  "tests": {k: v[0] for k, v in res["tests"].items()}}
        print(f"{mode:9s} {res['seconds']:8.1f}s rc={res['rc']} " +
              " ".join(f"{k}={tally.get(k, 0)}" for k in ("passed", "failed", "error", "skipped", "xfailed")))

    if len(results) == 2:
        nat, inj = results["native"]["tests"], results["injected"]["tests"]
        differ = []
        for node in sorted(set(nat) | set(inj)):
            a, b = nat.get(node, ("missing", "")), inj.get(node, ("missing", ""))
            if a[0] != b[0]:
                differ.append({"test": node, "native": a[0], "injected": b[0],
                               "native_message": a[1], "injected_message": b[1]})
        summary["differ"] = differ
        print(f"\n{len(differ)} test(s) whose outcome differs")
        for d in differ:
            print(f"  {d['test']}: native {d['native']}, injected {d['injected']}")
            for line in (d["injected_message"] or d["native_message"]).splitlines()[:4]:
                print(f"      {line[:200]}")

    if "injected" in results:
        counts, refusals, errors, per_test = injection_counts(results["injected"]["log"])
        summary["injection"] = {"counts": dict(counts), "refusals": dict(refusals), "errors": dict(errors)}
        print("\ninjection log (one line per deepspeed.initialize call in any rank): " +
              " ".join(f"{k}={v}" for k, v in sorted(counts.items())))
        for msg, n in refusals.most_common():
            print(f"  refused x{n}: {msg[:300]}")
        for msg, n in errors.most_common():
            print(f"  {n} x {msg[:300]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(summary, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
