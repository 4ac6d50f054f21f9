"""    .venv/bin/python benchmarks/host_syncs.py [--worlds 2 4 8] [--steps 6] [--json out.json]

Host conversions and host-to-device copies inside one bucket's reduction, per bucket, on real
DeepSpeed ZeRO-2 engines (the tiny Llama of ``tests/harness.py``, ranks forked on this machine
over gloo): every call of ``item``, ``tolist``, ``bool``/``int``/``float``/``index`` of a
tensor, ``cpu()``, ``numpy()``, ``torch.equal``, ``nonzero``, ``masked_select`` or a
boolean-mask index, and every tensor made from host data (``torch.tensor``, ``as_tensor``,
``new_tensor``: on an accelerator a pageable copy) or copied from unpinned host memory to an
accelerator, made while GIFT's ``average_tensor`` runs. On a GPU each one waits for
DeepSpeed's reduction stream, which runs behind the backward. Steps are split into *ordinary*
ones (no telemetry sample, no geometry refresh, no statistics collection, no new plan: these
must make none) and the others, which may sync and are printed beside them; a bucket's first
reduction under a new plan (its first step, the first after a refresh) agrees on the plan with
the other ranks, one host read. Configs: fp8 + kfac + error feedback, nvfp4, fp8 over the relay,
and fp8 with ``gift.params`` (whose parameter all-gathers, in ``allgather_bucket_size`` chunks,
are counted too: ordinary steps are those without a telemetry sample); flat and two-level
(nodes of 2 ranks).
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.results import write_json  # noqa: E402

_T = torch.Tensor
# What makes the host wait for the device: a value read back, or a shape that depends on data.
HOST_SYNCS = {_T.item: "item", _T.tolist: "tolist", _T.__bool__: "bool", _T.__int__: "int", _T.__float__: "float",
              _T.__index__: "index", _T.cpu: "cpu", _T.numpy: "numpy", torch.equal: "equal", _T.equal: "equal",
              _T.nonzero: "nonzero", torch.nonzero: "nonzero", torch.masked_select: "masked_select",
              _T.masked_select: "masked_select"}


# What puts host memory on the device path: a tensor made from Python data is host memory, and on
# an accelerator it reaches the device by a pageable copy (a synchronizing one); counted on every
# run. A copy of an unpinned host tensor to an accelerator is counted where it happens (on a
# CPU run every device is the host: only the constructors can be seen there, and the code makes
# its per-step values on the device by fills, so a constructor in a reduction is a copy a GPU
# run would make).
HOST_DATA = {torch.tensor: "tensor", torch.as_tensor: "as_tensor", _T.new_tensor: "new_tensor"}
HOST_COPIES = ("tensor", "as_tensor", "new_tensor", "pageable_copy")


class HostSyncCounter(TorchFunctionMode):
    """Counts, by name, the calls in ``HOST_SYNCS`` (and indexing by a boolean tensor) and the
    host data of ``HOST_DATA`` and pageable host-to-accelerator copies (``HOST_COPIES``) made
    while the mode is active on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = HOST_SYNCS.get(func) or HOST_DATA.get(func)
        if name is None and func is _T.__getitem__ and len(args) > 1 and _has_bool_tensor(args[1]):
            name = "bool_index"
        if name is None and _pageable_to_accelerator(func, args, kwargs):
            name = "pageable_copy"
        if name is not None:
            self.counts[name] += 1
        return func(*args, **kwargs)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    @property
    def copies(self) -> int:
        """Of :attr:`total`, the host data and pageable copies (``HOST_COPIES``)."""
        return sum(n for name, n in self.counts.items() if name in HOST_COPIES)


def _pageable_to_accelerator(func, args, kwargs) -> bool:
    """``func`` copies an unpinned host tensor to an accelerator (``.to``, ``.cuda``, ``copy_``)."""
    if func is _T.to or func is _T.cuda:
        src = args[0]
        if func is _T.cuda:
            target = torch.device("cuda")
        else:
            target = torch._C._nn._parse_to(*args[1:], **{k: v for k, v in kwargs.items() if k != "copy"})[0]
        return (isinstance(src, torch.Tensor) and target is not None and target.type != "cpu"
                and src.device.type == "cpu" and not src.is_pinned())
    if func is _T.copy_ and len(args) > 1 and isinstance(args[1], torch.Tensor):
        dst, src = args[0], args[1]
        return dst.device.type != "cpu" and src.device.type == "cpu" and not src.is_pinned()
    return False


def copies_of(counts: dict) -> int:
    """The host data and pageable copies in a ``counts`` record."""
    return sum(n for name, n in counts.items() if name in HOST_COPIES)


def _has_bool_tensor(index) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in items)


def count_bucket_syncs(gift) -> list:
    """Wrap the optimizer's ``average_tensor`` (GIFT's, once ``gift``, a ``GiftState``, is
    attached) so every bucket's reduction runs under a :class:`HostSyncCounter`; returns the
    list it appends ``{"step", "ordinary", "planned", "counts"}`` to: a reduction that made a new plan
    (a bucket's first step, the first after a refresh) agrees on it with the other ranks, one host
    read, and is not ordinary (``planned``). ZeRO-1's balanced rounds are counted
    whole, once a step, as an entry marked ``"where": "rounds"`` (the buckets then pass). With ``gift.params``, each step's
    parameter all-gather is counted too, its entries marked ``"where": "params"`` (ordinary: not a
    telemetry sample, which reads the replica-target gap)."""
    seen: list = []
    native = gift.opt.average_tensor

    def counted_call(run, k, **where):
        geometry = gift.geometry
        ordinary = not (gift.sampled(k) or geometry.refresh_due(k) or geometry.collecting())
        agreed = gift.reducer.plans_agreed
        with HostSyncCounter() as counter:
            run()
        planned = gift.reducer.plans_agreed != agreed  # a new plan, agreed by the ranks: a host read
        seen.append({"step": k, "ordinary": ordinary and not planned, "planned": planned,
                     "counts": dict(counter.counts), **where})

    def counted(tensor, dtype):
        counted_call(lambda: native(tensor, dtype), gift.k)

    gift.opt.average_tensor = counted
    native_rounds = gift.reduce_in_rounds

    def counted_rounds(k):  # ZeRO-1's balanced rounds (gift.stage1_rounds): the step's reduction, one entry
        counted_call(lambda: native_rounds(k), k, where="rounds")

    gift.reduce_in_rounds = counted_rounds
    if gift.params is not None:  # gift.params: the step's parameter all-gather too, as "where": "params"
        native_gather = gift.gather_params

        def counted_gather(native_all_gather):
            k = gift.k
            with HostSyncCounter() as counter:
                native_gather(native_all_gather)
            seen.append({"step": k, "ordinary": not gift.sampled(k), "counts": dict(counter.counts),
                         "where": "params"})

        gift.gather_params = counted_gather
    return seen


FP8_KFAC_EF = {"format": "fp8_e4m3", "layers": "all", "error_feedback": True,
               "geometry": {"rank": 8, "refresh_interval": 3, "collect_interval": 3}, "telemetry": {"every": 3}}
NVFP4 = {"format": "nvfp4", "layers": "all", "geometry": {"rank": 8, "refresh_interval": 3, "collect_interval": 3},
         "telemetry": {"every": 3}}
# fp8 deltas of the parameters (gift.params), gathered in chunks: the harness's allgather_bucket_size
# of 1e6 holds a 2-rank partition of its Llama whole, so the runs below cut it (ZERO_CHUNKED)
FP8_PARAMS = dict(FP8_KFAC_EF, params={})
ZERO_CHUNKED = {"allgather_bucket_size": 8192}
# the relay route forced (by_layout picks it only for buckets that reach few owners)
FP8_RELAY = dict(FP8_KFAC_EF, route="relay")
CONFIGS = {"fp8+kfac+ef": FP8_KFAC_EF, "nvfp4": NVFP4, "fp8+relay": FP8_RELAY, "fp8+params": FP8_PARAMS}


def split_entries(entries: list) -> tuple:
    """(the buckets' entries, the parameter all-gathers')."""
    return ([e for e in entries if e.get("where") != "params"], [e for e in entries if e.get("where") == "params"])


def per_bucket(buckets: list, ordinary: bool, count=lambda counts: sum(counts.values())) -> float:
    """Mean of ``count(counts)`` (default: everything counted) over the entries that are (not)
    ordinary; nan where there are none."""
    chosen = [b for b in buckets if b["ordinary"] == ordinary]
    return sum(count(b["counts"]) for b in chosen) / len(chosen) if chosen else float("nan")


def _rank_body(rank, world, specs):
    from tests.harness import train

    return [train(rank, world, spec)["host_syncs"] for spec in specs]


def measure(world: int, steps: int) -> list:
    from launch.spawn import run_ranks

    specs, names = [], []
    for name, gift in CONFIGS.items():
        for hierarchy in (("flat", "two_level") if world >= 4 else ("flat",)):
            block = dict(gift, hierarchy=hierarchy, **({"ranks_per_node": 2} if hierarchy == "two_level" else {}))
            specs.append(dict(stage=2, steps=steps, bucket=20000, gift=block, count_syncs=True,
                              **({"zero": ZERO_CHUNKED} if "params" in gift else {})))
            names.append((name, hierarchy))
    per_rank = run_ranks(_rank_body, world, specs, timeout=600)
    rows = []
    for i, (name, hierarchy) in enumerate(names):
        buckets, gathers = split_entries([b for rank in per_rank for b in rank[i]])
        kinds = collections.Counter()
        for b in buckets + gathers:
            if b["ordinary"]:
                kinds.update(b["counts"])
        rows.append({"world": world, "config": name, "hierarchy": hierarchy,
                     "buckets": len(buckets) // world, "ordinary_per_bucket": per_bucket(buckets, True),
                     "ordinary_copies_per_bucket": per_bucket(buckets, True, copies_of),
                     "planned_buckets": sum(bool(b.get("planned")) for b in buckets) // world,
                     "other_per_bucket": per_bucket(buckets, False), "ordinary_kinds": dict(kinds),
                     "ordinary_per_gather": per_bucket(gathers, True), "other_per_gather": per_bucket(gathers, False)})
    return rows


def _num(x: float) -> str:
    return "-" if x != x else f"{x:.2f}"  # nan: no parameter all-gather in that config


def main(argv=None) -> list:
    parser = argparse.ArgumentParser()
    parser.add_argument("--worlds", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = [row for world in args.worlds for row in measure(world, args.steps)]
    print("| W | config | hierarchy | buckets/rank | of them new plans | syncs + copies per bucket, ordinary steps "
          "| of them pageable copies | other steps | per parameter all-gather, ordinary | other | ordinary by kind |")
    print("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['world']} | {r['config']} | {r['hierarchy']} | {r['buckets']} | {r['planned_buckets']} | "
              f"{r['ordinary_per_bucket']:.2f} | {r['ordinary_copies_per_bucket']:.2f} | {r['other_per_bucket']:.2f} | "
              f"{_num(r['ordinary_per_gather'])} | {_num(r['other_per_gather'])} | {r['ordinary_kinds'] or '-'} |")
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
