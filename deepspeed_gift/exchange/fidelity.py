"""The sampled fidelity check: an exact fp32 reduction of an evenly strided sample of what
each owner receives, to compare GIFT's reduction with (telemetry's ``fidelity_rel_err``)."""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch

from .plan import BucketPlan, section_sample
from .stats import ByteKind, StepStats


def exact_sample_reduction(comm, tensor: torch.Tensor, plan: BucketPlan, divisor: float, stats: StepStats,
                           limit: int) -> Optional[Tuple[torch.Tensor, List[torch.Tensor]]]:
    """fp32 reduction, by a plain exchange, of an evenly strided sample of at most about
    ``limit`` of the elements this rank receives (gradient coordinates): the exact values and,
    per received section, the sampled positions. Every rank samples the same positions (they
    depend on the plan only); the bytes are counted as ``bytes_fidelity``. None when this rank
    receives nothing."""
    me, world = comm.rank, comm.world_size
    chunks, sizes, own, mine = [], [], None, []
    for dst in range(world):
        stride = max(1, -(-plan.received_numel(dst) // limit))
        samples = [section_sample(plan, i, stride, tensor.device) for i in plan.to_rank[dst]]
        raw = (torch.cat([tensor[at].float() for _, at in samples]) if samples
               else torch.empty(0, dtype=torch.float32, device=tensor.device))
        if dst == me:
            own, mine = raw, [pos for pos, _ in samples]
            raw = raw[:0]
        chunks.append(raw.view(torch.uint8))
        sizes.append(raw.numel() * 4)
    my_bytes = own.numel() * 4
    recv = comm.all_to_all_bytes(torch.cat(chunks), sizes, [0 if src == me else my_bytes for src in range(world)],
                                 kind=ByteKind.TELEMETRY)
    stats.bytes_fidelity += sum(sizes)
    if own.numel() == 0:
        return None
    exact = own.clone()
    if world > 1:
        exact += recv.view(torch.float32).view(world - 1, own.numel()).sum(0)
    return exact.div_(divisor), mine
