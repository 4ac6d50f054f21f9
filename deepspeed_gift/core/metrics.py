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

import dataclasses
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
    return roundtrip_whitened(whitener.apply(G.float()), codec, whitener)


def roundtrip_whitened(white: Tensor, codec, whitener) -> Tensor:
    """:func:`roundtrip` of the gradient whose whitened form ``white`` is already at hand."""
    return whitener.invert(codec.decode(codec.encode(white)))


def judge_geometry(G: Tensor, codec, whitener, *, rule=None) -> Tuple[dict, dict]:
    """Errors of one round trip of ``G`` in Euclidean coordinates and in ``whitener``'s, each
    as ``{"l2", "whitened", "optimizer", "rule_kind"}``: ``whitened`` is measured with
    ``whitener`` for both, so they compare; ``optimizer`` without a rule (an optimizer GIFT
    knows no update rule for) falls back to ``l2``, and ``rule_kind`` says which it was."""
    return judge_geometries(G, codec, {"": whitener}, rule=rule)[""]


def judge_geometries(G: Tensor, codec, whiteners: Dict[str, object], *, rule=None,
                     tile_rows: Optional[int] = None) -> Dict[str, Tuple[dict, dict]]:
    """:func:`judge_geometry` for several transforms of the same gradient (``{key: (euclid,
    geo)}``): the Euclidean round trip, the exact update and its error are computed once; the
    ``whitened`` errors use each transform's own norm.

    ``tile_rows``: judged ``tile_rows`` rows at a time, each error's squared sums added over the
    blocks, so the temporaries follow a block, not the layer. Only where that is the same
    judgement: a rule that acts element by element (Adam's, on its slice) or none, and
    transforms that act on rows (all do); the codec's round trip is per block, which equals
    the whole's where its scales are per block within rows (a per-tensor scale is then per
    block). A rule of the whole matrix (Muon) is judged whole."""
    rows = G.shape[0]
    if tile_rows is None or tile_rows >= rows or (rule is not None and rule.whole_matrix):
        sums = _judge_sums(G, codec, whiteners, rule, optimizer_is_l2=rule is None)
    else:
        cols, sums = G.shape[1], None
        for r0 in range(0, rows, tile_rows):
            r1 = min(rows, r0 + tile_rows)
            part = _judge_sums(G[r0:r1], codec, {k: RowBlock(w, r0, cols) for k, w in whiteners.items()},
                               None if rule is None else rule_on_rows(rule, r0, r1, cols),
                               optimizer_is_l2=rule is None)
            sums = part if sums is None else {k: tuple({m: (a[m][0] + b[m][0], a[m][1] + b[m][1]) for m in a}
                                                       for a, b in zip(sums[k], part[k])) for k in sums}
    kind = rule_kind(rule)
    return {k: tuple({**{m: _ratio(*sq) for m, sq in side.items()}, "rule_kind": kind} for side in pair)
            for k, pair in sums.items()}


def _squares(approx: Tensor, exact: Tensor) -> Tuple[float, float]:
    """``(||approx - exact||^2, ||exact||^2)`` in float64 sums."""
    return float((approx.double() - exact.double()).square().sum()), float(exact.double().square().sum())


def _ratio(err: float, ref: float) -> float:
    """:func:`relative_error` from its squared sums."""
    if ref == 0.0:
        return 0.0 if err == 0.0 else float("inf")
    return (err / ref) ** 0.5


def _judge_sums(G: Tensor, codec, whiteners: Dict[str, object], rule, *, optimizer_is_l2: bool) -> dict:
    """The squared sums behind :func:`judge_geometries`' errors: ``{key: (euclid, geo)}``, each
    ``{metric: (err^2, ref^2)}``. Without a rule the optimizer's error is the l2 one
    (``optimizer_is_l2``) or, for rows outside the rule's slice, nothing."""
    G = G.float()
    ref_update = rule.direction(G) if rule is not None else None

    def common(approx: Tensor) -> dict:
        l2 = _squares(approx, G)
        opt = (_squares(rule.direction(approx), ref_update) if rule is not None
               else l2 if optimizer_is_l2 else (0.0, 0.0))
        return {"l2": l2, "optimizer": opt}

    plain = roundtrip(G, codec)
    euclid = common(plain)
    out = {}
    for key, w in whiteners.items():
        ref_white = w.apply(G)
        geo_approx = roundtrip_whitened(ref_white, codec, w)  # G whitened once for both
        out[key] = ({**euclid, "whitened": _squares(w.apply(plain), ref_white)},
                    {**common(geo_approx), "whitened": _squares(w.apply(geo_approx), ref_white)})
    return out


class RowBlock:
    """A layer's transform on rows ``[row0, row0 + k)`` of its weight alone (through the
    transform's own ``apply_run``/``invert_run``, which place a run of the flat weight)."""

    def __init__(self, transform, row0: int, cols: int) -> None:
        self.transform, self.start = transform, row0 * cols

    def apply(self, G: Tensor) -> Tensor:
        return self.apply_run(G.reshape(-1), 0).view(G.shape)

    def invert(self, Z: Tensor) -> Tensor:
        return self.invert_run(Z.reshape(-1), 0).view(Z.shape)

    def apply_run(self, values: Tensor, start: int) -> Tensor:
        return self.transform.apply_run(values, self.start + start)

    def invert_run(self, values: Tensor, start: int) -> Tensor:
        return self.transform.invert_run(values, self.start + start)


def rule_on_rows(rule, row0: int, row1: int, cols: int):
    """An element-wise rule over a slice (``start``, its state) cut to rows ``[row0, row1)`` of
    the matrix it was made for: the part of its slice there, or None when it has none."""
    start, numel = rule.start or 0, getattr(rule, rule.state_keys[0]).numel()
    a, b = max(start, row0 * cols), min(start + numel, row1 * cols)
    if a >= b:
        return None
    state = {key: getattr(rule, key).reshape(-1)[a - start:b - start] for key in rule.state_keys}
    return dataclasses.replace(rule, start=a - row0 * cols, **state)