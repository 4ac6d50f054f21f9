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

The relay route (``--routes relay``) adds two parts: a relay's sum of its chunk of a section
(the same batch and sum), the owner's assembly of its section from the relays' chunks (a run
of relays at a time), and a sender's encode of its chunks to the relays (a run of relays'
chunks encoded as one payload and cut into theirs: a few encodes a section, not one a relay).
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
    counted: Dict[str, list] = {"owner": [], "relay_sums": [], "sender": []}
    if route == "direct":
        reducer._sum_at_owner = _counted(reducer._sum_at_owner, counted["owner"])
    else:
        reducer.sum_sources = _counted(reducer.sum_sources, counted["relay_sums"])
        _PATCHED[comm.rank] = counted
    for step in (0, 1):  # a new plan (agreed first), then an ordinary reduction: the one kept
        for calls in counted.values():
            calls.clear()
        stats = reducer.reduce(grads.clone(), slices, {}, divisor=world, step=step)
        assert stats.relay_buckets == (route == "relay")
    reducer.verify_checks()
    return counted


_PATCHED: Dict[int, dict] = {}  # rank -> where its relay functions are counted (ranks are threads)
_NATIVE = {"owner_totals": relay.owner_totals, "send_chunks": relay.send_chunks}
_PARTS_OF = {"owner_totals": "owner", "send_chunks": "sender"}


def _patched(name: str):
    def call(r, *args, **kwargs):
        return _counted(_NATIVE[name], _PATCHED[r.comm.rank][_PARTS_OF[name]])(r, *args, **kwargs)

    return call


def _row(fmt: str, route: str, world: int, numel: int, part: str, calls: List[collections.Counter]) -> dict:
    """The busiest call of ``part``: its ops, those of the rank-order sum, the rest."""
    total = [sum(c.values()) for c in calls]
    busiest = calls[max(range(len(calls)), key=total.__getitem__)]
    sums = sum(busiest[name] for name in SUM_OPS) if (route, part) in SUMMING else 0
    return {"format": fmt, "route": route, "world": world, "numel": numel, "part": part,
            "ops_per_section": max(total), "decode_ops": max(total) - sums, "sum_ops": sums, "senders": world - 1}


SUM_OPS = ("aten.add_",)  # the rank-order sum: one add per sender and tile (the decode adds nothing)
PARTS = {"direct": ("owner",), "relay": ("sender", "relay_sums", "owner")}
SUMMING = (("direct", "owner"), ("relay", "relay_sums"))  # the parts that sum (the relay's owner places chunks)


def measure(worlds, bucket: int, routes=("direct", "relay")) -> list:
    rows = []
    for name in _NATIVE:
        setattr(relay, name, _patched(name))
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
        for name, native in _NATIVE.items():
            setattr(relay, name, native)
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
    print("| route | part | format | W | elements per section | ATen ops per section | all but the sum (checks, "
          "decode; a sender's: encode) | sum in rank order (adds) |")
    print("|---|---|---|---:|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['route']} | {PART_NAMES[r['part']]} | {r['format']} | {r['world']} | {r['numel']} "
              f"| {r['ops_per_section']} | {r['decode_ops']} | {r['sum_ops']} |")
    write_json(args.json, rows)
    return rows


PART_NAMES = {"owner": "owner", "relay_sums": "relay's sum of its chunk", "sender": "a sender's chunks to the relays"}


if __name__ == "__main__":
    main()
