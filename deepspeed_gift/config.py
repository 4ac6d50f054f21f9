"""The ``"gift"`` block of ds_config.json: one validated model.

Built on DeepSpeed's own ``DeepSpeedConfigModel`` (unknown keys are rejected), in
pydantic's strict mode so that ``"32"`` is not quietly read as ``32`` and ``1`` is not
read as ``true``. Every error is re-raised as a ``ValueError`` whose message names the
key path (``gift.geometry.rank``), the value given and what is allowed.
"""

from __future__ import annotations

import enum

import json
from typing import List, Literal, Optional, Union, get_args

from deepspeed.runtime.config_utils import DeepSpeedConfigModel
from pydantic import ConfigDict, Field, ValidationError, model_validator

from .core.formats import DEFAULT_TILE_ELEMENTS, FORMAT_NAMES, ROUNDING_MODES, format_class
from .core.geometry import SOLVERS, GeometryKind
from .core.kernels import KERNEL_MODES
from .core.metrics import METRICS
from .exchange.comm import Backend
from .exchange.plan import Route

GIFT_KEY = "gift"
# gift.node_pieces where it is not set: a bucket's own pipeline pays its fill and drain every
# bucket, so more pieces; a pipeline carried from bucket to bucket (gift.carry_buckets) pays
# them once a step, so fewer pieces, each paying its collectives' latency once (layout model)
NODE_PIECES_BY_BUCKET = 6
NODE_PIECES_CARRIED = 4

class Hierarchy(str, enum.Enum):
    """``gift.hierarchy``, and the exchange it resolves to (``flat`` or ``two_level``)."""

    BY_TOPOLOGY = "by_topology"
    FLAT = "flat"
    TWO_LEVEL = "two_level"


class Layers(str, enum.Enum):
    """``gift.layers`` as a word: the layers selected by measurement, or all of them."""

    MEASURED = "measured"
    ALL = "all"


class DampingMode(str, enum.Enum):
    """``gift.geometry.damping_mode``: damping as it is, or relative to the statistic's mean diagonal."""

    ABSOLUTE = "absolute"
    RELATIVE = "relative"


GeometryKindName = Literal[tuple(k.value for k in GeometryKind)]
FormatName = Literal[FORMAT_NAMES]  # the codecs in ``formats`` name the formats
FP8_FORMATS = tuple(n for n in FORMAT_NAMES if n.startswith("fp8_"))
PASSTHROUGH_FORMATS = tuple(n for n in FORMAT_NAMES if format_class(n).default_block_size == 0)
# gift.relay_format's default under a quantized gift.format, and its block (docs/benchmarks.md,
# "Route fidelity": in GIFT's coordinates a block of 128 erred 1.42x direct's at 32 ranks, of 32 1.35x)
RELAY_DEFAULT_FORMAT, RELAY_DEFAULT_BLOCK = "int8", 32
DEFAULT_BLOCK_SIZE = {n: format_class(n).default_block_size for n in FORMAT_NAMES if n not in PASSTHROUGH_FORMATS}
NVFP4_BLOCK = format_class("nvfp4").default_block_size
E8M0_BLOCK = 32  # the OCP MX block of E8M0-scaled FP8 (formats.fp8._Fp8Codec)


class _GiftModel(DeepSpeedConfigModel):
    # ``use_attribute_docstrings``: the string under a field becomes its ``description`` (read by
    # scripts/config_reference.py); it affects neither parsing nor validation.
    model_config = ConfigDict(strict=True, use_attribute_docstrings=True)


class GeometryConfig(_GiftModel):
    """How gradients are moved into geometry-aware coordinates before quantization."""

    kind: Union[GeometryKindName, List[GeometryKindName]] = GeometryKind.KFAC_INPUT.value
    """``kfac_input``: whitening by the layer's input covariance (GIFT); ``adam_factored``:
    Adam's geometry, the gradient scaled by the row and column factors of the optimizer's
    second moment (Adam/AdamW layers; others stay Euclidean); ``identity``: Euclidean
    baseline; ``hadamard``: seeded random-sign Hadamard rotation. A list of kinds (with
    ``layers: "measured"``): each layer takes the one that measures best in ``selection.metric``."""

    rank: int = Field(32, ge=1)
    """Number of leading eigen-directions kept in the low-rank + diagonal fit. With ``kfac_input``
    it must not exceed the input features of the narrowest selected layer (checked at attach)."""

    damping: float = Field(1e-3, gt=0.0)
    """Floor of the residual diagonal ``d`` (keeps ``S`` bounded); see ``damping_mode``."""

    damping_mode: Literal[tuple(d.value for d in DampingMode)] = DampingMode.ABSOLUTE.value
    """``absolute``: the floor is ``damping``; ``relative``: ``damping * mean(diag(A))``, the
    same conditioning whatever the scale of the layer's inputs."""

    refresh_interval: int = Field(50, ge=1)
    """Steps between re-fits of the factors (while ``selection.idle_backoff`` spaces the
    judgements: a refit alone one interval before each judgement, and the judgement's own)."""

    collect_interval: int = Field(10, ge=1)
    """Input statistics are collected on every ``collect_interval``-th step (and on each
    refresh step; while ``selection.idle_backoff`` spaces the judgements, only shortly before
    them); collecting costs O(tokens * in * (rank + 8)) per layer."""

    stats_tokens: Optional[int] = Field(None, ge=1)
    """At most this many tokens per layer and forward enter the input statistics (evenly strided
    over the batch); ``null``: every token. Collecting costs O(tokens * in * (rank + 8)) per layer."""

    stats_decay: float = Field(0.95, ge=0.0, lt=1.0)
    """EMA decay of the input second moment ``E[x x^T]``, once per collection the schedule
    makes (a collection after ``selection.idle_backoff``'s gap decays the average once for each
    one skipped as well)."""

    factor_decay: float = Field(0.95, ge=0.0, lt=1.0)
    """Smoothing across refreshes: the fit sees ``factor_decay * A_hat_prev +
    (1 - factor_decay) * A_stats`` (``factor_decay ** n`` after ``n`` refresh intervals without
    a refit, under ``selection.idle_backoff``)."""

    solver: Literal[SOLVERS] = "structured"
    """``structured``: O(out*in*r) whitening with exact inverse; ``cholesky``: the
    published dense form, O(out*in^2), kept for comparison."""

    method: Literal["by_width", "eigh", "randomized"] = "by_width"
    """Eigen-solver for the fit: exact ``eigh`` (O(in^3)), or randomized subspace iteration
    for wide layers; ``by_width`` picks ``eigh`` up to 1024 input features, randomized above."""


class SelectionConfig(_GiftModel):
    """How ``layers: "measured"`` picks the layers that take the geometry branch."""

    min_gain: float = Field(0.05, ge=0.0, lt=1.0)
    """A layer is selected when geometry lowers its measured round-trip error by at
    least this fraction relative to Euclidean."""

    max_layers: Optional[int] = Field(None, ge=1)
    """Keep at most this many layers (highest gain per transform FLOP first)."""

    metric: Literal[METRICS] = "optimizer"
    """The error a layer's gain is measured in: ``optimizer``: the relative error of the
    update the configured optimizer takes from the gradient (Muon: Newton-Schulz of the
    Nesterov momentum blend; Adam/AdamW: ``m_hat / (sqrt(v_hat) + eps)``, with the real
    optimizer state; plain L2 for other optimizers); ``l2``: the gradient's plain relative
    error; ``whitened``: its error in the whitener's norm ``||E S|| / ||G S||``."""

    idle_backoff: int = Field(8, ge=1)
    """While the judgements select no layer, judge less often: after a refresh that selects
    none, the next judgement comes twice as many steps later as the last did, at most
    ``idle_backoff`` x ``geometry.refresh_interval`` steps later; one that selects a layer
    brings back every ``refresh_interval`` steps. Between two judgements more than
    ``refresh_interval`` apart the factors are refitted ``refresh_interval`` steps before the
    judgement (so it judges transforms refitted as recently as it would use them, from
    statistics aged by the steps that passed) and the input statistics are collected only in
    the ``2 x refresh_interval`` steps before it. Once the gap has grown to its cap, a run in
    which no layer gains pays ``1 / idle_backoff`` of the judgements and ``2 / idle_backoff`` of
    the refits and statistics (with the default 8: 1/8 and 1/4). A checkpoint resumed with
    another ``refresh_interval`` or ``idle_backoff`` judges at the multiples of
    ``refresh_interval`` from there. ``1``: judge every refresh."""


class TelemetryConfig(_GiftModel):
    """What is measured and where it goes."""

    every: int = Field(50, ge=0)
    """Every this many steps: sampled fidelity check and saturation counts (0 = never)."""

    fidelity: bool = True
    """Compare the low-precision reduction with an exact one on sampled steps."""

    fidelity_elements: int = Field(65536, ge=1)
    """The fidelity check's sample: at most about this many elements of what each owner receives
    of a bucket (evenly strided) are also reduced exactly in fp32; each rank sends 4 bytes per
    sampled element to each owner (``fidelity_bytes``)."""

    jsonl: Optional[str] = None
    """Path of a JSONL file (one record per step, written by the data-parallel group's rank 0);
    ``null``: no file. Where data parallelism is one group of several (pipeline or tensor
    parallelism), each group writes its own, the writer's global rank before the extension
    (``telemetry.jsonl`` -> ``telemetry.rank1.jsonl``)."""

    monitor: bool = True
    """Also write to DeepSpeed's monitor (tensorboard/csv/wandb) when configured."""


class ParamsConfig(_GiftModel):
    """The parameter all-gather after the optimizer step (``gift.params``; absent: DeepSpeed's own)."""

    format: FormatName = "fp8_e4m3"
    """What the owner sends of each replica's change: a quantized format, or ``bf16``/``fp32``.
    The format that is the replica's own dtype (bf16 for a bf16 model, fp32 for an fp32 one) is
    lossless: DeepSpeed's own all-gather runs; one wider than the replicas (fp32 for a bf16 model)
    is refused at attach."""

    block_size: Optional[int] = Field(None, ge=0)
    """Elements per scale of the change; ``null`` = the format's default (fp8/int: 128, nvfp4: 16,
    the only size nvfp4 takes); ``bf16``/``fp32`` have no scales and take only ``null`` or ``0``."""

    resync_interval: Optional[int] = Field(None, ge=1)
    """Every this many steps the exact replica is all-gathered (replica = target exactly);
    ``null``: never (the replica tracks its target without drift regardless)."""

    @model_validator(mode="after")
    def _check_block(self):
        _check_block_size(self.format, self.block_size, "gift.params.block_size")
        return self

    @property
    def effective_block_size(self) -> int:
        return resolved_block_size(self.format, self.block_size)


def resolved_block_size(fmt: str, block: Optional[int], scale: str = "fp32") -> int:
    """The block size a codec of ``fmt`` uses for a configured ``block`` (null: the format's default)."""
    if fmt in PASSTHROUGH_FORMATS:
        return 0
    if block is not None:
        return block
    return E8M0_BLOCK if scale == "e8m0" else DEFAULT_BLOCK_SIZE[fmt]


def _check_block_size(fmt: str, block: Optional[int], key: str) -> None:
    if fmt in PASSTHROUGH_FORMATS and block not in (None, 0):
        raise ValueError(f"{key}: got {block}; format '{fmt}' has no scales, leave block_size unset (null)")
    if fmt == "nvfp4" and block not in (None, NVFP4_BLOCK):
        raise ValueError(f"{key}: got {block}; format 'nvfp4' needs block_size {NVFP4_BLOCK}")


class GiftConfig(_GiftModel):
    """The ``"gift"`` block. A missing block means GIFT is off; a present block is on
    unless it says ``"enabled": false``."""

    enabled: bool = True
    """``false`` leaves DeepSpeed's own gradient reduction untouched (as a missing block does).
    When on, GIFT needs ZeRO stage 1, 2 or 3: DeepSpeed's ZeRO optimizer for stage 1/2, its BF16_Optimizer,
    or its stage 3 optimizer, optimizer offload to the host included (docs/deepspeed.md says what each
    serves)."""

    format: FormatName = "fp8_e4m3"
    """Wire format of the gradients: ``fp8_e4m3``/``fp8_e5m2`` (1 B per element + scales),
    ``nvfp4`` (E2M1, two per byte, E4M3 scale per 16), ``int8``/``int4`` (symmetric, fp32 scale
    per group), or the unscaled ``bf16``/``fp32`` (``fp32`` is bit-exact)."""

    block_size: Optional[int] = Field(None, ge=0)
    """Elements per scale; ``null`` = the format's default (fp8/int: 128, nvfp4: 16, the only
    size nvfp4 takes; 32 with ``scale: "e8m0"``); ``0`` = one scale per chunk (fp8/int only);
    ``bf16``/``fp32`` have no scales and take only ``null`` or ``0``."""

    scale: Literal["fp32", "e8m0"] = "fp32"
    """Scale encoding: fp32 per block, or power-of-two E8M0 per 32 (fp8 only)."""

    rounding: Literal[ROUNDING_MODES] = "nearest"
    """How values are rounded to the format's grid: ``nearest``, or ``stochastic`` (unbiased,
    seeded from ``seed`` and the rank). ``fp32`` is exact and only takes ``nearest``."""

    backend: Literal[tuple(b.value for b in Backend)] = Backend.TORCH.value
    """Transport of GIFT's payloads: ``torch``: torch.distributed over DeepSpeed's data-parallel
    group (gloo/NCCL); ``mpi``: mpi4py (needs the ``mpi`` extra installed)."""

    geometry: GeometryConfig = Field(default_factory=GeometryConfig)
    """The geometry transform applied before quantization."""

    layers: Union[Literal[tuple(x.value for x in Layers)], List[str]] = Layers.MEASURED.value
    """``measured``: per-layer selection by the measured error; ``all``: every eligible linear layer; or a
    list of glob patterns over module names (``"*.mlp.*"``)."""

    selection: SelectionConfig = Field(default_factory=SelectionConfig)
    """How ``layers: "measured"`` picks layers; unused with ``all`` or a list of patterns."""

    others: Literal["euclidean", "bf16", "fp32"] = "euclidean"
    """What happens to gradients outside the geometry branch: quantized in Euclidean
    coordinates with the same format, or sent at bf16/fp32."""

    error_feedback: bool = False
    """Keep each rank's quantization residual (in transformed coordinates) and add it to the
    next step's gradient before quantizing, so the error does not accumulate; costs 1.03 B per
    element this rank sends quantized: the residual is held as int8 with an fp32 scale per 128
    elements (``deepspeed_gift.exchange.feedback.RESIDUAL_BYTES_PER_ELEMENT``; telemetry
    ``error_feedback_bytes``). A step DeepSpeed skips (its overflow check found an inf/nan)
    drops every residual, and a residual block that held inf/nan is kept as zeros: no error of
    a thrown-away gradient reaches the next step. Off by default: under AdamW at NVFP4 it raised
    the sampled gradient error 1.4x and did not lower the validation loss (docs/results.md, the
    error-feedback study)."""

    start_step: int = Field(0, ge=0)
    """Steps run on DeepSpeed's native reduction before GIFT takes over."""

    comm_timeout_s: Optional[float] = Field(None, gt=0.0)
    """Seconds a GIFT exchange may wait for the other ranks before failing with an error
    (a dead or hung rank). ``null``: the data-parallel group's own timeout for ``torch``
    (``deepspeed.init_distributed(timeout=...)`` or torch's 30 min), 1800 s for ``mpi``."""

    tile_elements: int = Field(DEFAULT_TILE_ELEMENTS, ge=1)
    """Elements per tile of the reduction's element-wise work: staging, whitening and its
    inverse, encode, and the owner's decode and fp32 sum run over tiles of at most this many
    elements (whole blocks and whole rows; a longer one is a tile of its own), so their
    temporaries stay bounded whatever a section's size. The default (2^24) keeps them under
    ~0.6 GB on an accelerator: at most ~34 B per tile element (measured: NVFP4 encode 28, the
    section chunk it reads 4, a sampled step's recorded sample 4; fp8 encode 4, 11 with
    stochastic rounding; a whitener 12 (fitted) to 16 (Hadamard) while it makes a chunk, the
    chunk included; the sum's decode 4 to 8).
    The CPU cuts the codecs' tiles further to 2^20, which stays in cache. Tiling changes no
    value (stochastic rounding's random bits come from a counter over each element's offset),
    except that a fitted whitener's matrix products may round a row differently (an fp32 ulp) by the
    number of rows in a call; sampled steps measure the quantization on an evenly strided
    sample of whole blocks of at most 2^20 elements or a tile (telemetry's ``quantized`` counts the sample)."""

    seed: int = Field(0, ge=0)
    """Seed of Hadamard signs and stochastic rounding (identical on every rank)."""

    kernels: Literal[KERNEL_MODES] = "by_device"
    """How the codecs run: ``eager`` (chains of PyTorch ops, the reference), ``compiled`` (each
    format's encode and the owner's decode-and-sum fused by ``torch.compile`` into one or two
    kernels a tile; the same bits), or ``by_device``: compiled on CUDA, eager on a CPU (where
    the first compile of each format costs 5-40 s a process). Stochastic rounding is fused too
    and draws the same bits in both modes (a counter, not a stateful generator); E8M0 scales'
    encode, and an int4 section's last partial block where its block is odd, run eager.
    Compiled, the sections of a piece that lie in one buffer as they are sent (a rank's plain
    sections to its owners, a relay's sums) are encoded by one call for all in the block-scaled
    formats (on a CPU those of at most 2^16 elements): on a GPU a call costs the host about
    100 us."""

    hierarchy: Literal[tuple(h.value for h in Hierarchy)] = Hierarchy.BY_TOPOLOGY.value
    """How a bucket reaches its owners. ``flat``: one quantized all-to-all among all ranks.
    ``two_level``: first a reduce-scatter inside each node in the bucket's own dtype (summed in
    fp32 by the receiver), so local rank l holds the node's partial sum of what ranks with local
    rank l own; then the quantized exchange among the same-slot ranks of the nodes, whitened
    once per node partial. ``by_topology``: two-level when the job spans more than one node with
    more than one rank per node, else flat."""

    node_pieces: Optional[int] = Field(None, ge=1)
    """Two-level: each bucket (and each ZeRO-1 round) is cut into this many pieces (on row
    boundaries), run as a pipeline: while piece k crosses the NICs, piece k+1's node stage and
    earlier pieces' forwards run on the node's links, so a bucket takes about its longest stage
    instead of the sum of its stages (the last piece's stages after the first's add about
    1/``node_pieces`` of the others). ``1``: the stages one after another. The result depends on
    the cut (each piece is quantized on its own: per-tensor scales and the relay's split are per
    piece), never on the overlap; lossless configs give native's bits at any count. Unset: 4
    where the pipeline is carried from bucket to bucket (``carry_buckets`` applies), else 6.
    The layout model (``benchmarks/layout_model.py``, GIFT's GPU work counted, 7B and 13B at
    W = 64 in nodes of 8, each piece paying its collectives' latency and launches), ZeRO-2
    bucket by bucket: 0.65x and 0.68x DeepSpeed's gradient time at 4 pieces, 0.61x and 0.64x at
    6, 0.60x and 0.63x at 8; carried: 0.47x and 0.51x at 3, 0.48x and 0.52x at 4, 0.49x and
    0.54x at 6; ZeRO-1's rounds: 0.51x at 4, 0.48x at 6 (with each slot carrying its own
    owner's elements first, since the commit after ``767bf58``; docs/benchmarks.md)."""

    carry_buckets: bool = True
    """Two-level under ``zero_optimization.overlap_comm`` (with ``contiguous_gradients``, without
    ``offload_optimizer``, MoE or a ``PipelineEngine``): the pipeline of pieces carried from
    bucket to bucket, a bucket's last pieces finishing during the next bucket's reduction, so
    the node's links and the NICs do not idle through every bucket's fill and drain. DeepSpeed's
    double ipg buffer is filled again only after the next bucket's reduction; the bucket's
    copies into the partition wait until it is done, and on a GPU the backward waits, before it
    refills the buffer, for that bucket and the next one's node stages, not for the next one's
    exchanges (at each bucket's start it waits for the reductions begun before, as DeepSpeed's
    own; on a GPU this has not run yet). The same bits either way. A reduction that raises with
    a bucket carried makes every later backward refuse (restart from a checkpoint). The layout
    model (7B and 13B at W = 64 in nodes of 8; links only, the backward's compute not modelled)
    gives 0.48x and 0.52x DeepSpeed's gradient time carried in 4 pieces (``node_pieces``' default
    here), 0.61x and 0.64x bucket by bucket in 6. ``false``: each bucket finished before
    DeepSpeed's next."""

    node_piece_min_elements: int = Field(1 << 22, ge=1)
    """Two-level: the smallest piece ``node_pieces`` cuts (a bucket under twice this stays whole):
    every piece costs each of its collectives a latency (tens of microseconds), and a piece of
    4M elements takes about 80 microseconds to cross a 400 Gbit/s NIC in fp8, a few latencies."""

    node_format: Optional[FormatName] = None
    """Two-level: the wire format of the node stage, where each rank sends the other ranks of its
    node their parts of the bucket. ``null``: the bucket's own dtype, summed in fp32 by the
    receiver (no rounding beyond the gradients' own; lossless configs give native's bits). A
    format name: each rank encodes each part it sends in that format (rounded to nearest, scales
    per ``node_block_size``, in gradient coordinates: the whitening comes after, on the node
    partial), and the receiver decodes and sums them in fp32 with its own part exact. Every rank's
    gradient is then quantized once more before the exchange among the nodes; error feedback
    does not see that error, nor does telemetry's sampled ``fidelity_rel_err`` (the exchange
    among the nodes'). ``int8`` with a scale per 32 sends 1.125 B an element where a bf16
    bucket sends 2, for an encode of 7/8 of each piece on every GPU: where the node's links set
    the time (the layout model, 13B at W = 64 in nodes of 8, the codecs at their counted traffic)
    ZeRO-2's carried pipeline goes from 0.52x to 0.46x DeepSpeed's gradient time; with the codec
    as last timed on a GPU (host-bound, about 10x its traffic) the GPU sets it at 1.48x. Its error
    (docs/benchmarks.md, "The quantized node stage"): next to nothing in Euclidean coordinates,
    +12-20% in GIFT FP8's whitened norm at 32 ranks in nodes of 8. Needs a node stage: refused
    with ``hierarchy`` ``flat``; under ``by_topology`` a job of one node or one rank per node has
    none (logged). Refused with DeepSpeed's Muon (a matrix the partitions cut reaches each owner
    whole, and the copies must agree bit for bit)."""

    node_block_size: Optional[int] = Field(None, ge=0)
    """Elements per scale of ``node_format``: ``null`` = the format's default (as ``block_size``);
    ``bf16``/``fp32`` take only ``null`` or ``0``."""

    route: Route = "by_layout"
    """How each bucket's all-to-all is routed (flat, and among the nodes of ``two_level``).
    ``direct``: every rank sends each owner its part, one all-to-all; a bucket that reaches a
    few owners (buckets smaller than a partition: models past ~1B parameters) funnels into
    their links. ``relay``: two balanced all-to-alls: chunk j of every owner's part goes to
    rank j, which sums it in fp32 and sends the sum, quantized once more (in ``relay_format``),
    to the owner.
    ``by_layout``: per bucket, the one whose busiest rank receives fewer bytes (relay needs
    3+ ranks)."""

    stage1_rounds: bool = True
    """ZeRO stage 1 without ``overlap_comm`` (DeepSpeed's defaults below stage 3) reduces once a
    step, after the backward of the boundary micro-batch, when every gradient exists. ``true``:
    GIFT then reduces in balanced rounds instead of DeepSpeed's buckets: round r carries the
    r-th slice of every owner's partition (at most ``reduce_bucket_size`` elements a round, cut
    on row boundaries), so every rank receives its share of each round and every element is
    quantized once, on the direct route, whatever the bucket layout. ``false``: bucket by
    bucket, as stage 2 and stage 1 with ``overlap_comm`` always do (a bucket smaller than a
    partition reaches one or two owners: ``route`` decides between funnel and relay).
    Lossless configs give the same bits either way."""

    relay_format: Optional[FormatName] = None
    """The wire format of the relay route's second hop: the fp32 sums that relay j sends on to
    each owner. Those sums are of every rank's gradient, so quantizing them in the main format
    adds an error that does not average down over the ranks as the first quantization's does
    (fp8_e4m3 at 32 ranks: 2.9x the direct route's error on real gradients). ``null``: ``int8``
    with an fp32 scale per 32 elements (``relay_block_size``; 1.125 B per element) when
    ``format`` is quantized: at 32 ranks its relay errs 1.0-1.35x as much as the direct route
    where the main format's errs 2.1-3.5x, at 0.54x of bf16's busiest-link bytes under fp8
    (0.52x with an fp8 second hop) and 0.42x under nvfp4 (0.28x); the main format itself when
    that is ``bf16`` or ``fp32``. Any format name sets it (``rounding`` as the main format's); the
    main format's name gives the single-format relay. Error against bytes per route:
    docs/benchmarks.md, "Route fidelity"."""

    relay_block_size: Optional[int] = Field(None, ge=0)
    """Elements per scale of the relay's second hop: ``null`` = 32 for the default ``int8`` hop,
    else the format's default (as ``block_size``); ``bf16``/``fp32`` take only ``null`` or ``0``."""

    ranks_per_node: Optional[int] = Field(None, ge=1)
    """Data-parallel ranks per node. ``null``: detected (``LOCAL_WORLD_SIZE`` when data
    parallelism spans the whole job, else host names exchanged at initialize; the ranks of a
    node must be contiguous). A number also lets one machine pose as several nodes."""

    params: Optional[ParamsConfig] = None
    """Compressed parameter all-gather (see ``ParamsConfig``); ``null``/absent: DeepSpeed's own."""

    telemetry: TelemetryConfig = Field(default_factory=TelemetryConfig)
    """What is measured and where it is written."""

    @model_validator(mode="after")
    def _check_combinations(self):
        fmt, block = self.format, self.block_size
        _check_block_size(fmt, block, "gift.block_size")
        if self.scale == "e8m0":
            if fmt not in FP8_FORMATS:
                raise ValueError(f"gift.scale: got 'e8m0' with format '{fmt}'; E8M0 scales are for "
                                 f"{list(FP8_FORMATS)} only")
            if block not in (None, E8M0_BLOCK):
                raise ValueError(f"gift.block_size: got {block}; scale 'e8m0' needs block_size {E8M0_BLOCK}")
        try:  # what else a format accepts is its codec's to say (bf16 rounds stochastically; fp32 is exact)
            format_class(fmt)(block_size=None if fmt in PASSTHROUGH_FORMATS else self.effective_block_size,
                              scale=self.scale, rounding=self.rounding, seed=self.seed)
        except ValueError as exc:
            raise ValueError(f"gift.rounding: got {self.rounding!r} with format '{fmt}': {exc}") from None
        if self.relay_format is not None or self.relay_block_size is not None:
            _check_block_size(self.effective_relay_format, self.relay_block_size, "gift.relay_block_size")
            try:
                self.relay_codec_options()
            except ValueError as exc:
                raise ValueError(f"gift.relay_format: got {self.relay_format!r} with rounding {self.rounding!r}: "
                                 f"{exc}") from None
        if self.node_format is None and self.node_block_size is not None:
            raise ValueError(f"gift.node_block_size: got {self.node_block_size}; it sets node_format's scales, and "
                             "node_format is null (the bucket's dtype, no scales): set gift.node_format or leave "
                             "node_block_size unset")
        if self.node_format is not None:
            _check_block_size(self.node_format, self.node_block_size, "gift.node_block_size")
            if self.hierarchy == Hierarchy.FLAT.value:
                raise ValueError(f"gift.node_format: got {self.node_format!r} with gift.hierarchy 'flat', which has "
                                 "no node stage to quantize; use hierarchy 'two_level' or 'by_topology', or leave "
                                 "node_format unset (null)")
            try:
                self.node_codec_options()
            except ValueError as exc:
                raise ValueError(f"gift.node_format: got {self.node_format!r}: {exc}") from None
        kinds = self.geometry.kind
        if isinstance(kinds, list):
            if not kinds or len(set(kinds)) != len(kinds) or GeometryKind.IDENTITY in kinds:
                raise ValueError(f"gift.geometry.kind: got {kinds!r}; a list names distinct kinds among "
                                 "'kfac_input', 'adam_factored', 'hadamard' (Euclidean is every layer's fallback, "
                                 "'identity' is not listed)")
            if len(kinds) > 1 and self.layers != Layers.MEASURED:
                raise ValueError(f"gift.geometry.kind: got {kinds!r} with gift.layers {self.layers!r}; choosing a "
                                 "kind per layer needs gift.layers 'measured' (or give one kind)")
        if isinstance(self.layers, list):
            if not self.layers or not all(isinstance(p, str) and p for p in self.layers):
                raise ValueError(f"gift.layers: got {self.layers!r}; allowed: 'measured', 'all' or a "
                                 "non-empty list of non-empty glob patterns")
        return self

    @property
    def effective_block_size(self) -> int:
        """The block size the codec uses (format defaults resolved)."""
        return resolved_block_size(self.format, self.block_size, self.scale)

    @property
    def effective_relay_format(self) -> str:
        """The relay's second-hop format (``relay_format`` with its default resolved)."""
        if self.relay_format is not None:
            return self.relay_format
        return self.format if self.format in PASSTHROUGH_FORMATS else RELAY_DEFAULT_FORMAT

    def relay_codec_options(self) -> dict:
        """``formats.get_format`` keywords of the relay's second-hop codec (checked by its class)."""
        block = self.relay_block_size
        if block is None and self.relay_format is None:
            block = RELAY_DEFAULT_BLOCK
        return self._codec_options(self.effective_relay_format, block, self.rounding)

    def node_codec_options(self) -> Optional[dict]:
        """``formats.get_format`` keywords of the node stage's codec (``node_format``; rounded to
        nearest: its error is every rank's own, summed over the node), None where the node stage
        sends the bucket's dtype."""
        if self.node_format is None:
            return None
        return self._codec_options(self.node_format, self.node_block_size, "nearest")

    def _codec_options(self, fmt: str, block: Optional[int], rounding: str) -> dict:
        """``formats.get_format`` keywords of a codec of ``fmt`` (``block``: its block size, None
        the format's default; none for a passthrough format), checked by its class."""
        options = dict(rounding=rounding, seed=self.seed, kernels=self.kernels)
        if fmt not in PASSTHROUGH_FORMATS:
            options["block_size"] = resolved_block_size(fmt, block)
        format_class(fmt)(**options)
        return dict(options, name=fmt)

    def fingerprint(self) -> str:
        """Canonical JSON of every setting; ranks compare it before training starts."""
        return json.dumps(self.model_dump(), sort_keys=True, default=str)


def _is_union_tag(part) -> bool:
    """pydantic names the member of a Union an error came from in its location
    (``literal['measured','all']``, ``list[str]``); a user's key path has no such part."""
    return isinstance(part, str) and ("[" in part or part in ("str", "int", "float", "bool"))


def _format_errors(errors: List[dict]) -> List[str]:
    """One line per key: the errors of a Union's members on the same value are merged."""
    merged: dict = {}
    for err in errors:
        tags = [p for p in err["loc"] if _is_union_tag(p)]
        loc = tuple(p for p in err["loc"] if not _is_union_tag(p))
        merged.setdefault(loc, []).append(dict(err, loc=loc, tag=tags[-1] if tags else ""))
    lines = []
    for loc, errs in merged.items():
        if any(len(other) > len(loc) and other[:len(loc)] == loc for other in merged):
            continue  # a list's own item error says more than "not one of the scalar values"
        line = _format_error(errs[0])
        for other in errs[1:]:
            if other["msg"] == "Input should be a valid list":
                line += ", or a list of them" if other["tag"].startswith("list[literal") else ", or a list of strings"
            elif other["type"] != errs[0]["type"] or other["msg"] != errs[0]["msg"]:
                line += f"; or: {other['msg'].removeprefix('Value error, ')}"
        lines.append(line)
    return lines


def _format_error(err: dict) -> str:
    path = ".".join([GIFT_KEY] + [str(p) for p in err["loc"]])
    msg = err["msg"]
    if err["type"] == "value_error":
        msg = msg.removeprefix("Value error, ")
        if msg.startswith(GIFT_KEY + "."):
            return msg
    if err["type"] == "extra_forbidden":
        allowed = _known_keys(_model_at(err["loc"][:-1]))
        return f"{path}: unknown key (value {err['input']!r}); allowed keys here: {allowed}"
    return f"{path}: got {err['input']!r}; {msg}"


def _known_keys(model: type) -> List[str]:
    return sorted(model.model_fields)


def _model_at(loc: tuple) -> type:
    """The sub-model that a pydantic error location points into."""
    model = GiftConfig
    for key in loc:
        field = model.model_fields.get(str(key))
        annotation = getattr(field, "annotation", None)
        # an optional block (``params: Optional[ParamsConfig]``) names its model inside the Optional
        candidates = [annotation, *get_args(annotation)]
        sub = next((c for c in candidates if isinstance(c, type) and issubclass(c, _GiftModel)), None)
        if sub is None:
            break
        model = sub
    return model


# HF Transformers and Accelerate treat every string "auto" in a DeepSpeed config as a placeholder
# of theirs to fill (and fail on one they cannot), so no value of the gift block is "auto".
AUTO = "auto"
RENAMED_FROM_AUTO = {"layers": "measured", "geometry.method": "by_width"}


def _refuse_auto(block: dict, path: str = "") -> None:
    for key, value in block.items():
        here = f"{path}.{key}" if path else str(key)
        if isinstance(value, dict):
            _refuse_auto(value, here)
        elif value == AUTO or (isinstance(value, list) and AUTO in value):
            renamed = RENAMED_FROM_AUTO.get(here)
            hint = (f"the value once called 'auto' is now {renamed!r}" if renamed
                    else "name the value you want")
            raise ValueError(f"invalid gift config:\n  {GIFT_KEY}.{here}: got {value!r}; no gift value is \"auto\" "
                             "(HF Transformers and Accelerate fill every \"auto\" in a DeepSpeed config themselves): "
                             f"{hint}")


def get_gift_config(ds_config: dict) -> GiftConfig:
    """Read the ``gift`` block of a DeepSpeed config dict (a missing block = disabled)."""
    if not isinstance(ds_config, dict):
        raise ValueError(f"ds_config: expected a dict, got {type(ds_config).__name__}")
    if GIFT_KEY not in ds_config:
        return GiftConfig(strict=True, enabled=False)
    block = ds_config[GIFT_KEY]
    if not isinstance(block, dict):
        raise ValueError(f"{GIFT_KEY}: got {block!r}; expected an object like "
                         f"{{\"enabled\": true, \"format\": \"fp8_e4m3\"}} with keys {_known_keys(GiftConfig)}")
    _refuse_auto(block)
    try:
        return GiftConfig(strict=True, **block)
    except ValidationError as exc:
        lines = _format_errors(exc.errors())
        raise ValueError("invalid gift config:\n  " + "\n  ".join(lines)) from None


def first_difference(a, b, path):
    if isinstance(a, dict) and isinstance(b, dict):
        for key in sorted(set(a) | set(b)):
            if a.get(key) != b.get(key):
                return first_difference(a.get(key), b.get(key), f"{path}.{key}")
    return (path, a, b)
