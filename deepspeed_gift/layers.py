"""Geometry lifecycle for one model: which layers take the geometry branch, their input
statistics, the fit of their whiteners, and the versions every rank must agree on.

Works on ``nn.Module`` names and a ``Comm``; knows nothing of DeepSpeed's optimizer.

Lifecycle, with ``k = global_step - start_step``:

* forward of step k: if ``k % collect_interval == 0`` or ``k % refresh_interval == 0``,
  pre-hooks on candidate ``nn.Linear`` modules add ``x^T x`` of their input to a per-step
  sum (modules that read the same input tensor, like q/k/v, share one statistic);
* end of step k: the step's statistic enters a local EMA (the average of local EMAs over
  ranks is the EMA of averaged statistics, so nothing is exchanged here);
* end of a refresh step (``k % refresh_interval == 0``): the statistics are averaged over
  the data-parallel group - through a randomized sketch ``A Q`` for wide layers (bytes
  O(in * (rank + oversample)) per round instead of O(in^2)) - each layer is fitted by the
  rank it is assigned to, the factors are shared so every rank holds bit-identical
  whiteners, ``layers: "auto"`` re-profiles, and the version increases by one.
"""

from __future__ import annotations

import fnmatch
import io
import logging
from typing import Dict, List, Optional

import torch
from torch import nn

from . import geometry as geo

logger = logging.getLogger("deepspeed_gift")

SKETCH_OVERSAMPLE = 8
SKETCH_POWER_ITERS = 2
PROFILE_MAX_ROWS = 256  # rows of a layer's local gradient kept for the auto profile


class GeometryManager:
    def __init__(self, cfg, model: nn.Module, comm, *, main_codec) -> None:
        self.cfg = cfg
        self.gcfg = cfg.geometry
        self.comm = comm
        self.main_codec = main_codec
        self.kind = self.gcfg.kind
        self.modules: Dict[str, nn.Linear] = self._find_candidates(model)
        self.names: List[str] = sorted(self.modules)
        self.version = 0
        self.step = -1  # k of the step being run (set by begin_step)
        self.whiteners: Dict[str, geo.Whitener] = {}
        self.active: set = set()
        self.gains: Dict[str, float] = {}
        self.geometry_bytes = 0  # bytes sent for statistics and factors since last read
        self._hooks = []
        self._stats: Dict[str, geo.CovarianceEMA] = {}
        self._step_sum: Dict[str, torch.Tensor] = {}
        self._step_count: Dict[str, int] = {}
        self._stats_key: Dict[str, str] = {}  # module -> module whose input statistic it shares
        self._last_input = None  # (tensor, key) of the most recent hooked input
        self._lowrank: Dict[str, geo.LowRankDiag] = {}
        self._captured: Dict[str, torch.Tensor] = {}
        self._check_widths()
        self.owner_of = self._assign_fitters()
        if self.kind == "hadamard":
            for i, name in enumerate(self.names):
                width = self.modules[name].in_features
                self.whiteners[name] = geo.make_whitener("hadamard", width, seed=cfg.seed * 1_000_003 + i)
        if self.kind == "identity" or self.cfg.layers != "auto":
            self.active = set(self.names)
        if self.kind == "kfac_input":
            for name in self.names:
                self._hooks.append(self.modules[name].register_forward_pre_hook(self._make_hook(name)))

    # ---- selection of candidates ----------------------------------------------------
    def _find_candidates(self, model: nn.Module) -> Dict[str, nn.Linear]:
        linears = {n: m for n, m in model.named_modules()
                   if isinstance(m, nn.Linear) and m.weight.requires_grad}
        layers = self.cfg.layers
        if layers in ("auto", "all"):
            return linears
        chosen = {n: m for n, m in linears.items() if any(fnmatch.fnmatchcase(n, p) for p in layers)}
        unmatched = [p for p in layers if not any(fnmatch.fnmatchcase(n, p) for n in linears)]
        if unmatched:
            sample = sorted(linears)[:6]
            raise ValueError(f"gift.layers: pattern(s) {unmatched} match no trainable nn.Linear module; "
                             f"module names look like {sample}")
        return chosen

    def _check_widths(self) -> None:
        if self.kind != "kfac_input":
            return
        for name in self.names:
            width = self.modules[name].in_features
            if self.gcfg.rank > width:
                raise ValueError(f"gift.geometry.rank: got {self.gcfg.rank}; layer '{name}' has only "
                                 f"{width} input features, rank must be <= the narrowest selected layer "
                                 "(or narrow gift.layers)")

    def _assign_fitters(self) -> Dict[str, int]:
        """Greedy balance of fit cost (~ in^2 * rank) over ranks; identical on every rank."""
        load = [0.0] * self.comm.world_size
        owner = {}
        for name in sorted(self.names, key=lambda n: (-self.modules[n].in_features, n)):
            r = min(range(len(load)), key=lambda j: (load[j], j))
            owner[name] = r
            load[r] += float(self.modules[name].in_features) ** 2
        return owner

    # ---- statistics -----------------------------------------------------------------
    def begin_step(self, k: int) -> None:
        self.step = k
        self._last_input = None

    def collecting(self) -> bool:
        k = self.step
        return (self.kind == "kfac_input" and k >= 0
                and (k % self.gcfg.collect_interval == 0 or k % self.gcfg.refresh_interval == 0))

    def refresh_due(self, k: int) -> bool:
        return k >= 0 and k % self.gcfg.refresh_interval == 0 and self.kind != "identity"

    def _make_hook(self, name: str):
        def hook(module, inputs):
            if not (module.training and torch.is_grad_enabled() and self.collecting()):
                return None
            x = inputs[0]
            last = self._last_input
            if last is not None and last[0] is x:
                self._stats_key.setdefault(name, last[1])
            key = self._stats_key.setdefault(name, name)
            if key == name:
                with torch.no_grad():
                    flat = x.detach().reshape(-1, x.shape[-1]).float()
                    moment = flat.T @ flat
                prev = self._step_sum.get(key)
                self._step_sum[key] = moment if prev is None else prev.add_(moment)
                self._step_count[key] = self._step_count.get(key, 0) + flat.shape[0]
            self._last_input = (x, key)
            return None

        return hook

    def _fold_step_statistics(self) -> None:
        for key, total in self._step_sum.items():
            ema = self._stats.get(key)
            if ema is None:
                ema = self._stats[key] = geo.CovarianceEMA(total.shape[0], decay=self.gcfg.stats_decay,
                                                           device=total.device)
            ema.update_from_moment(total / max(self._step_count[key], 1))
        self._step_sum.clear()
        self._step_count.clear()

    # ---- profile capture (called from the reduction on refresh steps) ----------------
    def wants_capture(self, name: str) -> bool:
        return (self.cfg.layers == "auto" and self.kind != "identity" and self.refresh_due(self.step)
                and self.owner_of.get(name) == self.comm.rank)

    def capture(self, name: str, grad2d: torch.Tensor) -> None:
        rows = grad2d.shape[0]
        if rows > PROFILE_MAX_ROWS:
            index = torch.linspace(0, rows - 1, PROFILE_MAX_ROWS, device=grad2d.device).round().long()
            grad2d = grad2d.index_select(0, index)
        self._captured[name] = grad2d.detach().float().clone()

    # ---- end of step ----------------------------------------------------------------
    def end_step(self, k: int) -> None:
        if self.kind == "kfac_input":
            self._fold_step_statistics()
        if not self.refresh_due(k):
            return
        if self.kind == "kfac_input":
            self._refit()
        if self.cfg.layers == "auto":
            self._profile_and_select()
        self.version += 1
        for w in self.whiteners.values():
            w.version = self.version

    def _refit(self) -> None:
        keys = sorted(k for k in self._stats)
        if not keys:
            return
        fitted = {}
        dense_keys = [k for k in keys if self._dense_exchange(self._stats[k].dim)]
        sketch_keys = [k for k in keys if k not in dense_keys]
        fitted.update(self._fit_dense(dense_keys))
        fitted.update(self._fit_sketched(sketch_keys))
        shared = self._share(fitted)
        for key, lrd in shared.items():
            self._lowrank[key] = lrd
        for name in self.names:
            key = self._stats_key.get(name, name)
            if key in shared:
                self.whiteners[name] = self._whitener_for(key)

    def _whitener_for(self, key: str) -> geo.Whitener:
        cache = getattr(self, "_whitener_cache", None)
        if cache is None or cache[0] != self.version:
            self._whitener_cache = cache = (self.version, {})
        if key not in cache[1]:
            cache[1][key] = geo.whitener_from_low_rank(self._lowrank[key], self.gcfg.solver)
        return cache[1][key]

    def _dense_exchange(self, dim: int) -> bool:
        width = min(dim, self.gcfg.rank + SKETCH_OVERSAMPLE)
        return dim * width * (SKETCH_POWER_ITERS + 2) >= dim * dim

    def _fitter_of(self, key: str) -> int:
        return self.owner_of.get(key, 0)

    def _fit_dense(self, keys: List[str]) -> Dict[str, geo.LowRankDiag]:
        if not keys:
            return {}
        flat = torch.cat([self._stats[k].value().reshape(-1) for k in keys])
        before = sum(self.comm.bytes_sent.values())
        self.comm.all_reduce_sum(flat, kind="geometry")
        self.geometry_bytes += sum(self.comm.bytes_sent.values()) - before
        flat.div_(self.comm.world_size)
        out, pos = {}, 0
        for k in keys:
            dim = self._stats[k].dim
            A = flat[pos:pos + dim * dim].view(dim, dim)
            pos += dim * dim
            if self._fitter_of(k) != self.comm.rank:
                continue
            prev = self._lowrank.get(k)
            if prev is not None:
                A = geo.blend_low_rank(prev, A, factor_decay=self.gcfg.factor_decay)
            out[k] = geo.fit_low_rank_diag(A, rank=self.gcfg.rank, damping=self.gcfg.damping,
                                           method=self.gcfg.method, seed=self.cfg.seed)
        return out

    def _fit_sketched(self, keys: List[str]) -> Dict[str, geo.LowRankDiag]:
        """Randomized subspace iteration on the group average of the local EMAs, one
        all-reduce of all layers' ``A Q`` per round; the fitter then finishes each layer."""
        if not keys:
            return {}
        world = self.comm.world_size
        width = {k: min(self._stats[k].dim, self.gcfg.rank + SKETCH_OVERSAMPLE) for k in keys}

        def matmul_all(qs: Dict[str, torch.Tensor], with_diag: bool = False):
            parts = [self._stats[k].value() @ qs[k] for k in keys]
            if with_diag:
                parts += [torch.diagonal(self._stats[k].value()) for k in keys]
            flat = torch.cat([p.reshape(-1) for p in parts])
            before = sum(self.comm.bytes_sent.values())
            self.comm.all_reduce_sum(flat, kind="geometry")
            self.geometry_bytes += sum(self.comm.bytes_sent.values()) - before
            flat.div_(world)
            out, pos = {}, 0
            for k in keys:
                n = qs[k].numel()
                y = flat[pos:pos + n].view_as(qs[k])
                pos += n
                prev = self._lowrank.get(k)
                if prev is not None:
                    fd = self.gcfg.factor_decay
                    y = fd * _low_rank_matmul(prev, qs[k]) + (1.0 - fd) * y
                out[k] = y
            diags = {}
            if with_diag:
                for k in keys:
                    dim = self._stats[k].dim
                    d = flat[pos:pos + dim]
                    pos += dim
                    prev = self._lowrank.get(k)
                    if prev is not None:
                        fd = self.gcfg.factor_decay
                        d = fd * _low_rank_diagonal(prev) + (1.0 - fd) * d
                    diags[k] = d
            return out, diags

        qs = {}
        for i, k in enumerate(keys):
            gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + self.version * 131 + i)
            qs[k] = torch.randn(self._stats[k].dim, width[k], generator=gen).to(self._stats[k].value().device)
        ys, _ = matmul_all(qs)
        for _ in range(SKETCH_POWER_ITERS):
            qs = {k: torch.linalg.qr(ys[k]).Q for k in keys}
            ys, _ = matmul_all(qs)
        qs = {k: torch.linalg.qr(ys[k]).Q for k in keys}
        aqs, diags = matmul_all(qs, with_diag=True)
        out = {}
        for k in keys:
            if self._fitter_of(k) != self.comm.rank:
                continue
            out[k] = _low_rank_diag_from_sketch(qs[k], aqs[k], diags[k], rank=self.gcfg.rank,
                                                   damping=self.gcfg.damping)
        return out

    def _share(self, mine: Dict[str, geo.LowRankDiag]) -> Dict[str, geo.LowRankDiag]:
        """Every rank sends the factors it fitted; all end up with the same bits."""
        buf = io.BytesIO()
        torch.save({k: (v.U.cpu(), v.lam.cpu(), v.d.cpu()) for k, v in mine.items()}, buf)
        blob = torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)
        before = sum(self.comm.bytes_sent.values())
        blobs = self.comm.all_gather_bytes(blob, kind="geometry")
        self.geometry_bytes += sum(self.comm.bytes_sent.values()) - before
        shared = {}
        for b in blobs:
            part = torch.load(io.BytesIO(b.cpu().numpy().tobytes()), weights_only=True)
            for k, (U, lam, d) in part.items():
                device = self._stats[k].value().device if k in self._stats else U.device
                shared[k] = geo.LowRankDiag(U=U.to(device), lam=lam.to(device), d=d.to(device))
        return shared

    # ---- auto selection -------------------------------------------------------------
    def _roundtrip_error(self, G: torch.Tensor, whitener: Optional[geo.Whitener]) -> float:
        codec = self.main_codec
        if whitener is None:
            back = codec.decode(codec.encode(G))
        else:
            back = whitener.invert(codec.decode(codec.encode(whitener.apply(G))))
        return float((back - G).norm() / G.norm().clamp_min(1e-30))

    def _profile_and_select(self) -> None:
        gains = torch.zeros(len(self.names), 3, dtype=torch.float64)  # err_euclid, err_geo, measured
        for i, name in enumerate(self.names):
            G = self._captured.get(name)
            w = self.whiteners.get(name)
            if G is None or w is None or not torch.isfinite(G).all() or G.abs().max() == 0:
                continue
            gains[i, 0] = self._roundtrip_error(G, None)
            gains[i, 1] = self._roundtrip_error(G, w)
            gains[i, 2] = 1.0
        self._captured.clear()
        self.comm.all_reduce_sum(gains, kind="control")
        chosen = []
        for i, name in enumerate(self.names):
            e_euc, e_geo, measured = gains[i].tolist()
            if not measured or e_euc <= 0:
                continue
            gain = 1.0 - e_geo / e_euc
            self.gains[name] = gain
            if gain >= self.cfg.selection.min_gain:
                chosen.append((gain, name))
        chosen.sort(key=lambda t: (-t[0], t[1]))
        if self.cfg.selection.max_layers is not None:
            chosen = chosen[:self.cfg.selection.max_layers]
        self.active = {name for _, name in chosen}
        if self.comm.rank == 0:
            logger.info("gift auto selection (version %d): %d of %d layers; gains %s", self.version + 1,
                        len(self.active), len(self.names),
                        ", ".join(f"{n}={self.gains[n]:+.2f}" for n in sorted(self.gains)))

    # ---- what the reduction asks ----------------------------------------------------
    def whitener_for(self, name: str) -> Optional[geo.Whitener]:
        """The whitener to use for ``name`` now, or None if it goes without transform."""
        if name not in self.active:
            return None
        return self.whiteners.get(name)

    def in_branch(self, name: str) -> bool:
        return name in self.active

    def remove_hooks(self) -> None:
        for h in self._hooks:
            h.remove()
        self._hooks.clear()

    def take_geometry_bytes(self) -> int:
        n, self.geometry_bytes = self.geometry_bytes, 0
        return n


def _low_rank_matmul(lrd: geo.LowRankDiag, Q: torch.Tensor) -> torch.Tensor:
    """``A_hat @ Q`` without forming ``A_hat``."""
    return lrd.U @ (lrd.lam[:, None] * (lrd.U.T @ Q)) + lrd.d[:, None] * Q


def _low_rank_diagonal(lrd: geo.LowRankDiag) -> torch.Tensor:
    return lrd.U.square() @ lrd.lam + lrd.d


def _low_rank_diag_from_sketch(Q: torch.Tensor, AQ: torch.Tensor, diag: torch.Tensor, *, rank: int,
                               damping: float) -> geo.LowRankDiag:
    """Rayleigh-Ritz on an orthonormal basis ``Q`` with ``AQ = A @ Q``: top-``rank``
    eigenpairs of ``A`` within span(Q), plus the clamped residual diagonal."""
    T = (Q.T.double() @ AQ.double())
    T = 0.5 * (T + T.T)
    evals, evecs = torch.linalg.eigh(T)
    top = torch.argsort(evals, descending=True)[:rank]
    lam = evals[top].clamp_min(0.0)
    U = Q.double() @ evecs[:, top]
    d = (diag.double() - U.square() @ lam).clamp_min(damping)
    return geo.LowRankDiag(U=U.float(), lam=lam.float(), d=d.float())
