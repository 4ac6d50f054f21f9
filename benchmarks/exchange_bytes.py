"""    .venv/bin/python benchmarks/exchange_bytes.py [--world 4] [--steps 3] [--json out.json]

The busiest link of the gradient exchange, measured on real engines: every collective that
DeepSpeed's ``average_tensor`` (native, or GIFT's in its place) calls is intercepted on every
rank, with the bytes that rank receives in it (all-to-all: what the other ranks sent it; ring
all-reduce: 2 (W-1)/W of the tensor; reduce: the tensor, as the root of a chain receives it);
per step, the largest receive of any rank in each collective, summed over the step's
collectives (the busiest link sets each collective's time). Native bf16 DeepSpeed (its
multi-rank bucket all-reduce, and ``use_multi_rank_bucket_allreduce: false``) beside GIFT FP8
by route (direct, relay, by_layout), for a ``reduce_bucket_size`` smaller than a partition
(each bucket reaches one or two owners) and one larger than the model. Telemetry's own
``bytes_recv_max`` is printed beside the measured figure.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.results import write_json  # noqa: E402


def _received(name, args, kwargs, world, rank) -> int:
    """Bytes this rank receives in one collective (see the module docstring)."""
    t = args[0] if args else kwargs.get("tensor", kwargs.get("output"))
    nbytes = t.numel() * t.element_size()
    if name == "all_to_all_single":
        out_splits = kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None)
        out_splits = [int(n) for n in out_splits] if out_splits is not None else None
        if out_splits is None:
            return nbytes * (world - 1) // world
        return (sum(out_splits) - out_splits[rank]) * t.element_size()
    if name == "all_reduce":
        return 2 * (world - 1) * nbytes // world
    if name == "reduce":
        return nbytes
    if name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_gather_single"):
        return (world - 1) * nbytes // world  # ring: (W-1)/W of the whole tensor
    return nbytes


def count_gradient_receives(opt) -> list:
    """Wrap ``opt.average_tensor`` so the torch.distributed collectives it calls are recorded:
    returns the list of per-call lists of received bytes (one list per bucket, in call order)."""
    import torch.distributed as dist

    calls: list = []
    native = opt.average_tensor
    names = ("all_to_all_single", "all_reduce", "reduce", "reduce_scatter_tensor", "all_gather_into_tensor",
             "all_gather_single")

    def counted(tensor, dtype):
        seen: list = []
        saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

        def spy(n, fn):
            def call(*args, **kwargs):
                group = kwargs.get("group")
                world, rank = dist.get_world_size(group), dist.get_rank(group)
                seen.append(_received(n, args, kwargs, world, rank))
                return fn(*args, **kwargs)
            return call

        for n, fn in saved.items():
            setattr(dist, n, spy(n, fn))
        try:
            native(tensor, dtype)
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)
        calls.append(seen)

    opt.average_tensor = counted
    return calls


def busiest_per_step(per_rank: list, steps: int) -> float:
    """Sum over collectives of the largest receive of any rank, per step (ranks call the same
    collectives in the same order)."""
    flat = [[b for bucket in calls for b in bucket] for calls in per_rank]
    n = len(flat[0])
    assert all(len(f) == n for f in flat), [len(f) for f in flat]
    return sum(max(f[i] for f in flat) for i in range(n)) / steps


FP8 = {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 8, "refresh_interval": 100},
       "telemetry": {"every": 0}}


def configs(stage: int) -> list:
    no_multi = {"zero_optimization": {"stage": stage, "reduce_bucket_size": None, "allgather_bucket_size": 10**6,
                                      "overlap_comm": False, "contiguous_gradients": True,
                                      "use_multi_rank_bucket_allreduce": False}}
    return [("native bf16", None, {}), ("native bf16, multi-rank all-reduce off", None, no_multi),
            ("GIFT fp8 direct", dict(FP8, route="direct"), {}), ("GIFT fp8 relay", dict(FP8, route="relay"), {}),
            ("GIFT fp8 by_layout", dict(FP8, route="by_layout"), {})]


def _rank_body(rank, world, specs):
    from tests.harness import train

    return [train(rank, world, spec) for spec in specs]


def measure(world: int, stage: int, bucket: int, steps: int, hierarchy: str = "flat") -> list:
    from launch.spawn import run_ranks

    specs, names = [], []
    for name, gift, extra in configs(stage):
        if hierarchy == "two_level" and gift is None and extra:
            continue
        extra = json.loads(json.dumps(extra))
        if extra:
            extra["zero_optimization"]["reduce_bucket_size"] = bucket
        block = None if gift is None else dict(gift, hierarchy=hierarchy,
                                               **({"ranks_per_node": 2} if hierarchy == "two_level" else {}))
        specs.append(dict(stage=stage, steps=steps, bucket=bucket, dtype="bf16", gift=block, extra=extra,
                          count_recv=True))
        names.append(name)
    per_rank = run_ranks(_rank_body, world, specs, timeout=600)
    rows = []
    for i, name in enumerate(names):
        runs = [r[i] for r in per_rank]
        measured = busiest_per_step([r["grad_receives"] for r in runs], steps)
        records = runs[0].get("records") or []
        rows.append({"world": world, "stage": stage, "bucket": bucket, "hierarchy": hierarchy, "config": name,
                     "busiest_bytes_per_step": measured,
                     "telemetry_recv_max": records[-1]["bytes_recv_max"] if records else None,
                     "relay_buckets": records[-1]["relay_buckets"] if records else None})
    base = rows[0]["busiest_bytes_per_step"]
    for r in rows:
        r["vs_native_bf16"] = r["busiest_bytes_per_step"] / base
    return rows


def main(argv=None) -> list:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for stage in (2, 1):
        for bucket in (20000, 2_000_000):
            rows += measure(args.world, stage, bucket, args.steps)
    rows += measure(args.world, 2, 20000, args.steps, hierarchy="two_level")
    print("| stage | bucket | hierarchy | config | busiest rank's receive per step | vs native bf16 | telemetry | relay buckets |")
    print("|---|---:|---|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['stage']} | {r['bucket']} | {r['hierarchy']} | {r['config']} | {r['busiest_bytes_per_step']:.0f} | "
              f"{r['vs_native_bf16']:.2f}x | {r['telemetry_recv_max'] if r['telemetry_recv_max'] is not None else '-'} | "
              f"{r['relay_buckets'] if r['relay_buckets'] is not None else '-'} |")
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
