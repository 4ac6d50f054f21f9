"""    .venv/bin/python benchmarks/owner_ops.py [--worlds 4 8 16 32] [--bucket 1048576] [--json out.json]

The owner's side of one bucket reduction, counted in operations: every ATen operator call
(on a GPU each is a kernel launch, issued from the thread that runs DeepSpeed's reduction)
made while an owner decodes and sums the W - 1 messages it received for its own section
(``GiftReducer._sum_at_owner``: the header checks, the decode, the fp32 sum in rank order),
per format, for a bucket of one weight of ``--bucket`` elements owned by W ranks, a section
each (DeepSpeed's buckets have a fixed size, so a section is 1/W of it; ranks as threads,
``comm.LocalComm``).

Two figures per section: the header checks and the decode, which the owner does for all W - 1
senders at once (one batch, one pass per tile of the received payloads), so their count does
not depend on W; and the sum, one add per sender (the rank order every rank sums in, which
keeps shared copies bit-identical and the fp32 format equal to native at two ranks; no stock
reduction kernel keeps an order). Before the batch, the decode was 10-15 operations per sender:
fp8 37 per sender in all, nvfp4 34, int4 35, bf16 19 (1147 per section for fp8 at W = 32).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.results import write_json  # noqa: E402
from deepspeed_gift.core import formats  # noqa: E402
from deepspeed_gift.exchange.comm import run_local  # noqa: E402
from deepspeed_gift.exchange.plan import ParamSlice  # noqa: E402
from deepspeed_gift.exchange.reducer import GiftReducer  # noqa: E402

FORMATS = ("fp8_e4m3", "nvfp4", "int4", "bf16")


class OpCounter(TorchDispatchMode):
    """Counts the ATen operators dispatched on this thread while active (views included: on a
    GPU those launch nothing, so the count bounds the launches from above)."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func.overloadpacket)] += 1
        return func(*args, **(kwargs or {}))

    @property
    def total(self) -> int:
        return sum(self.counts.values())


def _rank(comm, fmt: str, numel: int) -> collections.Counter:
    """Ops (by name) of this rank's owner side for its section (every rank owns one section of numel)."""
    world = comm.world_size
    slices = [ParamSlice(d, d * numel, numel, d * numel, 0) for d in range(world)]
    reducer = GiftReducer(comm, formats.get_format(fmt), defer_checks=True)
    grads = torch.randn(world * numel, generator=torch.Generator().manual_seed(comm.rank))
    counted = {}
    native = reducer._sum_at_owner

    def sum_at_owner(*args, **kwargs):
        with OpCounter() as counter:
            out = native(*args, **kwargs)
        counted["ops"] = counter.counts
        return out

    reducer._sum_at_owner = sum_at_owner
    reducer.reduce(grads.clone(), slices, {}, divisor=world, step=0)  # a new plan: agreed first
    reducer.reduce(grads.clone(), slices, {}, divisor=world, step=1)  # an ordinary reduction
    reducer.verify_checks()
    return counted["ops"]


SUM_OPS = ("aten.add_",)  # the rank-order sum: one add per sender and tile (the decode adds nothing)


def measure(worlds, bucket: int) -> list:
    rows = []
    for fmt in FORMATS:
        for world in worlds:
            numel = bucket // world
            counts = run_local(world, _rank, fmt, numel)
            total = [sum(c.values()) for c in counts]
            sums = [sum(c[name] for name in SUM_OPS) for c in counts]
            busiest = max(range(world), key=total.__getitem__)
            rows.append({"format": fmt, "world": world, "numel": numel, "ops_per_section": total[busiest],
                         "decode_ops": total[busiest] - sums[busiest], "sum_ops": sums[busiest],
                         "senders": world - 1})
    return rows


def main(argv=None) -> list:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--bucket", type=int, default=1 << 20, help="elements of the bucket (a section each rank)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = measure(args.worlds, args.bucket)
    print("| format | W | elements per section | ATen ops per section (owner side) | header checks + decode "
          "| sum in rank order (adds) |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['world']} | {r['numel']} | {r['ops_per_section']} | {r['decode_ops']} "
              f"| {r['sum_ops']} |")
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
