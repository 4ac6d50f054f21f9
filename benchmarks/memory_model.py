"""    .venv/bin/python benchmarks/memory_model.py [--bucket 5e8] [--allgather-bucket 5e8] [--json out.json]

GIFT's extra memory per rank, component by component, beside what DeepSpeed ZeRO-2 itself holds
per rank for the same run, from the real layouts of ``benchmarks/layout_model.py`` (the model's
parameters in ``model.parameters()`` order, gradients bucketed in backward order, partitions cut
by DeepSpeed's rules), for ~1B / 7B / 13B / 70B at W = 8 / 64 / 512, flat and two-level (8
ranks a node), with the README's gift block ``{"format": "fp8_e4m3"}`` (kfac_input rank 32,
layers measured, no error feedback) and with error feedback on.

Two designs are modelled, each a :class:`Design`: ``before`` (main at 26e869f: fp32 in x in input
statistics on every rank, whole-section codec/staging/whitening on an accelerator, fp32 error
feedback, the parameter all-gather in one piece, whole-gradient profile captures) and ``now``
(what the code holds today, read from it: see :func:`design_now`). Every component is a small
pure function of the layout; :func:`gift_memory` takes an HF config dict, a world size and the
bucket sizes, so the CPU measurement (``benchmarks/memory_measure.py``) and these tables run the
same code path.

Components (bytes per rank; "held" lives between steps, the rest is a transient of the worst
step, step 0: a collect, refresh and telemetry-sampled step at once):
- ``statistics`` (held): per statistic (a layer's input; q/k/v share one, gate/up share one)
  what the EMA keeps; ``statistics_step`` (transient, collect steps): the per-step sums (and,
  at the end of the step, as many bytes again: the means ``take()`` hands the EMA);
- ``transforms`` (held): per statistic the shared factors (U, lam, d, as ``refresh._share``
  rebuilds them) and the whitener built from them (V, two diagonals, two r-vectors);
- ``codec_staging`` (transient): the section being encoded: its fp32 staging and the whitening's
  temporaries or the codec's work (the larger), over the whole section or over a tile;
- ``payload`` (transient): the encoded sections, the send buffer and the receive buffer, or what
  was received and the owner's fp32 sums, of the busiest bucket (the direct or relay route, as
  ``plan_route`` picks; :func:`bucket_phases`);
- ``error_feedback`` (held): the residual of every quantized payload this rank sends;
  ``relay_residuals`` (held): of every chunk sum it relays;
- ``param_gather`` (transient, with ``gift.params``): the replicas before the step and the
  compressed all-gather's buffers;
- ``refresh_captures`` (transient, refresh steps): the captured gradients and optimizer state;
- ``telemetry`` (transient, sampled steps): ``quantization_stats`` over a section and the
  fidelity check's exact sample (and the bucket's sampled positions, where they are made for the
  step); ``telemetry_samples`` (held, before ``9eaa19e``): the sampled positions each cached plan
  kept (``plan.section_sample``: two int64 per sampled element, up to ``fidelity_elements`` per
  owner and bucket), in every plan a sampled step used, up to the 256 plans the cache then held.

Peak extra (:func:`peak_bytes`) = held + statistics_step + refresh_captures (one more of the
moments below when a layer is judged as it is captured) + the largest of: a section's encode
(codec_staging, telemetry and the sections encoded so far), the payload's exchange or the
owner's sums, the parameter all-gather, and take()'s means (statistics_step again). It is the
steady state's worst step (a refresh step after the first: the EMA exists and Adam has state to
capture).

DeepSpeed ZeRO-2's own bytes per rank (``deepspeed/runtime/zero/stage_1_and_2.py``, counted as
its allocations are): the model's replicas (``bit16_groups_flat``, params_dtype x N), the fp32
master partition (``single_partition_of_fp32_groups``, 4 N/W), Adam's two moments (8 N/W), the
gradient partition (``grads_in_partition``, params_dtype x N/W) and its fp32 flat copy at the
step (``averaged_gradients``, 4 N/W), and the reduce bucket (``ipg_buckets``, params_dtype x
``reduce_bucket_size``; two with ``overlap_comm``, off by DeepSpeed's default for stage 2).
Activations are neither's and are not counted.
"""

from __future__ import annotations

import argparse
import os
import sys
from dataclasses import dataclass, replace
from typing import Dict, List, Optional, Tuple

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.layout_model import MODELS as LAYOUT_MODELS, NODE_PIECES, buckets_of, parameter_layout  # noqa: E402
from deepspeed_gift.config import NODE_PIECES_CARRIED  # noqa: E402
from benchmarks.results import write_json  # noqa: E402
from deepspeed_gift.exchange.two_level import FINISH_LAG  # noqa: E402

MODELS = {**LAYOUT_MODELS,
          "70B": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                      num_key_value_heads=8, vocab_size=32000)}
WORLDS = (8, 64, 512)
PER_NODE = 8  # ranks a node in the two-level rows
README_GIFT = {"format": "fp8_e4m3"}
GIB = 1 << 30

HELD = ("statistics", "transforms", "error_feedback", "relay_residuals", "telemetry_samples")
TRANSIENT = ("statistics_step", "codec_staging", "payload", "param_gather", "refresh_captures", "telemetry")
COMPONENTS = HELD + TRANSIENT

# Bytes per element the codec's own work holds over what it encodes (issue 31, read from
# core/formats/): fp8's scaled tile and its codes ~4, +7-9 under stochastic rounding (measured
# on a CPU tile, 2026-12-03: the counter hash's int64 temporaries over a chunk, a quarter of a
# GPU tile, and the rounding's own); NVFP4's nibble arithmetic ~20; bf16/fp32 a cast.
CODEC_WORK = {"fp8_e4m3": 4.0, "fp8_e5m2": 4.0, "int8": 4.0, "int4": 8.0, "nvfp4": 20.0, "bf16": 2.0, "fp32": 0.0}
STOCHASTIC_WORK = 9.0
WHITEN_TEMPS = 3  # StructuredWhitener._apply_rows: gp, P and the output, each 4 B an element, live at once
TELEMETRY_BYTES = 30.0  # quantization_stats: a decode, masks, two fp32 differences and a float64 square
CAPTURE_BYTES = 12.0  # a captured fp32 gradient and Adam's two moments of the slice (metric "optimizer")
CPU_TILE = 1 << 20  # core/formats/base.py's _CPU_TILE: codecs on a CPU already work in tiles of this


@dataclass(frozen=True)
class Design:
    """What the code holds, as the model needs it (see the module docstring)."""

    name: str
    stats: str  # "dense": fp32 in x in EMA per statistic; "sketch": EMAs of A @ Omega and diag(A), Omega, kept
    codec_tile: Optional[int]  # elements a codec works on at once on an accelerator (None: a whole section)
    stage_tile: Optional[int]  # the same for the staging, whitening and the owner's decode and sum
    ef_bytes: float  # bytes a residual element holds (block scales included)
    capture: str  # "full": every captured layer's gradient and state held to the end of the step; "layer": one;
    # "slice": one, cut to the rows its Adam state covers on the capturing rank (selection.rows_of_slice);
    # "tile": that, judged a tile of rows at a time (metrics.judge_geometries' tile_rows)
    samples_cached: bool  # the fidelity check's sampled positions kept in every cached plan
    send_copies: int  # the encoded bytes at the exchange: parts and their joined buffer (2), or an Outbox (1)
    telemetry_sample: Optional[int]  # elements quantization_stats measures of a section (None: all of it)
    oversample: int = 8  # refresh.SKETCH_OVERSAMPLE
    relay_keeps_chunks: bool = True  # the relay's received chunks held until the owner's totals are made


BEFORE = Design("before", stats="dense", codec_tile=None, stage_tile=None, ef_bytes=4.0, capture="full",
                samples_cached=True, send_copies=2, telemetry_sample=None)


def design_now() -> Design:
    """The design of the code in this checkout, read from the constants that name it (a design
    element whose constant is absent is still as it was before)."""
    import inspect

    from deepspeed_gift import config, refresh, selection
    from deepspeed_gift.core import metrics
    from deepspeed_gift.exchange import encode, feedback, plan, reducer, relay

    tile = getattr(config, "DEFAULT_TILE_ELEMENTS", None)  # gift.tile_elements' default
    ef = getattr(feedback, "RESIDUAL_BYTES_PER_ELEMENT", None)
    return replace(BEFORE, name="now", stats="sketch" if hasattr(refresh, "SketchEMA") else "dense",
                   codec_tile=tile, ef_bytes=float(ef) if ef is not None else BEFORE.ef_bytes,
                   # a section staged (and whitened) a tile at a time for the codec to read
                   stage_tile=tile if hasattr(plan, "SectionSource") else None,
                   # sampled steps measure a strided sample of at most a tile
                   telemetry_sample=(min(tile, getattr(encode, "QUANT_SAMPLE_ELEMENTS", tile))
                                     if hasattr(encode, "SampleRecorder") else None),
                   # each layer judged as its gradient is captured, nothing held to the end of the step
                   capture=(("tile" if "tile_rows" in inspect.signature(metrics.judge_geometries).parameters
                             else "slice") if hasattr(selection, "rows_of_slice") else "layer")
                   if hasattr(selection.Selection, "judge_captured") else "full",
                   samples_cached="plan.samples" in inspect.getsource(plan.section_sample),
                   # parts encoded straight into the laid-out send buffer
                   send_copies=1 if hasattr(reducer, "Outbox") else 2,
                   relay_keeps_chunks="del recv, incoming" not in inspect.getsource(relay.relay_totals),
                   oversample=getattr(refresh, "SKETCH_OVERSAMPLE", BEFORE.oversample))


# ---- the model's shape ---------------------------------------------------------------------
@dataclass
class Shape:
    """What the components need of a model: parameter sizes in ``parameters()`` order, gradient
    arrival order, each linear weight's (index, in, numel) and each statistic's width."""

    sizes: List[int]
    arrival: List[int]
    linears: List[Tuple[int, int, int]]
    stat_dims: List[int]

    @property
    def params(self) -> int:
        return sum(self.sizes)


_SHAPES: Dict[tuple, Shape] = {}


def model_shape(config: dict) -> Shape:
    """Sizes and order from ``layout_model.parameter_layout``; the statistics from a forward on
    the meta device with GIFT's rule (``statistics.InputMoments``): linear modules fed the very
    same input tensor, one after the other, share one statistic."""
    key = tuple(sorted(config.items()))
    if key in _SHAPES:
        return _SHAPES[key]
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    sizes, arrival = parameter_layout(config)
    with torch.device("meta"):
        model = LlamaForCausalLM(LlamaConfig(**config))
    index = {id(p): i for i, p in enumerate(model.parameters())}
    linears, stat_dims, last = [], [], [None]

    def hook(module, inputs):
        x = inputs[0]
        if last[0] is not x:
            stat_dims.append(module.in_features)
        last[0] = x

    for m in model.modules():
        if isinstance(m, torch.nn.Linear):
            linears.append((index[id(m.weight)], m.in_features, m.weight.numel()))
            m.register_forward_pre_hook(hook)
    ids = torch.zeros(1, 8, dtype=torch.long, device="meta")
    with torch.no_grad():
        model(input_ids=ids)
    _SHAPES[key] = shape = Shape(sizes, arrival, linears, stat_dims)
    return shape


# ---- components (bytes per rank) -------------------------------------------------------------
def statistics_bytes(dims: List[int], rank: int, design: Design) -> Tuple[int, int]:
    """(held, per-step sums of a collect step) of the input statistics: dense, an fp32 in x in EMA
    per statistic and a per-step sum of the same size; a sketch, EMAs of ``A @ Omega`` (in x w)
    and ``diag(A)`` and Omega itself, and per step sums of ``A @ Omega`` and ``diag(A)``. At the
    end of the step ``take()`` hands the EMA the means, as many bytes again as the sums."""
    if design.stats == "dense":
        held = sum(4 * d * d for d in dims)
        return held, held
    widths = [(d, min(d, rank + design.oversample)) for d in dims]
    # a statistic no wider than its sketch (in <= w + 1, refresh's dense exchange) stays whole
    held = sum(4 * d * d if d <= w + 1 else 4 * (2 * d * w + d) for d, w in widths)
    return held, sum(4 * d * d if d <= w + 1 else 4 * (d * w + d) for d, w in widths)


def transform_bytes(dims: List[int], rank: int, host: bool) -> int:
    """Shared factors and whiteners of every statistic: ``refresh._share`` rebuilds U (fp32, in x r)
    from the gathered bf16 bytes; on the host lam and d stay views into the gathered blob (one per
    fitting rank: 4 (1 + r + in) + 2 in r bytes a statistic), on a device they are copied out;
    the whitener holds V (in x r), two diagonals and two r-vectors, fp32."""
    u = sum(4 * d * rank for d in dims)
    blob = sum(4 * (1 + rank + d) + 2 * d * rank for d in dims) if host else sum(4 * (rank + d) for d in dims)
    whitener = sum(4 * (2 * d + d * rank + 2 * rank) for d in dims)
    return u + blob + whitener


def stage3_buckets(sizes: List[int], arrival: List[int], world: int, bucket: int,
                   piece: int) -> List[Dict[int, int]]:
    """ZeRO stage 3's reductions in backward order, elements per owner: a gradient that would take
    the bucket past ``reduce_bucket_size`` reduces it first (``__add_grad_to_ipg_bucket``), GIFT
    reduces a bucket in pieces of whole parameters of at most ``piece`` elements
    (``zero.STAGE3_PIECE_TILES`` tiles; a bucket's parameters in ``ds_id`` order there, counted here
    in arrival order: the same sizes), and every parameter is cut into W chunks of ceil(numel / W),
    rank r owning the r-th."""
    out: List[Dict[int, int]] = []
    current: Dict[int, int] = {}
    filled = 0
    for i in arrival:
        n = sizes[i]
        if filled and filled + n > min(bucket, piece):
            out.append(current)
            current, filled = {}, 0
        chunk = -(-n // world)
        for r in range(world):
            current[r] = current.get(r, 0) + max(0, min((r + 1) * chunk, n) - r * chunk)
        filled += n
    if filled:
        out.append(current)
    return out


def relay_is_lighter(owners: Dict[int, int], world: int, b: float) -> bool:
    """``plan.plan_route``'s ``by_layout`` choice: the relay when its busiest rank receives fewer
    bytes than the busiest owner of the direct route (it needs 3+ ranks)."""
    if world <= 2:
        return False
    n, biggest = sum(owners.values()), max(owners.values())
    return (world - 1) / world * n * b + biggest * b < (world - 1) * biggest * b


def bucket_phases(owners: Dict[int, int], me: int, world: int, b: float, relay: bool,
                  copies: int = 2, keeps_chunks: bool = True) -> Tuple[float, float, float]:
    """Payload bytes of one bucket on rank ``me`` while it encodes, exchanges and sums:
    - encode: its own section's values, staged whole (the owner's sum starts from them), and the
      encoded sections so far (b per element sent); relay, the chunk wires and its own chunks;
    - exchange: those and the send buffer they are copied into (``copies``: 2 b an element sent;
      1, b, where parts are encoded into a send buffer laid out first) and what it receives:
      direct, the W-1 parts of its own (b); relay, its chunk of every section from every rank
      (b N (W-1)/W) beside its fp32 chunk sums (4 N/W);
    - owner: what it received and its own values, and a sum of its own where whitened rows are
      summed apart from its exact values (4 B an owned element; counted: the worst case);
      relay, its chunk sums, the forwards it receives (b) and their totals (8 B an owned element),
      beside the chunks it received (``keeps_chunks``) or with them let go once summed.
    A tile's decode work is the codecs' (``codec_staging``)."""
    n, mine = sum(owners.values()), owners.get(me, 0)
    if relay:
        received, sums = b * n * (world - 1) / world, 4 * n / world
        return (b * n + sums, copies * b * n + received + sums,
                (received if keeps_chunks else 0.0) + sums + (b + 8) * mine)
    own, received = 4 * mine, b * (world - 1) * mine
    return own + b * (n - mine), own + copies * b * (n - mine) + received, own + received + 4 * mine


def ef_elements(owners: Dict[int, int], me: int, world: int, relay: bool) -> Tuple[float, float]:
    """(sent residual, relayed residual) elements of one bucket on ``me``: direct, every section
    but its own; relay, every section whole (its own chunk zeroed) and its chunk of the others."""
    n, mine = sum(owners.values()), owners.get(me, 0)
    if relay:
        return n, (n - mine) / world
    return n - mine, 0.0


def capture_bytes(shape: Shape, me_owner: Dict[int, int], design: Design, per_element: float,
                  world: int = 1) -> float:
    """Refresh-step captures on the busiest rank: each layer's local gradient and the state of its
    slice (``per_element``: 12 B, or 4 B at the first refresh, before the optimizer has state), by
    the rank that holds most of it (``ZeroOptimizerState.capture_rank``); one layer's when bounded."""
    if design.capture in ("slice", "tile"):  # AdamW (the README's run): the rows of the capturing rank's slice
        held = held_by_main_owner(shape.sizes, world)
        rows = max(min(numel, (-(-held[idx] // width) + 1) * width) for idx, width, numel in shape.linears)
        # "tile": judged a tile of rows at a time (gift.tile_elements), its gradient rows and state alike
        return per_element * (min(rows, design.codec_tile) if design.capture == "tile" and design.codec_tile
                              else rows)
    if design.capture == "layer":
        return per_element * max(numel for _, _, numel in shape.linears)
    per_rank: Dict[int, float] = {}
    for idx, _, numel in shape.linears:
        per_rank[me_owner[idx]] = per_rank.get(me_owner[idx], 0.0) + per_element * numel
    return max(per_rank.values(), default=0.0)


def held_by_main_owner(sizes: List[int], world: int) -> Dict[int, int]:
    """Per parameter, the elements of it in the partition that holds most of it."""
    align = 2 * world
    part = -(-sum(sizes) // align) * align // world
    out, pos = {}, 0
    for i, n in enumerate(sizes):
        best, start = 0, pos
        while start < pos + n:
            take = min(pos + n, (start // part + 1) * part) - start
            best, start = max(best, take), start + take
        out[i] = best
        pos += n
    return out


def main_owners(sizes: List[int], world: int) -> Dict[int, int]:
    """Per parameter, the partition that holds most of it (DeepSpeed's flat partitions)."""
    align = 2 * world
    total = sum(sizes)
    part = -(-total // align) * align // world
    out, pos = {}, 0
    for i, n in enumerate(sizes):
        best, start = (-1, 0), pos
        while start < pos + n:
            d = start // part
            take = min(pos + n, (d + 1) * part) - start
            best = max(best, (take, -d))
            start += take
        out[i] = -best[1]
        pos += n
    return out


@dataclass
class Run:
    """One run's settings, as DeepSpeed and GIFT read them."""

    world: int
    per_node: int = 1  # two-level when > 1 and the job spans nodes
    bucket: int = 500_000_000
    allgather_bucket: int = 500_000_000
    params_bytes: int = 2  # bf16 replicas (4: fp32)
    overlap_comm: bool = False
    device: str = "cuda"  # "cpu": codecs tile at CPU_TILE whatever the design
    format: str = "fp8_e4m3"
    rank: int = 32
    error_feedback: bool = False
    stochastic: bool = False
    params_format: Optional[str] = None  # gift.params.format (None: DeepSpeed's own all-gather)
    fidelity_elements: int = 65536
    sampled_versions: Optional[int] = None  # plan versions a sampled step used (None: a long run, cache full)
    optimizer_state: bool = True  # the worst refresh step has Adam state to capture (not so at step 0)
    offload: bool = False  # zero_optimization.offload_optimizer {"device": "cpu"}
    contiguous_gradients: bool = True  # zero_optimization.contiguous_gradients (DeepSpeed's default)
    carry_buckets: bool = True  # gift.carry_buckets
    node_pieces: Optional[int] = None  # gift.node_pieces (None: gift's default, 4 where carried, else 6)
    node_piece_min_elements: int = 1 << 22  # gift.node_piece_min_elements
    node_format: Optional[str] = None  # gift.node_format (None: the node stage in the bucket's dtype)
    node_block_size: Optional[int] = None  # gift.node_block_size
    stage: int = 2  # zero_optimization.stage (3: every parameter partitioned; flat rows only)
    max_live_parameters: int = 1_000_000_000  # stage3_max_live_parameters (DeepSpeed's default)
    prefetch_bucket: int = 50_000_000  # stage3_prefetch_bucket_size (DeepSpeed's default)


def carries(run: Run) -> bool:
    """Whether two-level's pipeline is carried from bucket to bucket (``GiftState.carry_applies``:
    DeepSpeed's double ipg buffer, i.e. ``overlap_comm`` with ``contiguous_gradients``, the
    gradients on the device, ``gift.carry_buckets``; no MoE or pipeline engine, which this model
    does not take), which sets ``gift.node_pieces``' default."""
    return run.overlap_comm and run.contiguous_gradients and not run.offload and run.carry_buckets


def wire_bytes(fmt: str, block_size: Optional[int] = None) -> float:
    from deepspeed_gift.core.formats import get_format

    return get_format(fmt, block_size=block_size).nbytes(1 << 24) / (1 << 24)


def gift_memory(config: dict, run: Run, design: Design) -> Dict[str, float]:
    """GIFT's bytes per rank by component, and ``held`` and ``peak`` (see the module docstring)."""
    shape = model_shape(config)
    b = wire_bytes(run.format)
    two_level = run.per_node > 1 and run.world > run.per_node
    nodes = run.world // run.per_node if two_level else run.world
    if run.stage == 3:  # flat: every owner's chunk of every parameter
        two_level, nodes = False, run.world
        from deepspeed_gift.zero import STAGE3_PIECE_TILES

        tile = design.codec_tile or 1 << 24
        layout = stage3_buckets(shape.sizes, shape.arrival, run.world, run.bucket, STAGE3_PIECE_TILES * tile)
    else:
        layout = [o for o in buckets_of(shape.sizes, shape.arrival, run.world, run.bucket) if o]
    if two_level:  # the exchange among nodes runs on each slot's node partial: 1/G of a bucket
        layout = [_node_partial(o, run.per_node) for o in layout]
    ranks = range(nodes)
    stats_held, stats_step = statistics_bytes(shape.stat_dims, run.rank, design)
    out = {"statistics": stats_held, "statistics_step": stats_step,
           "transforms": transform_bytes(shape.stat_dims, run.rank, run.device == "cpu")}
    section = max(max(o.values()) for o in layout)
    ef = relayed = 0.0
    phases = [0.0, 0.0, 0.0]  # encode, exchange, owner: the busiest rank's, over buckets
    for me in ranks:
        ef_me = relayed_me = 0.0
        for owners in layout:
            relay = relay_is_lighter(owners, nodes, b)
            sent, rel = ef_elements(owners, me, nodes, relay)
            ef_me, relayed_me = ef_me + sent, relayed_me + rel
            phases = [max(x, y) for x, y in zip(phases, bucket_phases(owners, me, nodes, b, relay, design.send_copies,
                                                                          design.relay_keeps_chunks))]
        ef, relayed = max(ef, ef_me), max(relayed, relayed_me)
    if two_level:  # the node stage: a piece in the bucket's dtype coming in (sent from where it lies in the
        # bucket: TorchComm's parts; the next piece's in flight while this one's is summed: two), and the fp32
        # node partial of a slot's share of a piece, which the pipeline holds for FINISH_LAG + 1 pieces with
        # their exchanges (the exchange's phases stay the whole bucket's: those pieces hold at most its parts)
        biggest = max(sum(o.values()) for o in layout) * run.per_node
        asked = run.node_pieces or (NODE_PIECES_CARRIED if carries(run) else NODE_PIECES)
        pieces = max(1, min(asked, int(biggest) // run.node_piece_min_elements))
        piece = biggest / pieces
        # quantized (gift.node_format): what comes in is the node format's payloads, and what goes out
        # is encoded into payloads of its own, held until its all-to-all is done (the bucket's dtype
        # leaves from where it lies)
        node_in = wire_bytes(run.node_format, run.node_block_size) * 2 if run.node_format else run.params_bytes
        node = node_in * piece * min(pieces, 2) + 4 * piece / run.per_node * min(pieces, FINISH_LAG + 1)
        phases = [x + node for x in phases]
    out["error_feedback"] = design.ef_bytes * ef if run.error_feedback else 0.0
    out["relay_residuals"] = design.ef_bytes * relayed if run.error_feedback else 0.0
    out["telemetry_samples"] = held_samples(layout, run, design)
    out["payload"] = max(phases[1:])
    staging, whiten, codec = codec_staging_parts(section, max(n for _, _, n in shape.linears), run, design)
    out["codec_staging"] = staging + max(whiten, codec)
    # the fidelity check's sample goes out and comes in too
    # quantization_stats over the section, or over a sample a recorder keeps as it is read (4 B more)
    if design.telemetry_sample is None:
        out["telemetry"] = TELEMETRY_BYTES * section
    else:
        out["telemetry"] = (TELEMETRY_BYTES + 4) * min(section, design.telemetry_sample)
    out["telemetry"] += 8 * run.fidelity_elements * nodes
    if not design.samples_cached:  # the bucket's sampled positions, made for the step
        out["telemetry"] += sample_bytes(layout, run)[1]
    # with error feedback a section is staged whole (its residual is whole) and decoded whole beside
    # it (the residual is what the decode misses), both fp32
    decoded = 0.0
    if run.error_feedback:
        staging, decoded = 4 * section, 4 * section
    encode = phases[0] + staging
    phases[0] = encode + max(whiten, codec + out["telemetry"], decoded)  # a section's encode, sampled step
    # one bucket's reduction at its largest: on an ordinary step and on a sampled one
    out["reduce"] = max(encode + max(whiten, codec, decoded), phases[1], phases[2])
    out["reduce_sampled"] = max(phases)
    if run.stage == 3:  # Stage3OptimizerState: a layer's whole gradient (no optimizer state modelled), one at a
        # time where judged as captured (a tile of rows at a time under "tile")
        largest = max(numel for _, _, numel in shape.linears)
        out["refresh_captures"] = 4.0 * (min(largest, design.codec_tile) if design.capture == "tile"
                                         and design.codec_tile else largest)
    else:
        out["refresh_captures"] = capture_bytes(shape, main_owners(shape.sizes, run.world), design,
                                                CAPTURE_BYTES if run.optimizer_state else 4.0, run.world)
    out["param_gather"] = param_gather_bytes(shape.params, run, design) if run.params_format else 0.0
    out["held"] = sum(out[k] for k in HELD)
    out["peak"] = peak_bytes(out, phases, design.capture in ("layer", "slice", "tile"))
    return out


def peak_bytes(c: Dict[str, float], phases: List[float], judged_at_capture: bool) -> float:
    """The worst step's peak: the held state, the step's statistic sums (from the forward to the
    end of the step) and the profile's captures (from the reduction to the end of the step), and
    the largest of: a section's encode (``phases[0]``: its staging, then the whitening's
    temporaries or the codec's work and a sampled step's telemetry, beside the sections encoded so
    far), the exchange, the owner's sums, the parameter all-gather, and the means ``take()`` makes
    beside the sums at the end of the step. A layer judged as it is captured (``judged_at_capture``)
    is gone before its bucket's reduction: its capture is one more moment, not held beside them."""
    moments = [phases[0], phases[1], phases[2], c["param_gather"], c["statistics_step"]]
    if judged_at_capture:
        return c["held"] + c["statistics_step"] + max(moments + [c["refresh_captures"]])
    return c["held"] + c["statistics_step"] + c["refresh_captures"] + max(moments)


def codec_staging_parts(section: float, layer: int, run: Run, design: Design) -> Tuple[float, float, float]:
    """(staging, whitening, codec work) of the section being encoded: whole-section staging
    (``design.stage_tile`` None) is an fp32 copy of the section, and a whitened piece (at most
    ``layer``, the largest linear weight) its two other temporaries; staged a chunk at a time
    (``plan.SectionSource``: whole rows of one piece, about a tile) the codec reads the chunk into
    its own tile and a whitened chunk holds its output and two temporaries (12 B an element). The
    codec's work is over a tile (on a CPU the codecs cut any tile to ``CPU_TILE``, as
    ``formats.base._device_tile`` does). The whitening's temporaries are gone before the codec runs."""
    work = CODEC_WORK[run.format] + (STOCHASTIC_WORK if run.stochastic else 0.0)
    codec = section if design.codec_tile is None else min(section, design.codec_tile)
    if run.device == "cpu":
        codec = min(codec, CPU_TILE)
    piece = min(section, layer)
    if design.stage_tile is None:
        return 4 * section, 4 * (WHITEN_TEMPS - 1) * piece, work * codec
    return 0.0, 4 * WHITEN_TEMPS * min(piece, design.stage_tile), work * codec


def sample_bytes(layout: List[Dict[int, int]], run: Run) -> Tuple[float, float]:
    """(all buckets', the largest bucket's) sampled positions of the fidelity check: per bucket and
    owner (its one section), the ``ceil(n / stride)`` positions and offsets of
    ``plan.section_sample``, int64 each, with the stride ``exact_sample_reduction`` takes."""
    per_bucket = []
    for owners in layout:
        total = 0.0
        for n in owners.values():
            stride = max(1, -(-int(n) // run.fidelity_elements))
            total += 16 * -(-int(n) // stride)
        per_bucket.append(total)
    return sum(per_bucket), max(per_bucket, default=0.0)


SAMPLES_CACHED_PLANS = 256  # plan.MAX_CACHED_PLANS when plans kept their sampled positions (before 9eaa19e)


def held_samples(layout: List[Dict[int, int]], run: Run, design: Design) -> float:
    """Sampled positions the cached plans keep (``design.samples_cached``): one set per plan
    version a sampled step used, up to the plan cache's size of that design (256 plans)."""
    if not design.samples_cached:
        return 0.0
    versions = run.sampled_versions or max(1, SAMPLES_CACHED_PLANS // max(len(layout), 1))
    return sample_bytes(layout, run)[0] * versions


def _node_partial(owners: Dict[int, int], per_node: int) -> Dict[int, int]:
    """The slot group's bucket after the node stage: each node's part of the slot's owners, by node."""
    out: Dict[int, int] = {}
    for d, n in owners.items():
        out[d // per_node] = out.get(d // per_node, 0) + n / per_node
    return out


def param_gather_bytes(params: int, run: Run, design: Design) -> float:
    """``gift.params``: the code's own count (``param_gather.gather_peak_bytes``, from its chunk
    plan) where it has one; before it, the replicas of this rank's partition before the step (the
    deltas' base) and the padded blob, the comm's copy and the world's blobs at once."""
    from deepspeed_gift.core.formats import get_format
    from deepspeed_gift.exchange import param_gather

    part = -(-params // (2 * run.world)) * 2  # DeepSpeed's partition: padded to 2 W elements
    codec = get_format(run.params_format)
    count = getattr(param_gather, "gather_peak_bytes", None)
    if count is not None:
        two_level = run.per_node > 1 and run.world > run.per_node
        # the worst step is a sampled one; the codec's work over its tile, as the reduction's codecs;
        # gloo on a CPU holds the world's blobs twice (its own buffer, then the output)
        tile = min(part, CPU_TILE if run.device == "cpu" else design.codec_tile or part)
        return count(codec, [part], run.world, bucket_elements=run.allgather_bucket,
                     replica_itemsize=run.params_bytes, ranks_per_node=run.per_node if two_level else 1,
                     two_level=two_level, sampled=True, codec_work_bytes=int(CODEC_WORK[run.params_format] * tile),
                     comm_copies=2 if run.device == "cpu" else 1)["total"]
    return run.params_bytes * part + (run.world + 2) * codec.nbytes(part)


def zero2_memory(params: int, run: Run, largest: int = 0) -> Dict[str, float]:
    """DeepSpeed ZeRO-2's own bytes per rank on the device (see the module docstring). With
    ``run.offload`` (``offload_optimizer: {"device": "cpu"}``, as ``stage_1_and_2.py`` allocates
    it): the fp32 master partition, its gradient, Adam's moments, the bf16 copy of the partition
    and the buffers that accumulate this partition's gradients across micro-steps live on the
    host (``host``, not in ``total``); the device keeps the replicas, the bucket (two: offload
    forces contiguous gradients, and ``overlap_comm`` swaps them) and a buffer of the largest
    parameter (``largest`` elements) that gradients pass through on their way out."""
    w, pb = run.world, run.params_bytes
    if not run.offload:
        out = {"replicas": pb * params, "fp32_master": 4 * params / w, "adam": 8 * params / w,
               "grad_partition": pb * params / w + 4 * params / w,
               "reduce_bucket": pb * run.bucket * (2 if run.overlap_comm else 1)}
        out["total"] = sum(out.values())
        return out
    out = {"replicas": pb * params, "reduce_bucket": pb * run.bucket * (2 if run.overlap_comm else 1),
           "offload_staging": pb * largest}
    out["total"] = sum(out.values())
    # host: fp32 master + its gradient + Adam (16 B), the bf16 partition copy, the accumulation
    # buffers (whole parameters of the partition: about a partition and one parameter more) and
    # the host's buffer of the largest parameter
    out["host"] = (16 + pb) * params / w + pb * (params / w + largest) + pb * largest
    return out


def zero3_memory(shape: "Shape", run: Run, block: int) -> Dict[str, float]:
    """DeepSpeed ZeRO-3's own bytes per rank on the device (``deepspeed/runtime/zero/stage3.py``,
    counted as it allocates them): the parameter partitions (params_dtype x N/W), the fp32 master
    partitions (4 N/W), Adam's moments (8 N/W), the gradient partitions (``grad_partitions_flat_buffer``,
    params_dtype x N/W) and their fp32 copy for the step (4 N/W), the reduce bucket (params_dtype x
    ``reduce_bucket_size``, and the copy ``reduce_scatter_coalesced`` interleaves it into), and the
    parameters gathered whole while a layer runs: the running transformer block and the prefetched
    one (``block`` elements each, at most ``stage3_max_live_parameters``) and the prefetch bucket."""
    w, pb, n = run.world, run.params_bytes, shape.params
    out = {"param_partition": pb * n / w, "fp32_master": 4 * n / w, "adam": 8 * n / w,
           "grad_partition": pb * n / w + 4 * n / w, "reduce_bucket": 2 * pb * run.bucket,
           "live_parameters": pb * (min(2 * block, run.max_live_parameters) + run.prefetch_bucket)}
    out["total"] = sum(out.values())
    return out


def largest_block(config: dict) -> int:
    """Elements of one transformer block of the model (a layer's attention, MLP and norms)."""
    h, i, heads, kv = (config["hidden_size"], config["intermediate_size"], config["num_attention_heads"],
                       config["num_key_value_heads"])
    return 2 * h * h + 2 * h * (h // heads) * kv + 3 * h * i + 2 * h


def print_stage3(args, design: Design) -> List[dict]:
    """ZeRO stage 3, flat, README block with and without error feedback: GIFT's peak extra against
    stage 3's own per rank, with DeepSpeed's default buckets and with what HF's integration sets
    for ``"auto"`` (``reduce_bucket_size`` hidden^2, ``stage3_prefetch_bucket_size`` 0.9 hidden^2)."""
    print(f"\nZeRO stage 3, flat, README block, design {design.name}: GIFT's peak extra / ZeRO-3's own per rank (GiB)")
    print("| model | buckets | W | EF | payload | codec_staging | error_feedback | statistics + transforms | "
          "GIFT peak | ZeRO-3 own | peak / ZeRO-3 |")
    print("|---|---|---:|---|---:|---:|---:|---:|---:|---:|---:|")
    rows = []
    for name in args.models.split(","):
        config = MODELS[name]
        shape = model_shape(config)
        h2 = config["hidden_size"] ** 2
        for buckets, bucket, prefetch in (("DeepSpeed's", int(args.bucket), Run.prefetch_bucket),
                                          ("HF auto", h2, int(0.9 * h2))):
            for world in WORLDS:
                for ef in (False, True):
                    run = Run(world=world, bucket=bucket, allgather_bucket=int(args.allgather_bucket),
                              error_feedback=ef, stage=3, prefetch_bucket=prefetch)
                    gift, zero = gift_memory(config, run, design), zero3_memory(shape, run, largest_block(config))
                    rows.append({"model": name, "buckets": buckets, "world": world, "stage": 3, "error_feedback": ef,
                                 "gift": gift, "zero3": zero, "peak_over_zero3": gift["peak"] / zero["total"]})
                    print(f"| {name} | {buckets} | {world} | {'on' if ef else 'off'} | {gift['payload'] / GIB:.2f} | "
                          f"{gift['codec_staging'] / GIB:.2f} | {gift['error_feedback'] / GIB:.2f} | "
                          f"{(gift['statistics'] + gift['transforms']) / GIB:.2f} | {gift['peak'] / GIB:.2f} | "
                          f"{zero['total'] / GIB:.2f} | {100 * gift['peak'] / zero['total']:.1f}% |")
    return rows


# ---- the tables ------------------------------------------------------------------------------
def rows_for(name: str, config: dict, design: Design, bucket: int, allgather: int,
             node_pieces: Optional[int] = None, node_format: Optional[str] = None) -> List[dict]:
    rows = []
    params = model_shape(config).params
    for world in WORLDS:
        for per_node in (1, PER_NODE):
            for ef in (False, True):
                run = Run(world=world, per_node=per_node, bucket=bucket, allgather_bucket=allgather,
                          error_feedback=ef, node_pieces=node_pieces, **node_format_keys(node_format))
                gift, zero = gift_memory(config, run, design), zero2_memory(params, run)
                rows.append({"model": name, "params": params, "world": world, "per_node": per_node,
                             # one node of 8 runs flat (by_topology)
                             "hierarchy": ("two_level" if world > per_node else "flat, one node") if per_node > 1
                             else "flat", "error_feedback": ef,
                             "design": design.name, "gift": gift, "zero2": zero,
                             "peak_over_zero2": gift["peak"] / zero["total"]})
    return rows


def node_format_keys(spec: Optional[str]) -> dict:
    """``Run``'s node_format / node_block_size of a ``FORMAT[/BLOCK]`` flag (None: the bucket's dtype)."""
    if not spec:
        return {}
    name, _, block = spec.partition("/")
    return {"node_format": name, "node_block_size": int(block) if block else None}


def print_offload(args, design: Design) -> None:
    """ZeRO-Offload: GIFT's peak extra (on the device, where all of GIFT's state lives) against
    what ZeRO-2 keeps on the device, and what it keeps on the host, flat, README block."""
    print(f"\nZeRO-Offload (offload_optimizer cpu), flat, README block, design {design.name}: GIFT's peak extra / "
          "ZeRO-2's own on the device (GiB), and ZeRO-2's host memory per rank")
    print("| model | W | GIFT peak GiB | ZeRO-2 device GiB | peak / ZeRO-2 device | ZeRO-2 host GiB |")
    print("|---|---:|---:|---:|---:|---:|")
    for name in args.models.split(","):
        config = MODELS[name]
        shape = model_shape(config)
        for world in WORLDS:
            run = Run(world=world, bucket=int(args.bucket), allgather_bucket=int(args.allgather_bucket), offload=True)
            gift, zero = gift_memory(config, run, design), zero2_memory(shape.params, run, max(shape.sizes))
            print(f"| {name} | {world} | {gift['peak'] / GIB:.2f} | {zero['total'] / GIB:.2f} | "
                  f"{100 * gift['peak'] / zero['total']:.1f}% | {zero['host'] / GIB:.2f} |")


def print_table(rows: List[dict], before: Optional[List[dict]] = None) -> None:
    """The components in GiB per rank, GIFT's peak beside ZeRO-2's own; with ``before`` (rows of
    the same runs under another design) that design's peak over ZeRO-2's own too."""
    cols = ("statistics", "transforms", "codec_staging", "payload", "error_feedback", "relay_residuals",
            "param_gather", "refresh_captures", "telemetry", "telemetry_samples", "statistics_step")
    extra = " before: peak / ZeRO-2 |" if before else ""
    print("| model | W | exchange | EF | " + " | ".join(cols) + " | GIFT peak GiB | ZeRO-2 own GiB | peak / ZeRO-2 |"
          + extra)
    print("|---|---:|---|---|" + "---:|" * (len(cols) + 3 + bool(before)))
    for i, r in enumerate(rows):
        g = r["gift"]
        cells = " | ".join(f"{g[c] / GIB:.3g}" for c in cols)
        ef = "on" if r["error_feedback"] else "off"
        tail = f" {100 * before[i]['peak_over_zero2']:.0f}% |" if before else ""
        print(f"| {r['model']} | {r['world']} | {r['hierarchy']} | {ef} | {cells} | "
              f"{g['peak'] / GIB:.3g} | {r['zero2']['total'] / GIB:.3g} | {100 * r['peak_over_zero2']:.1f}% |" + tail)


def grows_with(design: Design) -> List[str]:
    """Components at 70B that do not shrink when the world doubles and the buckets and the tile
    halve: they follow N, in^2, r in or W, not N/W, a bucket or a tile. The statistics and the
    transforms are r in by their formulas (:func:`statistics_bytes`, :func:`transform_bytes`)
    when the statistics are a sketch, and are named only when they are dense (in^2); the refresh
    captures may hold one layer's (the largest linear weight's) capture."""
    config = MODELS["70B"]
    zero = zero2_memory(model_shape(config).params, Run(world=1024))["total"]
    found: List[str] = []
    for ef in (False, True):
        small = gift_memory(config, Run(world=512, error_feedback=ef, params_format="fp8_e4m3"), design)
        halved = replace(design, codec_tile=design.codec_tile and design.codec_tile // 2,
                         stage_tile=design.stage_tile and design.stage_tile // 2)
        big = gift_memory(config, Run(world=1024, bucket=250_000_000, allgather_bucket=250_000_000,
                                      error_feedback=ef, params_format="fp8_e4m3"), halved)
        layer = CAPTURE_BYTES * max(numel for _, _, numel in model_shape(config).linears)
        for k in COMPONENTS:
            if k == "transforms" or (k in ("statistics", "statistics_step") and design.stats != "dense"):
                continue
            if k == "refresh_captures" and big[k] <= 1.01 * layer:  # bounded by one layer's capture
                continue
            if big[k] > 0.9 * small[k] > 0 and big[k] > 1e-3 * zero and k not in found:
                found.append(k)
    return found


def main(argv=None) -> List[dict]:
    parser = argparse.ArgumentParser()
    parser.add_argument("--bucket", type=float, default=5e8, help="reduce_bucket_size (DeepSpeed's default 5e8)")
    parser.add_argument("--allgather-bucket", type=float, default=5e8, help="allgather_bucket_size")
    parser.add_argument("--design", choices=("now", "before", "both"), default="both")
    parser.add_argument("--node-pieces", type=int, default=None,
                        help="gift.node_pieces (two-level's pipeline; 1: whole buckets, the stages one after another; "
                             "default gift's: 6, the tables' overlap_comm being off)")
    parser.add_argument("--node-format", default=None, metavar="FORMAT/BLOCK",
                        help="gift.node_format (and node_block_size) of the two-level rows, e.g. int8/32 (default: "
                             "the node stage in the bucket's dtype)")
    parser.add_argument("--models", default=",".join(MODELS), help="comma-separated among " + ", ".join(MODELS))
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    designs = {"now": [design_now()], "before": [BEFORE], "both": [BEFORE, design_now()]}[args.design]
    rows: List[dict] = []
    for design in designs:
        print(f"\n## design {design.name}: {design}")
        these = []
        for name in args.models.split(","):
            these += rows_for(name, MODELS[name], design, int(args.bucket), int(args.allgather_bucket),
                              args.node_pieces, args.node_format)
        print_table(these, before=rows if len(rows) == len(these) else None)
        key = [r for r in these if r["model"] == "7B" and r["world"] == 64 and r["per_node"] == 1
               and not r["error_feedback"]]
        if key:
            r = key[0]
            print(f"\nLlama-2-7B, W = 64, README block (fp8, kfac_input, layers measured, no EF), design "
                  f"{design.name}: GIFT's peak extra {r['gift']['peak'] / GIB:.2f} GiB / ZeRO-2's own "
                  f"{r['zero2']['total'] / GIB:.2f} GiB = {100 * r['peak_over_zero2']:.1f}%")
        if "70B" in args.models.split(","):
            print(f"70B: components that still grow with N or in^2 (design {design.name}): "
                  f"{', '.join(grows_with(design)) or 'none'}")
        print_offload(args, design)
        rows += these
        if design.name == "now":
            rows += print_stage3(args, design)
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
