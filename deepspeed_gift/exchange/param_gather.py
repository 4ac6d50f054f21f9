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

Pure of DeepSpeed: it works on lists of partition tensors and a :class:`~deepspeed_gift.exchange.comm.Comm`.
"""

from __future__ import annotations

from typing import List, Sequence, Tuple

import torch
from torch import Tensor

from ..core.formats import Codec
from .stats import ByteKind, StepStats, clock

# The telemetry's replica-target gap is taken relative to the largest target of each run of
# this many elements: a scale local enough that a small parameter next to a large one is judged
# by its own size, coarse enough to cost nothing.
GAP_BLOCK = 128


def relative_gap(replica: Tensor, target: Tensor, block: int = GAP_BLOCK) -> float:
    """max over blocks of ``block`` elements of ``max|replica - target| / max|target|`` (0 for an
    all-zero block that the replica matches; nan when the target is not finite)."""
    n = target.numel()
    if n == 0:
        return 0.0
    pad = -n % block
    diff = torch.nn.functional.pad((replica.float() - target.float()).abs().reshape(-1), (0, pad))
    scale = torch.nn.functional.pad(target.float().abs().reshape(-1), (0, pad))
    d, s = diff.view(-1, block).amax(1), scale.view(-1, block).amax(1)
    ratio = torch.where(d == 0, torch.zeros_like(d), d / s)  # 0/0 (an untouched zero block) is no gap
    return float(ratio.max())


class ReplicaGather:
    """Sends each rank's quantized replica deltas to every rank and applies them.

    Flat: one all-gather over ``comm``. Two-level (``node_comm`` and ``slot_comm`` given, ranks
    numbered node by node with ``ranks_per_node`` each): the deltas cross the network once per
    node, among the ranks of the same local slot, and are then shared inside each node, still
    quantized; every rank decodes every partition itself.
    """

    def __init__(self, comm, codec: Codec, *, node_comm=None, slot_comm=None, ranks_per_node: int = 1) -> None:
        if (node_comm is None) != (slot_comm is None):
            raise ValueError("ReplicaGather: give both node_comm and slot_comm, or neither")
        self.comm = comm
        self.codec = codec
        self.node_comm, self.slot_comm = node_comm, slot_comm
        self.ranks_per_node = ranks_per_node if node_comm is None else node_comm.world_size

    @property
    def two_level(self) -> bool:
        return self.node_comm is not None

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
        :func:`relative_gap`, one more pass over its partition) only with ``measure_gap``."""
        device, sync = replicas[0][me].device, measure_gap  # seconds that time the work: see StepStats.timed
        t0 = clock(device, sync)
        codec = self.codec
        # one fp32 temporary per partition, the difference computed in place in it: a copy even where
        # the replicas are fp32 (.float() would then return the target itself, and sub_ would
        # overwrite it before the gap below is measured against it)
        blobs = [codec.encode_to_bytes(parts[me].to(torch.float32, copy=True).sub_(old))
                 for parts, old in zip(replicas, before)]
        sizes = [b.numel() for b in blobs]
        blob = torch.cat(blobs) if len(blobs) > 1 else blobs[0]
        t1 = clock(device, sync)
        everyone = self.exchange(blob)
        t2 = clock(device, sync)
        gap = 0.0
        for r, buf in enumerate(everyone):
            offset = 0
            for g, parts in enumerate(replicas):
                piece = buf[offset:offset + sizes[g]]
                offset += sizes[g]
                new = codec.decode_from_bytes(piece, (parts[r].numel(),), check_header=(r == 0))
                new.add_(before[g] if r == me else parts[r])  # fp32 sum, rounded once by the copy
                if r == me and measure_gap:
                    gap = max(gap, relative_gap(new.to(parts[r].dtype), parts[r]))
                parts[r].copy_(new)
        numel = sum(parts[me].numel() for parts in replicas)
        sent, internode = self.sent_bytes(blob.numel())
        return StepStats(params_elements=numel * (self.comm.world_size - 1), params_bytes=sent,
                         params_bytes_internode=internode, params_codec_s=(t1 - t0) + (clock(device, sync) - t2),
                         params_comm_s=t2 - t1, params_gap_rel=gap if measure_gap else None,
                         timed=sync or device.type == "cpu")

    def exact_stats(self, numel: int, itemsize: int, seconds: float) -> StepStats:
        """Counters of an exact all-gather (DeepSpeed's own, flat) of ``numel`` elements per rank
        that took ``seconds``: the replicas are the targets, the gap is 0."""
        world, per_node = self.comm.world_size, self.ranks_per_node
        return StepStats(params_elements=numel * (world - 1), params_bytes=numel * itemsize * (world - 1),
                         params_bytes_internode=numel * itemsize * (world - per_node), params_comm_s=seconds,
                         params_exact_steps=1, params_gap_rel=0.0)
