"""Statistics collection: forward pre-hooks on the candidate layers add ``x^T x`` of their
input to a per-step sum (modules that read the same input tensor, like q/k/v, share one
statistic), optionally on an evenly strided subsample of the tokens."""

from __future__ import annotations

from typing import Dict, Optional

import torch
from torch import nn

from .core.geometry import full_fp32_matmuls


class InputMoments:
    """Forward pre-hooks that sum ``x^T x`` of the input of each module while attached (in
    training forwards with gradients). Modules fed the same tensor (q/k/v, gate/up) share one
    statistic, keyed by the first of them (``key_of``). ``tokens`` caps the tokens per module
    and forward (evenly strided). Also used by ``benchmarks/fidelity.py``."""

    def __init__(self, modules: Dict[str, nn.Module], tokens: Optional[int] = None) -> None:
        self.modules = modules
        self.tokens = tokens
        self.key_of: Dict[str, str] = {}  # module -> module whose input statistic it shares
        self.sums: Dict[str, torch.Tensor] = {}
        self.counts: Dict[str, int] = {}
        self._last = None  # (tensor, key) of the most recent hooked input
        self._handles: list = []

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
            if not (module.training and torch.is_grad_enabled()):
                return None
            x = inputs[0]
            if self._last is not None and self._last[0] is x:
                self.key_of.setdefault(name, self._last[1])
            key = self.key_of.setdefault(name, name)
            if key == name:
                # fp32 whatever the run computes in: autocast would make this product bf16 (and
                # accumulate it there), a TF32 setting would round it to 10 mantissa bits
                with torch.no_grad(), torch.autocast(x.device.type, enabled=False), full_fp32_matmuls():
                    flat = subsample_tokens(x.detach().reshape(-1, x.shape[-1]), self.tokens).float()
                    moment = flat.T @ flat
                prev = self.sums.get(key)
                self.sums[key] = moment if prev is None else prev.add_(moment)
                self.counts[key] = self.counts.get(key, 0) + flat.shape[0]
            self._last = (x, key)
            return None

        return hook

    def restore_keys(self, key_of: Dict[str, str]) -> None:
        """Which statistic each layer feeds, as a checkpoint recorded it (layers sharing an input)."""
        self.key_of = dict(key_of)

    def take(self) -> Dict[str, torch.Tensor]:
        """Mean ``x x^T`` per statistic since the last call."""
        out = {key: total / max(self.counts[key], 1) for key, total in self.sums.items()}
        self.sums.clear()
        self.counts.clear()
        self._last = None
        return out


def subsample_tokens(rows: torch.Tensor, limit: Optional[int]) -> torch.Tensor:
    """At most ``limit`` rows, evenly strided (a view: nothing is copied before the cast)."""
    if limit is None or rows.shape[0] <= limit:
        return rows
    return rows[::-(-rows.shape[0] // limit)]
