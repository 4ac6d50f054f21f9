"""What a bucket's reduction moves where: the caller's description of the bucket
(``ParamSlice``), the runs packed together (``Piece``), the payloads encoded once and
delivered to one or more ranks (``Section``) and the whole plan (``BucketPlan``), with the
route it takes and the byte sizes every rank expects. Pure: no communication.

The bucket is cut into *sections*, each encoded once by every rank and delivered to one
or more ranks:

* per owner ``dst``: its main-format section and its high-precision section (``others``);
* per *shared* parameter (a slice list with ``copy_ranks``: a Muon matrix split across
  partitions, which every owner of a slice must receive whole): one section holding the
  whole matrix, so every row is whole and can be whitened, sent to every rank in
  ``copy_ranks``.

Wire layout of the message from rank ``src`` to rank ``dst`` for one bucket::

    [16-byte control header][payload of every section delivered to dst, in plan order]
"""

from __future__ import annotations

import bisect
import enum
import hashlib
from dataclasses import dataclass, field
from typing import Callable, Dict, List, Literal, Optional, Sequence, Tuple, get_args

import torch

from ..core.formats import DEFAULT_TILE_ELEMENTS
from ..core.geometry import Transform, row_runs
from .headers import CONTROL_HEADER_BYTES, int64_bytes_on

Route = Literal["by_layout", "direct", "relay"]  # gift.route
ROUTES: Tuple[str, ...] = get_args(Route)
# A step's buckets (or ZeRO-1 rounds) under two versions of the transforms: a miss makes the plan
# again and agrees on it (a host read), so a step must never miss its own buckets (HF's "auto"
# reduce_bucket_size gives ~400 buckets at 7B); each refresh makes the old ones stale
MAX_CACHED_PLANS = 4096


class Mode(str, enum.Enum):
    """How a slice travels: transformed in whole run units (``GEO``), in the main format as it
    is (``MAIN``), in the high-precision format of ``others`` (``HIGH``), or, for a parameter
    with copies outside this data-parallel group (replicated on tensor-parallel peers, tied
    across pipeline stages), in the copy codec (bf16 nearest, or fp32), every contribution
    decoded by the owner too, its own included, and summed in rank order (``COPY``): an
    element's result then depends on that element's values alone, not on the bucket's layout,
    its neighbours' scales or who owns it, so every copy's group reduces it to the same bits."""

    GEO = "geo"
    MAIN = "main"
    HIGH = "high"
    COPY = "copy"


GEO, MAIN, HIGH, COPY = Mode.GEO, Mode.MAIN, Mode.HIGH, Mode.COPY


@dataclass(frozen=True)
class ParamSlice:
    """A contiguous run of one parameter's gradient inside the flat bucket, bound for ``dst``."""

    dst: int
    bucket_offset: int
    numel: int
    param_offset: int  # where the run starts inside the flattened parameter
    param_key: int
    row_len: int = 0  # GEO: the run unit of the parameter's transform (a whitener's rows: "in"; an
    # elementwise scaling: 1); runs of whole units are transformed, the rest travels as is
    mode: Mode = MAIN  # GEO: transform whole units; MAIN: main format as is; HIGH: others=bf16/fp32; COPY: see Mode
    copy_ranks: Tuple[int, ...] = ()  # non-empty: every listed rank receives the whole parameter


@dataclass(frozen=True)
class Piece:
    """A run of the bucket that is packed contiguously into one payload."""

    bucket_offset: int
    numel: int
    param_key: int
    rows: int = 0  # > 0: ``rows`` whole run units (whitener rows, or elements), transformed
    slice_index: int = -1  # index of the ParamSlice it came from (-1: a whole shared parameter)
    slice_start: int = 0  # offset of this piece inside that slice
    param_start: int = 0  # offset of this piece inside the flattened parameter (what a transform needs)


@dataclass
class Section:
    """Pieces encoded together with one codec and delivered to every rank in ``dests``."""

    dests: Tuple[int, ...]
    high: bool
    pieces: List[Piece] = field(default_factory=list)
    numel: int = 0
    whole: bool = False  # whole shared parameters: every receiver decodes every contribution, its own too
    copy: bool = False  # COPY slices: the copy codec, every contribution decoded (``whole`` semantics)

    @property
    def shared(self) -> bool:
        # A copy set of one rank (two-level: the other copies live in other slot groups) is still
        # shared: all copies must sum the same decoded values to stay bit-identical.
        return self.whole or len(self.dests) > 1

    @property
    def key(self):
        """Names the section across steps (error-feedback residuals): the owner, or the copy set."""
        return self.dests if self.shared else self.dests[0]

    def add(self, piece: Piece) -> None:
        self.pieces.append(piece)
        self.numel += piece.numel



def chunk_bounds(numel: int, world: int, align: int, first: int = 0) -> List[Tuple[int, int]]:
    """(start, numel) of ``world`` near-equal chunks of ``numel`` elements, cut at multiples of
    ``align`` (the codec's block, so no scale block straddles two relays), in order: every chunk
    q or q + 1 blocks, the r = blocks mod world longer ones to ``first`` and the ranks after it
    (cyclically; the owner, whose own chunk never travels, then its neighbours, so owners spread
    them), the last block possibly short. Chunks of one size then come in at most a few runs of
    consecutive ranks, which the owner decodes as one batch each (``relay``)."""
    q, r = divmod(-(-numel // align), world)
    edges = [0]
    for j in range(world):
        edges.append(min(numel, edges[-1] + (q + ((j - first) % world < r)) * align))
    return [(edges[j], edges[j + 1] - edges[j]) for j in range(world)]


def split_slice_rows(s: ParamSlice) -> List[Tuple[int, int, int]]:
    """Cut a slice of a row-major (out x in) weight into (start, numel, rows) runs:
    whole run units (rows > 0) and the partial units at either end (rows = 0), which travel
    in Euclidean coordinates because no single rank holds them whole. With an elementwise
    transform (unit 1) the whole slice is one run."""
    if s.mode != GEO or s.row_len <= 0:
        return [(0, s.numel, 0)]
    runs: List[Tuple[int, int, int]] = []
    for pos, _, _, length, rows in row_runs(s.param_offset, s.numel, s.row_len):
        if not rows and runs and not runs[-1][2]:  # two partial rows with no whole one between
            runs[-1] = (runs[-1][0], runs[-1][1] + length, 0)
        else:
            runs.append((pos, length, rows))
    return runs


def shared_parameter_pieces(slices: Sequence[ParamSlice]) -> Dict[Tuple[Tuple[int, ...], Mode], List[Piece]]:
    """One whole-parameter piece per shared parameter, grouped by (copy set, mode)."""
    spans: Dict[int, List[ParamSlice]] = {}
    for s in slices:
        if s.copy_ranks:
            spans.setdefault(s.param_key, []).append(s)
    groups: Dict[Tuple[Tuple[int, ...], bool], List[Piece]] = {}
    for key, parts in spans.items():
        parts.sort(key=lambda s: s.param_offset)
        first = parts[0]
        start = first.bucket_offset - first.param_offset
        numel = sum(s.numel for s in parts)
        if first.param_offset != 0 or any(s.bucket_offset != start + s.param_offset for s in parts) \
                or len({(s.copy_ranks, s.mode, s.row_len) for s in parts}) != 1:
            raise RuntimeError(f"deepspeed_gift: shared parameter {key} is not one contiguous run of the bucket "
                               "with one copy set and mode")
        rows = numel // first.row_len if first.mode == GEO and first.row_len > 0 else 0
        piece = Piece(start, numel, key, rows, -1, 0, 0)
        groups.setdefault((tuple(first.copy_ranks), first.mode), []).append(piece)
    return groups


class BucketPlan:
    """Where every element of a bucket goes, as sections, and what each rank receives."""

    def __init__(self, slices: Sequence[ParamSlice], world_size: int, versions: Dict[int, int]) -> None:
        self.slices = tuple(slices)
        self.world_size = world_size
        owned = [(Section((d,), False), Section((d,), True), Section((d,), True, whole=True, copy=True))
                 for d in range(world_size)]
        for index, s in enumerate(self.slices):
            if s.copy_ranks:
                continue
            section = owned[s.dst][2 if s.mode == COPY else int(s.mode == HIGH)]
            for start, numel, rows in split_slice_rows(s):
                section.add(Piece(s.bucket_offset + start, numel, s.param_key, rows, index, start,
                                  s.param_offset + start))
        self.sections: List[Section] = [sec for pair in owned for sec in pair]
        for (dests, mode), pieces in shared_parameter_pieces(self.slices).items():
            section = Section(dests, mode in (HIGH, COPY), whole=True, copy=mode == COPY)
            for p in pieces:
                section.add(p)
            self.sections.append(section)
        self.sections = [sec for sec in self.sections if sec.numel]
        # indices into ``sections`` of what each rank receives, in message order
        self.to_rank = [[i for i, sec in enumerate(self.sections) if d in sec.dests] for d in range(world_size)]
        self.message_sizes: List[int] = []  # bytes every other rank sends to each rank (set by plan_route)
        # The relay route (set by plan_route when it takes it): chunk j of every owned section goes
        # to rank j, which sums it and sends the sum on to the owner. ``chunks[i]``: (start, numel)
        # per rank for section i (owned sections only); ``relay_sizes[j]``: bytes every other rank
        # sends to relay j; ``forward_sizes[j][d]``: bytes relay j sends on to owner d.
        self.relay = False
        self.chunks: Dict[int, List[Tuple[int, int]]] = {}
        self.relay_sizes: List[int] = []
        self.forward_sizes: List[List[int]] = []
        self.recv_max = 0  # bytes the busiest rank receives for this bucket (every collective's largest)
        self.recv_max_internode = 0  # the same, of the messages from other nodes
        # Compact outputs of the slices of each shared parameter: (slice index, start in the parameter)
        self.shared_outputs: Dict[int, List[Tuple[int, int]]] = {}
        for index, s in enumerate(self.slices):
            if s.copy_ranks:
                self.shared_outputs.setdefault(s.param_key, []).append((index, s.param_offset))
        digest = hashlib.blake2b(repr((self.slices, sorted(versions.items()))).encode(), digest_size=8)
        self.hash = int.from_bytes(digest.digest(), "little", signed=True)
        self._hash_bytes: Dict[str, torch.Tensor] = {}
        # Element positions of the main payloads depend only on which slices are HIGH or shared:
        # an error-feedback residual survives re-selection and refreshes under this key. It names
        # the parameters too: two buckets of one shape (repeated layers, small buckets) with the
        # same owners would otherwise share one residual and feed one bucket's error to the other.
        self.layout_key = tuple((s.dst, s.bucket_offset, s.numel, s.param_key, s.param_offset, s.mode in (HIGH, COPY),
                                 s.copy_ranks) for s in self.slices)

    def hash_on(self, device) -> torch.Tensor:
        """The plan's hash as 8 bytes on ``device`` (made once per plan and device)."""
        key = str(device)
        if key not in self._hash_bytes:
            self._hash_bytes[key] = int64_bytes_on(self.hash, device)
        return self._hash_bytes[key]

    def sections_to(self, rank: int) -> List[Section]:
        return [self.sections[i] for i in self.to_rank[rank]]

    def received_numel(self, rank: int) -> int:
        return sum(sec.numel for sec in self.sections_to(rank))


def section_sample(plan: BucketPlan, index: int, stride: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every ``stride``-th element of section ``index``: its positions in the section's packed
    order and its offsets in the bucket. Made afresh on each sampled step, not kept with the
    plan: kept, they were two int64 per sampled element for every owner of every bucket of
    every cached plan (~1.4 GB a rank at 7B, W = 64), to save a few small kernels once in
    ``telemetry.every`` steps."""
    sec = plan.sections[index]
    starts = [0]
    for p in sec.pieces[:-1]:
        starts.append(starts[-1] + p.numel)
    pos = torch.arange(0, sec.numel, stride, device=device)
    first = torch.tensor(starts, device=device)
    which = torch.searchsorted(first, pos, right=True) - 1
    offsets = torch.tensor([p.bucket_offset for p in sec.pieces], device=device)
    return pos, offsets[which] + (pos - first[which])


def plan_route(plan: "BucketPlan", route: str, codec_of: Callable[["Section"], object], align: int,
               ranks_per_node: int = 1, forward_codec_of: Optional[Callable[["Section"], object]] = None) -> None:
    """Direct (every rank sends each owner its part: one all-to-all) or relay (two balanced
    ones, one more quantization): by ``route``, or for ``by_layout`` the one whose busiest
    rank receives fewer bytes. The same on every rank: it depends on the plan only. Sets the
    plan's route, sizes and busiest receives (in all, and from other nodes).
    ``forward_codec_of``: the codec of the relay's sums on their way to the owner (default
    ``codec_of``)."""
    forward_codec_of = forward_codec_of or codec_of
    world, L = plan.world_size, ranks_per_node
    plan.message_sizes = [message_nbytes(plan, d, codec_of) for d in range(world)]
    direct_max = max((world - 1) * n for n in plan.message_sizes) if world > 1 else 0
    plan.recv_max, plan.recv_max_internode = direct_max, max((world - L) * n for n in plan.message_sizes)
    owned = [i for i, sec in enumerate(plan.sections) if not sec.shared]
    if world <= 2 or not owned or route == "direct":
        return
    chunks = {i: chunk_bounds(plan.sections[i].numel, world, align, first=plan.sections[i].dests[0]) for i in owned}
    relay_sizes, forward_sizes = [], [[0] * world for _ in range(world)]
    for j in range(world):
        body = sum(codec_of(plan.sections[i]).nbytes(chunks[i][j][1]) for i in owned if chunks[i][j][1])
        body += sum(codec_of(sec).nbytes(sec.numel) for sec in plan.sections if sec.shared and j in sec.dests)
        relay_sizes.append(CONTROL_HEADER_BYTES + body if body else 0)
        for i in owned:
            d, n = plan.sections[i].dests[0], chunks[i][j][1]
            if d != j and n:
                forward_sizes[j][d] += forward_codec_of(plan.sections[i]).nbytes(n)
        for d in range(world):
            if forward_sizes[j][d]:
                forward_sizes[j][d] += CONTROL_HEADER_BYTES
    relay_max = max((world - 1) * n for n in relay_sizes) + max(
        sum(forward_sizes[j][d] for j in range(world)) for d in range(world))
    if route == "relay" or relay_max < direct_max:
        plan.relay, plan.chunks, plan.relay_sizes, plan.forward_sizes = True, chunks, relay_sizes, forward_sizes
        plan.recv_max = relay_max
        plan.recv_max_internode = max((world - L) * n for n in relay_sizes) + max(
            sum(forward_sizes[j][d] for j in range(world) if j // L != d // L) for d in range(world))


def message_nbytes(plan: "BucketPlan", dst: int, codec_of) -> int:
    """Bytes of the message every other rank sends to ``dst`` for this bucket."""
    if not plan.to_rank[dst]:
        return 0
    return CONTROL_HEADER_BYTES + sum(codec_of(sec).nbytes(sec.numel) for sec in plan.sections_to(dst))


# ---- pieces in and out of a packed buffer ----------------------------------------------
class SectionSource:
    """The fp32 values of a section (its ``pieces`` packed in order, transformed pieces moved
    into their coordinates; ``transforms`` None: all in gradient coordinates), made one chunk at
    a time: whole run units (a whitener's rows) of about ``tile`` elements, at fixed places in
    each piece. A codec reads it tile by tile (see ``core.formats.TensorSource``), so neither the
    section nor its transform is ever staged whole. ``start``/``numel``: a part of the section
    (a relay's chunk). Read in order; a read behind the last chunk starts again there."""

    def __init__(self, tensor: torch.Tensor, pieces: List[Piece], transforms: Optional[Dict[int, Transform]],
                 tile: int = DEFAULT_TILE_ELEMENTS, start: int = 0, numel: Optional[int] = None) -> None:
        self.tensor, self.pieces, self.transforms, self.tile = tensor, pieces, transforms, tile
        self.starts: List[int] = []
        pos = 0
        for p in pieces:
            self.starts.append(pos)
            pos += p.numel
        self.start = start
        self.numel = pos - start if numel is None else numel
        self.device = tensor.device
        self._chunk: Optional[Tuple[int, int, torch.Tensor]] = None  # (first, end, values) in the section

    def _make_chunk(self, at: int) -> Tuple[int, int, torch.Tensor]:
        i = bisect.bisect_right(self.starts, at) - 1
        p, first = self.pieces[i], self.starts[i]
        w = self.transforms[p.param_key] if p.rows and self.transforms is not None else None
        unit = w.run_unit if w is not None else 1
        per = max(1, self.tile // unit) * unit
        off = (at - first) // per * per
        n = min(per, p.numel - off)
        raw = self.tensor.narrow(0, p.bucket_offset + off, n)
        values = w.apply_run(raw, p.param_start + off) if w is not None else raw
        self._chunk = (first + off, first + off + n, values)
        return self._chunk

    def read(self, e0: int, e1: int, work: torch.Tensor) -> torch.Tensor:
        a, b = self.start + e0, self.start + e1
        chunk = self._chunk
        if chunk is not None and chunk[0] <= a and b <= chunk[1] and chunk[2].dtype == torch.float32:
            return chunk[2][a - chunk[0] : b - chunk[0]]  # inside one chunk: no copy
        out, at = work[: b - a], a
        while at < b:
            if chunk is None or not chunk[0] <= at < chunk[1]:
                chunk = self._make_chunk(at)
            n = min(b, chunk[1]) - at
            out[at - a : at - a + n].copy_(chunk[2][at - chunk[0] : at - chunk[0] + n])
            at += n
        return out

    def native(self, e0: int, e1: int) -> Optional[torch.Tensor]:
        """Elements ``e0:e1`` as they lie in one chunk, in its dtype (the bucket's for a piece in
        gradient coordinates, fp32 for a transformed one), a view; None where they span chunks
        (``read`` joins them). See ``core.formats.TensorSource.native``."""
        a, b = self.start + e0, self.start + e1
        chunk = self._chunk
        if chunk is None or not chunk[0] <= a < chunk[1]:
            chunk = self._make_chunk(a)
        return chunk[2][a - chunk[0] : b - chunk[0]] if b <= chunk[1] else None

    def window(self, start: int, numel: int) -> "SourceWindow":
        """Elements ``start:start + numel`` of this source, read through it: windows read one
        after the other (a relay's chunks in order) share the chunk it made last, so a
        transformed tile is made once, not once per window that falls in it (a fresh source
        per chunk made the whole tile, up to 2^24 elements on a GPU, for every chunk)."""
        return SourceWindow(self, start, numel)

    def gather(self) -> torch.Tensor:
        """All of it in one fp32 buffer of its own (what error feedback and an owner's own
        contribution need whole)."""
        return gather_source(self)


class SourceWindow:
    """A part of a :class:`SectionSource` (see :meth:`SectionSource.window`), itself a source."""

    def __init__(self, source: SectionSource, start: int, numel: int) -> None:
        self.source, self.start, self.numel, self.device = source, start, numel, source.device

    def read(self, e0: int, e1: int, work: torch.Tensor) -> torch.Tensor:
        return self.source.read(self.start + e0, self.start + e1, work)

    def native(self, e0: int, e1: int) -> Optional[torch.Tensor]:
        return self.source.native(self.start + e0, self.start + e1)

    def gather(self) -> torch.Tensor:
        return gather_source(self)


def gather_source(src) -> torch.Tensor:
    """All of a source's values in one fp32 buffer of its own, read through it."""
    out = torch.empty(src.numel, dtype=torch.float32, device=src.device)
    values = src.read(0, src.numel, out)
    return out if values.data_ptr() == out.data_ptr() else out.copy_(values)


def gather_pieces(tensor: torch.Tensor, pieces: List[Piece], numel: int,
                  transforms: Optional[Dict[int, Transform]], tile: int = DEFAULT_TILE_ELEMENTS) -> torch.Tensor:
    """fp32 staging buffer of ``pieces`` (transformed pieces moved into their coordinates;
    ``transforms`` None: all in gradient coordinates), always a buffer of its own; the
    transform's temporaries are a ``tile``'s."""
    return SectionSource(tensor, pieces, transforms, tile, 0, numel).gather()


def transform_pieces(buf: torch.Tensor, pieces: List[Piece], transforms: Dict[int, Transform], *,
                     inverse: bool, tile: int = DEFAULT_TILE_ELEMENTS) -> torch.Tensor:
    """A packed fp32 buffer with its transformed pieces moved into (or back from) their
    coordinates, in place, whole run units of about ``tile`` elements at a time (its temporaries
    are a tile's, not a section's). Returns ``buf``."""
    pos = 0
    for p in pieces:
        if p.rows:
            w = transforms[p.param_key]
            per = max(1, tile // w.run_unit) * w.run_unit
            for off in range(0, p.numel, per):
                view = buf.narrow(0, pos + off, min(per, p.numel - off))
                view.copy_(w.invert_run(view, p.param_start + off) if inverse else w.apply_run(view, p.param_start + off))
        pos += p.numel
    return buf


def scatter_section(tensor: torch.Tensor, total: torch.Tensor, sec: Section, plan: "BucketPlan",
                    outputs: Optional[Sequence[Optional[torch.Tensor]]]) -> None:
    """A section's result into the bucket, and added to the owner-side outputs of its slices."""
    pos = 0
    for p in sec.pieces:
        result = total.narrow(0, pos, p.numel)
        tensor.narrow(0, p.bucket_offset, p.numel).copy_(result)
        if outputs is not None:
            if p.slice_index >= 0:
                targets = [(p.slice_index, 0, p.slice_start)]
            else:  # a whole shared parameter: each of its slices' outputs takes its part
                targets = [(i, start, 0) for i, start in plan.shared_outputs[p.param_key]]
            for i, start, into in targets:
                if outputs[i] is not None:
                    n = plan.slices[i].numel if p.slice_index < 0 else p.numel
                    outputs[i].narrow(0, into, n).add_(result.narrow(0, start, n))
        pos += p.numel


# ---- agreement on a new plan ---------------------------------------------------------------
MODE_WORDS = {GEO: "transformed (geometry)", MAIN: "in the main format", HIGH: "in the high-precision format",
              COPY: "in the copy codec (a parameter with copies outside the group)"}


def plan_fingerprint(plan: "BucketPlan") -> int:
    """A plan's identity and every size its collectives use (signed 64 bits): what ranks
    must agree on before the first exchange of a new plan. Sizes are in it as well as the
    plan's hash because they also depend on the codecs."""
    sizes = (plan.hash, plan.relay, plan.message_sizes, plan.relay_sizes, plan.forward_sizes)
    digest = hashlib.blake2b(repr(sizes).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "little", signed=True)


def describe_plan(plan: "BucketPlan", versions: Dict[int, int]) -> dict:
    """What a rank believes about a bucket, in JSON terms, for :func:`plan_difference`."""
    params: Dict[str, list] = {}
    for s in plan.slices:
        params.setdefault(str(s.param_key), [Mode(s.mode).value, s.row_len, list(s.copy_ranks)])
    return {"layout": [[s.dst, s.bucket_offset, s.numel, s.param_key] for s in plan.slices], "params": params,
            "versions": {str(k): v for k, v in sorted(versions.items())}, "relay": plan.relay,
            "sizes": plan.message_sizes}


def _ranks_by(values: Sequence) -> str:
    """``value on ranks [..]; value on ranks [..]`` of each distinct value, in order of first rank."""
    groups: Dict[str, List[int]] = {}
    for rank, v in enumerate(values):
        groups.setdefault(str(v), []).append(rank)
    return "; ".join(f"{v} on ranks {ranks}" for v, ranks in groups.items())


def plan_difference(everyone: Sequence[dict], names: Optional[Dict[int, str]] = None) -> str:
    """The first thing ranks disagree on about a bucket (``everyone``: :func:`describe_plan` of
    each rank of the group, in rank order), in words; ``names`` turns parameter keys into names."""
    names = names or {}

    def called(key: str) -> str:
        return f"{names[int(key)]!r} (parameter {key})" if int(key) in names else f"parameter {key}"

    if len({repr(d["layout"]) for d in everyone}) > 1:
        return ("the bucket's layout (which parameters it holds, where, for which owner): "
                + _ranks_by([f"{len(d['layout'])} slices of parameters {sorted({s[3] for s in d['layout']})}"
                             for d in everyone]))
    for key in everyone[0]["params"]:
        seen = [tuple(d["params"][key][:2]) for d in everyone]
        if len(set(seen)) > 1:
            words = [MODE_WORDS[Mode(m)] + (f", runs of {r}" if m == GEO.value else "") for m, r in seen]
            return f"how {called(key)} travels (the selected layers): " + _ranks_by(words)
        copies = [tuple(d["params"][key][2]) for d in everyone]
        if len(set(copies)) > 1:
            return f"the ranks that receive {called(key)} whole: " + _ranks_by(copies)
    keys = sorted({k for d in everyone for k in d["versions"]}, key=int)
    for key in keys:
        seen = [d["versions"].get(key) for d in everyone]
        if len(set(seen)) > 1:
            return f"the whitener version of {called(key)}: " + _ranks_by([f"version {v}" for v in seen])
    return ("the route and message sizes (the codecs): "
            + _ranks_by([f"{'relay' if d['relay'] else 'direct'}, {d['sizes']} bytes" for d in everyone]))
