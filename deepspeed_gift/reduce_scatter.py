"""One bucket's reduce-scatter: per-owner chunks -> transform -> quantize -> all-to-all
-> dequantize + fp32 sum at the owner -> inverse transform.

Knows nothing of DeepSpeed: the caller describes the bucket as ``ParamSlice``s (which
part of the flat bucket goes to which owner, and whether it belongs to a weight whose
rows can be whitened). Knows no wire details: codecs from ``formats`` turn fp32 into
bytes, a ``Comm`` moves bytes.

The bucket is cut into *sections*, each encoded once by every rank and delivered to one
or more ranks:

* per owner ``dst``: its main-format section and its high-precision section (``others``);
* per *shared* parameter (a slice list with ``copy_ranks``: a Muon matrix split across
  partitions, which every owner of a slice must receive whole): one section holding the
  whole matrix, so every row is whole and can be whitened, sent to every rank in
  ``copy_ranks``.

Wire layout of the message from rank ``src`` to rank ``dst`` for one bucket::

    [16-byte control header][payload of every section delivered to dst, in plan order]

The control header carries a hash of the bucket plan (layout, selected layers and
whitener versions) so an owner fails loudly if ranks disagree on what they send. An
owner's own contribution to its own sections never goes through the codec (it is exact
and costs no bytes); in a shared section every receiver decodes every contribution,
its own included, and sums them in rank order, so all copies are bit-identical.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .formats import quantization_stats
from .stats import StepStats, clock
from .geometry import row_runs

CONTROL_HEADER_BYTES = 16
ROUTES = ("by_layout", "direct", "relay")  # gift.route
MAX_CACHED_PLANS = 256  # a few buckets x a few versions; each refresh makes the old ones stale
GEO, MAIN, HIGH = "geo", "main", "high"
DISAGREE = "ranks disagree on the bucket layout, the selected layers or the whitener versions"


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
    mode: str = MAIN  # GEO: transform whole units; MAIN: main format as is; HIGH: others=bf16/fp32
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


class HeaderChecks:
    """Header comparisons made on the device and read on the host once, not once per message.

    A message's header is compared with the one the receiver expects by a device op; reading
    the result would make the host wait for the reduction, so the results are kept and read
    together by :meth:`verify` (the reducer calls it at the end of ``reduce`` unless it defers,
    and then its owner calls it before the optimizer takes the step). A mismatch raises there,
    with the message the host-side check would have given."""

    def __init__(self) -> None:
        self._pending: list = []  # (0-dim bool "differs", received header copy, explain(raw bytes) -> message)
        self._cache: Dict[tuple, torch.Tensor] = {}  # the step's part of control headers, per device

    def expect(self, got: torch.Tensor, want: torch.Tensor, explain) -> None:
        """Check later that ``got`` (bytes) equals ``want``; ``explain(got_bytes)`` returns the
        error message (or raises its own error) when it does not."""
        head = got.narrow(0, 0, want.numel())
        self._pending.append((head.ne(want).any(), head.clone(), explain))

    def verify(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        differs = torch.stack([flag for flag, _, _ in pending]).tolist()  # the one host read
        for bad, (_, head, explain) in zip(differs, pending):
            if bad:
                raise RuntimeError(explain(bytes(head.cpu().tolist())))

    def step_bytes(self, step: int, device) -> torch.Tensor:
        """The step as 8 bytes on ``device``, made once per step and device."""
        key = (step, str(device))
        got = self._cache.get(key)
        if got is None:
            self._cache = {k: v for k, v in self._cache.items() if k[0] == step}
            got = self._cache[key] = torch.tensor([step], dtype=torch.int64).view(torch.uint8).to(device)
        return got


def control_header(plan_hash_bytes: torch.Tensor, step_bytes: torch.Tensor) -> torch.Tensor:
    """The 16 bytes that open every message: the plan's hash and the step (both already on
    the message's device)."""
    return torch.cat([plan_hash_bytes, step_bytes])


def hash_bytes(plan_hash: int, device) -> torch.Tensor:
    return torch.tensor([plan_hash], dtype=torch.int64).view(torch.uint8).to(device)


def expect_control_header(checks: HeaderChecks, msg: torch.Tensor, want: torch.Tensor, sender: str,
                          meaning: str) -> None:
    """Fail loudly (at ``checks.verify``) when ``msg`` was sent for another plan or step than
    the receiver's (``want``: its own control header)."""
    def explain(raw: bytes) -> str:
        got_hash, got_step = struct.unpack("<qq", raw)
        want_hash, want_step = struct.unpack("<qq", bytes(want.cpu().tolist()))
        return (f"deepspeed_gift: {sender} sent a bucket for plan {got_hash:#x} at step {got_step}, "
                f"this rank expects plan {want_hash:#x} at step {want_step}: {meaning}")

    checks.expect(msg, want, explain)


def expect_codec_header(checks: HeaderChecks, codec, buf: torch.Tensor, numel: int, sender: str) -> None:
    """The codec's own header of a payload from ``sender``, checked as the codec would."""
    def explain(raw: bytes) -> str:
        try:
            codec.check_header_bytes(raw, numel)
        except ValueError as exc:
            return f"deepspeed_gift: payload from {sender}: {exc}"
        return f"deepspeed_gift: payload from {sender} has an unexpected header"

    checks.expect(buf, codec.header_on(numel, buf.device), explain)


def chunk_bounds(numel: int, world: int, align: int) -> List[Tuple[int, int]]:
    """(start, numel) of ``world`` near-equal chunks of ``numel`` elements, cut at multiples of
    ``align`` (the codec's block, so no scale block straddles two relays)."""
    edges = [min(numel, -(-(numel * j // world) // align) * align) for j in range(world)] + [numel]
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


def shared_parameter_pieces(slices: Sequence[ParamSlice]) -> Dict[Tuple[Tuple[int, ...], bool], List[Piece]]:
    """One whole-parameter piece per shared parameter, grouped by (copy set, high)."""
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
        groups.setdefault((tuple(first.copy_ranks), first.mode == HIGH), []).append(piece)
    return groups


class BucketPlan:
    """Where every element of a bucket goes, as sections, and what each rank receives."""

    def __init__(self, slices: Sequence[ParamSlice], world_size: int, versions: Dict[int, int]) -> None:
        self.slices = tuple(slices)
        self.world_size = world_size
        owned = [(Section((d,), False), Section((d,), True)) for d in range(world_size)]
        for index, s in enumerate(self.slices):
            if s.copy_ranks:
                continue
            section = owned[s.dst][s.mode == HIGH]
            for start, numel, rows in split_slice_rows(s):
                section.add(Piece(s.bucket_offset + start, numel, s.param_key, rows, index, start,
                                  s.param_offset + start))
        self.sections: List[Section] = [sec for pair in owned for sec in pair]
        for (dests, high), pieces in shared_parameter_pieces(self.slices).items():
            section = Section(dests, high, whole=True)
            for p in pieces:
                section.add(p)
            self.sections.append(section)
        self.sections = [sec for sec in self.sections if sec.numel]
        # indices into ``sections`` of what each rank receives, in message order
        self.to_rank = [[i for i, sec in enumerate(self.sections) if d in sec.dests] for d in range(world_size)]
        self.message_sizes: List[int] = []  # bytes every other rank sends to each rank (set by the reducer)
        # The relay route (set by the reducer when it takes it): chunk j of every owned section goes
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
        self.samples: Dict[tuple, Tuple[torch.Tensor, torch.Tensor]] = {}  # see section_sample
        # Element positions of the main payloads depend only on which slices are HIGH or shared:
        # an error-feedback residual survives re-selection and refreshes under this key.
        self.layout_key = tuple((s.dst, s.bucket_offset, s.numel, s.mode == HIGH, s.copy_ranks) for s in self.slices)

    def hash_on(self, device) -> torch.Tensor:
        """The plan's hash as 8 bytes on ``device`` (made once per plan and device)."""
        key = str(device)
        if key not in self._hash_bytes:
            self._hash_bytes[key] = hash_bytes(self.hash, device)
        return self._hash_bytes[key]

    def sections_to(self, rank: int) -> List[Section]:
        return [self.sections[i] for i in self.to_rank[rank]]

    def received_numel(self, rank: int) -> int:
        return sum(sec.numel for sec in self.sections_to(rank))


@dataclass
class _Packed:
    """What this rank made of one section: the fp32 values it contributes as the receiver
    sees them (``own``; None when it does not receive the section) and the encoded bytes."""

    own: Optional[torch.Tensor] = None
    wire: Optional[torch.Tensor] = None


class GiftReducer:
    """Runs bucket reductions for one engine. Holds codecs, the comm and per-plan caches."""

    def __init__(self, comm, main_codec, high_codec=None, *, generator: Optional[torch.Generator] = None,
                 error_feedback: bool = False, ranks_per_node: int = 1, defer_checks: bool = False,
                 fidelity_elements: int = 65536, route: str = "direct") -> None:
        if route not in ROUTES:
            raise ValueError(f"gift.route: got {route!r}; allowed: {', '.join(ROUTES)}")
        self.route = route
        self.comm = comm
        self.fidelity_elements = fidelity_elements  # the sampled fidelity check: elements per owner and bucket
        # Headers are compared on the device; deferred, they are read once per step by the
        # owner's verify_checks() instead of at the end of every reduce (a host wait per bucket).
        self.checks = HeaderChecks()
        self.defer_checks = defer_checks
        self.ranks_per_node = ranks_per_node  # accounting only: which messages leave the node
        self.main_codec = main_codec
        self.high_codec = high_codec
        self.generator = generator
        self.error_feedback = error_feedback
        # Set (two-level, stochastic rounding): shared sections are rounded with a generator seeded
        # from (this seed, this rank = the node, step, parameters), so the same node partial
        # encoded by the node's ranks of different slot groups gives the same bytes.
        self.shared_seed: Optional[int] = None
        self._plans: Dict[tuple, BucketPlan] = {}
        self._timing = (torch.device("cpu"), False)  # (device, synchronize) of the reduction running
        # The relay route's second quantization: (plan hash, section index) -> residual of the chunk sum
        # this rank relays, in the coordinates of that plan's whiteners (the hash names their versions:
        # a refresh starts it afresh, since a chunk holds rows cut by its edges and cannot be moved)
        self.relay_residuals: Dict[Tuple[int, int], torch.Tensor] = {}
        # (layout key, section key) -> (fp32 residual of the main payload, pieces, whiteners it is expressed in)
        self.residuals: Dict[Tuple[tuple, object], Tuple[torch.Tensor, List[Piece], Dict[int, object]]] = {}

    # ---- planning -------------------------------------------------------------------
    def plan_for(self, slices: Sequence[ParamSlice], versions: Dict[int, int]) -> BucketPlan:
        key = (tuple(slices), tuple(sorted(versions.items())))
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = self.new_plan(slices, versions)
            while len(self._plans) >= MAX_CACHED_PLANS:  # plans of older whitener versions
                self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan  # most recently used last
        return plan

    def new_plan(self, slices: Sequence[ParamSlice], versions: Dict[int, int]) -> BucketPlan:
        """A plan with its sizes and route, not cached (two-level plans every slot group's)."""
        plan = BucketPlan(slices, self.comm.world_size, versions)
        plan.message_sizes = [self._message_nbytes(plan, d) for d in range(self.comm.world_size)]
        self._plan_route(plan)
        return plan

    def _plan_route(self, plan: BucketPlan) -> None:
        """Direct (every rank sends each owner its part: one all-to-all) or relay (two balanced
        ones, one more quantization): by ``route``, or for ``by_layout`` the one whose busiest
        rank receives fewer bytes. The same on every rank: it depends on the plan only."""
        world, L = plan.world_size, self.ranks_per_node
        direct_max = max((world - 1) * n for n in plan.message_sizes) if world > 1 else 0
        plan.recv_max, plan.recv_max_internode = direct_max, max((world - L) * n for n in plan.message_sizes)
        owned = [i for i, sec in enumerate(plan.sections) if not sec.shared]
        if world <= 2 or not owned or self.route == "direct":
            return
        align = max(self.main_codec.block_size, 1)
        chunks = {i: chunk_bounds(plan.sections[i].numel, world, align) for i in owned}
        relay_sizes, forward_sizes = [], [[0] * world for _ in range(world)]
        for j in range(world):
            body = sum(self.codec_of(plan.sections[i]).nbytes(chunks[i][j][1]) for i in owned if chunks[i][j][1])
            body += sum(self.codec_of(sec).nbytes(sec.numel) for sec in plan.sections if sec.shared and j in sec.dests)
            relay_sizes.append(CONTROL_HEADER_BYTES + body if body else 0)
            for i in owned:
                d, n = plan.sections[i].dests[0], chunks[i][j][1]
                if d != j and n:
                    forward_sizes[j][d] += self.codec_of(plan.sections[i]).nbytes(n)
            for d in range(world):
                if forward_sizes[j][d]:
                    forward_sizes[j][d] += CONTROL_HEADER_BYTES
        relay_max = max((world - 1) * n for n in relay_sizes) + max(
            sum(forward_sizes[j][d] for j in range(world)) for d in range(world))
        if self.route == "relay" or relay_max < direct_max:
            plan.relay, plan.chunks, plan.relay_sizes, plan.forward_sizes = True, chunks, relay_sizes, forward_sizes
            plan.recv_max = relay_max
            plan.recv_max_internode = max((world - L) * n for n in relay_sizes) + max(
                sum(forward_sizes[j][d] for j in range(world) if j // L != d // L) for d in range(world))

    def codec_of(self, section: Section):
        return self.high_codec if section.high else self.main_codec

    def _message_nbytes(self, plan: BucketPlan, dst: int) -> int:
        """Bytes of the message every other rank sends to ``dst`` for this bucket."""
        if not plan.to_rank[dst]:
            return 0
        return CONTROL_HEADER_BYTES + sum(self.codec_of(sec).nbytes(sec.numel) for sec in plan.sections_to(dst))

    # ---- packing --------------------------------------------------------------------
    @staticmethod
    def _gather(tensor: torch.Tensor, pieces: List[Piece], numel: int, whiteners) -> torch.Tensor:
        """fp32 staging buffer of ``pieces`` (transformed pieces moved into their coordinates;
        ``whiteners`` None: all in gradient coordinates), always a buffer of its own."""
        if len(pieces) == 1 and pieces[0].rows and whiteners is not None:  # the transform's own output
            src = tensor.narrow(0, pieces[0].bucket_offset, pieces[0].numel)
            return GiftReducer._transform_rows(src, pieces, whiteners, inverse=False)
        out = torch.empty(numel, dtype=torch.float32, device=tensor.device)
        pos = 0
        for p in pieces:
            src = tensor.narrow(0, p.bucket_offset, p.numel)
            dst = out.narrow(0, pos, p.numel)
            if p.rows and whiteners is not None:
                dst.copy_(whiteners[p.param_key].apply_run(src, p.param_start))
            else:
                dst.copy_(src)
            pos += p.numel
        return out

    @staticmethod
    def _transform_rows(buf: torch.Tensor, pieces: List[Piece], whiteners, *, inverse: bool) -> torch.Tensor:
        """A packed buffer with its transformed pieces moved into (or back from) their coordinates:
        the transform's own output when one piece fills it, else ``buf`` changed in place."""
        if len(pieces) == 1 and pieces[0].rows:
            p, w = pieces[0], whiteners[pieces[0].param_key]
            return w.invert_run(buf, p.param_start) if inverse else w.apply_run(buf, p.param_start)
        pos = 0
        for p in pieces:
            if p.rows:
                view = buf.narrow(0, pos, p.numel)
                w = whiteners[p.param_key]
                view.copy_(w.invert_run(view, p.param_start) if inverse else w.apply_run(view, p.param_start))
            pos += p.numel
        return buf

    def _generator_for(self, sec: Section, step: int):
        if self.shared_seed is None or not sec.shared or self.generator is None:
            return self.generator
        digest = hashlib.blake2b(repr((self.shared_seed, self.comm.rank, step, [p.param_key for p in sec.pieces]))
                                 .encode(), digest_size=7).digest()
        gen = torch.Generator(device=self.generator.device)
        gen.manual_seed(int.from_bytes(digest, "little"))
        return gen

    def _encode(self, sec: Section, values: torch.Tensor, stats: StepStats, sample: bool, generator, *,
                decode: bool) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The wire bytes of ``values`` in the section's codec and, with ``decode``, what the
        receiver will decode from them (sampled steps count the quantization)."""
        codec = self.codec_of(sec)
        if sec.high:
            wire = codec.encode_to_bytes(values)
            return wire, codec.decode_from_bytes(wire, (values.numel(),), check_header=False) if decode else None
        payload = codec.encode(values, generator=generator)
        if sample:
            q = quantization_stats(values, payload, codec)
            stats.underflow += q["underflow"]
            stats.saturated += q["saturated"]
            stats.nonfinite += q["nonfinite"]
            stats.quantized += q["numel"]
        return codec.payload_to_bytes(payload), codec.decode(payload) if decode else None

    def _count_sent(self, sec: Section, wire: torch.Tensor, numel: int, copies: int, stats: StepStats) -> None:
        stats.elements_sent += copies * numel
        if sec.high:
            stats.bytes_high += copies * wire.numel()
        else:
            stats.bytes_main += copies * wire.numel()
            stats.bytes_scales += copies * self.codec_of(sec).scale_nbytes(numel)

    def _pack(self, tensor, plan: BucketPlan, whiteners, stats: StepStats, sample: bool, step: int = 0,
              only_shared: bool = False):
        """Step 1: every section this rank contributes to, transformed and (where it leaves
        this rank) encoded once; a list in plan order, or (``only_shared``, the relay route) a
        dict of the shared sections by index."""
        me = self.comm.rank
        packed = [] if not only_shared else {}
        for index, sec in enumerate(plan.sections):
            if only_shared and not sec.shared:
                continue
            t0 = self._now()
            own_section = sec.dests == (me,) and not sec.shared
            # My own section is exact and never on the wire; it stays in gradient coordinates and
            # joins the sum after the inverse (S^-1 (sum of the others) + mine: the same by
            # linearity, with no transform of 1/W of the gradient and no round trip of mine).
            values = self._gather(tensor, sec.pieces, sec.numel, None if own_section else whiteners)
            stats.transform_s += self._now() - t0
            stats.elements += sec.numel
            if own_section:
                if sample:  # it skips the codec; count its non-finite inputs here
                    stats.nonfinite += int((~torch.isfinite(values)).sum())
                packed.append(_Packed(own=values))  # never shared: not reached with only_shared
                continue
            t0 = self._now()
            if not sec.high and self.error_feedback:
                values = self._add_residual(plan, sec, values, whiteners)
            wire, decoded = self._encode(sec, values, stats, sample, self._generator_for(sec, step),
                                         decode=self.error_feedback or me in sec.dests)
            own = decoded if me in sec.dests else None
            if not sec.high and self.error_feedback:
                self._keep_residual(plan, sec, values.sub_(decoded), whiteners)
            self._count_sent(sec, wire, sec.numel, sum(1 for d in sec.dests if d != me), stats)
            stats.codec_s += self._now() - t0
            if only_shared:
                packed[index] = _Packed(own=own, wire=wire)
            else:
                packed.append(_Packed(own=own, wire=wire))
        return packed

    # ---- the reduction --------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, slices: Sequence[ParamSlice], whiteners: Dict[int, object],
               versions: Dict[int, int], *, divisor: float, step: int = 0,
               outputs: Optional[Sequence[Optional[torch.Tensor]]] = None, sample: bool = False) -> StepStats:
        """Reduce ``tensor`` (a flat bucket, this rank's local gradients) so that every
        slice owned by this rank holds the sum over ranks divided by ``divisor`` (and every
        shared parameter this rank is a copy rank of holds it whole).

        ``outputs[i]`` (optional, owner side) is an extra fp32 destination for slice i:
        the result is added to it (DeepSpeed's compact fp32 gradient partition).
        Returns this rank's counters for telemetry (``sample``: with the quantization counts
        and the fidelity against an exact fp32 reduction)."""
        plan = self.plan_for(slices, versions)
        # On an accelerator the seconds mean something only with the device synchronized: on
        # sampled steps (a wait per section), not on ordinary ones (then left out of telemetry).
        self._timing = (tensor.device, sample)
        stats = StepStats(sampled=sample, timed=sample or tensor.device.type == "cpu")
        exact = self._exact_reduction(tensor, plan, divisor, stats) if sample else None
        stats.recv_max, stats.recv_max_internode = plan.recv_max, plan.recv_max_internode
        if plan.relay:
            stats.relay_buckets = 1
            totals = self._relay(tensor, plan, whiteners, stats, sample, step)
        else:
            with full_fp32_matmuls():
                packed = self._pack(tensor, plan, whiteners, stats, sample, step)
            recv = self._exchange(plan, packed, step, tensor.device, stats)
            totals = self._sum_at_owner(plan, packed, recv, step, stats)
        t0 = self._now()
        results = []  # the inverse may hand back a new tensor: keep what was scattered
        with full_fp32_matmuls():
            for sec, total, mine in totals:
                total = self._transform_rows(total, sec.pieces, whiteners, inverse=True)
                if mine is not None:
                    total.add_(mine)
                total.div_(divisor)
                self._scatter(tensor, total, sec, plan, outputs)
                results.append(total)
        stats.transform_s += self._now() - t0
        if exact is not None and results:
            exact, positions = exact
            result = torch.cat([total[pos] for total, pos in zip(results, positions)])
            stats.fidelity_err_sq = float((result - exact).square().sum())
            stats.fidelity_ref_sq = float(exact.square().sum())
        if not self.defer_checks or sample:
            self.checks.verify()
        return stats

    def verify_checks(self) -> None:
        """Raise now if a message of a deferred reduction had a header other than expected."""
        self.checks.verify()

    def _now(self) -> float:
        return clock(*self._timing)

    def _exchange(self, plan: BucketPlan, packed: List[_Packed], step: int, device, stats: StepStats) -> torch.Tensor:
        """Step 2: one all-to-all; the message to ``dst`` holds every section it receives."""
        me, world = self.comm.rank, self.comm.world_size
        head = control_header(plan.hash_on(device), self.checks.step_bytes(step, device))
        parts = {dst: [packed[i].wire for i in plan.to_rank[dst]] for dst in range(world)
                 if dst != me and plan.to_rank[dst]}
        my_size = plan.message_sizes[me]
        return self._send(parts, plan.message_sizes, [0 if src == me else my_size for src in range(world)],
                          head, stats)

    def _send(self, parts_by_dst: Dict[int, List[torch.Tensor]], expected: Sequence[int], recv_sizes: Sequence[int],
              head: torch.Tensor, stats: StepStats) -> torch.Tensor:
        """One all-to-all of payload: to every rank in ``parts_by_dst`` the control header and its
        parts, each message checked against the plan's size (``expected[dst]``) and counted."""
        messages, sizes = [], []
        for dst in range(self.comm.world_size):
            if dst not in parts_by_dst:
                sizes.append(0)
                continue
            msg = torch.cat([head] + parts_by_dst[dst])
            if msg.numel() != expected[dst]:
                raise RuntimeError(f"deepspeed_gift: message to rank {dst} has {msg.numel()} bytes, "
                                   f"plan expects {expected[dst]}; codec byte count is inconsistent")
            stats.bytes_header += CONTROL_HEADER_BYTES
            if dst // self.ranks_per_node != self.comm.rank // self.ranks_per_node:
                stats.bytes_internode += msg.numel()
            messages.append(msg)
            sizes.append(msg.numel())
        t0 = self._now()
        recv = self.comm.all_to_all_bytes(torch.cat(messages) if messages else head[:0], sizes, recv_sizes,
                                          kind="payload")
        stats.comm_s += self._now() - t0
        return recv

    # ---- the relay route -------------------------------------------------------------
    def _relay(self, tensor, plan: BucketPlan, whiteners, stats: StepStats, sample: bool,
               step: int) -> List[Tuple[Section, torch.Tensor, Optional[torch.Tensor]]]:
        """Two balanced all-to-alls instead of one that funnels into a bucket's few owners:

        1. every rank cuts each owned section (transformed, error feedback added) into ``world``
           chunks and sends chunk j, encoded, to rank j (its own chunk stays exact); shared
           sections travel as in the direct route;
        2. rank j sums chunk j of every section in fp32 (its own exactly, the others decoded),
           encodes the sum once and sends it to the section's owner, which decodes the chunks
           (its own chunk exact) into the section's sum.

        The busiest link then carries about twice its share of one quantized copy, whatever the
        bucket's owners; the sum is quantized a second time on the way to its owner."""
        me, world, device = self.comm.rank, self.comm.world_size, tensor.device
        head = control_header(plan.hash_on(device), self.checks.step_bytes(step, device))
        # 1. chunks to the relays
        chunk_wires: Dict[int, List[Optional[torch.Tensor]]] = {}
        own_chunks: Dict[int, torch.Tensor] = {}
        packed: Dict[int, _Packed] = {}
        with full_fp32_matmuls():
            for i, sec in enumerate(plan.sections):
                if sec.shared:
                    continue
                t0 = self._now()
                values = self._gather(tensor, sec.pieces, sec.numel, whiteners)
                stats.transform_s += self._now() - t0
                stats.elements += sec.numel
                t0 = self._now()
                if not sec.high and self.error_feedback:
                    values = self._add_residual(plan, sec, values, whiteners)
                wires: List[Optional[torch.Tensor]] = [None] * world
                for j, (start, n) in enumerate(plan.chunks[i]):
                    part = values.narrow(0, start, n)
                    if j == me:
                        own_chunks[i] = part.clone()
                        if sample:  # it skips the codec; count its non-finite inputs here
                            stats.nonfinite += int((~torch.isfinite(part)).sum())
                        if not sec.high and self.error_feedback:
                            part.zero_()  # exact: no residual
                        continue
                    if n == 0:
                        continue
                    wires[j], decoded = self._encode(sec, part, stats, sample, self.generator,
                                                     decode=self.error_feedback and not sec.high)
                    self._count_sent(sec, wires[j], n, 1, stats)
                    if decoded is not None:
                        part.sub_(decoded)  # the residual of this chunk
                if not sec.high and self.error_feedback:
                    self._keep_residual(plan, sec, values, whiteners)
                chunk_wires[i] = wires
                stats.codec_s += self._now() - t0
            shared = self._pack(tensor, plan, whiteners, stats, sample, step, only_shared=True)
            packed.update(shared)
        parts: Dict[int, List[torch.Tensor]] = {}
        for j in range(world):
            if j == me or not plan.relay_sizes[j]:
                continue
            parts[j] = [chunk_wires[i][j] if not sec.shared else packed[i].wire for i, sec in enumerate(plan.sections)
                        if (not sec.shared and chunk_wires[i][j] is not None) or (sec.shared and j in sec.dests)]
        recv = self._send(parts, plan.relay_sizes, [0 if src == me else plan.relay_sizes[me] for src in range(world)],
                          head, stats)
        # 2. relay: sum my chunk of every owned section, and the shared sections I copy
        t0 = self._now()
        incoming = self._split_messages(recv, plan.relay_sizes[me], head, DISAGREE)
        sums: Dict[int, torch.Tensor] = {}
        shared_totals: Dict[int, torch.Tensor] = {}
        offsets = {src: CONTROL_HEADER_BYTES for src in incoming}
        for i, sec in enumerate(plan.sections):
            codec = self.codec_of(sec)
            if not sec.shared:
                n = plan.chunks[i][me][1]
                if not n:
                    continue
                total = None
                for src in range(world):  # rank order
                    if src == me:
                        part = own_chunks[i]
                    else:
                        part = self._decode_at(codec, incoming[src], offsets, src, n)
                    total = part.clone() if total is None else total.add_(part)
                sums[i] = total
            elif me in sec.dests:
                total = None
                for src in range(world):  # every contribution decoded, mine too: copies agree bit for bit
                    part = packed[i].own if src == me else self._decode_at(codec, incoming[src], offsets, src,
                                                                           sec.numel)
                    total = part.clone() if total is None else total.add_(part)
                shared_totals[i] = total
        stats.codec_s += self._now() - t0
        # the sums on to the owners, encoded once
        t0 = self._now()
        forward: Dict[int, List[torch.Tensor]] = {}
        for i, sec in enumerate(plan.sections):
            d = sec.dests[0]
            if sec.shared or i not in sums or d == me:
                continue
            feedback = self.error_feedback and not sec.high
            value = sums[i]
            if feedback:  # the relay's own residual: the second quantization is fed back too
                held = self.relay_residuals.get((plan.hash, i))
                if held is not None:
                    value = value.add_(held)
            wire, decoded = self._encode(sec, value, stats, sample, self.generator, decode=feedback)
            if feedback:
                residual = value.sub_(decoded)
                residual.masked_fill_(~torch.isfinite(residual).all(), 0.0)
                self.relay_residuals[(plan.hash, i)] = residual
            self._count_sent(sec, wire, sums[i].numel(), 1, stats)
            forward.setdefault(d, []).append(wire)
        stats.codec_s += self._now() - t0
        recv = self._send(forward, plan.forward_sizes[me], [plan.forward_sizes[j][me] for j in range(world)],
                          head, stats)
        # the owner: my sections whole, from every relay's chunk
        t0 = self._now()
        pos, sums_from = 0, {}
        for j in range(world):
            n = plan.forward_sizes[j][me]
            if n:
                msg = recv.narrow(0, pos, n)
                expect_control_header(self.checks, msg, head, f"rank {j}", DISAGREE)
                sums_from[j] = msg
                pos += n
        offsets = {j: CONTROL_HEADER_BYTES for j in sums_from}
        totals = []
        for i in plan.to_rank[me]:
            sec = plan.sections[i]
            if sec.shared:
                totals.append((sec, shared_totals[i], None))
                continue
            total = torch.empty(sec.numel, dtype=torch.float32, device=device)
            for j, (start, n) in enumerate(plan.chunks[i]):
                if not n:
                    continue
                part = sums[i] if j == me else self._decode_at(self.codec_of(sec), sums_from[j], offsets, j, n)
                total.narrow(0, start, n).copy_(part)
            totals.append((sec, total, None))
        stats.codec_s += self._now() - t0
        return totals

    def _decode_at(self, codec, msg: torch.Tensor, offsets: Dict[int, int], src: int, numel: int) -> torch.Tensor:
        """Decode the next payload of ``numel`` elements in ``src``'s message (its header checked
        with the step's other headers)."""
        n = codec.nbytes(numel)
        buf = msg.narrow(0, offsets[src], n)
        offsets[src] += n
        expect_codec_header(self.checks, codec, buf, numel, f"rank {src}")
        return codec.decode_from_bytes(buf, (numel,), check_header=False)

    def _split_messages(self, recv: torch.Tensor, size: int, head: torch.Tensor, meaning: str) -> Dict[int, torch.Tensor]:
        """The message of every other rank (``size`` bytes each, in rank order), headers expected."""
        me, out, pos = self.comm.rank, {}, 0
        if not size:
            return out
        for src in range(self.comm.world_size):
            if src != me:
                out[src] = recv.narrow(0, pos, size)
                expect_control_header(self.checks, out[src], head, f"rank {src}", meaning)
                pos += size
        return out

    def _sum_at_owner(self, plan: BucketPlan, packed: List[_Packed], recv: torch.Tensor, step: int,
                      stats: StepStats) -> List[Tuple[Section, torch.Tensor, Optional[torch.Tensor]]]:
        """Step 3: decode every source and sum in fp32 - my own section starting from my exact
        contribution (or, where it has transformed pieces, the others' sum, with mine returned
        to be added after the inverse), a shared one in rank order from everyone's decoded
        contribution."""
        me, world = self.comm.rank, self.comm.world_size
        if not plan.to_rank[me]:
            return []
        t0 = self._now()
        want = control_header(plan.hash_on(recv.device), self.checks.step_bytes(step, recv.device))
        messages = self._split_messages(recv, plan.message_sizes[me], want, DISAGREE)
        offsets = {src: CONTROL_HEADER_BYTES for src in messages}
        totals = []
        for i in plan.to_rank[me]:
            sec = plan.sections[i]
            codec = self.codec_of(sec)
            own = packed[i].own
            after = not sec.shared and any(p.rows for p in sec.pieces)
            total = own.clone() if not sec.shared and not after else None
            for src in range(world):
                if src == me and not sec.shared:
                    continue
                part = own if src == me else self._decode_at(codec, messages[src], offsets, src, sec.numel)
                total = part.clone() if total is None else total.add_(part)
            if total is None:  # a world of one: nobody else contributed
                total = torch.zeros_like(own)
            totals.append((sec, total, own if after else None))
        stats.codec_s += self._now() - t0
        return totals

    def _add_residual(self, plan: BucketPlan, sec: Section, main: torch.Tensor, whiteners) -> torch.Tensor:
        """Add last step's quantization error, first moved into this step's coordinates when
        a refresh or re-selection changed the whiteners of some rows."""
        entry = self.residuals.get((plan.layout_key, sec.key))
        if entry is None:
            return main
        residual, pieces, used = entry
        if pieces != sec.pieces or any(used.get(p.param_key) is not whiteners.get(p.param_key)
                                       for p in sec.pieces + pieces if p.rows):
            residual = self._transform_rows(residual, pieces, used, inverse=True)
            residual = self._transform_rows(residual, sec.pieces, whiteners, inverse=False)
        return main.add_(residual)

    def _keep_residual(self, plan: BucketPlan, sec: Section, residual: torch.Tensor, whiteners) -> None:
        # An overflowing step (DeepSpeed skips it): its error must not leak into the next, so a
        # residual with any inf/nan is kept as zeros (decided on the device: no host read).
        residual.masked_fill_(~torch.isfinite(residual).all(), 0.0)
        self.residuals[(plan.layout_key, sec.key)] = (residual, sec.pieces, dict(whiteners))

    def state_dict(self) -> dict:
        """Error-feedback residuals, moved to gradient coordinates (the whiteners they were
        made with are not saved; the next step maps them into its own), and the stochastic
        rounding generator."""
        residuals = []
        for (layout_key, key), (residual, pieces, used) in self.residuals.items():
            grad_coords = self._transform_rows(residual.clone(), pieces, used, inverse=True)
            flat = [Piece(p.bucket_offset, p.numel, p.param_key, 0, p.slice_index, p.slice_start, p.param_start)
                    for p in pieces]
            residuals.append((layout_key, key, grad_coords.cpu(), [tuple(vars(p).values()) for p in flat]))
        gen = self.generator.get_state() if self.generator is not None else None
        relayed = [(plan_hash, index, r.cpu()) for (plan_hash, index), r in self.relay_residuals.items()]
        return {"residuals": residuals, "generator": gen, "relay_residuals": relayed}

    def load_state_dict(self, state: dict, device) -> None:
        self.residuals = {(layout_key, key): (r.to(device), [Piece(*p) for p in pieces], {})
                          for layout_key, key, r, pieces in state["residuals"]}
        self.relay_residuals = {(plan_hash, index): r.to(device)
                                for plan_hash, index, r in state.get("relay_residuals", [])}
        if state["generator"] is not None and self.generator is not None:
            self.generator.set_state(state["generator"])

    def residual_nbytes(self) -> int:
        """Memory held by error feedback (fp32 residuals of every payload this rank sends)."""
        return (sum(r.numel() * r.element_size() for r, _, _ in self.residuals.values())
                + sum(r.numel() * r.element_size() for r in self.relay_residuals.values()))

    @staticmethod
    def _scatter(tensor, total, sec: Section, plan: BucketPlan, outputs) -> None:
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

    def _exact_reduction(self, tensor, plan: BucketPlan, divisor: float, stats: StepStats):
        """fp32 reduction, by a plain exchange, of an evenly strided sample of at most about
        ``fidelity_elements`` of the elements this rank receives (gradient coordinates): the
        exact values and, per received section, the sampled positions. Every rank samples
        the same positions (they depend on the plan only); the bytes are counted as
        ``bytes_fidelity``. None when this rank receives nothing."""
        comm = self.comm
        me, world = comm.rank, comm.world_size
        chunks, sizes, own, mine = [], [], None, []
        for dst in range(world):
            stride = max(1, -(-plan.received_numel(dst) // self.fidelity_elements))
            samples = [section_sample(plan, i, stride, tensor.device) for i in plan.to_rank[dst]]
            raw = (torch.cat([tensor[at].float() for _, at in samples]) if samples
                   else torch.empty(0, dtype=torch.float32, device=tensor.device))
            if dst == me:
                own, mine = raw, [pos for pos, _ in samples]
                raw = raw[:0]
            chunks.append(raw.view(torch.uint8))
            sizes.append(raw.numel() * 4)
        my_bytes = own.numel() * 4
        recv = comm.all_to_all_bytes(torch.cat(chunks), sizes,
                                     [0 if src == me else my_bytes for src in range(world)], kind="telemetry")
        stats.bytes_fidelity += sum(sizes)
        if own.numel() == 0:
            return None
        exact = own.clone()
        if world > 1:
            exact += recv.view(torch.float32).view(world - 1, own.numel()).sum(0)
        return exact.div_(divisor), mine


def section_sample(plan: BucketPlan, index: int, stride: int, device) -> Tuple[torch.Tensor, torch.Tensor]:
    """Every ``stride``-th element of section ``index``: its positions in the section's packed
    order and its offsets in the bucket (made once per plan, stride and device)."""
    key = (index, stride, str(device))
    got = plan.samples.get(key)
    if got is None:
        sec = plan.sections[index]
        starts = [0]
        for p in sec.pieces[:-1]:
            starts.append(starts[-1] + p.numel)
        pos = torch.arange(0, sec.numel, stride, device=device)
        first = torch.tensor(starts, device=device)
        which = torch.searchsorted(first, pos, right=True) - 1
        offsets = torch.tensor([p.bucket_offset for p in sec.pieces], device=device)
        got = plan.samples[key] = (pos, offsets[which] + (pos - first[which]))
    return got


class full_fp32_matmuls:
    """Matrix products in full fp32 inside: a user's TF32 setting (HF ``tf32=True``) would
    round whitening and its inverse to 10 mantissa bits, ~1e-3 on the round trip, above the
    codec's own error at bf16/fp32. The setting is the process's: with ranks as threads
    (``comm.LocalComm``) the first to enter sets it and the last to leave restores it."""

    _lock = threading.Lock()
    _inside = 0
    _saved = "highest"

    def __enter__(self):
        cls = type(self)
        with cls._lock:
            if cls._inside == 0:
                cls._saved = torch.get_float32_matmul_precision()
                if cls._saved != "highest":
                    torch.set_float32_matmul_precision("highest")
            cls._inside += 1
        return self

    def __exit__(self, *exc):
        cls = type(self)
        with cls._lock:
            cls._inside -= 1
            if cls._inside == 0 and cls._saved != "highest":
                torch.set_float32_matmul_precision(cls._saved)
        return False


# ---- two-level: inside the node first, then among the nodes -------------------------------
NODE_SPLITS = ("owner_slot", "balanced")  # how a bucket is spread over a node's ranks; a tie picks the first

Carried = List[Tuple[int, int, int]]  # (index of the slice in the bucket, start inside it, numel), bucket order


def slot_targets(s: ParamSlice, ranks_per_node: int) -> Tuple[int, ...]:
    """Local ranks that must hold the node's partial sum of slice ``s``: the owner's slot, or,
    for a whole shared parameter, the slot of every rank in its copy set."""
    if s.copy_ranks:
        return tuple(sorted({c % ranks_per_node for c in s.copy_ranks}))
    return (s.dst % ranks_per_node,)


def carried_by_owner_slot(slices: Sequence[ParamSlice], ranks_per_node: int) -> List[Carried]:
    """Per local rank j, what it carries across nodes when every slice goes to its owner's slot:
    nothing to forward inside the node afterwards, but a bucket with few owners loads few slots."""
    return [[(i, 0, s.numel) for i, s in enumerate(slices) if j in slot_targets(s, ranks_per_node)]
            for j in range(ranks_per_node)]


def unit_boundary(s: ParamSlice, at: int) -> int:
    """The offset in ``s`` nearest ``at`` where a run unit of its transform starts (a whitener's
    row): a cut there keeps every row whole, so both sides are whitened as the slice was."""
    if s.mode != GEO or s.row_len <= 1:
        return at
    unit = s.row_len
    nearest = (s.param_offset + at + unit // 2) // unit * unit - s.param_offset
    return min(max(nearest, 0), s.numel)


def level_runs(owned: int, pinned: Sequence[int]) -> List[int]:
    """Run lengths of ``owned`` elements over slots that already carry ``pinned`` elements each, so
    that the loads come out as level as they can: slots pinned above the level get nothing."""
    active = list(range(len(pinned)))
    while True:
        level = (owned + sum(pinned[j] for j in active)) / len(active)
        keep = [j for j in active if pinned[j] <= level]
        if len(keep) == len(active):
            break
        active = keep
    runs = [max(0, int(level - pinned[j])) if j in active else 0 for j in range(len(pinned))]
    runs[active[-1]] += owned - sum(runs)
    return runs


def carried_balanced(slices: Sequence[ParamSlice], ranks_per_node: int) -> List[Carried]:
    """Per local rank j, what it carries when the elements each node owns (shared parameters
    aside) are cut into runs, run j to local rank j, sized so that every slot receives about as
    much for that node (a shared parameter still goes whole to its copy slots, and counts); each
    cut is moved to a row boundary of the slice it falls in. Every NIC of an owner's node then
    carries its share whatever the owners, and a slot hands an owner of another slot its results
    inside the node afterwards."""
    L = ranks_per_node
    by_node: Dict[int, List[Tuple[int, ParamSlice]]] = {}
    pinned: Dict[int, List[int]] = {}  # node -> shared elements each slot carries for it
    for i, s in enumerate(slices):
        if s.copy_ranks:
            for node in {c // L for c in s.copy_ranks}:
                for j in {c % L for c in s.copy_ranks if c // L == node}:
                    pinned.setdefault(node, [0] * L)[j] += s.numel
        else:
            by_node.setdefault(s.dst // L, []).append((i, s))
    carried: List[Carried] = [[] for _ in range(L)]
    for node, owned in by_node.items():
        total = sum(s.numel for _, s in owned)
        targets: List[int] = []
        for n in level_runs(total, pinned.get(node, [0] * L))[:-1]:
            targets.append((targets[-1] if targets else 0) + n)
        cuts: List[int] = []
        pos = 0
        for _, s in owned:
            while len(cuts) < L - 1 and targets[len(cuts)] < pos + s.numel:
                at = pos + unit_boundary(s, targets[len(cuts)] - pos)
                cuts.append(max([at] + cuts[-1:]))
            pos += s.numel
        edges = [0] + cuts + [total] * (L - len(cuts))
        pos = 0
        for i, s in owned:
            for j in range(L):
                start, end = max(edges[j], pos), min(edges[j + 1], pos + s.numel)
                if start < end:
                    carried[j].append((i, start - pos, end - start))
            pos += s.numel
    for i, s in enumerate(slices):
        if s.copy_ranks:
            for j in slot_targets(s, L):
                carried[j].append((i, 0, s.numel))
    for runs in carried:
        runs.sort(key=lambda run: slices[run[0]].bucket_offset + run[1])
    return carried


def slot_group_slices(slices: Sequence[ParamSlice], runs: Carried, ranks_per_node: int,
                      slot: int) -> List[ParamSlice]:
    """What slot ``slot`` carries, re-addressed for its slot group: owners numbered by node
    (rank // ranks per node), copy sets cut to this slot's members, offsets into a compact
    buffer of the node partials (in bucket order)."""
    L, out, compact = ranks_per_node, [], 0
    for i, at, n in runs:
        s = slices[i]
        copy = tuple(c // L for c in s.copy_ranks if c % L == slot)
        out.append(ParamSlice(s.dst // L, compact, n, s.param_offset + at, s.param_key, s.row_len, s.mode, copy))
        compact += n
    return out


def merged_runs(runs: Sequence[Tuple[int, int]]) -> List[Tuple[int, int]]:
    """(bucket offset, numel) runs in order, adjacent ones merged."""
    out: List[Tuple[int, int]] = []
    for start, numel in runs:
        if out and out[-1][0] + out[-1][1] == start:
            out[-1] = (out[-1][0], out[-1][1] + numel)
        else:
            out.append((start, numel))
    return out


class NodePlan:
    """What one bucket does in the two-level scheme, seen from one rank, for one split of the
    bucket over the node's ranks (``carried``: per local rank, what it carries across nodes)."""

    def __init__(self, slices: Sequence[ParamSlice], ranks_per_node: int, rank: int, carried: List[Carried],
                 split: str) -> None:
        L = ranks_per_node
        self.split = split
        self.slot, self.node = rank % L, rank // L
        self.runs_to_slot = [merged_runs([(slices[i].bucket_offset + at, n) for i, at, n in runs])
                             for runs in carried]
        self.numel_to_slot = [sum(n for _, _, n in runs) for runs in carried]
        mine = carried[self.slot]
        self.slices = slot_group_slices(slices, mine, L, self.slot)
        self.source_index = [i for i, _, _ in mine]
        self.delivered: List[Tuple[int, int, int]] = []  # (compact offset, bucket offset, numel) kept here
        self.kept: List[bool] = []  # per slice of my slot: this rank takes its result (owner or copy rank)
        self.forward_out: Dict[int, List[Tuple[int, int]]] = {}  # local rank -> (compact offset, numel) it gets
        for (i, at, n), t in zip(mine, self.slices):
            s = slices[i]
            keep = (self.node in t.copy_ranks) if s.copy_ranks else s.dst == rank
            self.kept.append(keep)
            if keep:
                self.delivered.append((t.bucket_offset, s.bucket_offset + at, n))
            elif not s.copy_ranks and s.dst // L == self.node:
                self.forward_out.setdefault(s.dst % L, []).append((t.bucket_offset, n))
        self.sources = [(i, at) for i, at, _ in mine]
        # what other local ranks forward to me ((slice index, start, numel), in their order), and the
        # busiest receiver of the forwards of any node (every rank plans the same: the figure agrees)
        self.forward_in: Dict[int, List[Tuple[int, int, int, int]]] = {}  # (bucket offset, slice index, start, numel)
        forward_to: Dict[int, Dict[int, int]] = {}  # data-parallel rank -> {local rank forwarding: numel}
        for j, runs in enumerate(carried):
            for i, at, n in runs:
                s = slices[i]
                if s.copy_ranks or s.dst % L == j:
                    continue
                senders = forward_to.setdefault(s.dst, {})
                senders[j] = senders.get(j, 0) + n
                if s.dst == rank:
                    self.forward_in.setdefault(j, []).append((s.bucket_offset + at, i, at, n))
        node_ranks = range(self.node * L, (self.node + 1) * L)
        self.forward_numel = [[forward_to.get(d, {}).get(j, 0) for d in node_ranks] for j in range(L)]
        # every rank calls the forward's all-to-all when any node forwards (an empty one where its node
        # has nothing to hand on): every rank runs the same collectives for a bucket, in the same order
        self.forwards = bool(forward_to)
        self.forward_senders = [list(senders.values()) for senders in forward_to.values()]
        digest = hashlib.blake2b(repr((tuple(slices), L, split)).encode(), digest_size=8)
        self.hash = int.from_bytes(digest.digest(), "little", signed=True)
        self._hash_bytes: Dict[str, torch.Tensor] = {}

    hash_on = BucketPlan.hash_on

    def outputs_for(self, outputs: Optional[Sequence[Optional[torch.Tensor]]]):
        """The owner-side outputs of my slot's slices: the bucket slice's output (the part this
        rank carries) where this rank keeps the result; None where it forwards it."""
        if outputs is None:
            return None
        out = []
        for (i, at), t, keep in zip(self.sources, self.slices, self.kept):
            target = outputs[i] if keep else None
            if target is not None and not t.copy_ranks and t.numel != target.numel():
                target = target.narrow(0, at, t.numel)
            out.append(target)
        return out

    def busiest_node_receive(self, element_size: int) -> int:
        """Bytes the busiest rank receives inside its node for this bucket: the node stage, and
        the forwards of a balanced split."""
        L = len(self.numel_to_slot)
        if L == 1:
            return 0
        stage = (L - 1) * max(CONTROL_HEADER_BYTES + n * element_size for n in self.numel_to_slot)
        forwards = max((sum(CONTROL_HEADER_BYTES + n * element_size for n in senders)
                        for senders in self.forward_senders), default=0)
        return stage + forwards


class TwoLevelReducer:
    """Reduce a bucket inside each node first, then across nodes with a :class:`GiftReducer`.

    1. Node stage: an all-to-all among the node's ranks in the bucket's own dtype (no codec:
       the fast links inside a node). Each local rank receives the part of the bucket it
       carries from every local rank and sums it in fp32 in local rank order: the node
       partial, with no rounding beyond the gradients' own. The part: every slice to its
       owner's slot (``owner_slot``), or the bucket's owned elements in equal runs, one per
       local rank (``balanced``; a bucket with few owners would load only their slots' NICs).
    2. Node exchange: the ranks with the same local rank on every node (a *slot group*)
       reduce the node partials with ``inner`` - transform, quantize, all-to-all (direct or
       relayed, by ``inner.route``), fp32 sum at the owner's node, inverse - so the transform
       and codec work per rank drop by the node size and each node's NICs carry one quantized
       copy of the bucket, not one per rank.
    3. Balanced only: each local rank hands what it reduced for an owner of another slot to
       that owner, in the bucket's dtype, inside the node.
    ``inner.route`` picks the split: ``direct`` owner_slot, ``relay`` balanced, ``by_layout``
    per bucket the one whose busiest rank among the nodes receives fewer bytes (owner_slot on a
    tie: it forwards nothing). Owners and copy ranks then copy their results into the bucket
    (and ``outputs``) as the flat reducer does."""

    def __init__(self, node_comm, inner: GiftReducer, ranks_per_node: int) -> None:
        self.node_comm = node_comm
        self.inner = inner
        self.ranks_per_node = ranks_per_node
        self.rank = inner.comm.rank * ranks_per_node + node_comm.rank
        self._plans: Dict[tuple, Tuple[NodePlan, int]] = {}

    def plan_for(self, slices: Sequence[ParamSlice]) -> Tuple[NodePlan, int]:
        """The bucket's node plan, and the bytes the busiest rank among the nodes receives (the
        slot groups differ: every slot's exchange is planned here, on every rank)."""
        key = tuple(slices)
        got = self._plans.pop(key, None)
        if got is None:
            got = self._choose(slices)
            while len(self._plans) >= MAX_CACHED_PLANS:
                self._plans.pop(next(iter(self._plans)))
        self._plans[key] = got
        return got

    def _choose(self, slices: Sequence[ParamSlice]) -> Tuple[NodePlan, int]:
        L, route = self.ranks_per_node, self.inner.route
        splits = {"owner_slot": carried_by_owner_slot(slices, L)}
        if L > 1 and route != "direct":
            splits["balanced"] = carried_balanced(slices, L)
        among_nodes = {split: max(self.inner.new_plan(slot_group_slices(slices, carried[j], L, j), {}).recv_max
                                  for j in range(L))
                       for split, carried in splits.items()}
        if route == "relay" and "balanced" in splits:
            split = "balanced"
        else:
            split = min(splits, key=lambda k: (among_nodes[k], NODE_SPLITS.index(k)))
        return NodePlan(slices, L, self.rank, splits[split], split), among_nodes[split]

    def reduce(self, tensor: torch.Tensor, slices: Sequence[ParamSlice], whiteners: Dict[int, object],
               versions: Dict[int, int], *, divisor: float, step: int = 0,
               outputs: Optional[Sequence[Optional[torch.Tensor]]] = None, sample: bool = False) -> StepStats:
        """Same contract as :meth:`GiftReducer.reduce` (``slices`` name data-parallel ranks)."""
        plan, among_nodes = self.plan_for(slices)
        t0 = clock(tensor.device, sample)
        partial, node_bytes = self._node_stage(tensor, plan, step)
        node_s = clock(tensor.device, sample) - t0
        stats = self.inner.reduce(partial, plan.slices, whiteners, versions, divisor=divisor, step=step,
                                  outputs=plan.outputs_for(outputs), sample=sample)
        for compact_at, bucket_at, numel in plan.delivered:
            tensor.narrow(0, bucket_at, numel).copy_(partial.narrow(0, compact_at, numel))
        t0 = clock(tensor.device, sample)
        node_bytes += self._forward(tensor, partial, plan, step, outputs)
        stats.node_s = node_s + clock(tensor.device, sample) - t0
        stats.bytes_node = node_bytes
        stats.balanced_buckets = int(plan.split == "balanced")
        stats.recv_max_internode = among_nodes
        stats.recv_max = among_nodes + plan.busiest_node_receive(tensor.element_size())
        return stats

    def _node_message(self, plan, step: int, device) -> torch.Tensor:
        return control_header(plan.hash_on(device), self.inner.checks.step_bytes(step, device))

    def _node_stage(self, tensor: torch.Tensor, plan: NodePlan, step: int) -> Tuple[torch.Tensor, int]:
        """fp32 node partial of every slice this rank's slot carries, in the compact layout (a
        buffer of its own), and the bytes this rank sent inside the node."""
        L, me = self.ranks_per_node, plan.slot
        mine = self._gather_runs(tensor, plan.runs_to_slot[me])
        if L == 1:
            return mine.to(torch.float32, copy=True), 0
        checks = self.inner.checks
        head = self._node_message(plan, step, tensor.device)
        messages, sizes = [], []
        for j in range(L):
            if j == me:
                sizes.append(0)
                continue
            body = self._gather_runs(tensor, plan.runs_to_slot[j]).view(torch.uint8)
            messages += [head, body]
            sizes.append(CONTROL_HEADER_BYTES + body.numel())
        incoming = CONTROL_HEADER_BYTES + mine.numel() * mine.element_size()
        recv = self.node_comm.all_to_all_bytes(torch.cat(messages), sizes,
                                               [0 if i == me else incoming for i in range(L)], kind="node")
        partial, pos = None, 0
        for i in range(L):  # local rank order on every receiver: copies of a shared parameter agree bit for bit
            if i == me:
                part = mine
            else:
                msg = recv.narrow(0, pos, incoming)
                expect_control_header(checks, msg, head, f"local rank {i}",
                                      "ranks of a node disagree on the bucket layout")
                part = msg.narrow(0, CONTROL_HEADER_BYTES, incoming - CONTROL_HEADER_BYTES).view(tensor.dtype)
                pos += incoming
            partial = part.to(torch.float32, copy=True) if partial is None else partial.add_(part)
        return partial, sum(sizes)

    def _forward(self, tensor: torch.Tensor, partial: torch.Tensor, plan: NodePlan, step: int, outputs) -> int:
        """Balanced split: hand every owner of this node the results other local ranks reduced for
        it, in the bucket's dtype (an fp32 model's results arrive exact); the bytes sent."""
        if not plan.forwards:
            return 0
        L, me, dtype = self.ranks_per_node, plan.slot, tensor.dtype
        head = self._node_message(plan, step, tensor.device)
        messages, sizes = [], []
        for o in range(L):
            runs = plan.forward_out.get(o)
            if not runs:
                sizes.append(0)
                continue
            body = torch.cat([partial.narrow(0, at, n) for at, n in runs]).to(dtype).view(torch.uint8)
            messages += [head, body]
            sizes.append(CONTROL_HEADER_BYTES + body.numel())
        elem = tensor.element_size()
        recv_sizes = [CONTROL_HEADER_BYTES + plan.forward_numel[j][me] * elem if plan.forward_numel[j][me] else 0
                      for j in range(L)]
        recv = self.node_comm.all_to_all_bytes(torch.cat(messages) if messages else head[:0], sizes, recv_sizes,
                                               kind="node")
        pos = 0
        for j in range(L):
            if not recv_sizes[j]:
                continue
            msg = recv.narrow(0, pos, recv_sizes[j])
            expect_control_header(self.inner.checks, msg, head, f"local rank {j}",
                                  "ranks of a node disagree on the bucket layout")
            values = msg.narrow(0, CONTROL_HEADER_BYTES, recv_sizes[j] - CONTROL_HEADER_BYTES).view(dtype)
            at = 0
            for bucket_at, i, start, n in plan.forward_in[j]:
                part = values.narrow(0, at, n)
                tensor.narrow(0, bucket_at, n).copy_(part)
                if outputs is not None and outputs[i] is not None:
                    outputs[i].narrow(0, start, n).add_(part)
                at += n
            pos += recv_sizes[j]
        return sum(sizes)

    @staticmethod
    def _gather_runs(tensor: torch.Tensor, runs: List[Tuple[int, int]]) -> torch.Tensor:
        if len(runs) == 1:
            return tensor.narrow(0, runs[0][0], runs[0][1]).contiguous()
        if not runs:
            return tensor.new_empty(0)
        return torch.cat([tensor.narrow(0, start, numel) for start, numel in runs])

    def verify_checks(self) -> None:
        self.inner.verify_checks()  # the node stage's headers are checked there too

    # the state lives in the node exchange's reducer (residuals, generator)
    def state_dict(self) -> dict:
        return self.inner.state_dict()

    def load_state_dict(self, state: dict, device) -> None:
        self.inner.load_state_dict(state, device)

    def residual_nbytes(self) -> int:
        return self.inner.residual_nbytes()
