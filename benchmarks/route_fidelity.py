"""    .venv/bin/python benchmarks/route_fidelity.py [--preset small] [--worlds 4 8 16 32] [--formats fp8_e4m3 nvfp4 int4] [--json out.json]

The error each route of the gradient exchange adds, measured on real per-rank gradients of a
real model with the plugin's own reducer at W simulated ranks, beside the bytes its busiest link
carries against DeepSpeed's bf16 all-reduce (the reducer's plans for this model, and the layout
rules of 7B and 13B).

What it does, in order:

1. Trains a Llama preset of ``launch/pretrain.py`` on the byte corpus with ``benchmarks/fidelity.py``'s
   machinery (``build_model``, ``Training``, ``train_step``, ``capture_step``, ``MomentHooks``,
   ``WhitenerFactory``): ``--train-steps`` AdamW steps on a global batch of ``--train-ranks``
   micro-batches of ``--micro`` x ``--seq`` tokens, the rank-averaged ``x x^T`` of every ``nn.Linear``
   input folded into an EMA (``--stats-decay``) every ``--collect-interval`` steps. The kfac whitener
   (``--kfac``) is fitted on that EMA ``--refresh-interval`` steps before the capture, as stale as the
   plugin's before its next refresh. Then one capture step: max(W) ranks, each its own distinct
   micro-batch, every rank's gradient of every ``nn.Linear`` weight kept. A world of W ranks reduces
   the gradients of the first W of them (one trained model for every W).
2. Every route reduces all the layers with the plugin's ``GiftReducer`` (or ``TwoLevelReducer``), the
   ranks as threads (``exchange.comm.run_local``), in one bucket laid out by hand as ``ParamSlice``s.
   An owner's own contribution stays exact, as in the plugin (the reducer does it; the reference below
   is the plain mean of all W gradients). Whole layers are owned in turn by ranks 0 .. min(W,
   ``--owners``) - 1 (layer i by rank i mod that):

   * ``direct``: each layer's whole gradient to its owner (what a ZeRO-2 bucket smaller than a partition
     is: one owner), ``route="direct"``: each element quantized once by each of the W - 1 other ranks.
     Which rank's contribution is the exact one changes the error by up to ~10-20% at W = 4 on small
     models (ranks' gradients differ in size), so ``direct`` is the rms over every rotation of the owners
     (``per_rotation`` in the JSON);
   * ``relay default``: the same layout, ``route="relay"``: chunk j of each owner's section to rank j,
     summed there in fp32, the sum quantized a second time on its way to the owner in the second-hop
     codec the default config resolves for the format (``zero._relay_codec(GiftConfig(format=...))``,
     ``gift.relay_format`` / ``relay_block_size`` unset; the main codec where it returns None). This is
     what the plugin's ``by_layout`` route does with a bucket that reaches one owner;
   * ``relay main`` (JSON ``relay``): the relay with its second hop in the main codec;
   * ``relay int8/128``, ``relay int8/32``, ``relay bf16``: the relay with its second hop in that codec
     (``GiftReducer(relay_codec=...)``); the first hop is the same bits as every relay's;
   * ``balanced`` (the ZeRO-1 route of issue 32): every layer's rows cut into W near-equal contiguous
     runs, run d owned by rank d, ``route="direct"``: every rank owns a slice of every layer and each
     element is quantized once;
   * ``2L owner_slot`` / ``2L balanced`` (W >= 2 G): ``TwoLevelReducer`` with ``--ranks-per-node`` G over
     the node and slot-group comms of ``split_by_node`` (as ``zero.py`` builds it): the node stage sums
     exactly in fp32, then the nodes' partials go through an inner ``GiftReducer`` of route ``direct``
     (the owner_slot split) or ``relay`` (the balanced split, relayed among the nodes: direct at two
     nodes), its second hop the default config's, as the plugin runs it; ``2L balanced main``: the
     same with the second hop in the main codec; ``... node int8/32``: the same with the node stage
     quantized (``gift.node_format: int8``, ``node_block_size: 32``; each rank's gradient in gradient
     coordinates, the receiver's own part exact).

   One bucket, not one per layer: an element's error depends only on its own path (which ranks
   quantize it, how often, whose contribution is exact), which is the same, and the reducer's work per
   rank grows with the sections of a bucket (one per owner), times W for the relay: per-layer buckets
   took 3x (relay) to 11x (balanced) longer at W = 32. What differs: scale blocks that straddle two
   layers of one owner, and a relay chunk of an owner's section covers parts of its layers, not 1/W of
   each (so its exact contributions are spread less evenly than ``balanced``'s; the relays run one
   rotation: up to ~15% of noise at W = 4 on the tiny preset). The ``by_layout`` routes choose by the
   bucket's layout, so they are planned (below), not reduced, with the default config's second hop.

   Codecs: each format as the default config makes it (``GiftConfig(format=...)`` through
   ``zero._main_codec``: fp8_e4m3 and int4 block 128, nvfp4 16). Coordinates: Euclidean (``MAIN``
   slices) and GIFT (``GEO`` slices whitened by the kfac whitener; ``balanced`` cuts at rows, so no row
   falls back to Euclidean).
3. Error of a route = ``||reduced - exact|| / ||exact||`` against the fp64 mean of the same W per-rank
   gradients, layers combined as ``sqrt(sum err^2 / sum ref^2)`` (the error of the whole gradient),
   in L2 and in the whitened norm ``||E S|| / ||G S||`` (``S`` the kfac whitener: one ruler for every
   route and both coordinates, as ``fidelity.py``'s ``whitened`` column; the norm in which GIFT's error
   is isotropic); ratios ``x`` are against ``direct`` at the same W, format and coordinates;
   ``GIFT / Euclidean`` is the GIFT error over the Euclidean one of the same route.
4. Busiest link, two ways:

   * the reducer's own plans (``new_plan`` / ``TwoLevelReducer.plan_for``, nothing reduced) for this model
     in per-layer buckets, each reaching one owner (``balanced``: every rank): the busiest rank's receive
     from other nodes (``recv_max_internode``) summed over the buckets, against DeepSpeed's bf16 ring
     ``2 (W-1)/W N 2 B`` (divided by G for the two-level routes: G rings share a node's G NICs), and how
     many buckets ``by_layout`` relays (flat) or splits balanced (two-level);
   * ``benchmarks/layout_model.py``'s rules (its ``parameter_layout``, ``buckets_of`` and
     ``bucket_link_bytes``) for 7B and 13B at W = 64 and 512, G = 1 and 8, ``--bucket`` elements a
     bucket. ``bucket_link_bytes`` takes one byte rate for both relay hops, so a relay whose second hop
     is in another codec is its docstring's formula, ``(W-G)/W N b + (W-G)/W max N_d b2`` per bucket
     (``b2`` that codec's bytes per element; ``by_layout`` the lighter of it with the default second hop
     and ``direct``, per bucket; ``by_layout main`` the rule's own); ``balanced`` is the rule's flat
     ``direct`` of one bucket
     holding the whole model (every owner's partition once a step), ``2L balanced, one bucket`` its
     ``two_level_by_layout``.

Prints the error tables (per coordinates and format, rows W), GIFT / Euclidean, ``relay default``
against ``direct`` in every ruler with its planned link (one table for the docs), the planned and the
layout-rule busiest-link tables (markdown, ready to paste); ``--json PATH`` writes every number (per-layer errors too).
``--worlds 4 8 16 32 64`` adds W = 64 (its capture holds 64 copies of the model's gradients).
Smoke run (seconds): ``--preset tiny --worlds 4 8 --formats fp8_e4m3 --micro 2 --seq 64 --train-steps 3
--refresh-interval 1 --layout-models 7B``.
"""

from __future__ import annotations

import argparse
import math
import os
import platform
import sys
import threading
import time
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import fidelity as fid  # noqa: E402
from benchmarks import layout_model  # noqa: E402
from benchmarks.results import write_json  # noqa: E402
from deepspeed_gift.core import formats  # noqa: E402
from deepspeed_gift.core import geometry as geo  # noqa: E402
from deepspeed_gift.exchange.comm import LocalComm, group_of, run_local, split_by_node  # noqa: E402
from deepspeed_gift.exchange.plan import GEO, MAIN, ParamSlice  # noqa: E402
from deepspeed_gift.exchange.reducer import GiftReducer  # noqa: E402
from deepspeed_gift.exchange.stats import StepStats  # noqa: E402
from deepspeed_gift.exchange.two_level import TwoLevelReducer  # noqa: E402
from launch.pretrain import PRESETS  # noqa: E402

DEFAULT_FORMATS = ("fp8_e4m3", "nvfp4", "int4")
DEFAULT_WORLDS = (4, 8, 16, 32)
# the relay's second hops besides the main codec: name -> (format, block size)
SECOND_HOPS: Dict[str, Tuple[str, Optional[int]]] = {"int8/128": ("int8", 128), "int8/32": ("int8", 32),
                                                     "bf16": ("bf16", None)}
# RouteSpec.second_hop of the plugin's default: whatever gift.relay_format / relay_block_size resolve
# to with every key at its default under the format (zero._relay_codec), not a fixed codec
DEFAULT_HOP = "default"
LAYOUT_WORLDS = (64, 512)
LAYOUT_PER_NODE = (1, 8)
# A sub-comm's exchange waits at most this long for its group: run_local aborts only the world's
# barrier when a rank fails, so a group's barrier must time out instead of hanging its other ranks.
GROUP_BARRIER_TIMEOUT_S = 300.0
GIL_SWITCH_S = 1e-4  # sys.setswitchinterval while the ranks run (see main)


@dataclass(frozen=True)
class RouteSpec:
    """One way to reduce a layer: its bucket layout, the reducer's route and second hop, flat or two-level."""

    key: str  # JSON key
    label: str  # printed
    layout: str = "one_owner"  # one_owner | balanced (rows cut into W slices, slice d to rank d)
    route: str = "direct"  # GiftReducer route (the inner one for two-level)
    second_hop: Optional[str] = None  # a SECOND_HOPS key, DEFAULT_HOP (the default config's); None: the main codec
    two_level: bool = False
    reduced: bool = True  # False: planned only (its choice depends on the bucket layout; see the docstring)
    # two-level: the node stage in this SECOND_HOPS codec (gift.node_format); None: exact in fp32
    node_hop: Optional[str] = None


def node_hop_codec(spec: RouteSpec):
    """The node stage's codec of ``spec`` (``gift.node_format``), None for the exact fp32 stage."""
    return second_hop_codec(spec.node_hop) if spec.node_hop is not None else None


ROUTES: Tuple[RouteSpec, ...] = (
    RouteSpec("direct", "direct"),
    RouteSpec("relay_default", "relay default", route="relay", second_hop=DEFAULT_HOP),
    RouteSpec("relay", "relay main", route="relay"),
    *(RouteSpec(f"relay_{k.replace('/', '_')}", f"relay {k}", route="relay", second_hop=k) for k in SECOND_HOPS),
    RouteSpec("balanced", "balanced", layout="balanced"),
    # two-level as the plugin runs it: the inner reducer's relay with the default config's second hop
    RouteSpec("two_level_owner_slot", "2L owner_slot", two_level=True, second_hop=DEFAULT_HOP),
    RouteSpec("two_level_balanced", "2L balanced", route="relay", two_level=True, second_hop=DEFAULT_HOP),
    RouteSpec("two_level_balanced_main", "2L balanced main", route="relay", two_level=True),
    # the same with the node stage quantized (gift.node_format int8, node_block_size 32)
    RouteSpec("two_level_owner_slot_node_int8_32", "2L owner_slot, node int8/32", two_level=True,
              second_hop=DEFAULT_HOP, node_hop="int8/32"),
    RouteSpec("two_level_balanced_node_int8_32", "2L balanced, node int8/32", route="relay", two_level=True,
              second_hop=DEFAULT_HOP, node_hop="int8/32"),
    RouteSpec("by_layout", "by_layout", route="by_layout", second_hop=DEFAULT_HOP, reduced=False),
    RouteSpec("two_level_by_layout", "2L by_layout", route="by_layout", two_level=True, second_hop=DEFAULT_HOP,
              reduced=False),
)


# ------------------------------------------------------------------------------ comms and layouts


class LocalGroups:
    """Sub-comms of a :class:`LocalComm` world (``LocalComm`` has no ``split``): the mailbox and
    barrier of each group, made once by whichever member asks first and shared by the others.
    One per ``run_local`` call."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._made: Dict[Tuple[int, int], Tuple[list, threading.Barrier]] = {}

    def comm(self, rank: int, world_size: int, groups: Sequence[Sequence[int]], call: int) -> LocalComm:
        index = group_of(groups, rank, world_size)
        members = sorted(groups[index])
        with self._lock:
            box = self._made.get((call, index))
            if box is None:
                box = self._made[(call, index)] = ([None] * len(members),
                                                   threading.Barrier(len(members), timeout=GROUP_BARRIER_TIMEOUT_S))
        return LocalComm(members.index(rank), len(members), *box)


class LocalSplitter:
    """What ``split_by_node`` needs of a comm (``world_size``, ``split``, ``split_many``) for one rank of a
    :class:`LocalComm` world; every rank calls ``split`` with the same groups in the same order."""

    def __init__(self, comm: LocalComm, groups: LocalGroups) -> None:
        self.rank, self.world_size = comm.rank, comm.world_size
        self._groups, self._calls = groups, 0

    def split(self, groups: Sequence[Sequence[int]]) -> LocalComm:
        self._calls += 1
        return self._groups.comm(self.rank, self.world_size, groups, self._calls)

    def split_many(self, partitions: Sequence[Sequence[Sequence[int]]]) -> List[LocalComm]:
        """``split`` by each partition in order (``Comm.split_many``: what ``split_by_node`` may call)."""
        return [self.split(groups) for groups in partitions]


def layer_slices(spec: RouteSpec, world: int, owner: int, out: int, cols: int, key: int, whitened: bool,
                 at: int = 0) -> List[ParamSlice]:
    """The slices of one (out x cols) layer that starts at ``at`` in the bucket: whole to ``owner``,
    or its rows in ``world`` near-equal contiguous runs, run d to rank d (``balanced``)."""
    mode, unit = (GEO, cols) if whitened else (MAIN, 0)
    if spec.layout == "one_owner":
        return [ParamSlice(owner, at, out * cols, 0, key, unit, mode)]
    edges = [out * d // world for d in range(world + 1)]
    return [ParamSlice(d, at + edges[d] * cols, (edges[d + 1] - edges[d]) * cols, edges[d] * cols, key, unit, mode)
            for d in range(world) if edges[d + 1] > edges[d]]


def owner_of(layer: int, world: int, owners: int, shift: int = 0) -> int:
    """The rank that owns a whole layer: layer i by rank (i + shift) % min(W, --owners)."""
    return (layer + shift) % min(world, owners)


def model_slices(spec: RouteSpec, world: int, shapes: Dict[str, Tuple[int, int]], names: List[str],
                 whitened: bool, owners: int, shift: int = 0) -> List[ParamSlice]:
    """One bucket of every layer in order, each layer whole to its owner (or cut over every rank)."""
    out, at = [], 0
    for i, n in enumerate(names):
        out += layer_slices(spec, world, owner_of(i, world, owners, shift), *shapes[n], i, whitened, at)
        at += shapes[n][0] * shapes[n][1]
    return out


def main_codec(fmt: str):
    """The codec of ``gift.format: fmt`` with every other key at its default, as the plugin makes it."""
    from deepspeed_gift.config import GiftConfig
    from deepspeed_gift.zero import _main_codec

    return _main_codec(GiftConfig(format=fmt))


def default_relay_codec(fmt: str):
    """The relay's second-hop codec of ``gift.format: fmt`` with every other key at its default, as
    the plugin makes it (``zero._relay_codec``; it returns None where that is the main codec)."""
    from deepspeed_gift.config import GiftConfig
    from deepspeed_gift.zero import _relay_codec

    return _relay_codec(GiftConfig(format=fmt)) or main_codec(fmt)


def second_hop_codec(name: str):
    fmt, block = SECOND_HOPS[name]
    return formats.get_format(fmt, block_size=block) if block is not None else formats.get_format(fmt)


def codec_label(codec) -> str:
    """``int8/32``: a codec's format and elements per scale (none for bf16 / fp32)."""
    return f"{codec.name}/{codec.block_size}" if codec.block_size else codec.name


class Hops:
    """The codec of each route's relay second hop, per format."""

    def __init__(self, fmts: Sequence[str]) -> None:
        self.main = {f: main_codec(f) for f in fmts}
        self.default = {f: default_relay_codec(f) for f in fmts}
        self.fixed = {k: second_hop_codec(k) for k in SECOND_HOPS}

    def of(self, spec: RouteSpec, fmt: str):
        if spec.second_hop is None:
            return self.main[fmt]
        return self.default[fmt] if spec.second_hop == DEFAULT_HOP else self.fixed[spec.second_hop]

    def default_is(self, fmt: str) -> Optional[str]:
        """What the default second hop equals: "main", a SECOND_HOPS key, or None."""
        c = self.default[fmt]
        if c is self.main[fmt] or (type(c) is type(self.main[fmt]) and c.block_size == self.main[fmt].block_size):
            return "main"
        return next((k for k, h in self.fixed.items() if type(h) is type(c) and h.block_size == c.block_size), None)


def bytes_per_element(codec) -> float:
    return codec.nbytes(1 << 24) / (1 << 24)


# ------------------------------------------------------------------------------ the reduction


def make_reducer(spec: RouteSpec, comm, codec, relay_codec, per_node: int, groups: Optional["LocalGroups"]):
    """The reducer of ``spec`` for one rank: flat, or two-level over comms split as zero.py splits
    them (``groups`` None: for planning only, comms that never exchange)."""
    if not spec.two_level:
        return GiftReducer(comm, codec, route=spec.route, relay_codec=relay_codec)
    if groups is None:
        node_comm = LocalComm(comm.rank % per_node, per_node, [], None)
        slot_comm = LocalComm(comm.rank // per_node, comm.world_size // per_node, [], None)
    else:
        node_comm, slot_comm = split_by_node(LocalSplitter(comm, groups), per_node)
    inner = GiftReducer(slot_comm, codec, route=spec.route, relay_codec=relay_codec)
    return TwoLevelReducer(node_comm, inner, per_node, node_codec=node_hop_codec(spec))


def reduce_model(grads: Dict[str, Tensor], shapes: Dict[str, Tuple[int, int]], names: List[str], spec: RouteSpec,
                 codec, relay_codec, whiteners: Optional[Dict[str, geo.Whitener]], world: int,
                 per_node: int, owners: int, shift: int = 0) -> Tuple[Dict[str, Tensor], StepStats]:
    """Every layer reduced over the first ``world`` ranks of ``grads`` by ``spec``'s route, all in one
    bucket (see the module docstring); the reduced mean of each layer (assembled from its owners)
    and rank 0's counters."""
    if whiteners is not None and any(whiteners[n].run_unit != shapes[n][1] for n in names):
        raise ValueError("the GEO slices cut whole rows: every whitener's run unit must be its layer's row")
    slices = model_slices(spec, world, shapes, names, whiteners is not None, owners, shift)
    ws = {i: whiteners[n] for i, n in enumerate(names)} if whiteners is not None else {}
    groups = LocalGroups()

    def rank_body(comm):
        reducer = make_reducer(spec, comm, codec, relay_codec, per_node, groups)
        bucket = torch.cat([grads[n][comm.rank].reshape(-1).float() for n in names])
        stats = reducer.reduce(bucket, slices, ws, divisor=float(world))
        return [(s.bucket_offset, bucket.narrow(0, s.bucket_offset, s.numel).clone())
                for s in slices if s.dst == comm.rank], stats

    per_rank = run_local(world, rank_body)
    flat = torch.full((sum(o * i for o, i in shapes.values()),), float("nan"))
    for owned, _ in per_rank:
        for at, values in owned:
            flat.narrow(0, at, values.numel()).copy_(values)
    out, at = {}, 0
    for n in names:
        numel = shapes[n][0] * shapes[n][1]
        out[n] = flat.narrow(0, at, numel).view(shapes[n])
        at += numel
    return out, per_rank[0][1]


def planned_link(spec: RouteSpec, world: int, shapes: Dict[str, Tuple[int, int]], names: List[str], codec,
                 relay_codec, per_node: int, owners: int) -> dict:
    """What the reducer plans for this model in per-layer buckets (each reaching one owner, or every
    rank for ``balanced``): the busiest rank's receive from other nodes summed over the buckets, against
    the bf16 ring's, and how many buckets took the relay or the balanced node split. Planning only:
    the plans are the same on every rank (rank 0's are read)."""
    reducer = make_reducer(spec, LocalComm(0, world, [], None), codec, relay_codec, per_node, None)
    busiest = ring = relayed = balanced = 0
    for i, n in enumerate(names):
        slices = layer_slices(spec, world, owner_of(i, world, owners), *shapes[n], i, False)
        if spec.two_level:
            node_plan, among_nodes = reducer.plan_for(slices)
            busiest += among_nodes
            balanced += node_plan.split == "balanced"
            relayed += reducer.inner.new_plan(node_plan.slices, {}).relay  # rank 0's slot group
        else:
            plan = reducer.new_plan(slices, {})
            busiest += plan.recv_max_internode
            relayed += plan.relay
        ring += ring_nic_bytes(shapes[n][0] * shapes[n][1], world, per_node)
    return {"busiest_bytes": busiest, "busiest_vs_bf16": busiest / ring, "relay_buckets": relayed,
            "balanced_buckets": balanced, "buckets": len(names)}


def squared_errors(reduced: Dict[str, Tensor], exact: Dict[str, Tensor],
                   ruler: Dict[str, geo.Whitener]) -> Dict[str, Tuple[float, float]]:
    """Per layer, ``||E||^2`` and ``||E S||^2`` (``S`` the layer's ``ruler``) of the error ``E``."""
    out = {}
    for n, ref in exact.items():
        e = reduced[n].double() - ref
        out[n] = (float(e.square().sum()), float(ruler[n].apply(e.float()).double().square().sum()))
        if not math.isfinite(out[n][0]):
            raise RuntimeError(f"layer {n}: the reduction has non-finite values (elements no owner delivered?)")
    return out


def route_errors(errs: List[Dict[str, Tuple[float, float]]], refs: Dict[str, Tuple[float, float]]) -> dict:
    """Relative error of the whole gradient (sqrt(sum err^2 / sum ref^2)) in L2 (``rel_l2``) and in
    the ruler's whitened norm (``whitened``), and per layer; the squared errors averaged over ``errs``
    (runs with the owners rotated; one for most routes)."""
    out: dict = {}
    for k, key in enumerate(("rel_l2", "whitened")):
        err = {n: sum(e[n][k] for e in errs) / len(errs) for n in refs}
        ref = {n: r[k] for n, r in refs.items()}
        out[key] = math.sqrt(sum(err.values()) / sum(ref.values()))
        out["layers" if key == "rel_l2" else "layers_whitened"] = {
            n: math.sqrt(err[n] / ref[n]) if ref[n] > 0 else 0.0 for n in refs}
        if len(errs) > 1:
            out["per_rotation" if key == "rel_l2" else "per_rotation_whitened"] = [
                math.sqrt(sum(e[n][k] for n in refs) / sum(ref.values())) for e in errs]
    return out


# ------------------------------------------------------------------------------ model and gradients


@dataclass
class Captured:
    model_label: str
    names: List[str]
    shapes: Dict[str, Tuple[int, int]]
    grads: Dict[str, Tensor]  # name -> (max W, out, in) per-rank gradients at the capture step
    whiteners: Dict[str, geo.Whitener]  # kfac, fitted --refresh-interval steps before the capture
    losses: List[float]
    capture_loss: float
    fit_step: int
    seconds: float


def train_and_capture(args, ranks: int) -> Captured:
    """Train on ``--train-ranks`` micro-batches a step, fit the kfac whitener on the statistics
    ``--refresh-interval`` steps before the end, and capture ``ranks`` ranks' gradients."""
    t0 = time.perf_counter()
    model, label = fid.build_model(args)
    layers = fid.linear_layers(model)
    hooks = fid.MomentHooks(layers, None)
    training = fid.Training(model, layers, args)
    train_samplers = [fid.Sampler(args.seq, args.seed * 9973 + r) for r in range(args.train_ranks)]
    # the capture's micro-batches: their own streams, distinct from each other and from training's
    capture_samplers = [fid.Sampler(args.seq, args.seed * 9973 + 104729 + r) for r in range(ranks)]
    emas: Dict[str, geo.CovarianceEMA] = {}
    fit_step = max(args.train_steps - args.refresh_interval, 0)
    stats: Optional[Dict[str, Tensor]] = None
    losses = []
    for k in range(args.train_steps):
        tokens = torch.cat([s.batch(args.micro) for s in train_samplers])
        collect = k % args.collect_interval == 0 or k == fit_step
        losses.append(fid.train_step(model, training, hooks, tokens, collect=collect))
        for key, a in hooks.take().items():
            ema = emas.get(key)
            if ema is None:
                ema = emas[key] = geo.CovarianceEMA(a.shape[0], decay=args.stats_decay)
            ema.update_from_moment(a)
        if k == fit_step:
            stats = {key: ema.value().clone() for key, ema in emas.items()}
    cap = fid.capture_step(model, training, layers, hooks, [s.batch(args.micro) for s in capture_samplers],
                           want_rules=False)
    if stats is None:  # no training steps: the capture's own statistics
        stats = cap.moments
    factory = fid.WhitenerFactory(layers, dict(hooks.key_of), args.damping, args.damping_mode)
    spec = fid.parse_kfac([args.kfac])[0]
    whiteners = factory.build(spec, 1, fid.Capture(grads={}, moments={}, rules=None, loss=0.0, stats=stats))
    names = [n for n, _ in layers]
    return Captured(label, names, {n: (m.out_features, m.in_features) for n, m in layers}, cap.grads, whiteners,
                    losses, cap.loss, fit_step, time.perf_counter() - t0)


# ------------------------------------------------------------------------------ link bytes


def layout_link_rows(models: Sequence[str], fmts: Sequence[str], bucket: int) -> List[dict]:
    """Busiest NIC's received bytes per step against bf16 by route, from layout_model's rules."""
    rows = []
    fixed = {k: bytes_per_element(second_hop_codec(k)) for k in SECOND_HOPS}
    for model in models:
        sizes, arrival = layout_model.parameter_layout(layout_model.MODELS[model])
        for world in LAYOUT_WORLDS:
            buckets = [o for o in layout_model.buckets_of(sizes, arrival, world, bucket) if o]
            whole = [o for o in layout_model.buckets_of(sizes, arrival, world, sum(sizes)) if o]  # one step, one bucket
            for per_node in LAYOUT_PER_NODE:
                off = world - per_node
                for fmt in fmts:
                    b = bytes_per_element(main_codec(fmt))
                    b2 = dict(fixed, default=bytes_per_element(default_relay_codec(fmt)))
                    tot: Dict[str, float] = {}
                    for owners in buckets:
                        got = layout_model.bucket_link_bytes(owners, world, per_node, b)
                        n, biggest = sum(owners.values()), max(owners.values())
                        for k, (nic, _) in got.items():
                            tot[k] = tot.get(k, 0.0) + nic
                        for hop, rate in b2.items():  # the docstring's relay, second hop at its own rate
                            key = f"relay_{hop.replace('/', '_')}"
                            relay = off / world * n * b + off / world * biggest * rate
                            tot[key] = tot.get(key, 0.0) + relay
                            if hop == "default":  # by_layout as the plugin runs it: the lighter, per bucket
                                tot["by_layout_default"] = tot.get("by_layout_default", 0.0) + min(
                                    got["direct"][0], relay)
                    whole_links = [layout_model.bucket_link_bytes(o, world, per_node, b) for o in whole]
                    tot["balanced"] = sum(links["direct"][0] for links in whole_links)
                    if all("two_level_by_layout" in links for links in whole_links):
                        tot["two_level_zero1"] = sum(links["two_level_by_layout"][0] for links in whole_links)
                    base = tot.pop("bf16")
                    row = {"model": model, "world": world, "per_node": per_node, "format": fmt,
                           "bytes_per_element": b, "buckets": len(buckets), "bf16_nic_gb": base / 1e9}
                    row.update({f"{k}_vs_bf16": v / base for k, v in tot.items()})
                    rows.append(row)
    return rows


def ring_nic_bytes(numel: int, world: int, per_node: int) -> float:
    """DeepSpeed's bf16 ring all-reduce of ``numel`` elements into the busiest NIC (layout_model's
    rule: the G rings of a node share its G NICs)."""
    return 2 * (world - 1) / world * numel * 2 / per_node


# ------------------------------------------------------------------------------ output


def _cell(x: Optional[float], digits: int = 4) -> str:
    return "-" if x is None else f"{x:.{digits}f}"


def print_error_tables(results: dict, geoms: List[str], fmts: List[str], worlds: List[int], routes) -> None:
    for g in geoms:
        for f in fmts:
            print(f"\n{'GIFT (kfac)' if g == 'gift' else 'Euclidean'} coordinates, {f}: relative L2 of the reduced "
                  "mean; x = against direct")
            head = ["W", "direct"]
            for r in routes[1:]:  # two-level: the ratio only
                head += [f"{r.label} x"] if r.two_level else [r.label, "x"]
            print("| " + " | ".join(head) + " |")
            print("|" + "---:|" * len(head))
            for w in worlds:
                row = results[g][f][str(w)]
                direct = row["direct"]["rel_l2"]
                cells = [str(w), _cell(direct)]
                for r in routes[1:]:
                    e = row.get(r.key, {}).get("rel_l2")
                    if not r.two_level:
                        cells.append(_cell(e))
                    cells.append(_cell(None if e is None else e / direct, 2))
                print("| " + " | ".join(cells) + " |")


def print_whitened_tables(results: dict, geoms: List[str], fmts: List[str], worlds: List[int], routes) -> None:
    for f in fmts:
        print(f"\n{f}: error in the whitened norm ||E S|| / ||G S||, S the kfac whitener (one ruler for every route "
              "and coordinates); x = against direct")
        head = ["coordinates", "W", "direct"] + [f"{r.label} x" for r in routes[1:]]
        print("| " + " | ".join(head) + " |")
        print("|---|" + "---:|" * (len(head) - 1))
        for g in geoms:
            for w in worlds:
                row = results[g][f][str(w)]
                direct = row["direct"]["whitened"]
                cells = ["GIFT" if g == "gift" else "Euclidean", str(w), _cell(direct)]
                for r in routes[1:]:
                    e = row.get(r.key, {}).get("whitened")
                    cells.append(_cell(None if e is None else e / direct, 2))
                print("| " + " | ".join(cells) + " |")


def print_gain_table(results: dict, fmts: List[str], worlds: List[int], routes) -> None:
    print("\nGIFT / Euclidean error, same route, in L2 and in the whitened norm (below 1: GIFT's coordinates help)")
    head = ["format", "W", "norm"] + [r.label for r in routes]
    print("| " + " | ".join(head) + " |")
    print("|---|---:|---|" + "---:|" * (len(head) - 3))
    for f in fmts:
        for metric, label in (("rel_l2", "L2"), ("whitened", "whitened")):
            for w in worlds:
                cells = [f, str(w), label]
                for r in routes:
                    e = results["euclidean"][f][str(w)].get(r.key, {}).get(metric)
                    gft = results["gift"][f][str(w)].get(r.key, {}).get(metric)
                    cells.append(_cell(gft / e if e and gft is not None else None, 2))
                print("| " + " | ".join(cells) + " |")


def print_default_table(results: dict, planned: dict, geoms: List[str], fmts: List[str], worlds: List[int],
                        hops: "Hops") -> None:
    """The plugin's relay (default second hop) against direct, every ruler at once: one table for the docs."""
    print("\nrelay default (what by_layout sends a bucket that reaches one owner) against direct: error / direct's "
          "at the same W, format and coordinates, L2 and whitened; busiest link / DeepSpeed's bf16 ring (the "
          "reducer's plans, per-layer buckets)")
    cols = [(g, m) for g in geoms for m in ("rel_l2", "whitened")]
    head = (["format", "second hop", "W"]
            + [f"{'GIFT' if g == 'gift' else 'Euclidean'} {'L2' if m == 'rel_l2' else m} x" for g, m in cols]
            + ["link relay default", "link direct"])
    print("| " + " | ".join(head) + " |")
    print("|---|---|---:|" + "---:|" * (len(head) - 3))
    for f in fmts:
        for w in worlds:
            cells = [f, codec_label(hops.default[f]), str(w)]
            for g, m in cols:
                row = results[g][f][str(w)]
                e, d = row.get("relay_default", {}).get(m), row["direct"][m]
                cells.append(_cell(None if e is None or not d else e / d, 2))
            link = planned[f][str(w)]
            cells += [_cell(link[k]["busiest_vs_bf16"], 3) if k in link else "-" for k in ("relay_default", "direct")]
            print("| " + " | ".join(cells) + " |")


def print_planned_bytes(planned: dict, fmts: List[str], worlds: List[int], routes) -> None:
    print("\nThe reducer's plans for this model in per-layer buckets (each reaching one owner; balanced: every "
          "rank): busiest NIC's receive / DeepSpeed's bf16 ring's (two-level: among the nodes, against the ring's "
          "NIC share 1/G); by_layout: the buckets it relays (flat) or splits balanced (two-level)")
    head = ["format", "W"] + [r.label for r in routes] + ["by_layout relays", "2L by_layout balanced"]
    print("| " + " | ".join(head) + " |")
    print("|---|" + "---:|" * (len(head) - 1))
    for f in fmts:
        for w in worlds:
            row = planned[f][str(w)]
            cells = [f, str(w)] + [_cell(row[r.key]["busiest_vs_bf16"], 3) if r.key in row else "-" for r in routes]
            flat, two = row.get("by_layout"), row.get("two_level_by_layout")
            cells.append(f"{flat['relay_buckets']}/{flat['buckets']}" if flat else "-")
            cells.append(f"{two['balanced_buckets']}/{two['buckets']}" if two else "-")
            print("| " + " | ".join(cells) + " |")


LAYOUT_COLUMNS = (("direct", "direct"), ("relay_default", "relay default"), ("relay", "relay main"),
                  ("relay_int8_128", "relay int8/128"), ("relay_int8_32", "relay int8/32"),
                  ("relay_bf16", "relay bf16"), ("by_layout_default", "by_layout"), ("by_layout", "by_layout main"),
                  ("balanced", "balanced"), ("two_level_owner_slot", "2L owner_slot"),
                  ("two_level_balanced", "2L balanced"), ("two_level_by_layout", "2L by_layout"),
                  ("two_level_zero1", "2L balanced, one bucket"))


def print_layout_table(rows: List[dict], bucket: int) -> None:
    print(f"\nLayout rules (benchmarks/layout_model.py), reduce_bucket_size {bucket:.0e}: busiest NIC's received bytes "
          "per step / DeepSpeed's bf16 all-reduce. G = 1: every GPU its own NIC (flat routes); G = 8: 8 GPUs share "
          "a node (flat routes off the node, two-level among nodes). relay default: second hop the default config's "
          "(per format, as printed above); relay main: in the main codec; relay <codec>: in that codec; by_layout: "
          "the lighter of direct and relay default per bucket (ZeRO-2 as the plugin runs it); by_layout main: the "
          "same with relay main (layout_model's own rule); balanced: one exchange of every owner's partition per "
          "step (ZeRO-1, issue 32), flat; 2L owner_slot / balanced / by_layout: layout_model's two-level schemes "
          "(each split on its lighter inner route, not the forced direct / relay of the error tables; one byte rate "
          "for both relay hops: the main codec's); 2L balanced, one bucket: ZeRO-1's one bucket through the "
          "two-level exchange (its by_layout)")
    head = ["model", "W", "G", "format", "B/elem", "bf16 GB/NIC"] + [label for _, label in LAYOUT_COLUMNS]
    print("| " + " | ".join(head) + " |")
    print("|---|---:|---:|---|" + "---:|" * (len(head) - 4))
    for r in rows:
        cells = [r["model"], str(r["world"]), str(r["per_node"]), r["format"], f"{r['bytes_per_element']:.3f}",
                 f"{r['bf16_nic_gb']:.2f}"]
        cells += [f"{r[k + '_vs_bf16']:.2f}x" if k + "_vs_bf16" in r else "-" for k, _ in LAYOUT_COLUMNS]
        print("| " + " | ".join(cells) + " |")


# ------------------------------------------------------------------------------ main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    p.add_argument("--preset", default="small", choices=sorted(PRESETS), help="a launch/pretrain.py Llama preset")
    p.add_argument("--worlds", type=int, nargs="+", default=list(DEFAULT_WORLDS), help="simulated ranks W")
    p.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS), choices=formats.FORMAT_NAMES,
                   help="wire formats, each with the default config's block size")
    p.add_argument("--owners", type=int, default=4,
                   help="whole layers are owned by ranks 0 .. min(W, OWNERS) - 1 in turn (direct averages over every "
                        "rotation of them); the relay's work per rank grows with the owners of its bucket")
    p.add_argument("--ranks-per-node", type=int, default=4, help="G of the two-level routes (run where W >= 2 G)")
    p.add_argument("--micro", type=int, default=4, help="sequences per rank (training and capture)")
    p.add_argument("--seq", type=int, default=256, help="tokens per sequence")
    p.add_argument("--train-steps", type=int, default=30, help="AdamW steps before the capture")
    p.add_argument("--train-ranks", type=int, default=4, help="micro-batches per training step (its global batch)")
    p.add_argument("--refresh-interval", type=int, default=10,
                   help="the kfac whitener is fitted this many steps before the capture")
    p.add_argument("--collect-interval", type=int, default=1, help="statistics collected every this many steps")
    p.add_argument("--stats-decay", type=float, default=0.95, help="EMA of the statistics (geometry.stats_decay)")
    p.add_argument("--kfac", default="structured:32", help="the GIFT geometry, SOLVER:RANK (fidelity.py's --kfac)")
    p.add_argument("--damping", type=float, default=1e-3, help="geometry.damping of the kfac fit")
    p.add_argument("--damping-mode", default="absolute", choices=("absolute", "relative"))
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate")
    p.add_argument("--beta2", type=float, default=0.999)
    p.add_argument("--warmup", type=int, default=20, help="linear lr warm-up steps")
    p.add_argument("--no-gift", action="store_true", help="Euclidean coordinates only (half the reductions)")
    p.add_argument("--layout-models", nargs="*", default=["7B", "13B"], choices=sorted(layout_model.MODELS),
                   help="models of the layout-rule bytes table (none: no table)")
    p.add_argument("--bucket", type=float, default=5e8, help="reduce_bucket_size of the layout rules")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1, help="torch CPU threads (0: torch's default)")
    p.add_argument("--routes", nargs="+", default=None, choices=[r.key for r in ROUTES],
                   help="only these routes (JSON keys; default: all; ratios are against direct, so keep it)")
    p.add_argument("--json", default=None, help="also write every number here")
    args = p.parse_args(argv)
    if min(args.worlds) < 2 or args.ranks_per_node < 2 or min(args.owners, args.micro, args.train_ranks,
                                                               args.refresh_interval, args.collect_interval) < 1:
        raise SystemExit("need --worlds >= 2, --ranks-per-node >= 2, --owners, --micro, --train-ranks, "
                         "--refresh-interval, --collect-interval >= 1")
    if args.seq < 2 or args.train_steps < 0:
        raise SystemExit(f"need --seq >= 2 and --train-steps >= 0, got {args.seq} and {args.train_steps}")
    if args.routes is not None and "direct" not in args.routes:
        raise SystemExit(f"--routes {' '.join(args.routes)}: every ratio is against 'direct'; name it too")
    # what fidelity.build_model and fidelity.Training read besides the above
    args.hf_model = args.model_config = None
    args.optimizer, args.muon_lr, args.muon_momentum = "adamw", 0.02, 0.95
    return args


def run_ranks_as_threads(run, args, argv):
    """``run(args, argv)`` with ``args.threads`` torch threads and short GIL slices: W simulated
    ranks trade the GIL after every small kernel; at the default 5 ms slice the relay at W = 32
    waited on it for half its time (12.3 s against 6.0 s with 0.1 ms on a 2-core machine)."""
    if args.threads:
        torch.set_num_threads(args.threads)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(GIL_SWITCH_S)
    try:
        return run(args, argv)
    finally:
        sys.setswitchinterval(switch)


def main(argv: Optional[List[str]] = None) -> dict:
    return run_ranks_as_threads(_run, parse_args(argv), argv)


def _run(args, argv) -> dict:
    t_start = time.perf_counter()
    worlds = sorted(set(args.worlds))
    fmts = list(dict.fromkeys(args.formats))
    G = args.ranks_per_node
    hops = Hops(fmts)
    codecs = hops.main
    routes = [r for r in ROUTES if args.routes is None or r.key in args.routes]

    cap = train_and_capture(args, max(worlds))
    names = cap.names
    n_params = sum(o * i for o, i in cap.shapes.values())
    print(f"model: {cap.model_label}, {len(names)} Linear weights, {n_params / 1e6:.2f}M elements; "
          f"{args.train_steps} AdamW steps of {args.train_ranks} x {args.micro} x {args.seq} tokens "
          f"(loss {cap.losses[0] if cap.losses else cap.capture_loss:.3f} -> {cap.capture_loss:.3f}); kfac "
          f"{args.kfac} fitted at step {cap.fit_step}; capture at step {args.train_steps}: {max(worlds)} ranks of "
          f"{args.micro} x {args.seq} tokens each; model + capture {cap.seconds:.1f} s")
    print("codecs: " + ", ".join(f"{f} block {c.block_size} ({bytes_per_element(c):.4f} B/elem)"
                                 for f, c in codecs.items())
          + "; second hops: " + ", ".join(f"{k} ({bytes_per_element(c):.4f} B/elem)" for k, c in hops.fixed.items()))
    print("the default config's second hop (relay default, the two-level and by_layout routes; zero._relay_codec): "
          + ", ".join(f"{f} {codec_label(hops.default[f])} ({bytes_per_element(hops.default[f]):.4f} B/elem)"
                      for f in fmts))

    geoms = ["euclidean"] + ([] if args.no_gift else ["gift"])
    results: dict = {g: {f: {} for f in fmts} for g in geoms}
    planned: dict = {f: {} for f in fmts}
    mean_norm_ratio = {}
    for w in worlds:
        grads = {n: cap.grads[n][:w] for n in names}
        exact = {n: g.double().mean(0) for n, g in grads.items()}
        refs = {n: (float(e.square().sum()), float(cap.whiteners[n].apply(e.float()).double().square().sum()))
                for n, e in exact.items()}
        one = sum(float(g[0].double().square().sum()) for g in grads.values())
        mean_norm_ratio[str(w)] = math.sqrt(sum(float(e.square().sum()) for e in exact.values()) / one)
        here = [r for r in routes if not r.two_level or (w >= 2 * G and w % G == 0)]
        for f in fmts:
            planned[f][str(w)] = {r.key: planned_link(r, w, cap.shapes, names, codecs[f], hops.of(r, f),
                                                      G if r.two_level else 1, args.owners) for r in here}
        for g in geoms:
            whiteners = cap.whiteners if g == "gift" else None
            for f in fmts:
                t0 = time.perf_counter()
                row = results[g][f][str(w)] = {}
                for r in here:
                    if not r.reduced:
                        continue
                    t_route = time.perf_counter()
                    errs = []
                    for shift in range(min(w, args.owners) if r.key == "direct" else 1):
                        reduced, stats = reduce_model(grads, cap.shapes, names, r, codecs[f], hops.of(r, f), whiteners,
                                                      w, G if r.two_level else 1, args.owners, shift)
                        errs.append(squared_errors(reduced, exact, cap.whiteners))
                    row[r.key] = route_errors(errs, refs)
                    row[r.key].update(relay_buckets=stats.relay_buckets, balanced_buckets=stats.balanced_buckets,
                                      seconds=time.perf_counter() - t_route)
                print(f"  W={w} {g} {f}: " + ", ".join(f"{k} {v['rel_l2']:.4f}" for k, v in row.items())
                      + f" ({time.perf_counter() - t0:.1f} s)", flush=True)
    t_reduce = time.perf_counter() - t_start - cap.seconds

    print(f"\nErrors against the exact fp64 mean of the same W gradients, layers combined as sqrt(sum err^2 / sum "
          f"ref^2); whole layers owned by ranks 0 .. min(W, {args.owners}) - 1 in turn, direct averaged over every "
          f"rotation of them; two-level with G = {G}. ||mean|| / ||one rank's gradient||: "
          + ", ".join(f"W={w} {v:.2f}" for w, v in mean_norm_ratio.items()))
    reduced_routes = [r for r in routes if r.reduced]
    print_error_tables(results, geoms, fmts, worlds, reduced_routes)
    print_whitened_tables(results, geoms, fmts, worlds, reduced_routes)
    if "gift" in geoms:
        print_gain_table(results, fmts, worlds, reduced_routes)
    print_default_table(results, planned, geoms, fmts, worlds, hops)
    print_planned_bytes(planned, fmts, worlds, routes)
    link_rows = layout_link_rows(args.layout_models, fmts, int(args.bucket)) if args.layout_models else []
    if link_rows:
        print_layout_table(link_rows, args.bucket)
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.1f} s (model + capture {cap.seconds:.1f} s, reductions {t_reduce:.1f} s, "
          f"{torch.get_num_threads()} threads)")
    out = {
        "command": [os.path.basename(sys.argv[0])] + (sys.argv[1:] if argv is None else list(argv)),
        "model": cap.model_label,
        "args": vars(args),
        "protocol": {
            "error": "||reduced - exact|| / ||exact||, exact = fp64 mean of the same W per-rank gradients; layers "
                     "combined as sqrt(sum err^2 / sum ref^2); whitened: the same of E S and G S, S the kfac whitener "
                     "of every layer (the ruler of every route and coordinates)",
            "buckets": f"one holding every nn.Linear weight in order; direct/relay/two-level: each layer owned whole "
                       f"by rank (layer index + rotation) % min(W, {args.owners}) (direct: rms over every rotation, "
                       "the others rotation 0); balanced: each layer's rows in W near-equal runs, run d to rank d",
            "owner_exact": True,
            "gift": f"kfac {args.kfac} whitener fitted {args.refresh_interval} steps before the capture",
            "two_level": f"G = {G}, node stage exact in fp32; the inner reducer's relay second hop as the default "
                         "config's (two_level_balanced_main: the main codec)",
            "relay_default": "route relay, second hop the default config's for the format (zero._relay_codec of "
                             "GiftConfig(format=...)); by_layout and the two-level routes take it too",
            "planned": "per-layer buckets planned by the reducer (not reduced): busiest receive from other nodes "
                       "(recv_max_internode) summed over the buckets, over 2 (W-1)/W N 2 B / G of DeepSpeed's bf16 "
                       "ring",
            "layout": "benchmarks/layout_model.py rules; relay_<codec>: (W-G)/W N b + (W-G)/W max N_d b2; balanced: "
                      "the rule's direct of one bucket of the whole model; two_level_zero1: its two_level_by_layout",
        },
        "codecs": {f: {"block_size": c.block_size, "bytes_per_element": bytes_per_element(c)}
                   for f, c in codecs.items()},
        "second_hops": {k: {"format": SECOND_HOPS[k][0], "block_size": c.block_size,
                            "bytes_per_element": bytes_per_element(c)} for k, c in hops.fixed.items()},
        "default_second_hops": {f: {"format": c.name, "block_size": c.block_size,
                                    "bytes_per_element": bytes_per_element(c), "same_as": hops.default_is(f)}
                                for f, c in hops.default.items()},
        "layers": [{"name": n, "out": cap.shapes[n][0], "in": cap.shapes[n][1]} for n in names],
        "losses": cap.losses,
        "capture_loss": cap.capture_loss,
        "mean_norm_over_one_rank": mean_norm_ratio,
        "results": results,
        "planned": planned,
        "layout": link_rows,
        "wall_s": wall,
        "model_and_capture_s": cap.seconds,
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "machine": platform.machine(),
    }
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
