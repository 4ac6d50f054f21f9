"""The step's reduction in balanced rounds (ZeRO-1, ``gift.stage1_rounds``). Pure: no
communication, no DeepSpeed.

DeepSpeed's buckets follow the flat order of the parameters, so once a bucket is smaller than
a partition it reaches one or two owners: a direct exchange funnels into their links, and the
relay that spreads it quantizes every sum a second time. When every gradient of the step
exists before anything is reduced (ZeRO-1 without ``overlap_comm`` reduces after the backward
of the boundary micro-batch), the reduction can be cut another way: round r carries the r-th
of R near-equal slices of *every* owner's partition. Each round is then balanced by
construction (every rank receives about the same, whatever the layout) and goes direct, so
every element is quantized once; a round holds at most about ``round_elements`` elements, as
a bucket does.

A cut inside a matrix falls on a row boundary (of the matrix's own rows, whatever its
transform: the layout, and with it error feedback's residuals, does not change when layers are
selected or refitted), so a round cut costs no row its whitening. A parameter that every owner
of a slice must receive whole (``copy``: a Muon matrix split across partitions) travels whole,
in one round, as its own shared section.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Sequence, Tuple


@dataclass(frozen=True)
class OwnedParam:
    """A parameter of the step as the partitions cut it: ``runs`` are ``(start, end, owner)``
    in the flattened parameter, in order; ``unit`` its row length (1: cut anywhere); ``copy``:
    it travels whole to every owner of a run."""

    key: int
    numel: int
    runs: Tuple[Tuple[int, int, int], ...]
    unit: int = 1
    copy: bool = False


@dataclass(frozen=True)
class RoundPiece:
    """Elements ``[start, start + numel)`` of parameter ``key`` (index ``param`` in the caller's
    list), owned by ``owner``, at ``offset`` in the round's staging buffer."""

    param: int
    key: int
    start: int
    numel: int
    owner: int
    offset: int


@dataclass(frozen=True)
class Round:
    pieces: Tuple[RoundPiece, ...]
    numel: int


def contiguous_runs(sizes: Sequence[int], partition: int) -> List[Tuple[Tuple[int, int, int], ...]]:
    """The ``(start, end, owner)`` runs of parameters of ``sizes`` elements, flattened in order,
    over contiguous partitions of ``partition`` elements each (ZeRO's layout)."""
    out, flat = [], 0
    for numel in sizes:
        runs, pos = [], 0
        while pos < numel:
            owner = (flat + pos) // partition
            end = min(numel, (owner + 1) * partition - flat)
            runs.append((pos, end, owner))
            pos = end
        out.append(tuple(runs))
        flat += numel
    return out


def round_count(params: Sequence[OwnedParam], world: int, round_elements: int) -> int:
    """Rounds needed so that the owners' shares of one round add up to at most about
    ``round_elements`` (the largest owner's share sets it)."""
    owned = [0] * world
    for p in params:
        if not p.copy:
            for start, end, owner in p.runs:
                owned[owner] += end - start
    largest = max(owned) if owned else 0
    return max(1, -(-largest * world // max(round_elements, 1)))


def _snap(cut: int, runs: List[Tuple[int, int, int, int]]) -> int:
    """``cut`` (a position in an owner's concatenated runs) moved to the nearest row boundary of
    the matrix it falls in, inside that run; runs are ``(begin, param start, numel, unit)``."""
    for begin, start, numel, unit in runs:
        if begin < cut < begin + numel:
            if unit <= 1:
                return cut
            absolute = start + (cut - begin)
            down = absolute - absolute % unit
            up = down + unit
            best = min((c for c in (down, up) if start <= c <= start + numel),
                       key=lambda c: abs(c - absolute), default=absolute)
            return begin + (best - start)
    return cut


def plan_rounds(params: Sequence[OwnedParam], world: int, round_elements: int) -> List[Round]:
    """The rounds of one step: round r holds the r-th slice of every owner's runs (in the
    parameters' order, owner by owner), then the whole copy parameters assigned to it (the
    i-th of them to round i mod R). Every element of every run is in exactly one round."""
    count = round_count(params, world, round_elements)
    by_owner: List[List[Tuple[int, int, int, int, int]]] = [[] for _ in range(world)]  # (param, begin, start, numel, unit)
    for index, p in enumerate(params):
        if p.copy:
            continue
        for start, end, owner in p.runs:
            if end > start:
                total = by_owner[owner][-1][1] + by_owner[owner][-1][3] if by_owner[owner] else 0
                by_owner[owner].append((index, total, start, end - start, p.unit))
    pieces: List[List[RoundPiece]] = [[] for _ in range(count)]
    sizes = [0] * count
    for owner, runs in enumerate(by_owner):
        total = runs[-1][1] + runs[-1][3] if runs else 0
        geometry = [(begin, start, numel, unit) for _, begin, start, numel, unit in runs]
        cuts = [0] + [_snap(total * r // count, geometry) for r in range(1, count)] + [total]
        for r in range(1, count + 1):  # snapped cuts stay in order: keep them monotone
            cuts[r] = max(cuts[r], cuts[r - 1])
        for r in range(count):
            lo, hi = cuts[r], cuts[r + 1]
            for index, begin, start, numel, _ in runs:
                a, b = max(lo, begin), min(hi, begin + numel)
                if a < b:
                    pieces[r].append(RoundPiece(index, params[index].key, start + (a - begin), b - a, owner, sizes[r]))
                    sizes[r] += b - a
    copies = [index for index, p in enumerate(params) if p.copy]
    for i, index in enumerate(copies):
        r, p = i % count, params[index]
        for start, end, owner in p.runs:  # contiguous in the round: the whole matrix, in order
            pieces[r].append(RoundPiece(index, p.key, start, end - start, owner, sizes[r] + start))
        sizes[r] += p.numel
    return [Round(tuple(pieces[r]), sizes[r]) for r in range(count)]
