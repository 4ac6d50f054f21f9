"""    .venv/bin/python benchmarks/step_pair.py [--rounds 4] [--steps 250] [--configs A B] [--json out.json]

Two configs' step times on the main job (``launch/compare.py``'s defaults: the ``small`` Llama, 2
ranks on CPU), measured in turn and in alternating order: round 1 runs A then B, round 2 B then
A, and so on, so the machine's drift and the position in a round weigh on both alike. Defaults:
Euclidean FP8 against GIFT FP8 under AdamW (issue 42's pair, ``ds_configs/euclid_fp8_e5m2_tensor_zero2.json``
and ``ds_configs/gift_fp8_e5m2_tensor_zero2.json``); four rounds of 250 steps take about 25
minutes on 2 cores. Prints per round each run's mean and median step (wall) and CPU time over the
steps after ``--skip``, GIFT's own geometry work a step (telemetry's ``geometry_s``, where the
records have it), B / A per round, and over the rounds the mean of those ratios and the pooled
ratio. A round's ratio is as noisy as the machine; the rounds together are the measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from typing import Dict, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.results import write_json  # noqa: E402
from launch import compare  # noqa: E402
from launch.compare import config_label as label  # noqa: E402  (the name compare gives a run's metrics)

PAIR = ("ds_configs/euclid_fp8_e5m2_tensor_zero2.json", "ds_configs/gift_fp8_e5m2_tensor_zero2.json")


def step_times(path: str, skip: int) -> Dict[str, float]:
    """Mean and median wall time, mean CPU time and mean ``geometry_s`` a step of one run's
    metrics JSONL (``launch/pretrain.py``'s train records), after ``skip`` warm-up steps."""
    train = [r for r in map(json.loads, open(path)) if r.get("event") == "train"][skip:]
    if not train:
        raise SystemExit(f"{path}: no train records after the first {skip}")
    wall = [r["step_time_s"] for r in train]
    return {"steps": len(train), "mean_s": statistics.fmean(wall), "median_s": statistics.median(wall),
            "cpu_s": statistics.fmean(r["cpu_time_s"] for r in train),
            "geometry_s": statistics.fmean(r.get("geometry_s", 0.0) for r in train)}


def ratios(rounds: List[Dict[str, Dict[str, float]]], a: str, b: str) -> dict:
    """B / A per round (wall and CPU) and over the rounds: the mean of the ratios and the pooled
    ratio (sum of B's means over sum of A's)."""
    per = [{"wall": r[b]["mean_s"] / r[a]["mean_s"], "cpu": r[b]["cpu_s"] / r[a]["cpu_s"]} for r in rounds]
    pooled = {key: sum(r[b][src] for r in rounds) / sum(r[a][src] for r in rounds)
              for key, src in (("wall", "mean_s"), ("cpu", "cpu_s"))}
    return {"per_round": per, "mean": {k: statistics.fmean(p[k] for p in per) for k in ("wall", "cpu")},
            "pooled": pooled}


def main(argv: Optional[List[str]] = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], epilog="Other options go to launch/compare.py.")
    p.add_argument("--configs", nargs=2, default=list(PAIR), metavar=("A", "B"))
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--skip", type=int, default=5, help="warm-up steps left out of the means")
    p.add_argument("--out-dir", default=os.path.join("runs", "step_pair"))
    p.add_argument("--json", default=None)
    args, rest = p.parse_known_args(argv)
    if args.rounds < 1:
        raise SystemExit(f"--rounds: got {args.rounds}; must be >= 1")
    a, b = args.configs
    if label(a) == label(b):
        raise SystemExit(f"--configs: {a} and {b} have the same name; the runs would overwrite each other")
    rounds = []
    for i in range(args.rounds):
        order = (a, b) if i % 2 == 0 else (b, a)
        out = os.path.join(args.out_dir, f"round{i + 1}")
        compare.main(["--configs", *order, "--out-dir", out, *rest])
        rounds.append({label(c): step_times(os.path.join(out, "runs", label(c) + ".jsonl"), args.skip)
                       for c in order})
    got = ratios(rounds, label(a), label(b))
    print(f"\n{label(b)} (B) against {label(a)} (A), steps after the first {args.skip}; A ran first in odd rounds")
    print("| round | A mean (median) | B mean (median) | B / A wall (CPU) | B's geometry_s a step |")
    print("|---|---:|---:|---:|---:|")
    for i, (r, q) in enumerate(zip(rounds, got["per_round"])):
        ra, rb = r[label(a)], r[label(b)]
        print(f"| {i + 1} | {ra['mean_s'] * 1e3:.1f} ({ra['median_s'] * 1e3:.1f}) ms | {rb['mean_s'] * 1e3:.1f} "
              f"({rb['median_s'] * 1e3:.1f}) ms | {q['wall']:.3f}x ({q['cpu']:.3f}x) | {rb['geometry_s'] * 1e3:.2f} ms |")
    print(f"over {args.rounds} rounds: B / A {got['mean']['wall']:.3f}x wall (mean of the ratios), "
          f"{got['pooled']['wall']:.3f}x pooled; CPU time {got['mean']['cpu']:.3f}x / {got['pooled']['cpu']:.3f}x")
    out = {"configs": [a, b], "rounds": rounds, "ratios": got, "skip": args.skip, "compare_args": rest}
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
