"""The parameter half of a ZeRO-1/2 step, compressed (``gift.params``).

After the optimizer step each rank holds the new fp32 master of its own partition, and
DeepSpeed all-gathers the parameters in the replica's dtype (bf16: 2 B/element) so that every
rank can run the next forward. Here the owner sends the quantized *change of the replica*
instead: ``delta = target - replica``, where ``target`` is the master rounded to the replica's
dtype (what DeepSpeed would have sent) and ``replica`` is the value every rank already holds.
Every rank, the owner included, adds the same dequantized delta to the same replica and rounds
once to the replica's dtype, so the replicas stay bit-identical; the fp32 master is never
touched. The next delta is taken against the replica, so this step's quantization error is
carried into the next delta instead of piling up: the replica stays within one quantization
step of the delta of its target.

The gather moves at most DeepSpeed's ``allgather_bucket_size`` elements per all-gather, as
DeepSpeed's own ``all_gather_dp_groups`` does: each rank's partitions are cut into aligned pieces
(:func:`chunk_plan`), and one all-gather's pieces are encoded, gathered, decoded and applied before
the next is encoded, so what the gather holds beyond the replicas grows with that bucket, not with
the partition times the ranks (:func:`gather_peak_bytes`). The codec headers that arrive are
compared on the device; the results are read with the reduction's at the next step's one host read
(or at once on telemetry's sampled steps, which read the gap anyway), never on an ordinary step.

Pure of DeepSpeed: it works on lists of partition tensors and a :class:`~deepspeed_gift.exchange.comm.Comm`.
"""

from __future__ import annotations

import math
from typing import Dict, List, NamedTuple, Optional, Sequence, Tuple

import torch
from torch import Tensor

from ..core.formats import HEADER_BYTES, Codec
from .headers import HeaderChecks
from .stats import ByteKind, StepStats, clock

# The telemetry's replica-target gap is taken relative to the largest target of each run of
# this many elements: a scale local enough that a small parameter next to a large one is judged
# by its own size, coarse enough to cost nothing.
GAP_BLOCK = 128


# The gather's own element-wise work (a bf16 operand widened to fp32 for an fp32 sum, the gap's
# passes) runs over runs of this many elements: mixed-dtype in-place ops allocate a converted
# copy of their operand, which then stays a tile (4 MB), not a piece (up to the bucket / W).
APPLY_TILE = 1 << 20


def relative_gap(replica: Tensor, target: Tensor, block: int = GAP_BLOCK) -> float:
    """max over blocks of ``block`` elements of ``max|replica - target| / max|target|`` (0 for an
    all-zero block that the replica matches; nan when the target is not finite)."""
    return float(_gap_on_device(replica, target, block))


def _gap_on_device(replica: Tensor, target: Tensor, block: int = GAP_BLOCK) -> Tensor:
    """:func:`relative_gap` as a 0-dim fp32 tensor on the target's device (no host read)."""
    n = target.numel()
    if n == 0:
        return torch.zeros((), dtype=torch.float32, device=target.device)
    pad = -n % block
    diff = torch.nn.functional.pad((replica.float() - target.float()).abs().reshape(-1), (0, pad))
    scale = torch.nn.functional.pad(target.float().abs().reshape(-1), (0, pad))
    d, s = diff.view(-1, block).amax(1), scale.view(-1, block).amax(1)
    ratio = torch.where(d == 0, torch.zeros_like(d), d / s)  # 0/0 (an untouched zero block) is no gap
    return ratio.max()


def _tiles(n: int, tile: int = APPLY_TILE):
    """(start, length) of consecutive runs of at most ``tile`` elements covering ``n``."""
    return ((t, min(tile, n - t)) for t in range(0, n, tile))


def _difference(target: Tensor, base: Tensor) -> Tensor:
    """``target - base`` in fp32 (both in the replicas' dtype), widened tile by tile."""
    out = torch.empty(target.numel(), dtype=torch.float32, device=target.device)
    for t, k in _tiles(target.numel()):
        out.narrow(0, t, k).copy_(target.narrow(0, t, k)).sub_(base.narrow(0, t, k))
    return out


class Piece(NamedTuple):
    """Elements ``start:start + numel`` of every rank's partition of ZeRO group ``group``."""

    group: int
    start: int
    numel: int


def piece_alignment(codec: Codec) -> int:
    """Where a piece that does not end its partition must end: on a whole codec block (a piece
    then quantizes to the bits of the whole partition, block scales computed alone), on a whole
    byte of a packed 4-bit format, and on a whole :data:`GAP_BLOCK` (so the gap telemetry reads
    is the same number, taken piece by piece)."""
    return math.lcm(codec.block_size or 1, codec.elements_per_byte, GAP_BLOCK)


def chunk_elements(bucket_elements: Optional[int], world: int, align: int) -> Optional[int]:
    """Elements of its own partition each rank sends in one all-gather: DeepSpeed's
    ``allgather_bucket_size`` counts what one all-gather delivers (``world`` shards), as its
    ``all_gather_dp_groups`` does; at least one aligned piece. ``None``: no bound."""
    if bucket_elements is None:
        return None
    return max(bucket_elements // world // align * align, align)


def chunk_plan(sizes: Sequence[int], cap: Optional[int], align: int) -> List[List[Piece]]:
    """The all-gathers of one step: each a list of pieces holding at most ``cap`` elements of a
    rank's partitions (``sizes[g]``: partition elements of group g, the same on every rank, as
    DeepSpeed pads them), in group order. Small groups share an all-gather; a large one is cut
    at multiples of ``align``. ``cap=None``: one all-gather holding every partition whole."""
    if cap is None:
        return [[Piece(g, 0, n) for g, n in enumerate(sizes) if n > 0]]
    chunks: List[List[Piece]] = []
    current: List[Piece] = []
    room = cap
    for g, size in enumerate(sizes):
        start = 0
        while start < size:
            left = size - start
            take = left if left <= room else room // align * align
            if take == 0:  # too little room for an aligned piece: the next all-gather takes it
                chunks.append(current)
                current, room = [], cap
                continue
            current.append(Piece(g, start, take))
            start, room = start + take, room - take
    if current:
        chunks.append(current)
    return chunks


def gather_peak_bytes(codec: Codec, sizes: Sequence[int], world: int, *, bucket_elements: Optional[int],
                      replica_itemsize: int, ranks_per_node: int = 1, two_level: bool = False,
                      sampled: bool = False, codec_work_bytes: int = 0, comm_copies: int = 1) -> Dict[str, int]:
    """Peak bytes one rank's compressed gather allocates beyond DeepSpeed's own step, by part,
    from the real plan: ``sizes[g]`` the partition elements of ZeRO group g (the same on every
    rank), ``bucket_elements`` DeepSpeed's ``allgather_bucket_size``, ``replica_itemsize`` the
    replicas' bytes per element.

    - ``before``: the owner's replicas before the step, the base of the deltas (grows with N/W);
    - ``exchange``: one all-gather's buffers when they are largest: flat, the blob, the comm's
      copy of it and the world's blobs ((world + 2) x blob); two-level, the blob, the slot
      stage's gathered blobs, their concatenation, the node comm's copy of it and the world's
      blobs ((world + 1 + 3 x nodes) x blob). ``comm_copies``: the world's blobs a collective
      holds at once, 1 where it gathers into its output (NCCL's all_gather_into_tensor), 2 for
      gloo (it gathers into a buffer of its own, then copies);
    - ``fp32``: the fp32 delta of the largest piece while it is encoded, or its fp32 decode while
      it is applied (the world's blobs still held), with a tile's widened operand beside it
      (and on telemetry's ``sampled`` steps the gap's passes over a tile);
    - ``total``: ``before`` plus the largest moment of a chunk.

    ``codec_work_bytes``: what the codec allocates besides its input and its output while it
    encodes or decodes the largest piece (the codecs' own model: their tiles). A comm whose device
    is not the tensors' (gloo beside CUDA) holds the gathered bytes twice, once on each device:
    counted once here, on the tensors' device."""
    align = piece_alignment(codec)
    nodes = world // ranks_per_node
    exchange = fp32 = peak = 0
    for pieces in chunk_plan(sizes, chunk_elements(bucket_elements, world, align), align):
        blob = sum(codec.nbytes(p.numel) for p in pieces)
        n = max(p.numel for p in pieces)
        tile = min(n, APPLY_TILE)
        # a widened bf16 tile beside the sum; on sampled steps the gap's: the replica's tile in its
        # dtype, both sides widened, their difference and the two padded magnitudes
        widened = (4 if replica_itemsize < 4 else 0) * tile
        tile_work = widened + (replica_itemsize + 16) * tile * sampled
        held = (comm_copies * world + (1 + 3 * nodes if two_level else 2)) * blob
        encoding = 2 * blob + 4 * n + max(widened, codec_work_bytes)  # pieces' blobs, their concatenation
        # the world's blobs, this rank's and the comm's copy of it (released with the collective)
        decoding = (world + 2) * blob + 4 * n + max(tile_work, codec_work_bytes)
        exchange, fp32 = max(exchange, held), max(fp32, 4 * n)
        peak = max(peak, held, encoding, decoding)
    before = sum(sizes) * replica_itemsize
    return {"before": before, "exchange": exchange, "fp32": fp32, "total": before + peak}


class ReplicaGather:
    """Sends each rank's quantized replica deltas to every rank and applies them.

    Flat: one all-gather over ``comm`` per chunk. Two-level (``node_comm`` and ``slot_comm`` given,
    ranks numbered node by node with ``ranks_per_node`` each): the deltas cross the network once
    per node, among the ranks of the same local slot, and are then shared inside each node, still
    quantized; every rank decodes every partition itself.

    ``bucket_elements``: DeepSpeed's ``allgather_bucket_size``, the elements one all-gather may
    deliver (``None``: every partition in one all-gather).
    """

    def __init__(self, comm, codec: Codec, *, node_comm=None, slot_comm=None, ranks_per_node: int = 1,
                 bucket_elements: Optional[int] = None) -> None:
        if (node_comm is None) != (slot_comm is None):
            raise ValueError("ReplicaGather: give both node_comm and slot_comm, or neither")
        if bucket_elements is not None and bucket_elements <= 0:
            raise ValueError(f"ReplicaGather: bucket_elements must be positive or None, got {bucket_elements}")
        self.comm = comm
        self.codec = codec
        self.node_comm, self.slot_comm = node_comm, slot_comm
        self.ranks_per_node = ranks_per_node if node_comm is None else node_comm.world_size
        self.align = piece_alignment(codec)
        self.cap = chunk_elements(bucket_elements, comm.world_size, self.align)
        self._plans: Dict[Tuple[int, ...], List[List[Piece]]] = {}
        self._wanted: Dict[Tuple[int, str], Tensor] = {}  # (numel, device) -> every rank's expected header
        self._unchecked: list = []  # (received headers, expected, explain): compared on the device, not yet read

    @property
    def two_level(self) -> bool:
        return self.node_comm is not None

    def plan(self, sizes: Sequence[int]) -> List[List[Piece]]:
        key = tuple(sizes)
        got = self._plans.get(key)
        if got is None:
            got = self._plans[key] = chunk_plan(sizes, self.cap, self.align)
        return got

    def exchange(self, blob: Tensor) -> List[Tensor]:
        """Every rank's ``blob`` (all of one length), in rank order."""
        if not self.two_level:
            return self.comm.all_gather_bytes(blob, kind=ByteKind.PARAMS, same_size=True)
        size = blob.numel()
        by_node = self.slot_comm.all_gather_bytes(blob, kind=ByteKind.PARAMS, same_size=True)  # [n]: rank n*G + l
        by_slot = self.node_comm.all_gather_bytes(torch.cat(by_node), kind=ByteKind.PARAMS_NODE, same_size=True)
        nodes, per_node = len(by_node), len(by_slot)
        return [by_slot[l][n * size:(n + 1) * size] for n in range(nodes) for l in range(per_node)]

    def sent_bytes(self, blob_nbytes: int) -> Tuple[int, int]:
        """What one rank sends for a blob of ``blob_nbytes``: in all, and to ranks of other nodes."""
        world, per_node = self.comm.world_size, self.ranks_per_node
        nodes = world // per_node
        if self.two_level:
            return blob_nbytes * (nodes - 1) + nodes * blob_nbytes * (per_node - 1), blob_nbytes * (nodes - 1)
        return blob_nbytes * (world - 1), blob_nbytes * (world - per_node)

    def gather(self, replicas: Sequence[Sequence[Tensor]], me: int, before: Sequence[Tensor],
               measure_gap: bool = True) -> StepStats:
        """``replicas[g][r]``: partition r of group g. On entry every rank holds the same replica in
        every partition, except its own ``replicas[g][me]``, which holds the target (the new master
        in the replica's dtype); ``before[g]`` is what that partition held before the step. On
        return ``replicas[g][r] = dtype(replica + decode(encode(target - replica)))`` for every r,
        bit-identical on every rank. Returns this rank's counters; ``params_gap_rel`` (the owner's
        :func:`relative_gap`, one more pass over its partition) only with ``measure_gap``, and
        then the headers received are checked at once; otherwise they wait for
        :meth:`hand_over_checks`."""
        device, sync = replicas[0][me].device, measure_gap  # seconds that time the work: see StepStats.timed
        codec_s = comm_s = 0.0
        sent = internode = 0
        gaps: List[Tensor] = []
        for pieces in self.plan([parts[me].numel() for parts in replicas]):
            t0 = clock(device, sync)
            blob = self._encode(replicas, me, before, pieces)
            t1 = clock(device, sync)
            everyone = self.exchange(blob)
            t2 = clock(device, sync)
            self._expect_headers(everyone, pieces)
            gaps += self._apply(replicas, me, before, pieces, everyone, measure_gap)
            codec_s += (t1 - t0) + (clock(device, sync) - t2)
            comm_s += t2 - t1
            chunk_sent, chunk_internode = self.sent_bytes(blob.numel())
            sent, internode = sent + chunk_sent, internode + chunk_internode
            del blob, everyone  # this chunk's buffers go before the next chunk's are made
        gap = None
        if measure_gap:  # a sampled step reads values back anyway: its headers are read with them
            self.verify_checks()
            gap = float(torch.stack(gaps).amax()) if gaps else 0.0  # nan, if any, wins: it is no gap to hide
        numel = sum(parts[me].numel() for parts in replicas)
        return StepStats(params_elements=numel * (self.comm.world_size - 1), params_bytes=sent,
                         params_bytes_internode=internode, params_codec_s=codec_s, params_comm_s=comm_s,
                         params_gap_rel=gap, timed=sync or device.type == "cpu")

    def _encode(self, replicas, me: int, before: Sequence[Tensor], pieces: Sequence[Piece]) -> Tensor:
        """This rank's blob of one all-gather: each piece's delta, encoded alone, in order."""
        blobs = []
        for g, start, n in pieces:
            # a new fp32 delta, even where the replicas are fp32: the target is measured against later
            delta = _difference(replicas[g][me].narrow(0, start, n), before[g].narrow(0, start, n))
            blobs.append(self.codec.encode_to_bytes(delta))
            del delta
        return torch.cat(blobs) if len(blobs) > 1 else blobs[0]

    def _apply(self, replicas, me: int, before: Sequence[Tensor], pieces: Sequence[Piece], everyone: Sequence[Tensor],
               measure_gap: bool) -> List[Tensor]:
        """Decode every rank's pieces of one all-gather into its replicas; the owner's gaps (on the
        device) when ``measure_gap``."""
        gaps = []
        for r, buf in enumerate(everyone):
            offset = 0
            for g, start, n in pieces:
                size = self.codec.nbytes(n)
                new = self.codec.decode_from_bytes(buf.narrow(0, offset, size), (n,), check_header=False)
                offset += size
                part = replicas[g][r].narrow(0, start, n)
                base = before[g].narrow(0, start, n) if r == me else part
                for t, k in _tiles(n):  # tiles start on whole GAP_BLOCKs: the gap is the whole piece's
                    now = new.narrow(0, t, k).add_(base.narrow(0, t, k))  # fp32 sum, rounded once by the copy
                    if r == me and measure_gap:
                        gaps.append(_gap_on_device(now.to(part.dtype), part.narrow(0, t, k)))
                    part.narrow(0, t, k).copy_(now)
                del new, now  # (a view of it) before the next piece's decode, not after it
        return gaps

    # ---- codec headers: compared on the device, read with others ----------------------
    def _expect_headers(self, everyone: Sequence[Tensor], pieces: Sequence[Piece]) -> None:
        """Compare the codec header of every rank's every piece with this codec's, on the device:
        one comparison per piece, over all ranks' copies of it (stacked: one small copy)."""
        offset = 0
        for _, _, n in pieces:
            got = torch.stack([buf.narrow(0, offset, HEADER_BYTES) for buf in everyone]).view(-1)
            self._unchecked.append((got, self._wanted_headers(n, got.device, len(everyone)), self._explainer(n)))
            offset += self.codec.nbytes(n)

    def _wanted_headers(self, numel: int, device, world: int) -> Tensor:
        key = (numel, str(device))
        got = self._wanted.get(key)
        if got is None:
            if len(self._wanted) >= 1024:  # the sizes of earlier partitionings
                self._wanted.clear()
            got = self._wanted[key] = self.codec.header_on(numel, device).repeat(world)
        return got

    def _explainer(self, numel: int):
        codec = self.codec

        def explain(raw: bytes) -> str:
            for r in range(len(raw) // HEADER_BYTES):
                try:
                    codec.check_header_bytes(raw[r * HEADER_BYTES:(r + 1) * HEADER_BYTES], numel)
                except ValueError as exc:
                    return f"deepspeed_gift: parameter deltas from rank {r}: {exc}"
            return "deepspeed_gift: parameter deltas arrived with an unexpected header"

        return explain

    def hand_over_checks(self, checks: HeaderChecks) -> None:
        """Add the header comparisons not yet read to ``checks``, to be read with its own at its
        :meth:`~HeaderChecks.verify` (the reducer's one host read of a step)."""
        unchecked, self._unchecked = self._unchecked, []
        for got, want, explain in unchecked:
            checks.expect(got, want, explain)

    def verify_checks(self) -> None:
        """Read the header comparisons not yet read now; raise if a header differed."""
        checks = HeaderChecks()
        self.hand_over_checks(checks)
        checks.verify()

    def exact_stats(self, numel: int, itemsize: int, seconds: float) -> StepStats:
        """Counters of an exact all-gather (DeepSpeed's own, flat) of ``numel`` elements per rank
        that took ``seconds``: the replicas are the targets, the gap is 0."""
        world, per_node = self.comm.world_size, self.ranks_per_node
        return StepStats(params_elements=numel * (world - 1), params_bytes=numel * itemsize * (world - 1),
                         params_bytes_internode=numel * itemsize * (world - per_node), params_comm_s=seconds,
                         params_exact_steps=1, params_gap_rel=0.0)
