"""The relay route: two balanced all-to-alls instead of one that funnels into a bucket's
few owners (``gift.route``; planned by :func:`plan.plan_route`)."""

from __future__ import annotations

from typing import Dict, Generator, List, Optional, Tuple

import torch

from ..core.geometry import full_fp32_matmuls
from .encode import Packed, SpanBatches
from .headers import CONTROL_HEADER_BYTES, DISAGREE, expect_codec_header, expect_control_header
from ..core.formats import spans_batch_limit
from .plan import BucketPlan, Section, SectionSource, gather_pieces
from .stats import StepStats


def relay_totals(r, tensor: torch.Tensor, plan: BucketPlan, transforms, stats: StepStats, sample: bool,
                 step: int) -> Generator[None, None, List[Tuple[Section, torch.Tensor, Optional[torch.Tensor]]]]:
    """Two balanced all-to-alls instead of one that funnels into a bucket's few owners (a
    generator: it yields with each all-to-all under way, see ``GiftReducer.reduce_steps``):

    1. every rank cuts each owned section (transformed, error feedback added) into ``world``
       chunks and sends chunk j, encoded, to rank j (its own chunk stays exact); shared
       sections travel as in the direct route;
    2. rank j sums chunk j of every section in fp32 (its own exactly, the others decoded),
       encodes the sum once and sends it to the section's owner, which decodes the chunks
       (its own chunk exact) into the section's sum.

    The busiest link then carries about twice its share of one quantized copy, whatever the
    bucket's owners; the sum is quantized a second time on the way to its owner, in the relay's
    own codec (``gift.relay_format``: by default int8, whose error on a sum of many ranks is a
    fraction of fp8's or nvfp4's at the same or more bytes, so that the second quantization does not
    undo what averaging the first over the ranks gained). Chunks are made
    and encoded tile by tile (whole with error feedback, whose residual is whole), and decoded
    into the sums tile by tile."""
    me, world, device = r.comm.rank, r.comm.world_size, tensor.device
    head = r.checks.control_header(plan, step, device)
    # 1. chunks to the relays, each copied into the send buffer as it is encoded
    layout: Dict[int, List[Tuple[object, int]]] = {}
    for j in range(world):
        if j == me or not plan.relay_sizes[j]:
            continue
        codec_of = r.encoder.codec_of
        layout[j] = [((i, j), codec_of(sec).nbytes(plan.chunks[i][j][1])) if not sec.shared
                     else (i, codec_of(sec).nbytes(sec.numel)) for i, sec in enumerate(plan.sections)
                     if (not sec.shared and plan.chunks[i][j][1]) or (sec.shared and j in sec.dests)]
    outbox = r.outbox(layout, plan.relay_sizes, head, stats)
    own_chunks: Dict[int, torch.Tensor] = {}
    packed: Dict[int, Packed] = {}
    with full_fp32_matmuls():
        for i, sec in enumerate(plan.sections):
            if not sec.shared:
                own_chunks[i] = send_chunks(r, tensor, plan, i, transforms, outbox, stats, sample)
        shared = r.pack(tensor, plan, transforms, stats, sample, step, only_shared=True, outbox=outbox)
        packed.update(shared)
    pending = r.post_start(outbox, [0 if src == me else plan.relay_sizes[me] for src in range(world)], stats)
    yield 1  # the chunks under way, the sums' exchange to come (see GiftReducer.reduce_steps)
    recv = r.wait(pending, stats)
    del pending
    # 2. relay: sum my chunk of every owned section, and the shared sections I copy
    t0 = r.now()
    incoming = r.split_messages(recv, plan.relay_sizes[me], head, DISAGREE)
    sums: Dict[int, torch.Tensor] = {}
    shared_totals: Dict[int, torch.Tensor] = {}
    # my chunks' sums one after another in one buffer: the ones sent on are spans of it, encoded
    # together where the codec can (Codec.encode_spans)
    places, filled = {}, 0
    for i, sec in enumerate(plan.sections):
        if not sec.shared and plan.chunks[i][me][1]:
            places[i] = filled
            filled += plan.chunks[i][me][1]
    flat = torch.empty(filled, dtype=torch.float32, device=device)
    at = CONTROL_HEADER_BYTES
    for i, sec in enumerate(plan.sections):  # every sender's payloads decoded as one batch, summed in rank order
        codec = r.encoder.codec_of(sec)
        if not sec.shared:
            n = plan.chunks[i][me][1]
            if not n:
                continue
            sums[i] = r.sum_sources(codec, incoming, at, n, own=own_chunks[i], out=flat.narrow(0, places[i], n))
            at += codec.nbytes(n)
        elif me in sec.dests:  # every contribution decoded, mine too: copies agree bit for bit
            shared_totals[i] = r.sum_sources(codec, incoming, at, sec.numel, own=packed[i].own)
            at += codec.nbytes(sec.numel)
    stats.codec_s += r.now() - t0
    # the chunks received are summed: let them go before the forwards arrive (b N (W-1)/W bytes
    # that would otherwise sit beside the owner's totals)
    del recv, incoming, own_chunks  # (my chunks are in their sums now)
    # the sums on to the owners, encoded once
    t0 = r.now()
    forward: Dict[int, list] = {}

    def deliver(item, numel, codec, wire):
        i, d, slot = item
        forward[d][slot] = wire
        r.encoder.count_sent(plan.sections[i], sum(t.numel() for t in wire), numel, 1, stats, codec=codec)

    spans = SpanBatches(flat, r.tile_elements, deliver)  # sums that are spans of ``flat``: a call a batch
    for i, sec in enumerate(plan.sections):
        d = sec.dests[0]
        if sec.shared or i not in sums or d == me:
            continue
        feedback = r.error_feedback and not sec.high
        value = sums[i]
        codec = r.encoder.forward_codec_of(sec)
        if not (feedback or sample) and codec.encodes_spans(device) and (
                value.numel() <= spans_batch_limit(device, r.tile_elements)):
            # a span of the sums' buffer: encoded with the others of its codec in one call, its
            # stochastic rounding key drawn here, where its own encode would have drawn it (a
            # high section's from its codec's own generator, as SectionEncoder.encode's)
            forward.setdefault(d, []).append(None)
            spans.add(codec, places[i], value.numel(), codec.next_key(None if sec.high else r.encoder.generator),
                      (i, d, len(forward[d]) - 1))
            continue
        if feedback and not sample:  # the relay's own residual added, encoded and kept: one pass where compiled
            wire = r.feedback.send_relayed(plan, i, value, codec, generator=r.encoder.generator,
                                           tile_elements=r.encoder.tile_elements)
        else:
            if feedback:  # the relay's own residual: the second quantization is fed back too
                value = r.feedback.add_relayed(plan, i, value)
            wire, _ = r.encoder.encode(sec, value, stats, sample, r.encoder.generator, decode=False, codec=codec)
            if feedback:  # the sum minus the payload's decode, in one pass where compiled
                r.feedback.keep_relayed_sent(plan, i, value, codec, wire)
        r.encoder.count_sent(sec, wire.numel(), sums[i].numel(), 1, stats, codec=codec)
        forward.setdefault(d, []).append(wire)
    spans.finish()
    stats.codec_s += r.now() - t0
    pending = r.send_start(forward, plan.forward_sizes[me], [plan.forward_sizes[j][me] for j in range(world)],
                           head, stats)
    del forward  # copied into the send buffer
    yield 0  # the sums under way, the last
    recv = r.wait(pending, stats)
    t0 = r.now()
    totals = owner_totals(r, plan, recv, head, sums, shared_totals, device)
    stats.codec_s += r.now() - t0
    return totals


def send_chunks(r, tensor: torch.Tensor, plan: BucketPlan, i: int, transforms, outbox, stats: StepStats,
                sample: bool) -> torch.Tensor:
    """Every relay's chunk of owned section ``i`` but mine, encoded into ``outbox`` (a run of
    relays at a time: see :func:`chunk_runs`), error feedback kept; returns my chunk, exact."""
    me, world, sec = r.comm.rank, r.comm.world_size, plan.sections[i]
    own = None
    t0 = r.now()
    feedback = not sec.high and r.error_feedback
    values = gather_pieces(tensor, sec.pieces, sec.numel, transforms, r.tile_elements) if feedback else None
    stats.transform_s += r.now() - t0
    stats.elements += sec.numel
    t0 = r.now()
    if feedback:
        values = r.feedback.add(plan, sec, values, transforms)
    else:  # the chunks are windows of one source, read in order: each transformed tile made once
        source = SectionSource(tensor, sec.pieces, transforms, r.tile_elements)
    runs = chunk_runs(plan, i, me, outbox)
    for relays, n in runs + [([world], 0)]:  # in rank order, mine in its place: the source read in order
        if own is None and relays[0] > me:
            start, n_me = plan.chunks[i][me]
            part = values.narrow(0, start, n_me) if feedback else source.window(start, n_me)
            own = part.clone() if feedback else part.gather()
            if sample:  # it skips the codec; count its non-finite inputs here
                stats.nonfinite += int((~torch.isfinite(own)).sum())
            if feedback:
                part.zero_()  # exact: no residual
        if not n:
            continue
        codec = r.encoder.codec_of(sec)
        # A run is one payload (its bytes at most a section's, as the direct route's), whatever the
        # tile: the scales that span blocks (NVFP4's global, per-tensor) must not depend on it.
        for some in [relays] if codec.splits_into(n) else [[j] for j in relays]:
            start, m = plan.chunks[i][some[0]][0], n * len(some)
            part = values.narrow(0, start, m) if feedback else source.window(start, m)
            wire, _ = r.encoder.encode(sec, part, stats, sample, r.encoder.generator, decode=False)
            r.encoder.count_sent(sec, codec.nbytes(n), n, len(some), stats)
            payload = codec.bytes_to_payload(wire, (m,), check_header=False)
            if len(some) == 1:
                outbox.put((i, some[0]), wire)
            else:  # one encode for the run's chunks, cut into their places
                codec.payload_to_rows(payload, outbox.rows([(i, j) for j in some]))
            if feedback:  # the residual of these chunks, a tile of the decode at a time
                for e0, e1, decoded in codec.decode_tiles(payload, tile_elements=r.tile_elements):
                    part[e0:e1].sub_(decoded)
            del wire, payload
    if not sec.high and r.error_feedback:
        r.feedback.keep(plan, sec, values, transforms)
    stats.codec_s += r.now() - t0
    return own


def chunk_runs(plan: BucketPlan, i: int, me: int, outbox) -> List[Tuple[List[int], int]]:
    """The relays of section ``i``'s chunks but mine, in runs of consecutive ranks whose chunks
    have one size and lie at one stride in the send buffer: (the run's ranks, the chunk size).
    A run is encoded as one payload and cut into its chunks' payloads, so a sender encodes a
    few times a section, not once per relay; by ``chunk_bounds`` most relays fall in a few runs."""
    runs: List[Tuple[List[int], int]] = []
    places: List[int] = []
    for j, (_, n) in enumerate(plan.chunks[i]):
        if j == me or not n:
            continue
        at = outbox.slots[(i, j)][0][0]
        if runs and runs[-1][1] == n and runs[-1][0][-1] == j - 1 and (
                len(runs[-1][0]) == 1 or at - places[-1] == places[-1] - places[-2]):
            runs[-1][0].append(j)
        else:
            runs.append(([j], n))
        places.append(at)
    return runs


def owner_totals(r, plan: BucketPlan, recv: torch.Tensor, head: torch.Tensor, sums: Dict[int, torch.Tensor],
                 shared_totals: Dict[int, torch.Tensor], device) -> List[Tuple[Section, torch.Tensor, None]]:
    """The owner's sections whole: its own chunk's sum (``sums``) and every relay's chunk
    decoded from ``recv``, a run of relays (see :func:`relay_runs`) as one batch straight into
    its place; shared sections as summed by this rank (``shared_totals``)."""
    me = r.comm.rank
    owned = [i for i in plan.to_rank[me] if not plan.sections[i].shared]
    whole = {i: torch.empty(plan.sections[i].numel, dtype=torch.float32, device=device) for i in owned}
    for i in owned:
        start, n = plan.chunks[i][me]
        if n:
            whole[i].narrow(0, start, n).copy_(sums[i])
    pos = 0
    for relays, size in relay_runs(plan, me):
        k = len(relays)
        msgs = recv.narrow(0, pos, k * size).view(k, size)
        pos += k * size
        expect_control_header(r.checks, msgs, head, relays, DISAGREE)
        at = CONTROL_HEADER_BYTES
        for i in owned:  # the run's chunks of a section: consecutive, of one size, so one batch
            start, n = plan.chunks[i][relays[0]]
            if not n:
                continue
            codec = r.encoder.forward_codec_of(plan.sections[i])
            bufs = msgs[:, at:at + codec.nbytes(n)]
            at += codec.nbytes(n)
            expect_codec_header(r.checks, codec, bufs, n, relays)
            codec.decode_into(codec.bytes_to_payload(bufs, (n,), check_header=False),
                              whole[i].narrow(0, start, k * n).view(k, n), tile_elements=r.tile_elements)
    return [(plan.sections[i], shared_totals[i] if plan.sections[i].shared else whole[i], None)
            for i in plan.to_rank[me]]


def relay_runs(plan: BucketPlan, owner: int) -> List[Tuple[List[int], int]]:
    """The relays that send ``owner`` sums, in runs of consecutive ranks whose messages have the
    same layout (the same chunk size of every section): (the run's ranks, bytes of each
    message). Their messages lie one after the other in what the owner receives, at one
    stride, and their chunks one after the other in each section; by ``chunk_bounds`` most
    relays are in one of a few runs, whatever the world size."""
    runs: List[Tuple[List[int], int]] = []
    owned = [i for i in plan.to_rank[owner] if not plan.sections[i].shared]
    last = None
    for j in range(plan.world_size):
        size = plan.forward_sizes[j][owner]
        if not size:
            continue
        layout = (size, tuple(plan.chunks[i][j][1] for i in owned))
        if runs and last == (j - 1, layout):
            runs[-1][0].append(j)
        else:
            runs.append(([j], size))
        last = (j, layout)
    return runs
