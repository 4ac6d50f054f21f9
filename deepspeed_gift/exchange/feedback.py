"""Error feedback: what quantization left out of this step's payloads, added to the next.

Two stores, both fp32 and on the reducer's device:

* per payload a rank sends (its main-format sections), the residual in the coordinates of the
  transforms it was made with, keyed by the plan's layout and the section; a refresh or a
  re-selection that changes some rows' transform moves it into the new coordinates;
* per chunk sum a rank relays (the relay route's second quantization), keyed by the plan's
  layout and the section, and kept with the plan's hash: the hash names the transform versions
  and the selection, and a residual of another hash is dropped (a refresh starts it afresh,
  since a chunk holds rows cut by its edges and cannot be moved), so one residual per layout
  is held however many refreshes a run has.

An overflowing step (DeepSpeed skips it) must not leak its error into the next, so a residual
with any inf/nan is kept as zeros, decided on the device (no host read).
"""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import torch

from .plan import BucketPlan, Piece, Section, transform_pieces

logger = logging.getLogger("deepspeed_gift")


def _finite_or_zero(residual: torch.Tensor) -> torch.Tensor:
    return residual.masked_fill_(~torch.isfinite(residual).all(), 0.0)


class ErrorFeedback:
    """The residuals of one reducer (see the module docstring)."""

    def __init__(self) -> None:
        # (layout key, section key) -> (residual, pieces, transforms it is expressed in)
        self.sent: Dict[Tuple[tuple, object], Tuple[torch.Tensor, List[Piece], Dict[int, object]]] = {}
        # (layout key, section index) -> (plan hash, residual of the chunk sum this rank relays)
        self.relayed: Dict[Tuple[tuple, int], Tuple[int, torch.Tensor]] = {}

    def add(self, plan: BucketPlan, sec: Section, values: torch.Tensor, transforms) -> torch.Tensor:
        """``values`` plus last step's residual of this payload, first moved into this step's
        coordinates when a refresh or re-selection changed the transforms of some rows."""
        entry = self.sent.get((plan.layout_key, sec.key))
        if entry is None:
            return values
        residual, pieces, used = entry
        if pieces != sec.pieces or any(used.get(p.param_key) is not transforms.get(p.param_key)
                                       for p in sec.pieces + pieces if p.rows):
            residual = transform_pieces(residual, pieces, used, inverse=True)
            residual = transform_pieces(residual, sec.pieces, transforms, inverse=False)
        return values.add_(residual)

    def keep(self, plan: BucketPlan, sec: Section, residual: torch.Tensor, transforms) -> None:
        self.sent[(plan.layout_key, sec.key)] = (_finite_or_zero(residual), sec.pieces, dict(transforms))

    def add_relayed(self, plan: BucketPlan, index: int, value: torch.Tensor) -> torch.Tensor:
        held = self.relayed.get((plan.layout_key, index))
        return value if held is None or held[0] != plan.hash else value.add_(held[1])

    def keep_relayed(self, plan: BucketPlan, index: int, residual: torch.Tensor) -> None:
        self.relayed[(plan.layout_key, index)] = (plan.hash, _finite_or_zero(residual))

    def state_dict(self) -> dict:
        """The residuals in gradient coordinates (the transforms they were made with are not
        saved; the next step maps them into its own)."""
        sent = []
        for (layout_key, key), (residual, pieces, used) in self.sent.items():
            grad_coords = transform_pieces(residual.clone(), pieces, used, inverse=True)
            flat = [Piece(p.bucket_offset, p.numel, p.param_key, 0, p.slice_index, p.slice_start, p.param_start)
                    for p in pieces]
            sent.append((layout_key, key, grad_coords.cpu(), [tuple(vars(p).values()) for p in flat]))
        relayed = [(layout_key, index, plan_hash, r.cpu()) for (layout_key, index), (plan_hash, r)
                   in self.relayed.items()]
        return {"residuals": sent, "relay_residuals": relayed}

    def load_state_dict(self, state: dict, device) -> None:
        self.sent = {(layout_key, key): (r.to(device), [Piece(*p) for p in pieces], {})
                     for layout_key, key, r, pieces in state["residuals"]}
        relayed = state.get("relay_residuals", [])
        # entries of (hash, index, residual), as saved before residuals were held per layout: their
        # hash cannot name a layout, so they cannot be matched; said, and the relay starts afresh
        old = [entry for entry in relayed if len(entry) == 3]
        if old:
            logger.warning("gift: %d relayed error-feedback residuals in this checkpoint are of an earlier "
                           "format and are dropped; the relay route's feedback starts afresh", len(old))
        self.relayed = {(layout_key, index): (plan_hash, r.to(device))
                        for layout_key, index, plan_hash, r in (e for e in relayed if len(e) == 4)}

    def nbytes(self) -> int:
        return (sum(r.numel() * r.element_size() for r, _, _ in self.sent.values())
                + sum(r.numel() * r.element_size() for _, r in self.relayed.values()))
