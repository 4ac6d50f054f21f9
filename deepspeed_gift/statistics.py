"""Statistics collection: forward pre-hooks on the candidate layers add what the geometry's fit
needs of ``x^T x`` of their input to a per-step sum (modules that read the same input tensor,
like q/k/v, share one statistic), optionally on an evenly strided subsample of the tokens.

With a ``test_matrix`` provider (the plugin's :class:`~deepspeed_gift.refresh.KfacRefresh`) a
wide statistic is kept as a sketch: ``x^T (x Omega)`` (in x w) and the exact diagonal
``sum x^2`` (in), O(T in w) work and O(in w) bytes instead of O(T in^2) and O(in^2). Without one
(or for a narrow layer) the full ``x^T x``."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Union

import torch
from torch import nn

from .core.geometry import full_fp32_matmuls


@dataclass
class SketchedMoment:
    """One statistic's mean ``x x^T`` as a sketch: ``Y = A @ omega`` and ``diag(A)``."""

    Y: torch.Tensor
    diag: torch.Tensor

    def add_(self, other: "SketchedMoment") -> "SketchedMoment":
        self.Y.add_(other.Y)
        self.diag.add_(other.diag)
        return self

    def __truediv__(self, count: float) -> "SketchedMoment":
        return SketchedMoment(self.Y / count, self.diag / count)


Moment = Union[torch.Tensor, SketchedMoment]
# (statistic key, its fp32 input rows) -> the test matrix to sketch it with, or None for x^T x
TestMatrix = Callable[[str, torch.Tensor], Optional[torch.Tensor]]


def moment_of(rows: torch.Tensor, omega: Optional[torch.Tensor]) -> Moment:
    """The sum over ``rows`` of ``x x^T``: whole (``omega`` None) or sketched against ``omega``."""
    if omega is None:
        return rows.T @ rows
    return SketchedMoment(rows.T @ (rows @ omega), torch.linalg.vector_norm(rows, dim=0).square_())


class InputMoments:
    """Forward pre-hooks that sum ``x^T x`` (or its sketch, see the module docstring) of the
    input of each module while attached (in training forwards with gradients). Modules fed the
    same tensor (q/k/v, gate/up) share one statistic, keyed by the first of them (``key_of``).
    ``tokens`` caps the tokens per module and forward (evenly strided). Also used by
    ``benchmarks/fidelity.py``."""

    def __init__(self, modules: Dict[str, nn.Module], tokens: Optional[int] = None,
                 test_matrix: Optional[TestMatrix] = None) -> None:
        self.modules = modules
        self.tokens = tokens
        self.test_matrix = test_matrix
        self.key_of: Dict[str, str] = {}  # module -> module whose input statistic it shares
        self.sums: Dict[str, Moment] = {}
        self.counts: Dict[str, int] = {}
        self._last = None  # (tensor, key) of the most recent hooked input
        self._pending: Dict[str, int] = {}  # training forwards under no_grad not yet recomputed, per module
        self._handles: list = []
        self.seconds = 0.0  # host time in the hooks' sums since the last take_seconds

    def attach(self) -> None:
        if not self._handles:
            self._handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in self.modules.items()]

    def detach(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    @property
    def attached(self) -> bool:
        return bool(self._handles)

    def new_forward(self) -> None:
        self._last = None

    def _hook(self, name: str):
        def hook(module, inputs):
            if not module.training:
                return None
            # Activation recomputation runs a module's forward again inside the backward, on the
            # same inputs: non-reentrant checkpointing after a first forward with gradients (counted
            # then), reentrant after a first one under no_grad (not counted then: recorded, and the
            # recompute counts). So a forward in the backward counts only where one under no_grad
            # is waiting for it; each call of a module in a forward counts once, as its gradient does.
            in_backward = torch._C._current_graph_task_id() != -1
            if not torch.is_grad_enabled():
                if not in_backward:
                    self._pending[name] = self._pending.get(name, 0) + 1
                return None
            if in_backward:
                if not self._pending.get(name):
                    return None
                self._pending[name] -= 1
            x = inputs[0]
            if self._last is not None and self._last[0] is x:
                self.key_of.setdefault(name, self._last[1])
            key = self.key_of.setdefault(name, name)
            if key == name:
                t0 = time.perf_counter()
                # fp32 whatever the run computes in: autocast would make these products bf16 (and
                # accumulate them there), a TF32 setting would round them to 10 mantissa bits
                with torch.no_grad(), torch.autocast(x.device.type, enabled=False), full_fp32_matmuls():
                    flat = subsample_tokens(x.detach().reshape(-1, x.shape[-1]), self.tokens).float()
                    omega = self.test_matrix(key, flat) if self.test_matrix is not None else None
                    moment = moment_of(flat, omega)
                prev = self.sums.get(key)
                self.sums[key] = moment if prev is None else prev.add_(moment)
                self.counts[key] = self.counts.get(key, 0) + flat.shape[0]
                self.seconds += time.perf_counter() - t0
            self._last = (x, key)
            return None

        return hook

    def restore_keys(self, key_of: Dict[str, str]) -> None:
        """Which statistic each layer feeds, as a checkpoint recorded it (layers sharing an input)."""
        self.key_of = dict(key_of)

    def take(self) -> Dict[str, Moment]:
        """Mean ``x x^T`` (or its sketch) per statistic since the last call."""
        out = {key: total / max(self.counts[key], 1) for key, total in self.sums.items()}
        self.sums.clear()
        self.counts.clear()
        self._last = None
        self._pending.clear()
        return out


def subsample_tokens(rows: torch.Tensor, limit: Optional[int]) -> torch.Tensor:
    """At most ``limit`` rows, evenly strided (a view: nothing is copied before the cast)."""
    if limit is None or rows.shape[0] <= limit:
        return rows
    return rows[::-(-rows.shape[0] // limit)]
