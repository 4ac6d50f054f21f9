"""Native DeepSpeed vs Euclidean FP8 vs GIFT FP8 on 2 CPU ranks, same model, data and seed.

    .venv/bin/python launch/demo.py                      # small Llama, 100 steps, 2 ranks
    .venv/bin/python launch/demo.py --steps 20 --preset tiny
    .venv/bin/python launch/demo.py --steps 40 --telemetry-every 5 \
        --extra '{"e5m2 tensor kfac": {"format": "fp8_e5m2", "block_size": 0, "layers": "all"}}'

Prints one row per config: final loss, mean step time and its ratio to native, wire
bytes per gradient element sent (geometry metadata included, averaged over the run), the
sampled fidelity of the reduced gradient, and what ``layers: "measured"`` chose. Writes the
rows as JSON to ``--json``. (The full comparison with reports and plots is
``launch/compare.py``, built on the pretraining script.)
"""

import argparse
import json
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from launch.common import train_many  # noqa: E402
from launch.spawn import run_ranks  # noqa: E402

def configs(rank: int, refresh: int, every: int):
    TELEMETRY = {"every": every}
    return {
        "native bf16": None,
        "euclidean fp8_e4m3": {"format": "fp8_e4m3", "geometry": {"kind": "identity"}, "layers": "all",
                               "telemetry": TELEMETRY},
        "gift fp8_e4m3 (auto)": {"format": "fp8_e4m3", "layers": "measured",
                                 "geometry": {"kind": "kfac_input", "rank": rank, "refresh_interval": refresh},
                                 "telemetry": TELEMETRY},
        "gift fp8_e4m3 (all)": {"format": "fp8_e4m3", "layers": "all",
                                "geometry": {"kind": "kfac_input", "rank": rank, "refresh_interval": refresh},
                                "telemetry": TELEMETRY},
    }


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="small", choices=["tiny", "small"])
    parser.add_argument("--steps", type=int, default=100)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--stage", type=int, default=2, choices=[1, 2])
    parser.add_argument("--rank", type=int, default=32, help="gift.geometry.rank")
    parser.add_argument("--refresh", type=int, default=50, help="gift.geometry.refresh_interval")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--micro", type=int, default=4)
    parser.add_argument("--telemetry-every", type=int, default=10, help="fidelity sampled every N steps")
    parser.add_argument("--extra", default="{}",
                        help="JSON object: name -> gift block, run after the built-in configs")
    parser.add_argument("--json", default="demo.json")
    args = parser.parse_args()

    named = configs(args.rank, args.refresh, args.telemetry_every)
    for name, block in json.loads(args.extra).items():
        block.setdefault("telemetry", {"every": args.telemetry_every})
        named[name] = block
    base = dict(preset=args.preset, stage=args.stage, steps=args.steps, seq=args.seq, micro=args.micro,
                dtype="bf16", bucket=50_000_000, lr=1e-3)
    specs = [dict(base, gift=g) for g in named.values()]
    results = run_ranks(train_many, args.world_size, specs, timeout=3600)[0]
    warm = min(5, args.steps // 4)  # leave out the first steps (allocation, first refresh)
    native_time = statistics.mean(results[0]["step_times"][warm:])
    rows = []
    for name, r in zip(named, results):
        t = statistics.mean(r["step_times"][warm:])
        recs = r.get("records", [])
        fid = [x["fidelity_rel_err"] for x in recs[1:] if "fidelity_rel_err" in x]  # step 0: no geometry yet
        rows.append({
            "config": name,
            "final_loss": statistics.mean(r["losses"][-5:]),
            "step_s": t,
            "time_ratio": t / native_time,
            "bytes_per_elem": recs[-1]["bytes_per_elem_run"] if recs else 2.0,
            "geometry_bytes": sum(x["bytes_geometry"] for x in recs),
            "fidelity_rel_err": statistics.mean(fid) if fid else 0.0,
            "geometry_layers": recs[-1]["geometry_layers"] if recs else 0,
            "auto_gains": r.get("gains", {}),
        })
    width = max(24, max(len(n) for n in named))
    header = f"{'config':{width}} {'loss(last5)':>11} {'step s':>8} {'x native':>8} {'B/elem':>7} {'fidelity':>9} {'geo layers':>10}"
    print(header)
    print("-" * len(header))
    for row in rows:
        print(f"{row['config']:{width}} {row['final_loss']:11.4f} {row['step_s']:8.3f} {row['time_ratio']:8.2f} "
              f"{row['bytes_per_elem']:7.4f} {row['fidelity_rel_err']:9.4f} {row['geometry_layers']:10d}")
    print("B/elem: bytes sent per gradient element (native bf16 all-reduce/reduce = 2.0), geometry metadata "
          "included; fidelity: relative L2 error of the reduced gradient vs an exact fp32 reduction")
    gains = rows[2]["auto_gains"]
    if gains:
        print("auto profile (1 - err_geo/err_euclid per layer):",
              ", ".join(f"{k}={v:+.2f}" for k, v in sorted(gains.items())))
    with open(args.json, "w") as f:
        json.dump(rows, f, indent=1)
    print(f"rows written to {args.json}")


if __name__ == "__main__":
    main()
