"""Errors of a communicated gradient in the metric that matters to the optimizer.

Pure tensor math (no communication, nothing of DeepSpeed). GIFT moves quantization error
into the directions where the gradient is large, so plain L2 barely changes while the
error of the *update* the optimizer takes can fall a lot (or rise). Every comparison here
reports the error of ``approx`` against ``exact`` relative to ``exact``, in one of:

* ``l2``: ``||approx - exact|| / ||exact||``;
* ``whitened``: the same after both are moved into a whitener's coordinates
  (``||E S|| / ||G S||``, the norm in which GIFT's error is isotropic);
* ``optimizer``: the relative error of the next update direction of the optimizer whose
  state is given (``MuonRule``: Newton-Schulz of the Nesterov momentum blend, as DeepSpeed's
  Muon computes it; ``AdamRule``: ``m_hat / (sqrt(v_hat) + eps)``).
"""

from __future__ import annotations

from dataclasses import dataclass
import enum
from typing import ClassVar, Dict, Optional, Protocol, Tuple

import torch
from torch import Tensor

METRICS = ("optimizer", "l2", "whitened")


class RuleKind(str, enum.Enum):
    """Which update rule judges a layer: Muon's, Adam's, or none (plain L2)."""

    L2 = "l2"
    ADAM = "adam"
    MUON = "muon"
# Muon's quintic Newton-Schulz coefficients (Keller Jordan's, as DeepSpeed uses them).
NS_COEFFS = (3.4445, -4.7750, 2.0315)
NS_STEPS = 5
NS_EPS = 1e-7


def newton_schulz5(G: Tensor, steps: int = NS_STEPS) -> Tensor:
    """Muon's orthogonalization of a 2-D matrix, in fp32 (so the metric measures the
    communication error, not the bf16 rounding of the iteration)."""
    a, b, c = NS_COEFFS
    X = G.float()
    tall = X.shape[-2] > X.shape[-1]
    if tall:
        X = X.mT
    X = X / (X.norm() + NS_EPS)
    for _ in range(steps):
        A = X @ X.mT
        X = a * X + (b * A + c * A @ A) @ X
    return X.mT if tall else X


def relative_error(approx: Tensor, exact: Tensor) -> float:
    """``||approx - exact|| / ||exact||`` in float64 sums (0 when both are zero; inf/nan pass through)."""
    err = float((approx.double() - exact.double()).square().sum())
    ref = float(exact.double().square().sum())
    if ref == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return (err / ref) ** 0.5


def whitened_relative_error(approx: Tensor, exact: Tensor, whitener) -> float:
    """Relative error after moving rows into ``whitener``'s coordinates (``G -> G S``)."""
    return relative_error(whitener.apply(approx.float()), whitener.apply(exact.float()))


@dataclass
class MuonRule:
    """Muon's update of one matrix: ``m' = lerp(m, g, 1 - beta)``, then Newton-Schulz of
    ``lerp(g, m', beta)`` (Nesterov) or of ``m'``. ``momentum`` is the state before the step."""

    momentum: Tensor
    beta: float = 0.95
    nesterov: bool = True

    kind: ClassVar[RuleKind] = RuleKind.MUON
    # DeepSpeed's Muon orthogonalizes whole matrices: every owner of a slice holds the
    # momentum of the whole matrix, and the rule needs all of it
    whole_matrix: ClassVar[bool] = True
    state_keys: ClassVar[Tuple[str, ...]] = ("momentum_buffer",)

    @staticmethod
    def serves(group: dict, param) -> bool:
        return bool(group.get("use_muon", False)) and bool(getattr(param, "use_muon", False))

    @classmethod
    def from_state(cls, state: Dict[str, object], group: dict, *, shape, start: int, numel: int,
                   device) -> "MuonRule":
        buffer = state.get("momentum_buffer")
        momentum = (torch.zeros(shape, device=device) if buffer is None
                    else buffer.view(shape).float().clone())
        return cls(momentum=momentum, beta=float(group["momentum"]), nesterov=True)

    def direction(self, g: Tensor) -> Tensor:
        g = g.float()
        m = self.momentum.float().view_as(g).lerp(g, 1.0 - self.beta)
        blend = g.lerp(m, self.beta) if self.nesterov else m
        return newton_schulz5(blend)


@dataclass
class AdamRule:
    """Adam's update direction ``m_hat / (sqrt(v_hat) + eps)`` for the elements whose state is
    given (``exp_avg``, ``exp_avg_sq`` before the step; ``step`` = steps taken so far).
    Decoupled weight decay is left out: it does not depend on the gradient."""

    exp_avg: Tensor
    exp_avg_sq: Tensor
    step: int
    betas: Tuple[float, float] = (0.9, 0.999)
    eps: float = 1e-8
    start: Optional[int] = None  # the state covers flat elements [start, start + numel) of g (a ZeRO slice)

    kind: ClassVar[RuleKind] = RuleKind.ADAM
    whole_matrix: ClassVar[bool] = False  # each rank holds the moments of its own slice
    state_keys: ClassVar[Tuple[str, ...]] = ("exp_avg", "exp_avg_sq")

    @staticmethod
    def serves(group: dict, param) -> bool:
        return "betas" in group and not group.get("use_muon", False)

    @classmethod
    def from_state(cls, state: Dict[str, object], group: dict, *, shape, start: int, numel: int,
                   device) -> "AdamRule":
        if "exp_avg" in state and "exp_avg_sq" in state:
            m, v = state["exp_avg"].float().clone(), state["exp_avg_sq"].float().clone()
            step = int(float(state.get("step", 0)))
        else:  # before the first step: Adam starts from zero moments
            m = v = torch.zeros(numel, device=device)
            step = 0
        return cls(exp_avg=m, exp_avg_sq=v, step=step, betas=tuple(group["betas"]),
                   eps=float(group.get("eps", 1e-8)), start=start)

    def direction(self, g: Tensor) -> Tensor:
        b1, b2 = self.betas
        g = g.float().reshape(-1)
        if self.start is not None:
            g = g.narrow(0, self.start, self.exp_avg.numel())
        g = g.reshape(self.exp_avg.shape)
        t = self.step + 1
        m = self.exp_avg.float() * b1 + g * (1.0 - b1)
        v = self.exp_avg_sq.float() * b2 + g.square() * (1.0 - b2)
        m_hat = m / (1.0 - b1 ** t)
        v_hat = v / (1.0 - b2 ** t)
        return m_hat / (v_hat.sqrt() + self.eps)


class UpdateRule(Protocol):
    """The contract of an optimizer's update rule, as the optimizer's metric uses it.

    ``serves(group, param)``: the rule models the optimizer of this parameter group (the inner
    optimizer's ``param_groups`` entry). ``from_state``: the rule with a copy of the optimizer's
    per-parameter state, its ``state_keys`` tensors already narrowed by the DeepSpeed seam to
    the elements this rank holds (the other entries, such as ``step``, as they are): the whole
    matrix when ``whole_matrix`` (``start`` 0), else this rank's ZeRO slice, flat elements
    ``[start, start + numel)`` of the weight. ``direction(g)``:
    the update the optimizer would take from gradient ``g`` (the whole ``(out, in)`` matrix)."""

    kind: ClassVar[RuleKind]
    whole_matrix: ClassVar[bool]
    state_keys: ClassVar[Tuple[str, ...]]

    @staticmethod
    def serves(group: dict, param) -> bool: ...

    @classmethod
    def from_state(cls, state: Dict[str, object], group: dict, *, shape, start: int, numel: int,
                   device) -> "UpdateRule": ...

    def direction(self, g: Tensor) -> Tensor: ...


# The rules the optimizer's metric knows, tried in order (the first that serves a group wins);
# a new optimizer's rule is a class here and a RuleKind member, nothing else.
UPDATE_RULES: Tuple[type, ...] = (MuonRule, AdamRule)


def rule_serving(group: dict, param) -> Optional[type]:
    """The first rule of :data:`UPDATE_RULES` that models ``group``'s optimizer, or None."""
    return next((rule for rule in UPDATE_RULES if rule.serves(group, param)), None)


def update_relative_error(rule, approx: Tensor, exact: Tensor) -> float:
    """Relative error of the optimizer's next update when it sees ``approx`` instead of ``exact``."""
    return relative_error(rule.direction(approx), rule.direction(exact))


def rule_kind(rule: Optional[object]) -> RuleKind:
    """The kind of ``rule`` (plain L2 where the optimizer has none GIFT models)."""
    return RuleKind.L2 if rule is None else rule.kind


def roundtrip(G: Tensor, codec, whitener=None) -> Tensor:
    """``G`` through one encode/decode of ``codec``, in ``whitener``'s coordinates if given."""
    if whitener is None:
        return codec.decode(codec.encode(G.float()))
    return whitener.invert(codec.decode(codec.encode(whitener.apply(G.float()))))


def judge_geometry(G: Tensor, codec, whitener, *, rule=None) -> Tuple[dict, dict]:
    """Errors of one round trip of ``G`` in Euclidean coordinates and in ``whitener``'s, each
    as ``{"l2", "whitened", "optimizer", "rule_kind"}``: ``whitened`` is measured with
    ``whitener`` for both, so they compare; ``optimizer`` without a rule (an optimizer GIFT
    knows no update rule for) falls back to ``l2``, and ``rule_kind`` says which it was."""
    return judge_geometries(G, codec, {"": whitener}, rule=rule)[""]


def judge_geometries(G: Tensor, codec, whiteners: Dict[str, object], *, rule=None) -> Dict[str, Tuple[dict, dict]]:
    """:func:`judge_geometry` for several transforms of the same gradient (``{key: (euclid,
    geo)}``): the Euclidean round trip, the exact update and its error are computed once; the
    ``whitened`` errors use each transform's own norm."""
    G = G.float()
    ref_update = rule.direction(G) if rule is not None else None
    kind = rule_kind(rule)

    def common(approx: Tensor) -> dict:
        l2 = relative_error(approx, G)
        return {"l2": l2, "optimizer": relative_error(rule.direction(approx), ref_update) if rule is not None else l2,
                "rule_kind": kind}

    plain = roundtrip(G, codec)
    euclid = common(plain)
    out = {}
    for key, w in whiteners.items():
        ref_white = w.apply(G)
        geo_approx = roundtrip(G, codec, w)
        out[key] = ({**euclid, "whitened": relative_error(w.apply(plain), ref_white)},
                    {**common(geo_approx), "whitened": relative_error(w.apply(geo_approx), ref_white)})
    return out
