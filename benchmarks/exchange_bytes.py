"""    .venv/bin/python benchmarks/exchange_bytes.py [--world 4] [--steps 3] [--json out.json]

The busiest link of the gradient exchange, measured on real engines: every collective that
DeepSpeed's ``average_tensor`` (native, or GIFT's in its place) calls is intercepted on every
rank, with the bytes that rank receives in it (all-to-all: what the other ranks sent it; ring
all-reduce: 2 (W-1)/W of the tensor; reduce: the tensor, as the root of a chain receives it);
per step, the largest receive of any rank in each collective, summed over the step's
collectives (the busiest link sets each collective's time). Native bf16 DeepSpeed (its
multi-rank bucket all-reduce, and ``use_multi_rank_bucket_allreduce: false``) beside GIFT FP8
by route (direct, relay, by_layout; at stage 1 also the default balanced rounds, the routes then
with ``stage1_rounds: false``), for a ``reduce_bucket_size`` smaller than a partition
(each bucket reaches one or two owners) and one larger than the model, flat and two-level
(2 x 2: ranks 0-1 and 2-3 as nodes). ZeRO stage 3 beside them: its ``__avg_scatter_grads``
(native: ``reduce_scatter_coalesced``, a reduce-scatter in which every rank owns 1/W of every
parameter; GIFT's exchange in its place). Beside it the same sum over what arrives from other
nodes only (the NICs', where the node stage of two-level rides a node's own links; native's
ring in rank order crosses a node at every second rank; flat, every rank counts as a node).
Telemetry's own ``bytes_recv_max`` and ``bytes_recv_max_internode`` are printed beside the
measured figures (the latter by GIFT's topology: flat on one machine, one node, so 0).
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


def _received(name, args, kwargs, world, rank, off_node) -> tuple:
    """Bytes this rank receives in one collective (see the module docstring), in all and from
    ranks of other nodes (``off_node[i]``: group rank i sits on another node than this one)."""
    t = args[0] if args else kwargs.get("tensor", kwargs.get("output"))
    if name == "reduce_scatter_tensor":  # (output, input): the input is the whole tensor
        t = args[1] if len(args) > 1 else kwargs.get("input", kwargs.get("input_tensor"))
    nbytes = t.numel() * t.element_size()
    if name == "all_to_all_single":
        out_splits = kwargs.get("output_split_sizes", args[2] if len(args) > 2 else None)
        if out_splits is None:
            out_splits = [nbytes // world // t.element_size()] * world
        got = [0 if i == rank else int(n) * t.element_size() for i, n in enumerate(out_splits)]
        return sum(got), sum(n for n, off in zip(got, off_node) if off)
    if name == "all_reduce":  # ring in rank order: everything arrives from the previous rank
        total = 2 * (world - 1) * nbytes // world
    elif name == "reduce":  # the root of a chain
        total = nbytes
    elif name in ("reduce_scatter_tensor", "all_gather_into_tensor", "all_gather_single"):
        total = (world - 1) * nbytes // world  # ring: (W-1)/W of the whole tensor
    elif name == "reduce_scatter":  # (output, input list): a ring brings the output's size W - 1 times
        total = (world - 1) * nbytes
    else:
        total = nbytes
    return total, total if world > 1 and off_node[(rank - 1) % world] else 0


def count_gradient_receives(opt, ranks_per_node: int = 1) -> list:
    """Wrap ``opt.average_tensor`` and ``opt.reduce_gradients`` (ZeRO-1's boundary, where GIFT's
    balanced rounds run before DeepSpeed's walk through its buckets) so the torch.distributed
    collectives they call are recorded: returns the list of per-call lists of (received bytes,
    of them from other nodes), one list per outermost call in call order (a bucket, or a
    stage-1 boundary with its buckets); a node is ``ranks_per_node`` consecutive global ranks."""
    import torch.distributed as dist

    calls: list = []
    names = ("all_to_all_single", "all_reduce", "reduce", "reduce_scatter_tensor", "reduce_scatter",
             "all_gather_into_tensor", "all_gather_single", "batch_isend_irecv")
    me = dist.get_rank() // ranks_per_node
    active = []  # the spies are in place (an average_tensor inside reduce_gradients is counted there)

    def counting(native):
        def counted(*call_args, **call_kwargs):
            if active:
                return native(*call_args, **call_kwargs)
            active.append(True)
            try:
                return spied(native, call_args, call_kwargs)
            finally:
                active.clear()
        return counted

    def spied(native, call_args, call_kwargs):
        seen: list = []
        saved = {n: getattr(dist, n) for n in names if hasattr(dist, n)}

        def spy(n, fn):
            def call(*args, **kwargs):
                if n == "batch_isend_irecv":  # point-to-point parts (the node stage's): what the receives take
                    recvs = [(op.tensor.numel() * op.tensor.element_size(), op.peer // ranks_per_node != me)
                             for op in (args[0] if args else kwargs["p2p_op_list"]) if op.op is dist.irecv]
                    seen.append((sum(b for b, _ in recvs), sum(b for b, off in recvs if off)))
                    return fn(*args, **kwargs)
                group = kwargs.get("group")
                world, rank = dist.get_world_size(group), dist.get_rank(group)
                off = [(dist.get_global_rank(group, i) if group is not None else i) // ranks_per_node != me
                       for i in range(world)]
                seen.append(_received(n, args, kwargs, world, rank, off))
                return fn(*args, **kwargs)
            return call

        for n, fn in saved.items():
            setattr(dist, n, spy(n, fn))
        # DeepSpeed's comm keeps its own reference to torch's reduce_scatter_tensor (ZeRO-3's path)
        from deepspeed.comm import comm as ds_comm

        backend = ds_comm.cdb
        held = getattr(backend, "reduce_scatter_function", None)
        if held is not None:
            backend.reduce_scatter_function = spy("reduce_scatter_tensor", held)
        try:
            return native(*call_args, **call_kwargs)
        finally:
            for n, fn in saved.items():
                setattr(dist, n, fn)
            if held is not None:
                backend.reduce_scatter_function = held
            calls.append(seen)

    # ZeRO-1/2's bucket and boundary reductions; ZeRO-3's per-bucket average-and-scatter
    for name in ("average_tensor", "reduce_gradients", "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads"):
        if hasattr(opt, name):
            setattr(opt, name, counting(getattr(opt, name)))
    return calls


def busiest_per_step(per_rank: list, steps: int, internode: bool = False, last: bool = False) -> float:
    """Sum over collectives of the largest receive of any rank (``internode``: from other nodes),
    per step (ranks call the same collectives in the same order); ``last``: of the last step only
    (what its telemetry record reports: a step's buckets are its share of the calls)."""
    if last:
        per_rank = [calls[len(calls) - len(calls) // steps:] for calls in per_rank]
        steps = 1
    flat = [[b[1 if internode else 0] for bucket in calls for b in bucket] for calls in per_rank]
    n = len(flat[0])
    assert all(len(f) == n for f in flat), [len(f) for f in flat]
    return sum(max(f[i] for f in flat) for i in range(n)) / steps


FP8 = {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 8, "refresh_interval": 100},
       "telemetry": {"every": 0}}


def configs(stage: int) -> list:
    no_multi = {"zero_optimization": {"stage": stage, "reduce_bucket_size": None, "allgather_bucket_size": 10**6,
                                      "overlap_comm": False, "contiguous_gradients": True,
                                      "use_multi_rank_bucket_allreduce": False}}
    # stage 1: the default reduces in balanced rounds; the bucket routes with stage1_rounds false
    buckets = {} if stage != 1 else {"stage1_rounds": False}
    rounds = [("GIFT fp8 rounds (stage-1 default)", dict(FP8), {})] if stage == 1 else []
    natives = [("native bf16", None, {})] + ([] if stage == 3 else [("native bf16, multi-rank all-reduce off", None,
                                                                    no_multi)])
    return [*natives, *rounds,
            ("GIFT fp8 direct", dict(FP8, route="direct", **buckets), {}),
            ("GIFT fp8 relay", dict(FP8, route="relay", **buckets), {}),
            ("GIFT fp8 by_layout", dict(FP8, route="by_layout", **buckets), {}),
            # stage 3's other shipped block (ds_configs/gift_nvfp4_zero3.json): 0.56 B an element
            *([("GIFT nvfp4 by_layout", dict(FP8, format="nvfp4", route="by_layout"), {})] if stage == 3 else [])]


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
                          count_recv=2 if hierarchy == "two_level" else 1))
        names.append(name)
    per_rank = run_ranks(_rank_body, world, specs, timeout=600)
    rows = []
    for i, name in enumerate(names):
        runs = [r[i] for r in per_rank]
        receives = [r["grad_receives"] for r in runs]
        last = (runs[0].get("records") or [{}])[-1]
        rows.append({"world": world, "stage": stage, "bucket": bucket, "hierarchy": hierarchy, "config": name,
                     "busiest_bytes_per_step": busiest_per_step(receives, steps),
                     "busiest_internode_per_step": busiest_per_step(receives, steps, internode=True),
                     "telemetry_recv_max": last.get("bytes_recv_max"),
                     "telemetry_recv_max_internode": last.get("bytes_recv_max_internode"),
                     "relay_buckets": last.get("relay_buckets"), "balanced_buckets": last.get("balanced_buckets"),
                     "rounds": last.get("rounds")})
    base, base_nic = rows[0]["busiest_bytes_per_step"], rows[0]["busiest_internode_per_step"]
    for r in rows:
        r["vs_native_bf16"] = r["busiest_bytes_per_step"] / base
        r["internode_vs_native_bf16"] = r["busiest_internode_per_step"] / base_nic if base_nic else None
    return rows


def main(argv=None) -> list:
    parser = argparse.ArgumentParser()
    parser.add_argument("--world", type=int, default=4)
    parser.add_argument("--steps", type=int, default=2)
    parser.add_argument("--stages", type=int, nargs="*", help="ZeRO stages (default 2 1 3, then two-level at 2 and 3)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for stage in (args.stages or (2, 1, 3)):
        for bucket in (20000, 2_000_000):
            rows += measure(args.world, stage, bucket, args.steps)
    for stage in (s for s in (args.stages or (2, 3)) if s in (2, 3)):
        rows += measure(args.world, stage, 20000, args.steps, hierarchy="two_level")
    print("| stage | bucket | hierarchy | config | busiest rank's receive per step | vs native bf16 | telemetry |"
          " from other nodes | vs native bf16 | telemetry | relay buckets | balanced buckets | rounds |")
    print("|---|---:|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")

    def cell(v, fmt="{}"):
        return "-" if v is None else fmt.format(v)

    for r in rows:
        print(f"| {r['stage']} | {r['bucket']} | {r['hierarchy']} | {r['config']} | {r['busiest_bytes_per_step']:.0f} | "
              f"{r['vs_native_bf16']:.2f}x | {cell(r['telemetry_recv_max'])} | {r['busiest_internode_per_step']:.0f} | "
              f"{cell(r['internode_vs_native_bf16'], '{:.2f}x')} | {cell(r['telemetry_recv_max_internode'])} | "
              f"{cell(r['relay_buckets'])} | {cell(r['balanced_buckets'])} | {cell(r['rounds'])} |")
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
