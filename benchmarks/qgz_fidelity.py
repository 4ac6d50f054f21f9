"""    .venv/bin/python benchmarks/qgz_fidelity.py [--preset small] [--worlds 8 32] [--ranks-per-node 8] [--json out.json]

GIFT against DeepSpeed's own quantized gradients for ZeRO-3 (ZeRO++ "qgZ",
``zero_quantized_gradients``) on the same real per-rank gradients, in plain L2 and in the
optimizer's metric (issue 44). Defaults: the ``small`` Llama preset (4 layers, 29 ``nn.Linear``
weights, 3.2M elements; route_fidelity's training defaults: 30 AdamW steps), worlds 8 and 32 at 8
ranks a node (1 and 4 nodes), formats nvfp4 and fp8_e4m3: about 1.5 minutes on 2 CPU cores. Smoke run (seconds): ``--preset tiny --worlds 4 8
--ranks-per-node 2 --micro 1 --seq 32 --train-steps 2 --refresh-interval 1``.

qgZ's CUDA kernels do not build here, so ``qgz_reduce`` below is a pure-torch CPU reference of what
DeepSpeed 0.19.8 computes, written from a reading of its sources (paths under
``deepspeed/``; the rules are restated, no code is taken from them):

* Entry and fallbacks (``runtime/comm/coalesced_collectives.py``, ``all_to_all_quant_reduce``;
  called by ``runtime/zero/stage3.py`` ``__avg_scatter_grads`` only when the all-to-all groups exist
  and there are two nodes or more, else the plain ``reduce_scatter_coalesced``). A 1-D tensor, or
  one whose numel is not divisible by 2 W, falls back to ``reduce_scatter_coalesced`` (pre-divided by
  W, exact up to the gradient dtype's rounding). Otherwise the tensor is read flat (row major) as
  fp16: ``swizzle_quant`` hands the data pointer to the kernel as ``__half`` (``ops/csrc/quantization/
  pt_binding.cpp``, ``ds_swizzle_quant``), so the reference rounds the gradient to fp16 first (after
  a power-of-two loss scale, as fp16 training would have; ``loss_scale``).
* Groups of the first hop: ``max(shape[0], shape[1], W)`` contiguous groups of the flat tensor, each
  of ``numel / groups`` elements (``= min(rows, cols)`` for a 2-D weight at least W wide). The
  second hop's groups are that count divided by the ranks per node ``L``, over the ``numel / L``
  elements a rank holds after the first hop, so they have the same size and the same boundaries.
* The INT4 symmetric rule (``ops/csrc/includes/quantization_utils.h``: ``GroupStats<Symmetric>``,
  ``Params<Symmetric, 4>``; ``quantization.h`` ``PackedInt4``): ``amax`` = the group's largest
  ``|x|`` taken in fp16, then in fp32; quantization scale ``s = 16 / (2 amax)`` (fp32; ``s = 1`` when
  ``amax = 0``); code ``q = clamp(round_half_even(float(x) * s), -8, 7)`` (``__float2int_rn``,
  ``conversion_utils.h``), so ``+amax`` maps to 8 and clamps to 7 while ``-amax`` is -8; two codes
  per byte. What is stored and sent is the fp32 ``1 / s = amax / 8``, one per group. Dequantization
  (``dequantization_utils.h`` ``chunk``, ``Params::dequantize``): ``fp16(float(q) * (amax / 8))``.
* Swizzle (``ops/csrc/quantization/swizzled_quantize.cu``, ``swizzled_quant_kernel`` and the note
  above ``launch_swizzled_quant_impl``; pipelining 1): the flat tensor is W contiguous partitions of
  ``numel / W`` (partition p is global rank p's ZeRO-3 shard); partition ``p = a L + b`` (node a,
  local rank b) is written to slot ``b * nodes + a``. The intra-node ``all_to_all_single`` (group
  ``local_<node>``, ``utils/groups.py`` ``_get_local_all_to_all_group``) cuts the swizzled codes and
  scales into L equal chunks: local rank b receives from each rank of its node the partitions
  ``a L + b`` of every node a, in node order.
* ``quantized_reduction`` (``ops/csrc/quantization/quant_reduce.cu``, ``dequant_reduce``): for each
  element, the L received copies are dequantized to fp16 and added in fp16 (``__half2`` adds, source
  rank 0 .. L-1, from 0): a SUM, not a mean. The fp16 sums are re-quantized with the same INT4 rule
  over groups of the same size (absmax of the fp16 sums).
* Inter-node ``all_to_all_single`` (group ``global_<local rank>``: the ranks of equal local rank on
  every node) sends chunk a' (partition ``a' L + b``) to node a'. ``dequantize`` (``dequantize.cu``,
  the fp16 instantiation) gives fp16; ``sum(final_output.chunk(num_nodes)) / num_nodes`` adds the
  nodes' copies in fp16 (node order, from 0) and divides in fp16.
* Scale: that output is ``sum over all W ranks / nodes = L x the mean``, and ``__avg_scatter_grads``
  does not divide it further (``reduce_scatter_coalesced`` pre-divides by W; this path does not).
  ``qgz_reduce`` returns the mean (it divides by L in fp32); ``deepspeed_scale=True`` returns
  DeepSpeed's raw scale.

Bytes on the wire per element carried, each hop: ``0.5 + 4 / group_size`` (INT4 codes, fp32 scale a
group): 0.5156 for a 256-wide layer. Per rank, hop 1 sends ``(L-1)/L numel`` such elements over the
node's links, hop 2 ``(nodes-1)/nodes numel / L`` over the NICs.

Layout limits the reference enforces (``layout="strict"``), where the kernels would silently
misplace data: the group count must be a multiple of W (``launch_swizzled_quant_impl`` launches
``groups / W`` whole groups a partition, rounding down, so a partition of ``numel / W`` elements must
hold whole groups) and a group must be a multiple of 8 elements (16-byte loads and stores). In the
``small`` preset the MLP weights (688 x 256) have 688 groups: fine at W = 8, not a multiple of 32 at
W = 32, where DeepSpeed would mis-lay them. The benchmark then runs ``layout="aligned"``: the smallest
group count above DeepSpeed's that is a multiple of W and gives groups of a multiple of 8 elements
(1376 groups of 128 for 688 x 256: smaller groups, in qgZ's favour), flags those layers, and also
reports the aggregate over the layers DeepSpeed lays out exactly.

The comparison (each W; gradients from ``benchmarks/route_fidelity.py``'s ``train_and_capture``,
its defaults, with AdamW's state before the capture step kept as ``benchmarks/fidelity.py`` keeps
it): for every ``nn.Linear`` weight, the exact fp64 mean of the W per-rank gradients against

* ``qgZ INT4``: ``qgz_reduce`` with L = ``--ranks-per-node`` (at W = L, one node, DeepSpeed itself
  would not run qgZ but an exact reduce-scatter; the row shows the algorithm's one-hop error);
* GIFT with each format (the default config's codec, ``route_fidelity.main_codec``), as the plugin
  reduces a ZeRO-3 partition (every rank owns 1/W of every layer: ``route_fidelity``'s ``balanced``
  layout, each layer's rows cut in W runs), the owner's own contribution exact: one node, the flat
  ``GiftReducer`` route ``direct``; several nodes, ``TwoLevelReducer`` (node stage exact, then one
  quantized copy per node among the nodes, inner route ``direct``). Coordinates (``--coordinates``):
  Euclidean, kfac (``route_fidelity``'s whitener, ``--kfac``) and hadamard (the plugin's
  ``geometry.kind: hadamard``: each layer's seeded random-sign Hadamard rotation, built as
  ``lifecycle.GeometryManager`` builds it for ``--seed``; orthonormal, so plain L2 errors are the
  rotated coordinates' own).

Errors, layers combined as ``sqrt(sum err^2 / sum ref^2)``: ``rel L2``; ``whitened`` (``||E S|| /
||G S||``, S the kfac whitener: route_fidelity's ruler); ``Adam upd``: the error of AdamW's next
direction ``m_hat / (sqrt(v_hat) + eps)`` from its real state (``fidelity.py``'s ``adam_update_rel_err``,
``deepspeed_gift.core.metrics.AdamRule``). ``B/elem inter`` is what the NICs carry per element of
an inter-node hop (GIFT: the codec's ``nbytes``), ``B/elem intra`` the node's links (GIFT's node stage
runs in the bucket's dtype: 2 B under bf16; the simulation sums it in fp32).
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import time
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import fidelity as fid  # noqa: E402
from benchmarks import route_fidelity as rf  # noqa: E402
from benchmarks.results import write_json  # noqa: E402
from deepspeed_gift.core import geometry as geo  # noqa: E402
from deepspeed_gift.core import metrics as fm  # noqa: E402

FP16_MAX = 65504.0
INT4_MIN, INT4_MAX = -8, 7
SCALE_BYTES = 4  # fp32 scale per group


# ------------------------------------------------------------------------------ the qgZ reference


def int4_quantize(x: Tensor) -> Tuple[Tensor, Tensor]:
    """Symmetric INT4 of fp16 groups ``x`` (..., group): int8 codes in [-8, 7] and the fp32 value
    stored per group, ``amax / 8`` (the reciprocal of the quantization scale ``16 / (2 amax)``)."""
    if x.dtype != torch.float16:
        raise TypeError("qgZ quantizes fp16 values")
    amax = x.abs().amax(dim=-1).float()
    one = torch.ones((), dtype=torch.float32)
    scale = torch.where(amax == 0, one, torch.tensor(16.0) / (2.0 * amax))
    codes = torch.round(x.float() * scale.unsqueeze(-1)).clamp_(INT4_MIN, INT4_MAX).to(torch.int8)
    return codes, (1.0 / scale).float()


def int4_dequantize(codes: Tensor, stored: Tensor) -> Tensor:
    """fp16 values of INT4 ``codes`` with the per-group stored ``amax / 8``."""
    return (codes.float() * stored.unsqueeze(-1)).half()


def group_count(shape: Sequence[int], world: int, ranks_per_node: int, layout: str = "strict") -> Tuple[int, bool]:
    """The first hop's group count and whether it is DeepSpeed's own (``max(rows, cols, W)``).
    ``layout="aligned"``: where DeepSpeed's count would mis-lay the data, the smallest larger count
    that is a multiple of W, divides numel and gives groups of a multiple of 8 elements."""
    numel = math.prod(shape)
    groups = max(shape[0], shape[1], world)

    def fits(g: int) -> bool:
        return g % world == 0 and numel % g == 0 and (numel // g) % 8 == 0 and (g // ranks_per_node) % (
            world // ranks_per_node) == 0

    if fits(groups):
        return groups, True
    if layout == "strict":
        raise ValueError(f"shape {tuple(shape)} at W = {world}: {groups} groups of {numel / groups:g} elements; the "
                         f"kernels need a multiple of W groups of a multiple of 8 elements (layout='aligned' rounds)")
    g = groups + 1
    while g <= numel and not fits(g):
        g += 1
    if g > numel:
        raise ValueError(f"shape {tuple(shape)} at W = {world}: no aligned group count")
    return g, False


def qgz_reduce(grads_per_rank: List[Tensor], ranks_per_node: int, *, loss_scale: Optional[float] = None,
               layout: str = "strict", deepspeed_scale: bool = False, groups: Optional[int] = None) -> Tensor:
    """The tensor every rank's ZeRO-3 shard of qgZ's reduction assembles into (the module docstring
    has each rule and its source). ``grads_per_rank[r]`` is global rank r's gradient (rank r = node
    ``r // L``, local rank ``r % L``). Returns the mean over ranks (fp32, the input's shape), or
    DeepSpeed's own ``L x mean`` with ``deepspeed_scale``. ``loss_scale``: the gradients are multiplied
    by it before the fp16 cast and divided after (None: the largest power of two that keeps
    ``W max|g|`` within fp16, as a dynamic loss scaler would find)."""
    world = len(grads_per_rank)
    L = ranks_per_node
    if world % L:
        raise ValueError(f"W = {world} is not a whole number of nodes of {L}")
    nodes = world // L
    shape = grads_per_rank[0].shape
    stacked = torch.stack([g.detach().float().reshape(-1) for g in grads_per_rank])
    numel = stacked.shape[1]
    if loss_scale is None:
        amax = float(stacked.abs().max())
        loss_scale = 2.0 ** math.floor(math.log2(FP16_MAX / (world * amax))) if amax > 0 else 1.0
    x = (stacked * loss_scale).half()

    if len(shape) < 2 or numel % (2 * world):
        # reduce_scatter_coalesced: pre-divided by W, summed (fp32 here; NCCL's fp16 order is not modelled)
        out = (x / world).float().sum(0) * (L if deepspeed_scale else 1)
        return (out / loss_scale).reshape(shape)

    if groups is None:
        groups, _ = group_count(shape, world, L, layout)
    size = numel // groups  # elements a group (both hops)
    per_part = groups // world  # groups a partition

    # hop 1: every rank quantizes its whole tensor, then swizzles partition p = a L + b to slot b * nodes + a
    codes, stored = int4_quantize(x.view(world, groups, size))
    codes = codes.view(world, world, per_part, size)
    stored = stored.view(world, world, per_part)
    slot_of = torch.tensor([(p % L) * nodes + p // L for p in range(world)])
    part_in_slot = torch.empty(world, dtype=torch.long)
    part_in_slot[slot_of] = torch.arange(world)
    codes, stored = codes[:, part_in_slot], stored[:, part_in_slot]
    # sender (node a, local j), chunk for local rank b, slot within the chunk = destination node a'
    codes = codes.reshape(nodes, L, L, nodes, per_part, size)
    stored = stored.reshape(nodes, L, L, nodes, per_part)

    # quantized_reduction at (node a, local b): fp16 sum over the L senders j in order, from 0
    acc = torch.zeros((nodes, L, nodes, per_part, size), dtype=torch.float16)
    for j in range(L):
        acc = acc + int4_dequantize(codes[:, j], stored[:, j])
    codes2, stored2 = int4_quantize(acc)  # same group size: per_part groups a partition

    # hop 2: (a, b) sends chunk a' to (a', b); the receiver dequantizes and adds the nodes' copies in fp16
    total = torch.zeros((L, nodes, per_part, size), dtype=torch.float16)
    for a in range(nodes):
        total = total + int4_dequantize(codes2[a], stored2[a])
    total = total / nodes  # fp16: DeepSpeed's output, L x the mean
    # (b, a') holds partition a' L + b: back to partition order
    out = total.permute(1, 0, 2, 3).reshape(numel).float()
    if not deepspeed_scale:
        out = out / L
    return (out / loss_scale).reshape(shape)


def qgz_bytes_per_element(shape: Sequence[int], world: int, ranks_per_node: int, layout: str = "aligned") -> float:
    """Wire bytes per element carried on either hop: half a byte of code plus a group's fp32 scale."""
    groups, _ = group_count(shape, world, ranks_per_node, layout)
    return 0.5 + SCALE_BYTES * groups / math.prod(shape)


# ------------------------------------------------------------------------------ the comparison


def capture_with_rules(args, ranks: int):
    """``route_fidelity.train_and_capture`` (the same gradients and whitener) with AdamW's state
    before the capture step kept (``fidelity.capture_step(want_rules=True)``, as fidelity.py does)."""
    kept = {}
    original = fid.capture_step

    def keep_rules(*a, **k):
        k["want_rules"] = True
        cap = original(*a, **k)
        kept["rules"] = cap.rules
        return cap

    fid.capture_step = keep_rules
    try:
        cap = rf.train_and_capture(args, ranks)
    finally:
        fid.capture_step = original
    return cap, kept["rules"]


def gift_spec(world: int, per_node: int) -> rf.RouteSpec:
    """A ZeRO-3 partition the GIFT way: every layer's rows in W runs, one to each rank; flat on one
    node, two-level on several."""
    if world >= 2 * per_node and world % per_node == 0:
        return rf.RouteSpec("gift_2l", "GIFT 2L", layout="balanced", route="direct", two_level=True)
    return rf.RouteSpec("gift_flat", "GIFT flat", layout="balanced", route="direct")


def layer_errors(avg: Tensor, exact: Tensor, ruler, adam: fm.AdamRule) -> Dict[str, Tuple[float, float]]:
    """Per metric: (squared error, squared reference) of one layer."""
    e = avg.double() - exact
    ex = exact.float()
    d_exact = adam.direction(ex).double()
    return {
        "rel_l2": (float(e.square().sum()), float(exact.square().sum())),
        "whitened": (float(ruler.apply(e.float()).double().square().sum()),
                     float(ruler.apply(ex).double().square().sum())),
        "adam_upd": (float((adam.direction(avg.float()).double() - d_exact).square().sum()),
                     float(d_exact.square().sum())),
    }


METRICS = ("rel_l2", "whitened", "adam_upd")


def aggregate(per_layer: Dict[str, Dict[str, Tuple[float, float]]], names: Sequence[str]) -> Dict[str, float]:
    return {m: math.sqrt(sum(per_layer[n][m][0] for n in names) / sum(per_layer[n][m][1] for n in names))
            for m in METRICS}


COORDINATES = ("euclidean", "kfac", "hadamard")


def coordinates_of(geom: str, cap, seed: int) -> Optional[Dict[str, object]]:
    """Each layer's transform in coordinates ``geom`` (None: Euclidean): the captured kfac
    whitener, or the plugin's own data-independent rotation (``geo.FIXED_KINDS``, the seed
    ``lifecycle.GeometryManager`` gives layer i of the sorted names)."""
    if geom == "euclidean":
        return None
    if geom == "kfac":
        return cap.whiteners
    build = geo.FIXED_KINDS[geo.GeometryKind(geom)]
    return {n: build(cap.shapes[n][1], seed * 1_000_003 + i) for i, n in enumerate(sorted(cap.names))}


def parse_args(argv):
    p = argparse.ArgumentParser(description="GIFT against DeepSpeed's qgZ INT4 (a CPU reference) on real gradients",
                                epilog="Any other option goes to benchmarks/route_fidelity.py's parser (--micro, "
                                       "--seq, --train-steps, --refresh-interval, --kfac, --seed, ...).")
    p.add_argument("--worlds", type=int, nargs="+", default=[8, 32])
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--formats", nargs="+", default=["nvfp4", "fp8_e4m3"])
    p.add_argument("--coordinates", nargs="+", choices=COORDINATES, default=["euclidean", "kfac"])
    p.add_argument("--json", default=None)
    mine, rest = p.parse_known_args(argv)
    args = rf.parse_args(["--worlds", *map(str, mine.worlds), "--ranks-per-node", str(mine.ranks_per_node),
                          "--formats", *mine.formats, "--layout-models", *rest])
    args.json, args.coordinates = mine.json, list(dict.fromkeys(mine.coordinates))
    for w in args.worlds:
        if w % args.ranks_per_node:
            raise SystemExit(f"W = {w} is not a whole number of nodes of {args.ranks_per_node}")
    return args


def main(argv: Optional[List[str]] = None) -> dict:
    return rf.run_ranks_as_threads(_run, parse_args(argv), argv)


def _run(args, argv) -> dict:
    t_start = time.perf_counter()
    worlds = sorted(set(args.worlds))
    G = args.ranks_per_node
    fmts = list(dict.fromkeys(args.formats))
    codecs = {f: rf.main_codec(f) for f in fmts}
    relay = {f: rf.default_relay_codec(f) for f in fmts}
    cap, rules = capture_with_rules(args, max(worlds))
    names = cap.names
    print(f"model: {cap.model_label}, {len(names)} Linear weights, "
          f"{sum(o * i for o, i in cap.shapes.values()) / 1e6:.2f}M elements; {args.train_steps} AdamW steps "
          f"(loss {cap.losses[0] if cap.losses else cap.capture_loss:.3f} -> {cap.capture_loss:.3f}); kfac {args.kfac}; "
          f"capture of {max(worlds)} ranks ({cap.seconds:.1f} s)", flush=True)

    results: dict = {}
    for w in worlds:
        nodes = w // G
        grads = {n: cap.grads[n][:w] for n in names}
        exact = {n: g.double().mean(0) for n, g in grads.items()}
        # one loss scale for the model, as a dynamic loss scaler has
        amax = max(float(g.abs().max()) for g in grads.values())
        loss_scale = 2.0 ** math.floor(math.log2(FP16_MAX / (w * amax)))
        row: dict = {}
        t0 = time.perf_counter()
        per_layer, ds_exact, qbytes = {}, [], {}
        for n in names:
            gcount, own = group_count(cap.shapes[n], w, G, "aligned")
            if own:
                ds_exact.append(n)
            qbytes[n] = 0.5 + SCALE_BYTES * gcount / (cap.shapes[n][0] * cap.shapes[n][1])
            avg = qgz_reduce(list(grads[n]), G, loss_scale=loss_scale, groups=gcount)
            per_layer[n] = layer_errors(avg, exact[n], cap.whiteners[n], rules[n].adam)
        numel = {n: cap.shapes[n][0] * cap.shapes[n][1] for n in names}
        qb = sum(qbytes[n] * numel[n] for n in names) / sum(numel.values())
        row["qgz_int4"] = dict(aggregate(per_layer, names), label="qgZ INT4", bytes_inter=qb if nodes > 1 else 0.0,
                               bytes_intra=qb, seconds=time.perf_counter() - t0,
                               ds_layout_layers=ds_exact, loss_scale=loss_scale,
                               layers={n: {m: math.sqrt(v[0] / v[1]) for m, v in per_layer[n].items()} for n in names})
        if ds_exact and len(ds_exact) < len(names):
            row["qgz_int4"]["ds_layout_only"] = aggregate(per_layer, ds_exact)
        print(f"  W={w}: qgZ INT4 rel_l2 {row['qgz_int4']['rel_l2']:.4f} ({time.perf_counter() - t0:.1f} s)", flush=True)
        spec = gift_spec(w, G)
        for f in fmts:
            for geom in args.coordinates:
                t0 = time.perf_counter()
                whiteners = coordinates_of(geom, cap, args.seed)
                reduced, stats = rf.reduce_model(grads, cap.shapes, names, spec, codecs[f], relay[f], whiteners, w,
                                                 G if spec.two_level else 1, args.owners)
                per_layer = {n: layer_errors(reduced[n], exact[n], cap.whiteners[n], rules[n].adam) for n in names}
                b = rf.bytes_per_element(codecs[f])
                key = f"gift_{f}_{geom}"
                row[key] = dict(aggregate(per_layer, names), label=f"GIFT {f} {geom}",
                                bytes_inter=b if nodes > 1 else 0.0, bytes_intra=2.0 if nodes > 1 else b,
                                route=spec.label, relay_buckets=stats.relay_buckets,
                                balanced_buckets=stats.balanced_buckets, seconds=time.perf_counter() - t0,
                                layers={n: {m: math.sqrt(v[0] / v[1]) for m, v in per_layer[n].items()}
                                        for n in names})
                if ds_exact and len(ds_exact) < len(names):
                    row[key]["ds_layout_only"] = aggregate(per_layer, ds_exact)
                print(f"  W={w}: {row[key]['label']} ({spec.label}) rel_l2 {row[key]['rel_l2']:.4f} "
                      f"({time.perf_counter() - t0:.1f} s)", flush=True)
        results[str(w)] = row

    print_tables(results, worlds, G, fmts, args.coordinates)
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.1f} s (model + capture {cap.seconds:.1f} s, {torch.get_num_threads()} threads)")
    out = {
        "command": [os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv)),
        "model": cap.model_label, "args": {k: v for k, v in vars(args).items()},
        "ranks_per_node": G,
        "layers": [{"name": n, "out": cap.shapes[n][0], "in": cap.shapes[n][1]} for n in names],
        "results": results, "wall_s": wall, "torch": torch.__version__, "machine": platform.machine(),
    }
    write_json(args.json, out)
    return out


def print_tables(results: dict, worlds: Sequence[int], G: int, fmts: Sequence[str],
                 coordinates: Sequence[str] = COORDINATES) -> None:
    print("\nErrors against the exact fp64 mean of the same W gradients, layers combined as sqrt(sum err^2 / "
          "sum ref^2); whitened: ||E S|| / ||G S|| with the kfac whitener S; Adam upd: AdamW's next direction from "
          "its real state. B/elem: wire bytes per element carried on an inter-node (intra-node) hop.")
    print("| W (nodes x G) | method | route | B/elem inter | B/elem intra | rel L2 | whitened | Adam upd | "
          "rel L2 / qgZ | Adam upd / qgZ |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for w in worlds:
        row = results[str(w)]
        q = row["qgz_int4"]
        for key, r in row.items():
            route = r.get("route", "swizzle + 2 all-to-all" if w > G else "swizzle + 1 all-to-all")
            print(f"| {w} ({w // G} x {G}) | {r['label']} | {route} | {r['bytes_inter']:.4f} | {r['bytes_intra']:.4f} "
                  f"| {r['rel_l2']:.4f} | {r['whitened']:.4f} | {r['adam_upd']:.4f} | {r['rel_l2'] / q['rel_l2']:.3f} "
                  f"| {r['adam_upd'] / q['adam_upd']:.3f} |")
    for geom in coordinates if "euclidean" in coordinates else ():
        if geom == "euclidean":
            continue
        print(f"\nGIFT {geom} / GIFT Euclidean (same format and W; < 1: the coordinates help)")
        print("| W | format | rel L2 | whitened | Adam upd |")
        print("|---|---|---|---|---|")
        for w in worlds:
            row = results[str(w)]
            for f in fmts:
                k, e = row[f"gift_{f}_{geom}"], row[f"gift_{f}_euclidean"]
                print(f"| {w} | {f} | {k['rel_l2'] / e['rel_l2']:.3f} | {k['whitened'] / e['whitened']:.3f} "
                      f"| {k['adam_upd'] / e['adam_upd']:.3f} |")
    partial = [w for w in worlds if "ds_layout_only" in results[str(w)]["qgz_int4"]]
    for w in partial:
        row = results[str(w)]
        print(f"\nW={w}: only the {len(row['qgz_int4']['ds_layout_layers'])} layers DeepSpeed's kernels lay out as "
              f"written (the others ran with aligned groups, see the docstring):")
        print("| method | rel L2 | whitened | Adam upd | rel L2 / qgZ |")
        print("|---|---|---|---|---|")
        q = row["qgz_int4"]["ds_layout_only"]
        for key, r in row.items():
            d = r["ds_layout_only"]
            print(f"| {r['label']} | {d['rel_l2']:.4f} | {d['whitened']:.4f} | {d['adam_upd']:.4f} "
                  f"| {d['rel_l2'] / q['rel_l2']:.3f} |")


if __name__ == "__main__":
    main()
