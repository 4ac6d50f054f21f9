"""Two-level reduction: inside each node first (the bucket's dtype, or ``gift.node_format``; the
node's own links), then among the nodes, by the ranks of one local rank on every node (a *slot
group*) with a :class:`GiftReducer`. How a bucket is spread over a node's ranks is the node split: every slice
to its owner's slot, or the owned elements in level runs over every slot (see
:class:`TwoLevelReducer`)."""

from __future__ import annotations

import hashlib
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import torch

from ..core.formats import Codec, Payload, get_format
from ..core.geometry import Transform
from .headers import CONTROL_HEADER_BYTES, FINGERPRINT_BYTES, agree_on_plan, expect_control_header
from .plan import COPY, GEO, MAX_CACHED_PLANS, BucketPlan, ParamSlice, Piece, SectionSource
from .comm import Pending
from .reducer import Begun, GiftReducer
from .stats import ByteKind, StepStats, clock

NODE_SPLITS = ("owner_slot", "balanced")  # how a bucket is spread over a node's ranks; a tie picks the first
# Pieces whose exchange among the nodes is under way before the oldest is finished (decoded,
# delivered, forwarded). At 1 the GPU's stream, in order, waits for piece k-1's last exchange
# before it sums and encodes piece k+1; at 2 that wait falls behind piece k's encode and piece
# k+1's sum, for one more piece's partial held (benchmarks/layout_model.py: 7B at W = 64 in nodes
# of 8, 0.74x -> 0.69x DeepSpeed's gradient time with GIFT's GPU work counted).
FINISH_LAG = 2

# An owner whose part exceeds its slot's share by at most 1/OWN_TAIL_KEPT of it keeps the
# excess on its own slot (``carried_balanced``): at W = 512 a node's owners hold about a share
# each, and their few elements past an exact level, handed to the slots with room, made runs of
# 128 elements, 17 a slot in a piece of 7B's buckets (past ``comm.MAX_PEER_PARTS``, so the node's
# sends were copied into one buffer); kept, a NIC carries at most 1/64 more than its share.
OWN_TAIL_KEPT = 64

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


def cut_segments(slices: Sequence[ParamSlice], segments: Carried, sizes: Sequence[int]) -> List[Carried]:
    """``segments`` (``(slice index, start, numel)`` runs, in order) cut into consecutive parts of
    about ``sizes`` elements, the last part taking what is left; each cut moved to a row boundary
    of the slice it falls in (``unit_boundary``), never before the cut before it. Per part its runs."""
    total = sum(n for _, _, n in segments)
    targets: List[int] = []
    for n in sizes[:-1]:
        targets.append((targets[-1] if targets else 0) + n)
    cuts: List[int] = []
    pos = 0
    for i, start, n in segments:
        while len(cuts) < len(targets) and targets[len(cuts)] < pos + n:
            at = min(max(unit_boundary(slices[i], start + targets[len(cuts)] - pos) - start, 0), n)
            cuts.append(max([pos + at] + cuts[-1:]))
        pos += n
    edges = [0] + cuts + [total] * (len(sizes) - len(cuts))
    out: List[Carried] = [[] for _ in sizes]
    pos = 0
    for i, start, n in segments:
        for k in range(len(sizes)):
            lo, hi = max(edges[k], pos), min(edges[k + 1], pos + n)
            if lo < hi:
                out[k].append((i, start + lo - pos, hi - lo))
        pos += n
    return out


def carried_balanced(slices: Sequence[ParamSlice], ranks_per_node: int) -> List[Carried]:
    """Per local rank j, what it carries when the elements each node owns (shared parameters
    aside) are spread over its slots so that every slot receives about as much for that node (a
    shared parameter still goes whole to its copy slots, a ``COPY`` slice to its owner's slot, and
    both count). Every NIC of an owner's node then carries its share whatever the owners, and a
    slot hands an owner of another slot its results inside the node afterwards. So each slot first
    takes its own owner's elements, up to its share: those are never handed on, and what an owner
    receives inside the node falls from its whole part less a share to that (at 13B, W = 64, nodes
    of 8, a bucket's owners hold 2-3 shares each). The rest, in bucket order, is cut over the
    slots' remaining room, in slot order. Every cut is moved to a row boundary of the slice it
    falls in."""
    L = ranks_per_node
    by_node: Dict[int, List[Tuple[int, ParamSlice]]] = {}
    pinned: Dict[int, List[int]] = {}  # node -> shared elements each slot carries for it
    for i, s in enumerate(slices):
        if s.copy_ranks:
            for node in {c // L for c in s.copy_ranks}:
                for j in {c % L for c in s.copy_ranks if c // L == node}:
                    pinned.setdefault(node, [0] * L)[j] += s.numel
        elif s.mode == COPY:  # kept by its owner's slot: its result is never handed over in the bucket's dtype
            pinned.setdefault(s.dst // L, [0] * L)[s.dst % L] += s.numel
        else:
            by_node.setdefault(s.dst // L, []).append((i, s))
    carried: List[Carried] = [[] for _ in range(L)]
    for node, owned in by_node.items():
        share = level_runs(sum(s.numel for _, s in owned), pinned.get(node, [0] * L))
        room, rest = list(share), []
        mine_of: Dict[int, Carried] = {}  # local rank -> its owner's slices, in bucket order
        for i, s in owned:
            mine_of.setdefault(s.dst % L, []).append((i, 0, s.numel))
        for j, mine in mine_of.items():
            head, tail = cut_segments(slices, mine, [share[j], 0])
            if sum(n for _, _, n in tail) <= share[j] // OWN_TAIL_KEPT:
                head, tail = mine, []
            carried[j].extend(head)
            room[j] -= sum(n for _, _, n in head)
            rest.extend(tail)
        rest.sort(key=lambda run: slices[run[0]].bucket_offset + run[1])
        if rest:
            takers = [j for j in range(L) if room[j] > 0] or [min(range(L), key=lambda j: share[j] - room[j])]
            for j, runs in zip(takers, cut_segments(slices, rest, [room[j] for j in takers])):
                carried[j].extend(runs)
    for i, s in enumerate(slices):
        if s.copy_ranks:
            for j in slot_targets(s, L):
                carried[j].append((i, 0, s.numel))
        elif s.mode == COPY:
            carried[s.dst % L].append((i, 0, s.numel))
    for runs in carried:
        runs.sort(key=lambda run: slices[run[0]].bucket_offset + run[1])
    return carried


def bucket_pieces(slices: Sequence[ParamSlice], pieces: int, min_elements: int) -> List[Carried]:
    """The bucket cut into at most ``pieces`` pieces for the two-level pipeline, each at least
    about ``min_elements`` (a small bucket stays whole): piece k holds the k-th of ``pieces``
    near-equal parts of every owner's slices (in bucket order), as ZeRO-1's rounds hold a slice
    of every owner's partition. Every piece then loads every owner, its slot and its node as the
    bucket does, 1/``pieces`` of it: a piece of contiguous elements would hold one or two owners
    of a bucket of several, and hand all their results on inside the node at once. A cut inside
    a slice falls on a row boundary of its transform (``unit_boundary``: every row stays whole,
    whitened as it was). A whole shared parameter (``copy_ranks``: it travels whole to its
    copies, all its slices in one exchange) is never cut: the j-th of them goes whole to piece
    j mod ``pieces``. Per piece its ``(slice index, start, numel)`` runs, in bucket order."""
    order = sorted(range(len(slices)), key=lambda i: slices[i].bucket_offset)
    total = sum(slices[i].numel for i in order)
    count = max(1, min(int(pieces), total // max(int(min_elements), 1)))
    out: List[Carried] = [[] for _ in range(count)]
    by_owner: Dict[int, List[int]] = {}
    shared: Dict[int, int] = {}  # parameter key -> its piece
    for i in order:
        s = slices[i]
        if s.copy_ranks:
            piece = shared.setdefault(s.param_key, len(shared) % count)
            out[piece].append((i, 0, s.numel))
        else:
            by_owner.setdefault(s.dst, []).append(i)
    for owned in by_owner.values():
        mine = sum(slices[i].numel for i in owned)
        parts = cut_segments(slices, [(i, 0, slices[i].numel) for i in owned],
                             [mine * (k + 1) // count - mine * k // count for k in range(count)])
        for k, runs in enumerate(parts):
            out[k].extend(runs)
    for runs in out:
        runs.sort(key=lambda run: slices[run[0]].bucket_offset + run[1])
    return [runs for runs in out if runs] or [[]]


def piece_slices(slices: Sequence[ParamSlice], runs: Carried, outputs: Optional[Sequence[Optional[torch.Tensor]]]
                 ) -> Tuple[List[ParamSlice], Optional[List[Optional[torch.Tensor]]]]:
    """A piece's slices (the runs of ``slices`` it holds, at their places in the bucket and in
    their parameters) and its outputs (the runs of ``outputs``)."""
    out, outs = [], ([] if outputs is not None else None)
    for i, at, n in runs:
        s = slices[i]
        whole = at == 0 and n == s.numel
        out.append(s if whole else ParamSlice(s.dst, s.bucket_offset + at, n, s.param_offset + at, s.param_key,
                                              s.row_len, s.mode, s.copy_ranks))
        if outs is not None:
            target = outputs[i]
            outs.append(target if target is None or whole else target.narrow(0, at, n))
    return out, outs


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
        self.all_slices = tuple(slices)
        self.slot, self.node = rank % L, rank // L
        self.runs_to_slot = [merged_runs([(slices[i].bucket_offset + at, n) for i, at, n in runs])
                             for runs in carried]
        self.numel_to_slot = [sum(n for _, _, n in runs) for runs in carried]
        mine = carried[self.slot]
        self.slices = slot_group_slices(slices, mine, L, self.slot)
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

    def busiest_node_receive(self, element_size: int, stage_nbytes: Optional[Callable[[int], int]] = None) -> int:
        """Bytes the busiest rank receives inside its node for this bucket: the node stage (its
        messages of ``n`` elements ``stage_nbytes(n)`` bytes, where it is quantized; else the
        bucket's dtype), and the forwards of a balanced split."""
        L = len(self.numel_to_slot)
        if L == 1:
            return 0
        stage_nbytes = stage_nbytes or (lambda n: n * element_size)
        stage = (L - 1) * max(CONTROL_HEADER_BYTES + stage_nbytes(n) for n in self.numel_to_slot)
        forwards = max((sum(CONTROL_HEADER_BYTES + n * element_size for n in senders)
                        for senders in self.forward_senders), default=0)
        return stage + forwards


class _BucketRun:
    """One bucket in the two-level pipeline: its tensor, pieces, plans and headers, and what its
    pieces have added up so far (finished pieces count down in ``unfinished``)."""

    def __init__(self, tensor, parts, planned, heads, sampled: int, sample: bool, agreed: int, tag) -> None:
        self.tensor, self.parts, self.planned, self.heads = tensor, parts, planned, heads
        self.sampled, self.sample, self.agreed, self.tag = sampled, sample, agreed, tag
        self.acc = {"node_s": 0.0, "bytes": 0, "stats": None}
        self.unfinished = len(planned)
        self.carried = False  # some piece finished during the next bucket's call
        self.on_done = None  # called the moment the bucket is done (reduce_carried's on_done)

    def timed(self, fn, *args):
        t0 = clock(self.tensor.device, self.sample)
        out = fn(*args)
        self.acc["node_s"] += clock(self.tensor.device, self.sample) - t0
        return out


class TwoLevelReducer:
    """Reduce a bucket inside each node first, then across nodes with a :class:`GiftReducer`.

    1. Node stage: an all-to-all among the node's ranks in the bucket's own dtype (no codec:
       the fast links inside a node), or quantized by ``node_codec`` (``gift.node_format``:
       each part encoded by its sender, decoded by its receiver). Each local rank receives the
       part of the bucket it carries from every local rank and sums it in fp32 in local rank
       order, its own part exact: the node partial, with no rounding beyond the gradients' own
       (and, quantized, the node format's). The part: every slice to its
       owner's slot (``owner_slot``), or an equal share of the bucket's owned elements per local
       rank, its own owner's first (``balanced``; a bucket with few owners would load only their
       slots' NICs).
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
    (and ``outputs``) as the flat reducer does.

    The stages use different links (the node's, the NICs), so a bucket is cut into ``pieces``
    (``bucket_pieces``: row boundaries, at least ``piece_min_elements`` each) run as a pipeline:
    while piece k crosses the NICs (its exchange among the nodes), piece k+1's node stage and
    piece k-1's forwards are under way on the node's comm, so a bucket takes about its longest
    stage, not their sum. Each piece is planned, split and reduced on its own, so the result
    depends on the cut, never on ``overlap``: ``overlap=False`` runs the same pieces one stage
    after another, to the same bits. In flight beside piece k's exchange: one piece's node
    stage and one piece's forwards."""

    def __init__(self, node_comm, inner: GiftReducer, ranks_per_node: int, *, pieces: int = 1,
                 piece_min_elements: int = 1, overlap: bool = True, node_codec: Optional[Codec] = None) -> None:
        self.node_comm = node_comm
        # the node stage's wire (``gift.node_format``): None sends the bucket's dtype
        self.node_codec = node_codec
        self.inner = inner
        inner.agrees = False  # the slot groups' plans are agreed with the node plans (_agree)
        self.ranks_per_node = ranks_per_node
        self.rank = inner.comm.rank * ranks_per_node + node_comm.rank
        self.pieces = int(pieces) if ranks_per_node > 1 else 1  # a node of one rank has no stage to overlap
        self.piece_min_elements = int(piece_min_elements)
        self.overlap = bool(overlap)
        kernels = inner.encoder.main_codec.kernels  # the node partial's sum runs as the codecs do
        self._node_codecs = {torch.bfloat16: get_format("bf16", kernels=kernels),
                             torch.float32: get_format("fp32", kernels=kernels)}
        self._plans: Dict[tuple, Tuple[NodePlan, int]] = {}
        self._cuts: Dict[tuple, List[Carried]] = {}  # bucket layout -> its pieces (bucket_pieces)
        self.plans_agreed = 0  # new plans, each agreed by the node and the slot group before its first use
        # the pipeline's pieces begun and not finished, (bucket, piece, exchange, node partial),
        # oldest first; the forwards under way (bucket, handle); buckets finished, not reported
        self._waiting: List[tuple] = []
        self._forwarding: Optional[tuple] = None
        self._done: List[Tuple[object, StepStats]] = []

    def plan_for(self, slices: Sequence[ParamSlice], versions: Optional[Dict[int, int]] = None
                 ) -> Tuple[NodePlan, int]:
        """The bucket's node plan, and the bytes the busiest rank among the nodes receives (the
        slot groups differ: every slot's exchange is planned here, on every rank). A new one
        (``versions``: of the whiteners, which the slot group's exchange names) is agreed by
        the node and by the slot group before it is used; every rank of the data-parallel group
        meets the same keys in the same order, so all agree at the same reductions."""
        key = (tuple(slices), tuple(sorted((versions or {}).items())))
        got = self._plans.pop(key, None)
        if got is None:
            got = self._choose(slices)
            if versions is not None:
                self._agree(got[0], versions)
            while len(self._plans) >= MAX_CACHED_PLANS:
                self._plans.pop(next(iter(self._plans)))
        self._plans[key] = got
        return got

    def _agree(self, plan: "NodePlan", versions: Dict[int, int]) -> None:
        """The node's ranks made this node plan the same way, and this rank's slot group its
        exchange (``headers.agree_on_plan``, on both comms). The slot group's plan is made and
        agreed here, not when ``inner`` first meets it: whether that is new differs between slot
        groups (two buckets may give one slot the same slices), which would leave the ranks
        with different numbers of collectives."""
        if self.ranks_per_node > 1:
            layout = [[s.dst, s.bucket_offset, s.numel, s.param_key] for s in plan.all_slices]

            def explain(everyone):
                if len({repr(d["layout"]) for d in everyone}) > 1:
                    return "the bucket's layout (which parameters it holds, where, for which owner)"
                return "the bucket's split over the node: " + ", ".join(
                    f"{d['split']} on local rank {r}" for r, d in enumerate(everyone))

            agree_on_plan(self.node_comm, plan.hash, lambda: {"layout": layout, "split": plan.split}, explain,
                          f"the node stage of a bucket of {sum(s.numel for s in plan.all_slices)} elements")
        self.inner.agree(self.inner.plan_for(plan.slices, versions), versions)
        self.plans_agreed += 1

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

    def reduce(self, tensor: torch.Tensor, slices: Sequence[ParamSlice], whiteners: Dict[int, Transform], *,
               divisor: float, step: int = 0,
               outputs: Optional[Sequence[Optional[torch.Tensor]]] = None, sample: bool = False) -> StepStats:
        """Same contract as :meth:`GiftReducer.reduce` (``slices`` name data-parallel ranks): the
        bucket reduced whole when this returns. A bucket still carried must be drained first
        (its report would be lost here)."""
        if self.carrying:
            raise RuntimeError("deepspeed_gift: a bucket is still carried into the next reduction "
                               "(gift.carry_buckets: true); drain() it before reducing a bucket whole")
        done = self.reduce_carried(tensor, slices, whiteners, divisor=divisor, step=step, outputs=outputs,
                                   sample=sample, carry=False)
        return done[-1][1]

    def reduce_carried(self, tensor: torch.Tensor, slices: Sequence[ParamSlice], whiteners: Dict[int, Transform],
                       *, divisor: float, step: int = 0, outputs: Optional[Sequence[Optional[torch.Tensor]]] = None,
                       sample: bool = False, carry: bool = True, tag=None,
                       on_done: Optional[Callable[[object, StepStats], None]] = None
                       ) -> List[Tuple[object, StepStats]]:
        """:meth:`reduce`, with the pipeline of pieces carried from bucket to bucket (``carry``):
        this bucket's last ``FINISH_LAG`` pieces may still be crossing the nodes when this
        returns, and they finish during the next call (or :meth:`drain`), after the next
        bucket's first pieces are in their node stage and exchange, so the node's links and the
        NICs do not idle through each bucket's fill and drain. Until it is reported done, the
        bucket's ``tensor`` and ``outputs`` must stay as they are and unread (DeepSpeed's
        double ipg buffer under ``overlap_comm`` keeps a bucket's buffer through the next one).
        Every bucket is cut, planned and reduced as without the carry, and its encodes run in
        the same order (only decodes and forwards move later): the same bits. Returns the
        buckets finished during this call, oldest first, as ``(tag, stats)``; ``carry`` False
        finishes them all, this one last. ``on_done(tag, stats)``, where given, is called instead
        the moment the bucket is done, before any later piece's exchange is waited for: on a GPU
        whatever it queues on the stream (DeepSpeed's copies into the partition, an event the
        backward waits for before it fills the bucket's buffer again) waits for this bucket's
        work and the next bucket's node stages, not for the next bucket's exchanges. So a
        carried bucket's last piece has its forwards waited for as soon as they are begun.

        The pieces' work, in the one order every mode runs (so stochastic rounding's counter
        meets the encodes in the same order): piece k+1's node stage begun, piece k's node
        partial summed, piece k-1's last exchange begun (a relay's sums encoded and sent), piece
        k's exchange among the nodes begun (its encode, its first all-to-all posted), then piece
        k - FINISH_LAG's exchange finished (the owner's decode and inverse), its results
        delivered and its forwards begun, the forwards before them finished. Overlapped, every
        all-to-all runs while the work after it is done; serial, each is waited for as it is
        posted. Held at once: FINISH_LAG + 1 pieces' node partials and exchanges, the next
        piece's node stage, one piece's forwards."""
        run = self._begin_bucket(tensor, slices, whiteners, step, outputs, sample, tag)
        run.on_done = on_done
        waiting = self._waiting  # pieces begun, not finished, oldest first (of this bucket and the last)
        staged = run.timed(self._node_stage_start, tensor, run.planned[0][0], run.heads[0])
        for k, (plan, _) in enumerate(run.planned):
            this = staged
            if k + 1 < len(run.planned):  # begun before this piece's sum: the node's links never wait for it
                staged = run.timed(self._node_stage_start, tensor, run.planned[k + 1][0], run.heads[k + 1])
            partial, sent = run.timed(self._node_stage_finish, this, tensor.dtype)
            run.acc["bytes"] += sent
            if len(waiting) == FINISH_LAG and waiting[0][0] is not run:
                self._finish_oldest(run)  # a carried bucket's piece: before this bucket's exchanges go on
            if waiting:  # piece k-1's last exchange under way before piece k's first (posted once)
                waiting[-1][2].post_last()
            steps = Begun(self.inner.reduce_steps(partial, plan.slices, whiteners, divisor=divisor, step=step,
                                                  outputs=plan.outputs_for(run.parts[k][1]), sample=sample,
                                                  wait_at_once=not self.overlap, fidelity_elements=run.sampled))
            if len(waiting) == FINISH_LAG:
                self._finish_oldest(run)
            waiting.append((run, k, steps, partial))
        while waiting[0][0] is not run:  # a bucket of fewer pieces than FINISH_LAG: the carried one's last
            self._finish_oldest(run)
        waiting[-1][2].post_last()  # the same order of encodes carried or not: the relay's sums now
        if not carry:
            return self.drain()
        run.carried = self.carrying  # only this bucket's pieces can be left under way now
        done, self._done = self._done, []
        return done

    def drain(self) -> List[Tuple[object, StepStats]]:
        """Every carried bucket finished: ``(tag, stats)`` of those finished since the last report."""
        while self._waiting:
            self._finish(*self._waiting.pop(0))
        if self._forwarding is not None:
            self._forward_done()
        done, self._done = self._done, []
        return done

    def abandon(self) -> None:
        """Forget every carried bucket without finishing it (a reduction that raised part-way:
        its exchanges are not waited for, and nothing of it is reported)."""
        self._waiting, self._forwarding, self._done = [], None, []

    @property
    def carrying(self) -> bool:
        """A bucket's last pieces are still under way (reported by the next call or :meth:`drain`)."""
        return bool(self._waiting) or self._forwarding is not None

    def _begin_bucket(self, tensor, slices, whiteners, step, outputs, sample, tag) -> "_BucketRun":
        agreed = self.plans_agreed
        versions = {key: t.version for key, t in whiteners.items()}
        layout = tuple(slices)
        cut = self._cuts.pop(layout, None)  # the same layout step after step: cut once
        if cut is None:
            cut = bucket_pieces(slices, self.pieces, self.piece_min_elements)
            while len(self._cuts) >= MAX_CACHED_PLANS:
                self._cuts.pop(next(iter(self._cuts)))
        self._cuts[layout] = cut
        parts = [piece_slices(slices, runs, outputs) for runs in cut]
        planned = [self.plan_for(part, versions) for part, _ in parts]  # new ones agreed before any exchange
        # the node's messages open with the piece's header (a node of one rank sends none)
        heads = [self.inner.checks.control_header(plan, step, tensor.device) if self.ranks_per_node > 1 else None
                 for plan, _ in planned]
        # the sampled fidelity check takes a bucket's sample over its pieces, not one per piece
        sampled = max(1, self.inner.fidelity_elements // len(planned))
        return _BucketRun(tensor, parts, planned, heads, sampled, sample, self.plans_agreed - agreed, tag)

    def _finish_oldest(self, current: "_BucketRun") -> None:
        """The oldest piece under way finished; where it was the last of a bucket carried before
        ``current``, that bucket's forwards too, so it is done (and reported) before any of
        ``current``'s exchanges is waited for: on a GPU, what waits for the carried bucket then
        waits for ``current``'s node stages, not for its exchanges."""
        entry = self._waiting.pop(0)
        self._finish(*entry)
        if entry[0] is not current and not any(w[0] is entry[0] for w in self._waiting):
            self._forward_done()

    def _finish(self, run: "_BucketRun", k: int, steps: Begun, partial: torch.Tensor) -> None:
        """Piece k of ``run``: its exchange finished (the owner's decode and inverse), its results
        delivered into its bucket, the forwards before it finished and its own begun."""
        plan, outs = run.planned[k][0], run.parts[k][1]
        stats = steps.result()
        for compact_at, bucket_at, numel in plan.delivered:
            run.tensor.narrow(0, bucket_at, numel).copy_(partial.narrow(0, compact_at, numel))
        if self._forwarding is not None:
            self._forward_done()
        self._forwarding = (run, run.timed(self._forward_start, run.tensor, partial, plan, run.heads[k], outs))
        stats.balanced_buckets = int(plan.split == "balanced")
        run.acc["stats"] = stats if run.acc["stats"] is None else run.acc["stats"].add(stats)
        run.unfinished -= 1

    def _forward_done(self) -> None:
        """The forwards under way finished into their own bucket; a bucket whose every piece is
        finished and forwarded is done."""
        run, forwarding = self._forwarding
        self._forwarding = None
        run.acc["bytes"] += run.timed(self._forward_finish, forwarding, run.tensor)
        if not run.unfinished:
            if run.on_done is not None:
                run.on_done(run.tag, self._bucket_stats(run))
            else:
                self._done.append((run.tag, self._bucket_stats(run)))

    def _bucket_stats(self, run: "_BucketRun") -> StepStats:
        total = run.acc["stats"]
        # a bucket counts once, whatever its pieces did (any piece relayed, any split evenly)
        total.relay_buckets, total.balanced_buckets = min(total.relay_buckets, 1), min(total.balanced_buckets, 1)
        total.pieces = len(run.planned)
        total.node_s = run.acc["node_s"]
        total.bytes_node = run.acc["bytes"]
        total.carried_buckets = int(run.carried)
        # new plans: the fingerprints shown inside the node, and among the nodes (every slot group at once)
        node_agreed = run.agreed * FINGERPRINT_BYTES * (self.ranks_per_node - 1)
        among_agreed = run.agreed * FINGERPRINT_BYTES * (self.inner.comm.world_size - 1)
        among_nodes = sum(among for _, among in run.planned)
        stage_nbytes = self.node_codec.nbytes if self.node_codec is not None else None
        busiest_node = sum(plan.busiest_node_receive(run.tensor.element_size(), stage_nbytes)
                           for plan, _ in run.planned)
        total.recv_max_internode = among_nodes + among_agreed
        total.recv_max = among_nodes + among_agreed + busiest_node + node_agreed
        return total

    def _begun(self, pending: Pending) -> Pending:
        """A node all-to-all as the mode runs it: under way (overlapped), or finished (serial)."""
        return pending if self.overlap else pending.finished()

    def _node_stage_start(self, tensor: torch.Tensor, plan: NodePlan, head: Optional[torch.Tensor]):
        """A piece's node stage begun: this rank's own part, and the all-to-all that brings the
        other local ranks' parts (None: a node of one rank) with the sizes to read it by."""
        L, me = self.ranks_per_node, plan.slot
        mine = self._gather_runs(tensor, plan.runs_to_slot[me])
        if L == 1:
            return mine, None, head, 0, 0
        if self.node_codec is not None:
            # quantized (``gift.node_format``): each local rank's runs encoded as one payload, read
            # run by run as the codec takes its tiles (no staging copy of the runs)
            parts = [[] if j == me else [head, self._node_encode(tensor, plan.runs_to_slot[j])] for j in range(L)]
            mine_parts = [CONTROL_HEADER_BYTES, self.node_codec.nbytes(plan.numel_to_slot[me])]
        else:
            # the runs as they lie in the bucket: sent from there where the comm's point-to-point
            # sends can (TorchComm), else joined into one send buffer (what leaves is copied once)
            parts = [[] if j == me else [head] + [tensor.narrow(0, start, numel).view(torch.uint8)
                                                  for start, numel in plan.runs_to_slot[j]] for j in range(L)]
            # every rank of the node sends this one the runs of its slot, as its own bucket holds them
            mine_parts = [CONTROL_HEADER_BYTES] + [numel * tensor.element_size()
                                                   for _, numel in plan.runs_to_slot[me]]
        incoming = sum(mine_parts)
        pending = self._begun(self.node_comm.all_to_all_parts_start(
            parts, [[] if i == me else mine_parts for i in range(L)], kind=ByteKind.NODE))
        return mine, pending, head, incoming, sum(p.numel() for ps in parts for p in ps)

    def _node_stage_finish(self, staged, dtype: torch.dtype) -> Tuple[torch.Tensor, int]:
        """fp32 node partial of every slice this rank's slot carries, in the compact layout (a
        buffer of its own), and the bytes this rank sent inside the node."""
        mine, pending, head, incoming, sent = staged
        if pending is None:
            return mine.to(torch.float32, copy=True), 0
        recv = pending.wait()
        L, me = self.ranks_per_node, self.node_comm.rank
        others = [i for i in range(L) if i != me]
        messages = recv.view(L - 1, incoming)
        expect_control_header(self.inner.checks, messages[:, :CONTROL_HEADER_BYTES], head,
                              [f"local rank {i}" for i in others], "ranks of a node disagree on the bucket layout")
        partial = torch.empty(mine.numel(), dtype=torch.float32, device=mine.device)
        # in local rank order on every receiver (copies of a shared parameter agree bit for bit;
        # a quantized node stage would round each slot's copy otherwise, so Muon refuses one):
        # a codec's decode-and-sum (the node format's, or the passthrough's of the bucket's
        # dtype), one kernel where compiled; this rank's own part exact
        if self.node_codec is not None:
            if mine.numel():  # the header was checked with the control header's plan: no read to the host
                payloads = self.node_codec.bytes_to_payload(messages[:, CONTROL_HEADER_BYTES:], mine.numel(),
                                                            check_header=False)
                self.node_codec.decode_sum(payloads, partial, own=mine, own_at=me)
            return partial, sent
        rows = messages[:, CONTROL_HEADER_BYTES:].view(dtype)  # (L - 1, n), a sender a row
        codec = self._node_codecs.get(dtype)
        if codec is not None and mine.numel():
            codec.decode_sum(Payload(codec.name, torch.Size((mine.numel(),)), rows), partial, own=mine, own_at=me)
            return partial, sent
        terms = list(rows.unbind(0))  # fp16 (no passthrough codec): added one by one, the same order
        terms.insert(me, mine)
        partial.copy_(terms[0])
        for term in terms[1:]:
            partial.add_(term)
        return partial, sent

    def _forward_start(self, tensor: torch.Tensor, partial: torch.Tensor, plan: NodePlan, head: torch.Tensor,
                       outputs):
        """Balanced split: begin handing every owner of this node the results other local ranks
        reduced for it, in the bucket's dtype (an fp32 model's results arrive exact); None where
        no node forwards."""
        if not plan.forwards:
            return None
        L, me, dtype = self.ranks_per_node, plan.slot, tensor.dtype
        elem = tensor.element_size()
        sizes = [CONTROL_HEADER_BYTES + sum(n for _, n in plan.forward_out[o]) * elem if plan.forward_out.get(o) else 0
                 for o in range(L)]
        send = torch.empty(sum(sizes), dtype=torch.uint8, device=partial.device)
        at_send = 0
        for o, size in enumerate(sizes):
            if not size:
                continue
            send.narrow(0, at_send, CONTROL_HEADER_BYTES).copy_(head)
            # the runs cast into the message as they are gathered: one pass, no fp32 or
            # bucket-dtype copy of what is forwarded besides the message
            torch.cat([partial.narrow(0, at, n) for at, n in plan.forward_out[o]],
                      out=send.narrow(0, at_send + CONTROL_HEADER_BYTES, size - CONTROL_HEADER_BYTES).view(dtype))
            at_send += size
        recv_sizes = [CONTROL_HEADER_BYTES + plan.forward_numel[j][me] * elem if plan.forward_numel[j][me] else 0
                      for j in range(L)]
        pending = self._begun(self.node_comm.all_to_all_bytes_start(send, sizes, recv_sizes, kind=ByteKind.NODE))
        return pending, plan, head, recv_sizes, outputs, sum(sizes)

    def _forward_finish(self, forwarding, tensor: torch.Tensor) -> int:
        """The forwards received: copied into the bucket (and added to ``outputs``); the bytes sent."""
        if forwarding is None:
            return 0
        pending, plan, head, recv_sizes, outputs, sent = forwarding
        recv = pending.wait()
        pos = 0
        for j, size in enumerate(recv_sizes):
            if not size:
                continue
            msg = recv.narrow(0, pos, size)
            expect_control_header(self.inner.checks, msg, head, f"local rank {j}",
                                  "ranks of a node disagree on the bucket layout")
            values = msg.narrow(0, CONTROL_HEADER_BYTES, size - CONTROL_HEADER_BYTES).view(tensor.dtype)
            at = 0
            for bucket_at, i, start, n in plan.forward_in[j]:
                part = values.narrow(0, at, n)
                tensor.narrow(0, bucket_at, n).copy_(part)
                if outputs is not None and outputs[i] is not None:
                    outputs[i].narrow(0, start, n).add_(part)
                at += n
            pos += size
        return sent

    def _node_encode(self, tensor: torch.Tensor, runs: List[Tuple[int, int]]) -> torch.Tensor:
        """The wire bytes of ``runs`` of the bucket (in order, as one tensor) in the node's format."""
        source = SectionSource(tensor, [Piece(start, numel, -1) for start, numel in runs], None,
                               tile=self.node_codec.tile_elements)
        return self.node_codec.payload_to_bytes(self.node_codec.encode_source(source, source.numel))

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
    def state_dict(self, **residuals) -> dict:
        return self.inner.state_dict(**residuals)

    def load_state_dict(self, state: dict, device, **residuals) -> None:
        self.inner.load_state_dict(state, device, **residuals)

    def residual_nbytes(self) -> int:
        return self.inner.residual_nbytes()

    def drop_residuals(self) -> None:
        self.inner.drop_residuals()
