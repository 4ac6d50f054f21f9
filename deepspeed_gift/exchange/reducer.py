"""One bucket's reduce-scatter: per-owner sections -> transform -> quantize -> all-to-all
-> dequantize + fp32 sum at the owner -> inverse transform.

Knows nothing of DeepSpeed: the caller describes the bucket as ``ParamSlice``s (which part of
the flat bucket goes to which owner, and whether it belongs to a weight whose rows can be
whitened). Knows no wire details: codecs from ``core.formats`` turn fp32 into bytes, a
``Comm`` moves bytes. The plan (``plan``), the headers (``headers``), the encoding
(``encode``), error feedback (``feedback``), the relay route (``relay``) and the sampled
fidelity check (``fidelity``) live in their own modules; this one runs a bucket through them.

An owner's own contribution to its own sections never goes through the codec (it is exact and
costs no bytes); in a shared section every receiver decodes every contribution, its own
included, and sums them in rank order, so all copies are bit-identical.
"""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple

import torch

from ..core.geometry import Transform, full_fp32_matmuls
from .comm import Pending
from .encode import Packed, SectionEncoder, SpanBatches
from .feedback import ErrorFeedback
from .fidelity import exact_sample_reduction
from .headers import (CONTROL_HEADER_BYTES, DISAGREE, FINGERPRINT_BYTES, HeaderChecks, agree_on_plan, expect_codec_header,
                      expect_control_header)
from ..core.formats import DEFAULT_TILE_ELEMENTS, check_tile_elements, spans_batch_limit
from ..core.rng import CounterRng
from .plan import (MAX_CACHED_PLANS, ROUTES, BucketPlan, ParamSlice, Section, SectionSource, describe_plan,
                   gather_pieces, plan_difference, plan_fingerprint, plan_route, scatter_section, transform_pieces)
from .relay import relay_totals
from .stats import ByteKind, StepStats, clock

Totals = List[Tuple[Section, torch.Tensor, Optional[torch.Tensor]]]  # (section, its sum, mine to add after the inverse)


class GiftReducer:
    """Runs bucket reductions for one engine: the comm, the encoder, error feedback and per-plan caches.

    ``defer_checks``: headers are compared on the device and read once per step by the owner's
    :meth:`verify_checks` instead of at the end of every reduce (a host wait per bucket).
    ``ranks_per_node`` is for accounting only (which messages leave the node).
    ``tile_elements`` (``gift.tile_elements``): staging, transforms, codecs and the owner's sum
    work in tiles of at most about this many elements, so their temporaries never grow with a
    section; the results do not depend on it. ``relay_codec``: the codec of the relay route's
    sums on their way to the owner (None: the main codec)."""

    def __init__(self, comm, main_codec, high_codec=None, *, generator: Optional[CounterRng] = None,
                 error_feedback: bool = False, ranks_per_node: int = 1, defer_checks: bool = False,
                 fidelity_elements: int = 65536, route: str = "direct", shared_seed: Optional[int] = None,
                 tile_elements: int = DEFAULT_TILE_ELEMENTS, relay_codec=None) -> None:
        if route not in ROUTES:
            raise ValueError(f"gift.route: got {route!r}; allowed: {', '.join(ROUTES)}")
        self.route = route
        self.tile_elements = check_tile_elements(tile_elements, "gift.tile_elements")
        self.comm = comm
        self.fidelity_elements = fidelity_elements  # the sampled fidelity check: elements per owner and bucket
        self.checks = HeaderChecks()
        self.defer_checks = defer_checks
        self.ranks_per_node = ranks_per_node
        self.encoder = SectionEncoder(comm.rank, main_codec, high_codec, generator=generator,
                                      shared_seed=shared_seed, tile_elements=self.tile_elements,
                                      relay_codec=relay_codec)
        self.error_feedback = error_feedback
        self.feedback = ErrorFeedback(kernels=main_codec.kernels)
        self._plans: Dict[tuple, BucketPlan] = {}
        self.plans_agreed = 0  # new plans, each agreed by the ranks before its first exchange
        self.agrees = True  # plan_for agrees on new plans (False: the caller does, two-level)
        self.param_names: Dict[int, str] = {}  # parameter key -> name, for errors that name a layer
        self._others = tuple(r for r in range(comm.world_size) if r != comm.rank)  # senders to me, in rank order
        self._timing = (torch.device("cpu"), False)  # (device, synchronize) of the reduction running
        self._wait_at_once = False  # see reduce_steps

    # ---- planning -------------------------------------------------------------------
    def plan_for(self, slices: Sequence[ParamSlice], versions: Dict[int, int]) -> BucketPlan:
        """The bucket's plan, cached; a new one is agreed by the ranks before it is used (unless
        :attr:`agrees` is off: two-level agrees on its slot groups' plans itself)."""
        key = (tuple(slices), tuple(sorted(versions.items())))
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = self.new_plan(slices, versions)
            if self.agrees:
                self.agree(plan, versions)
            while len(self._plans) >= MAX_CACHED_PLANS:  # plans of older transform versions
                self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan  # most recently used last
        return plan

    def agree(self, plan: BucketPlan, versions: Dict[int, int]) -> None:
        """Every rank made this plan the same way (see ``headers.agree_on_plan``)."""
        what = f"a bucket of {sum(s.numel for s in plan.slices)} elements, {len(plan.slices)} slices"
        agree_on_plan(self.comm, plan_fingerprint(plan), lambda: describe_plan(plan, versions),
                      lambda everyone: plan_difference(everyone, self.param_names), what)
        self.plans_agreed += 1

    def new_plan(self, slices: Sequence[ParamSlice], versions: Dict[int, int]) -> BucketPlan:
        """A plan with its sizes and route, not cached (two-level plans every slot group's)."""
        plan = BucketPlan(slices, self.comm.world_size, versions)
        plan_route(plan, self.route, self.encoder.codec_of, max(self.encoder.main_codec.block_size, 1),
                   self.ranks_per_node, self.encoder.forward_codec_of)
        return plan

    # ---- the reduction --------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, slices: Sequence[ParamSlice], whiteners: Dict[int, Transform], *,
               divisor: float, step: int = 0,
               outputs: Optional[Sequence[Optional[torch.Tensor]]] = None, sample: bool = False) -> StepStats:
        """Reduce ``tensor`` (a flat bucket, this rank's local gradients) so that every
        slice owned by this rank holds the sum over ranks divided by ``divisor`` (and every
        shared parameter this rank is a copy rank of holds it whole).

        1. every section this rank contributes to is transformed (``whiteners``: the transform
           of each parameter by key) and encoded once;
        2. one all-to-all (direct), or two balanced ones through every rank (relay);
        3. the owner decodes and sums in fp32, inverts the transform, divides, and scatters.

        ``outputs[i]`` (optional, owner side) is an extra fp32 destination for slice i:
        the result is added to it (DeepSpeed's compact fp32 gradient partition).
        Returns this rank's counters for telemetry (``sample``: with the quantization counts
        and the fidelity against an exact fp32 reduction)."""
        return Begun(self.reduce_steps(tensor, slices, whiteners, divisor=divisor, step=step, outputs=outputs,
                                       sample=sample)).result()

    def reduce_steps(self, tensor: torch.Tensor, slices: Sequence[ParamSlice], whiteners: Dict[int, Transform], *,
                     divisor: float, step: int = 0, outputs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                     sample: bool = False, wait_at_once: bool = False, fidelity_elements: Optional[int] = None):
        """:meth:`reduce` as a generator that yields whenever an exchange is under way (after
        posting it, before waiting for it) the number of exchanges still to come after it (the
        relay: 1, then 0), and returns the stats: a caller runs other work there (two-level: the
        next piece's node stage and encode). ``wait_at_once``: every exchange waited for as it
        is posted (the same work in the same order, nothing under way). ``fidelity_elements``:
        the sampled check's elements per owner for this call (a piece of a bucket: its share)."""
        self._wait_at_once = wait_at_once
        agreed = self.plans_agreed
        plan = self.plan_for(slices, {key: t.version for key, t in whiteners.items()})  # the plan names the fits
        # On an accelerator the seconds mean something only with the device synchronized: on
        # sampled steps (a wait per section), not on ordinary ones (then left out of telemetry).
        self._timing = (tensor.device, sample)
        stats = StepStats(sampled=sample, timed=sample or tensor.device.type == "cpu")
        exact = (exact_sample_reduction(self.comm, tensor, plan, divisor, stats,
                                        fidelity_elements or self.fidelity_elements)
                 if sample else None)
        stats.recv_max, stats.recv_max_internode = plan.recv_max, plan.recv_max_internode
        if self.plans_agreed != agreed:  # the plan was new: every rank showed the others its fingerprint
            world, L = self.comm.world_size, self.ranks_per_node
            stats.recv_max += FINGERPRINT_BYTES * (world - 1)
            stats.recv_max_internode += FINGERPRINT_BYTES * (world - min(L, world))
        if plan.relay:
            stats.relay_buckets = 1
            totals = yield from relay_totals(self, tensor, plan, whiteners, stats, sample, step)
        else:
            head = self.checks.control_header(plan, step, tensor.device)  # sent and expected alike
            me = self.comm.rank
            outbox = self.outbox({dst: [(i, self.encoder.codec_of(plan.sections[i]).nbytes(plan.sections[i].numel))
                                        for i in plan.to_rank[dst]]
                                  for dst in range(self.comm.world_size) if dst != me and plan.to_rank[dst]},
                                 plan.message_sizes, head, stats)
            with full_fp32_matmuls():
                packed = self.pack(tensor, plan, whiteners, stats, sample, step, outbox=outbox)
            my_size = plan.message_sizes[me]
            pending = self.post_start(outbox, [0 if src == me else my_size for src in range(self.comm.world_size)],
                                      stats)
            yield 0
            recv = self.wait(pending, stats)
            totals = self._sum_at_owner(plan, packed, recv, head, stats)
        t0 = self.now()
        results = []  # the inverse may hand back a new tensor: keep what was scattered
        with full_fp32_matmuls():
            for sec, total, mine in totals:
                total = transform_pieces(total, sec.pieces, whiteners, inverse=True, tile=self.tile_elements)
                if mine is not None:
                    total.add_(mine)
                total.div_(divisor)
                scatter_section(tensor, total, sec, plan, outputs)
                results.append(total)
        stats.transform_s += self.now() - t0
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

    def now(self) -> float:
        return clock(*self._timing)

    def pack(self, tensor, plan: BucketPlan, whiteners, stats: StepStats, sample: bool, step: int = 0,
             only_shared: bool = False, outbox: Optional["Outbox"] = None):
        """Every section this rank contributes to, transformed and (where it leaves this rank)
        encoded once; a list in plan order, or (``only_shared``, the relay route) a dict of the
        shared sections by index. With ``outbox`` each section's bytes go into it as they are
        made (key: the section's index) and are not kept in the result."""
        me, enc = self.comm.rank, self.encoder
        packed = [] if not only_shared else {}
        def deliver(item, numel, codec, wire):
            index, sec = item
            outbox.put_parts(index, wire)
            enc.count_sent(sec, sum(t.numel() for t in wire), numel, 1, stats)

        spans = SpanBatches(tensor, self.tile_elements, deliver)  # plain spans sent, a call a batch
        for index, sec in enumerate(plan.sections):
            if only_shared and not sec.shared:
                continue
            t0 = self.now()
            own_section = sec.dests == (me,) and not sec.shared
            # My own section is exact and never on the wire; it stays in gradient coordinates and
            # joins the sum after the inverse (S^-1 (sum of the others) + mine: the same by
            # linearity, with no transform of 1/W of the gradient and no round trip of mine).
            # It is staged whole (the sum starts from it), as is a section with error feedback
            # (its residual is whole); any other is made tile by tile as the codec reads it.
            feedback = not own_section and not sec.high and self.error_feedback
            start = self._batched_span(tensor, sec, whiteners, outbox) \
                if not (own_section or feedback or sample) else None
            if start is not None:
                # a span of the bucket as it lies, sent to one rank: with the others of its codec,
                # one encode for all (Codec.encode_spans; a call each cost the host ~100 us), its
                # stochastic rounding key drawn here, where its own encode would have drawn it
                codec = enc.codec_of(sec)
                # (a high section's encode takes its codec's own generator, as SectionEncoder.encode's)
                key = codec.next_key(None if sec.high else enc.generator_for(sec, step))
                spans.add(codec, start, sec.numel, key, (index, sec))
                stats.elements += sec.numel
                stats.codec_s += self.now() - t0
                packed.append(Packed())
                continue
            if own_section or feedback:
                values = gather_pieces(tensor, sec.pieces, sec.numel, None if own_section else whiteners,
                                       self.tile_elements)
            else:
                values = SectionSource(tensor, sec.pieces, whiteners, self.tile_elements)
            stats.transform_s += self.now() - t0
            stats.elements += sec.numel
            if own_section:
                if sample:  # it skips the codec; count its non-finite inputs here
                    stats.nonfinite += int((~torch.isfinite(values)).sum())
                packed.append(Packed(own=values))  # never shared: not reached with only_shared
                continue
            t0 = self.now()
            if feedback and not sample and me not in sec.dests:
                # last residual added, encoded, the new residual kept: one pass where compiled
                wire = self.feedback.send(plan, sec, values, enc.codec_of(sec), whiteners,
                                          generator=enc.generator_for(sec, step), tile_elements=enc.tile_elements)
                own = None
            else:  # (sampled steps measure the quantization on the way; a section I own decodes)
                if feedback:
                    values = self.feedback.add(plan, sec, values, whiteners)
                wire, own = enc.encode(sec, values, stats, sample, enc.generator_for(sec, step),
                                       decode=me in sec.dests)
                if feedback and own is not None:
                    self.feedback.keep(plan, sec, values.sub_(own), whiteners)
                elif feedback:  # values minus the payload's decode, in one pass where compiled
                    self.feedback.keep_sent(plan, sec, values, enc.codec_of(sec), wire, whiteners)
            enc.count_sent(sec, wire.numel(), sec.numel, sum(1 for d in sec.dests if d != me), stats)
            if outbox is not None:
                outbox.put(index, wire)
                wire = None
            stats.codec_s += self.now() - t0
            if only_shared:
                packed[index] = Packed(own=own, wire=wire)
            else:
                packed.append(Packed(own=own, wire=wire))
        t0 = self.now()
        spans.finish()
        stats.codec_s += self.now() - t0
        return packed

    def _batched_span(self, tensor: torch.Tensor, sec: Section, whiteners, outbox) -> Optional[int]:
        """Where section ``sec`` starts in the bucket if it is a plain span of it that the batched
        encode serves: its pieces in gradient coordinates and one after another in ``tensor``
        (1-D, contiguous), sent to one rank that is not this one, through ``outbox``, at most
        ``spans_batch_limit`` long (a tile; 2^16 elements on a CPU), in a codec that encodes spans (compiled block scales); else None (the section
        is encoded on its own)."""
        if (outbox is None or sec.shared or self.comm.rank in sec.dests
                or not 0 < sec.numel <= spans_batch_limit(tensor.device, self.tile_elements) or tensor.dim() != 1 or not tensor.is_contiguous()
                or not self.encoder.codec_of(sec).encodes_spans(tensor.device)):
            return None
        at = sec.pieces[0].bucket_offset
        for p in sec.pieces:
            if (p.rows and whiteners is not None) or p.bucket_offset != at:
                return None
            at += p.numel
        return sec.pieces[0].bucket_offset

    def outbox(self, layout: Dict[int, List[Tuple[object, int]]], expected: Sequence[int], head: torch.Tensor,
               stats: StepStats) -> "Outbox":
        """The send buffer of one all-to-all, laid out before anything is encoded (see
        :class:`Outbox`); each message's size checked against the plan's and counted."""
        sizes = [0] * self.comm.world_size
        for dst, parts in layout.items():
            n = CONTROL_HEADER_BYTES + sum(nbytes for _, nbytes in parts)
            if n != expected[dst]:
                raise RuntimeError(f"deepspeed_gift: message to rank {dst} has {n} bytes, "
                                   f"plan expects {expected[dst]}; codec byte count is inconsistent")
            stats.bytes_header += CONTROL_HEADER_BYTES
            if dst // self.ranks_per_node != self.comm.rank // self.ranks_per_node:
                stats.bytes_internode += n
            sizes[dst] = n
        return Outbox(layout, sizes, head)

    def post_start(self, outbox: "Outbox", recv_sizes: Sequence[int], stats: StepStats) -> Pending:
        """The all-to-all of a filled :class:`Outbox`, begun (finished at once under
        ``wait_at_once``)."""
        outbox.check_filled()
        t0 = self.now()
        pending = self.comm.all_to_all_bytes_start(outbox.buffer, outbox.sizes, recv_sizes, kind=ByteKind.PAYLOAD)
        if self._wait_at_once:
            pending = pending.finished()
        stats.comm_s += self.now() - t0
        return pending

    def wait(self, pending: Pending, stats: StepStats) -> torch.Tensor:
        """What a begun all-to-all received."""
        t0 = self.now()
        recv = pending.wait()
        stats.comm_s += self.now() - t0
        return recv

    def send_start(self, parts_by_dst: Dict[int, List[torch.Tensor]], expected: Sequence[int],
                   recv_sizes: Sequence[int], head: torch.Tensor, stats: StepStats) -> Pending:
        """One all-to-all of payload already encoded, begun: to every rank in ``parts_by_dst``
        the control header and its parts (an :class:`Outbox` filled at once; a part is a tensor,
        or the list of the uint8 pieces that make it, joined into its place)."""
        def size(part) -> int:  # a tensor, or the uint8 pieces that make it (Codec.encode_spans)
            return part.numel() if isinstance(part, torch.Tensor) else sum(t.numel() for t in part)

        box = self.outbox({dst: [((dst, i), size(p)) for i, p in enumerate(parts)]
                           for dst, parts in parts_by_dst.items()}, expected, head, stats)
        for dst, parts in parts_by_dst.items():
            for i, part in enumerate(parts):
                box.put_parts((dst, i), [part] if isinstance(part, torch.Tensor) else part)
        return self.post_start(box, recv_sizes, stats)

    def split_messages(self, recv: torch.Tensor, size: int, head: torch.Tensor, meaning: str) -> torch.Tensor:
        """The messages of every other rank, ``size`` bytes each in rank order: a (world - 1,
        size) view of ``recv``, a row per sender, their headers expected by one comparison."""
        world = self.comm.world_size
        messages = recv.view(world - 1, size) if size else recv.new_empty((world - 1, 0))
        if size and world > 1:
            expect_control_header(self.checks, messages, head, self._others, meaning)
        return messages

    def sum_sources(self, codec, messages: torch.Tensor, at: int, numel: int, *,
                    start: Optional[torch.Tensor] = None, own: Optional[torch.Tensor] = None,
                    out: Optional[torch.Tensor] = None) -> torch.Tensor:
        """The fp32 sum of the payloads of ``numel`` elements at byte ``at`` of every other rank's
        message (``messages``: see :meth:`split_messages`), in rank order: from ``start`` (added
        to in place) if given, with ``own`` (my contribution) at my place in the order if given;
        into ``out`` (fp32, ``numel``) if given, where ``start`` is not.

        All the payloads are one batch (every sender's message has the same layout): their
        headers are checked by one comparison and they are decoded a tile at a time in one pass
        per tile, the same operations whatever the number of senders; then each tile is summed
        row by row in rank order, the order that makes the sum the same on every rank and
        equal to native's at two ranks (no stock reduction kernel keeps an order, so the adds
        stay one per sender). Bits equal decoding each sender alone and adding, except the
        payload bits of a nan."""
        me, world = self.comm.rank, self.comm.world_size
        if start is not None and out is not None:
            raise ValueError("sum_sources: a sum from start is made in start, not in out; give one of them")
        if start is None and own is not None and me == 0:  # I come first: the sum starts from mine
            start, own = (own, None) if out is None else (out.copy_(own), None)
        if world == 1:  # nobody else contributed (my own, if given, is the start: I am rank 0)
            if start is not None:
                return start
            return out.zero_() if out is not None else torch.zeros(numel, dtype=torch.float32, device=messages.device)
        bufs = messages[:, at:at + codec.nbytes(numel)]
        expect_codec_header(self.checks, codec, bufs, numel, self._others)
        payload = codec.bytes_to_payload(bufs, (numel,), check_header=False)
        total = start if start is not None else (
            out if out is not None else torch.empty(numel, dtype=torch.float32, device=messages.device))
        # the senders are the others in rank order, mine at my place (me others come before it)
        return codec.decode_sum(payload, total, own=own, own_at=me, from_out=start is not None,
                                tile_elements=self.tile_elements)

    def _sum_at_owner(self, plan: BucketPlan, packed: List[Packed], recv: torch.Tensor, head: torch.Tensor,
                      stats: StepStats) -> Totals:
        """Decode every source and sum in fp32 - my own section starting from my exact
        contribution (or, where it has transformed pieces, the others' sum, with mine returned
        to be added after the inverse), a shared one in rank order from everyone's decoded
        contribution (see :meth:`sum_sources`)."""
        me = self.comm.rank
        if not plan.to_rank[me]:
            return []
        t0 = self.now()
        messages = self.split_messages(recv, plan.message_sizes[me], head, DISAGREE)
        at = CONTROL_HEADER_BYTES
        totals = []
        for i in plan.to_rank[me]:
            sec = plan.sections[i]
            codec = self.encoder.codec_of(sec)
            own = packed[i].own
            after = not sec.shared and any(p.rows for p in sec.pieces)
            if sec.shared:  # mine decoded for this sum, in its place: every copy sums alike
                total = self.sum_sources(codec, messages, at, sec.numel, own=own)
            else:  # my staging is the sum's start, or is added after the inverse
                total = self.sum_sources(codec, messages, at, sec.numel, start=None if after else own)
            at += codec.nbytes(sec.numel)
            totals.append((sec, total, own if after else None))
        stats.codec_s += self.now() - t0
        return totals

    # ---- state ------------------------------------------------------------------------
    def state_dict(self, **residuals) -> dict:
        """Error-feedback residuals (``residuals``: how, see ``ErrorFeedback.state_dict``) and the
        stochastic rounding generator."""
        gen = self.encoder.generator.get_state() if self.encoder.generator is not None else None
        return dict(self.feedback.state_dict(**residuals), generator=gen)

    def load_state_dict(self, state: dict, device, **residuals) -> None:
        self.feedback.load_state_dict(state, device, **residuals)
        if state["generator"] is not None and self.encoder.generator is not None:
            self.encoder.generator.set_state(state["generator"])

    def residual_nbytes(self) -> int:
        """Memory held by error feedback (int8 residuals of every payload this rank sends and relays)."""
        return self.feedback.nbytes()

    def drop_residuals(self) -> None:
        """Error feedback's residuals dropped: the step that made them was skipped."""
        self.feedback.drop_all()


class Begun:
    """A generator of ``GiftReducer.reduce_steps`` advanced to its first exchange under way (or
    to its end, when it has none), then on by :meth:`post_last` and :meth:`result`."""

    def __init__(self, steps) -> None:
        self._steps, self._value, self._to_come = steps, None, 0
        self._advance()

    def _advance(self) -> None:
        try:
            self._to_come = next(self._steps)
        except StopIteration as done:
            self._steps, self._value = None, done.value

    def post_last(self) -> None:
        """On to its last exchange under way (the relay's sums encoded and sent)."""
        while self._steps is not None and self._to_come:
            self._advance()

    def result(self):
        while self._steps is not None:
            self._advance()
        return self._value


class Outbox:
    """The send buffer of one all-to-all, laid out from the codecs' exact byte counts before
    anything is encoded: per destination (in rank order) the control header, then its parts in
    the plan's order. Each part is copied into every message it belongs to as soon as it is
    encoded (:meth:`put`) and the caller drops it, so a bucket's encoded bytes exist once, not
    once as parts and again as the joined buffer (~1 B an element of the bucket less at the
    exchange's peak)."""

    def __init__(self, layout: Dict[int, List[Tuple[object, int]]], sizes: Sequence[int], head: torch.Tensor) -> None:
        self.sizes = list(sizes)
        self.buffer = torch.empty(sum(self.sizes), dtype=torch.uint8, device=head.device)
        self.slots: Dict[object, List[Tuple[int, int]]] = {}  # part -> (offset, bytes) of each copy
        pos = 0
        for dst in sorted(layout):
            pos = sum(self.sizes[:dst])
            self.buffer.narrow(0, pos, head.numel()).copy_(head)
            pos += head.numel()
            for key, nbytes in layout[dst]:
                self.slots.setdefault(key, []).append((pos, nbytes))
                pos += nbytes
        self._missing = set(self.slots)

    def put(self, key, wire: torch.Tensor) -> None:
        self.put_parts(key, [wire])

    def put_parts(self, key, parts: Sequence[torch.Tensor]) -> None:
        """Part ``key``'s wire bytes, given as uint8 pieces in order (a header, scales, data:
        ``Codec.encode_spans``), joined straight into each of its places (one ``cat`` a place)."""
        size = sum(t.numel() for t in parts)
        for offset, nbytes in self.slots.get(key, ()):  # none: a part no other rank receives
            if size != nbytes:
                raise RuntimeError(f"deepspeed_gift: part {key!r} encoded to {size} bytes, the plan laid "
                                   f"out {nbytes}; codec byte count is inconsistent")
            place = self.buffer.narrow(0, offset, nbytes)
            if len(parts) == 1:
                place.copy_(parts[0])
            else:
                torch.cat(list(parts), out=place)
        self._missing.discard(key)

    def rows(self, keys: Sequence[object]) -> torch.Tensor:
        """The send buffer's places of the parts ``keys`` (one copy each, one size, at one stride:
        a run of relays' chunks) as the rows of a 2-D view, written in place by the caller (see
        ``Codec.payload_to_rows``); they count as put."""
        places = [self.slots[key] for key in keys]
        first, nbytes = places[0][0]
        stride = places[1][0][0] - first if len(places) > 1 else nbytes
        if any(len(p) != 1 or p[0] != (first + t * stride, nbytes) for t, p in enumerate(places)):
            raise RuntimeError(f"deepspeed_gift: parts {list(keys)[:5]} do not lie at one stride in the send buffer")
        self._missing.difference_update(keys)
        return self.buffer.as_strided((len(places), nbytes), (stride, 1), self.buffer.storage_offset() + first)

    def check_filled(self) -> None:
        if self._missing:
            raise RuntimeError(f"deepspeed_gift: parts {sorted(map(repr, self._missing))[:5]} of the send buffer "
                               "were never encoded")
