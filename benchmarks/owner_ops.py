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
from typing import Dict, List

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.results import write_json  # noqa: E402
from deepspeed_gift.core import formats  # noqa: E402
from deepspeed_gift.exchange import relay  # noqa: E402
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


def _counted(fn, into: list):
    """``fn`` that appends the ops (by name) of each of its calls to ``into``."""
    def counting(*args, **kwargs):
        with OpCounter() as counter:
            out = fn(*args, **kwargs)
        into.append(counter.counts)
        return out

    return counting


def _rank(comm, fmt: str, numel: int, route: str) -> Dict[str, List[collections.Counter]]:
    """Ops (by name) of this rank's owner side (every rank owns one section of numel): direct,
    the owner's decode-and-sum of its section; relay, each sum this rank makes as a relay (one
    per section, its chunk of it) and the owner's assembly of its section from the relays."""
    world = comm.world_size
    slices = [ParamSlice(d, d * numel, numel, d * numel, 0) for d in range(world)]
    reducer = GiftReducer(comm, formats.get_format(fmt), defer_checks=True, route=route,
                          relay_codec=formats.get_format(fmt))
    grads = torch.randn(world * numel, generator=torch.Generator().manual_seed(comm.rank))
    counted: Dict[str, list] = {"owner": [], "relay_sums": []}
    if route == "direct":
        reducer._sum_at_owner = _counted(reducer._sum_at_owner, counted["owner"])
    else:
        reducer.sum_sources = _counted(reducer.sum_sources, counted["relay_sums"])
        _OWNER_TOTALS[comm.rank] = counted["owner"]
    for step in (0, 1):  # a new plan (agreed first), then an ordinary reduction: the one kept
        for calls in counted.values():
            calls.clear()
        stats = reducer.reduce(grads.clone(), slices, {}, divisor=world, step=step)
        assert stats.relay_buckets == (route == "relay")
    reducer.verify_checks()
    return counted


_OWNER_TOTALS: Dict[int, list] = {}  # rank -> where the relay owner's assembly is counted (ranks are threads)


def _owner_totals(r, *args, **kwargs):
    return _counted(_NATIVE_OWNER_TOTALS, _OWNER_TOTALS[r.comm.rank])(r, *args, **kwargs)


_NATIVE_OWNER_TOTALS = relay.owner_totals


def _row(fmt: str, route: str, world: int, numel: int, part: str, calls: List[collections.Counter]) -> dict:
    """The busiest call of ``part``: its ops, those of the rank-order sum, the rest."""
    total = [sum(c.values()) for c in calls]
    busiest = calls[max(range(len(calls)), key=total.__getitem__)]
    sums = sum(busiest[name] for name in SUM_OPS)
    return {"format": fmt, "route": route, "world": world, "numel": numel, "part": part,
            "ops_per_section": max(total), "decode_ops": max(total) - sums, "sum_ops": sums, "senders": world - 1}


SUM_OPS = ("aten.add_",)  # the rank-order sum: one add per sender and tile (the decode adds nothing)
PARTS = {"direct": ("owner",), "relay": ("relay_sums", "owner")}


def measure(worlds, bucket: int, routes=("direct", "relay")) -> list:
    rows = []
    relay.owner_totals = _owner_totals
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # ranks are threads: each op on one core, not every rank's on all of them
    try:
        for route in routes:
            for fmt in FORMATS:
                for world in worlds:
                    numel = bucket // world
                    ranks = run_local(world, _rank, fmt, numel, route)
                    for part in PARTS[route]:
                        calls = [c for counted in ranks for c in counted[part]]
                        rows.append(_row(fmt, route, world, numel, part, calls))
    finally:
        relay.owner_totals = _NATIVE_OWNER_TOTALS
        torch.set_num_threads(threads)
    return rows


def main(argv=None) -> list:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--bucket", type=int, default=1 << 20, help="elements of the bucket (a section each rank)")
    parser.add_argument("--routes", nargs="+", default=["direct", "relay"], choices=list(PARTS))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = measure(args.worlds, args.bucket, args.routes)
    print("| route | part | format | W | elements per section | ATen ops per section | header checks + decode "
          "| sum in rank order (adds) |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['route']} | {PART_NAMES[r['part']]} | {r['format']} | {r['world']} | {r['numel']} "
              f"| {r['ops_per_section']} | {r['decode_ops']} | {r['sum_ops']} |")
    write_json(args.json, rows)
    return rows


PART_NAMES = {"owner": "owner", "relay_sums": "relay's sum of its chunk"}


if __name__ == "__main__":
    main()
