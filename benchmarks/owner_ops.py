"""    .venv/bin/python benchmarks/owner_ops.py [--worlds 4 8 16 32] [--numel 65536] [--json out.json]

The owner's side of one bucket reduction, counted in operations: every ATen operator call
(on a GPU each is a kernel launch, issued from the thread that runs DeepSpeed's reduction)
made while an owner decodes and sums the W - 1 messages it received for its own section
(``GiftReducer._sum_at_owner``: the header checks, each source's decode, the fp32 sum in rank
order), per format, for a bucket of one weight owned by W ranks (ranks as threads,
``comm.LocalComm``). Printed per section and per source: today the owner decodes each source
on its own, so the count grows with W; a batched decode would make the decode part
independent of W (the sum in rank order stays one add per source, the lossless guarantee's
order). The baseline for issue 34's batched decode.
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


def _rank(comm, fmt: str, numel: int) -> int:
    """Ops of this rank's owner side for its section (every rank owns one section of numel)."""
    world = comm.world_size
    slices = [ParamSlice(d, d * numel, numel, d * numel, 0) for d in range(world)]
    reducer = GiftReducer(comm, formats.get_format(fmt), defer_checks=True)
    grads = torch.randn(world * numel, generator=torch.Generator().manual_seed(comm.rank))
    counted = {}
    native = reducer._sum_at_owner

    def sum_at_owner(*args, **kwargs):
        with OpCounter() as counter:
            out = native(*args, **kwargs)
        counted["ops"] = counter.total
        return out

    reducer._sum_at_owner = sum_at_owner
    reducer.reduce(grads.clone(), slices, {}, divisor=world, step=0)  # a new plan: agreed first
    reducer.reduce(grads.clone(), slices, {}, divisor=world, step=1)  # an ordinary reduction
    reducer.verify_checks()
    return counted["ops"]


def measure(worlds, numel: int) -> list:
    rows = []
    for fmt in FORMATS:
        for world in worlds:
            ops = run_local(world, _rank, fmt, numel)
            rows.append({"format": fmt, "world": world, "numel": numel, "ops_per_section": max(ops),
                         "ops_per_source": max(ops) / (world - 1)})
    return rows


def main(argv=None) -> list:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[4, 8, 16, 32])
    parser.add_argument("--numel", type=int, default=65536, help="elements of each owner's section")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = measure(args.worlds, args.numel)
    print("| format | W | elements per section | ATen ops per section (owner side) | per source |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['format']} | {r['world']} | {r['numel']} | {r['ops_per_section']} | {r['ops_per_source']:.1f} |")
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
