r"""    .venv/bin/python benchmarks/replica_gap.py --steps 1000

How far the parameter replicas of a compressed all-gather (``gift.params``) stay from what
DeepSpeed's own all-gather would have given them, bf16(master), over a long run:
``launch/pretrain.py`` on 2 gloo ranks with a config's gift block, the replica-target gap
measured on every step (``telemetry.every`` 1, the fidelity check off so it costs nothing
else). Prints, per window of steps, the largest and the mean ``params_gap_rel`` (the largest
|replica - bf16(master)| of rank 0's partition relative to the largest |bf16(master)| of its
128-element block), also in bf16 ulps (2^-8 relative), and the train loss. A gap that grew
with the steps would be an error that accumulates; the change of the replica is taken
against the replica, so it should not.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.scale_model import set_gift_keys  # noqa: E402
from launch.pretrain import read_metrics, run_rank  # noqa: E402
from launch.spawn import run_ranks  # noqa: E402

BF16_ULP = 2.0**-8


def windows(records: list, size: int) -> list:
    """Per ``size`` steps: first and last step, largest and mean gap, mean train loss."""
    out = []
    for lo in range(0, len(records), size):
        part = records[lo:lo + size]
        gaps = [r["params_gap_rel"] for r in part if "params_gap_rel" in r]
        if gaps:
            out.append({"steps": (part[0]["step"], part[-1]["step"]), "max": max(gaps),
                        "mean": statistics.fmean(gaps), "loss": statistics.fmean(r["loss"] for r in part)})
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1].strip(),
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--config", default="ds_configs/gift_fp8_e5m2_tensor_params_fp8_zero2.json",
                   help="a ds_config with a gift.params block")
    p.add_argument("--set", default="", help="more gift keys, key=value,key=value (e.g. params.format=nvfp4)")
    p.add_argument("--preset", default="small")
    p.add_argument("--steps", type=int, default=1000)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--seq-len", type=int, default=128)
    p.add_argument("--micro-batch", type=int, default=4)
    p.add_argument("--window", type=int, default=100)
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--json", help="write the windows and every step's gap here")
    args = p.parse_args(argv)
    with open(os.path.join(ROOT, args.config) if not os.path.isabs(args.config) else args.config) as f:
        cfg = json.load(f)
    if not (cfg.get("gift") or {}).get("params"):
        raise SystemExit(f"--config {args.config}: its gift block has no params block")
    set_gift_keys(cfg, "telemetry.every=1,telemetry.fidelity=false" + (f",{args.set}" if args.set else ""))
    with tempfile.TemporaryDirectory() as tmp:
        path, metrics = os.path.join(tmp, "config.json"), os.path.join(tmp, "metrics.jsonl")
        with open(path, "w") as f:
            json.dump(cfg, f)
        run_ranks(run_rank, args.world_size,
                  ["--ds-config", path, "--preset", args.preset, "--steps", str(args.steps), "--lr", str(args.lr),
                   "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--eval-every", "0",
                   "--log-every", str(args.window), "--metrics", metrics, "--no-progress",
                   # bf16 replicas are what this measures, also where a bf16 matmul is slow
                   "--compute-dtype", "bf16"], timeout=7200)
        train = read_metrics(metrics)["train"]
    rows = windows(train, args.window)
    print(f"\n{args.config} ({json.dumps(cfg['gift']['params'])}), preset {args.preset}, {len(train)} steps, "
          f"{args.world_size} ranks: replica - bf16(master), relative to its block's largest value\n")
    print("| steps | max gap | (bf16 ulps) | mean gap | (bf16 ulps) | train loss |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['steps'][0]}-{r['steps'][1]} | {r['max']:.2e} | {r['max'] / BF16_ULP:.2f} | {r['mean']:.2e} | "
              f"{r['mean'] / BF16_ULP:.2f} | {r['loss']:.4f} |")
    result = {"config": args.config, "params": cfg["gift"]["params"], "steps": len(train), "windows": rows,
              "gaps": [r.get("params_gap_rel") for r in train]}
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
