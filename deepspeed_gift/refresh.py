"""Geometry refresh: fitting each layer's transform and sharing it, so every rank holds the
same bits.

* ``kfac_input`` (:class:`KfacRefresh`): each statistic (an EMA of this rank's ``x^T x``) is
  averaged at the rank assigned to fit it, in full for narrow layers, as a one-round Nystrom
  sketch (O(in * (rank + oversample)) bytes instead of O(in^2)) for wide ones; that rank fits
  a low-rank + diagonal approximation and every fitter's factors are gathered by all ranks.
* ``adam_factored`` (:func:`refit_adam_scalings`): every rank sums the optimizer's
  ``exp_avg_sq`` over the rows and columns of the slices it owns, one all-reduce of
  ``out + in + 1`` numbers per weight gives every rank the same sums, and each builds the same
  :class:`core.geometry.FactoredScaling`.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional

import torch
from torch import nn

from .config import DampingMode
from .core import geometry as geo
from .exchange.stats import ByteKind

logger = logging.getLogger("deepspeed_gift")

SKETCH_OVERSAMPLE = 8
# Statistics and eigenvectors travel as bf16: a 2^-8 relative perturbation of A_hat is far
# below what a low-rank + diagonal fit already discards, and it halves the metadata. The
# fitter rounds its factors the same way, so every rank still holds the same bits.
GEOMETRY_WIRE_DTYPE = torch.bfloat16


def balance_over_ranks(widths: Dict[str, int], world_size: int) -> Dict[str, int]:
    """Greedy balance of fit cost (~ width^2) over ranks, widest first; identical on every rank."""
    load = [0.0] * world_size
    owner = {}
    for name in sorted(widths, key=lambda n: (-widths[n], n)):
        r = min(range(world_size), key=lambda j: (load[j], j))
        owner[name] = r
        load[r] += float(widths[name]) ** 2
    return owner


class KfacRefresh:
    """The ``kfac_input`` statistics of one model on this rank and their refresh (see the module
    docstring). ``owner_of`` (layer or statistic -> fitting rank) is shared with the caller."""

    def __init__(self, gcfg, seed: int, comm, names: List[str], owner_of: Dict[str, int]) -> None:
        self.gcfg = gcfg
        self.seed = seed
        self.comm = comm
        self.names = names
        self.owner_of = owner_of
        self.stats: Dict[str, geo.CovarianceEMA] = {}
        self.lowrank: Dict[str, geo.LowRankDiag] = {}

    def fold(self, means: Dict[str, torch.Tensor]) -> None:
        """This step's mean ``x x^T`` per statistic into its local EMA (the average of local EMAs
        over ranks is the EMA of averaged statistics, so nothing is exchanged here)."""
        for key, mean in means.items():
            ema = self.stats.get(key)
            if ema is None:
                ema = self.stats[key] = geo.CovarianceEMA(mean.shape[0], decay=self.gcfg.stats_decay,
                                                          device=mean.device)
            ema.update_from_moment(mean)

    def state_dict(self) -> dict:
        return {"stats": {k: ema.state_dict() for k, ema in self.stats.items()},
                "lowrank": {k: (v.U.cpu(), v.lam.cpu(), v.d.cpu()) for k, v in self.lowrank.items()}}

    def load_state_dict(self, state: dict, device) -> None:
        self.stats = {}
        for k, ema_state in state["stats"].items():
            ema = geo.CovarianceEMA(ema_state["dim"], decay=self.gcfg.stats_decay, device=device)
            ema.load_state_dict(ema_state)
            self.stats[k] = ema
        self.lowrank = {k: geo.LowRankDiag(U=U.to(device), lam=lam.to(device), d=d.to(device))
                        for k, (U, lam, d) in state["lowrank"].items()}

    def refit(self, version: int) -> Dict[str, geo.LowRankDiag]:
        """Average the statistics at each layer's fitter, fit there, share the factors.

        Each rank sends every statistic only to the rank that fits it (not an all-reduce:
        half the bytes of a ring). A narrow layer sends its full ``A``; a wide one a
        Nystrom sketch ``A @ Omega`` (in x (rank + oversample)) plus ``diag(A)``, with
        ``Omega`` warm-started from the previous factors so one round tracks the EMA."""
        keys = sorted(self.stats)
        if not keys:
            return {}
        world, me = self.comm.world_size, self.comm.rank
        fitter = self._assign(keys)
        omegas = {k: self._omega(k, version) for k in keys if not self._dense_exchange(self.stats[k].dim)}
        self._power_step(omegas)
        parts = [[] for _ in range(world)]
        for k in keys:
            A = self.stats[k].value()
            if k in omegas:
                contrib = torch.cat([(A @ omegas[k]).reshape(-1), torch.diagonal(A)])
            else:
                contrib = A.reshape(-1)
            parts[fitter[k]].append(contrib.to(GEOMETRY_WIRE_DTYPE))
        device = self.stats[keys[0]].value().device
        sends = [torch.cat(p) if p else torch.empty(0, dtype=GEOMETRY_WIRE_DTYPE, device=device) for p in parts]
        width = torch.finfo(GEOMETRY_WIRE_DTYPE).bits // 8
        recv_len = sum(self._contrib_numel(k, omegas) for k in keys if fitter[k] == me)
        total = sends[me].float()
        sends[me] = sends[me][:0]
        recv = self.comm.all_to_all_bytes(torch.cat([t.view(torch.uint8) for t in sends]),
                                          [t.numel() * width for t in sends],
                                          [0 if r == me else recv_len * width for r in range(world)],
                                          kind=ByteKind.GEOMETRY)
        if world > 1 and recv_len:
            total += recv.view(GEOMETRY_WIRE_DTYPE).view(world - 1, recv_len).float().sum(0)
        total /= world
        fitted, pos = {}, 0
        for k in keys:
            if fitter[k] != me:
                continue
            n = self._contrib_numel(k, omegas)
            flat = total[pos:pos + n]
            pos += n
            lrd = self._fit_one(k, flat, omegas.get(k))
            if lrd is not None:
                fitted[k] = geo.LowRankDiag(U=lrd.U.to(GEOMETRY_WIRE_DTYPE).float(), lam=lrd.lam, d=lrd.d)
        shared = self._share(fitted, keys)
        self.lowrank.update(shared)
        return shared

    def _assign(self, keys: List[str]) -> Dict[str, int]:
        out = balance_over_ranks({k: self.stats[k].dim for k in keys}, self.comm.world_size)
        self.owner_of.update(out)
        return out

    def _dense_exchange(self, dim: int) -> bool:
        width = min(dim, self.gcfg.rank + SKETCH_OVERSAMPLE)
        return dim * dim <= dim * (width + 1)

    def _contrib_numel(self, key: str, omegas) -> int:
        dim = self.stats[key].dim
        return dim * omegas[key].shape[1] + dim if key in omegas else dim * dim

    def _omega(self, key: str, version: int) -> torch.Tensor:
        """Orthonormal test matrix: the previous eigenvectors plus seeded random columns."""
        dim = self.stats[key].dim
        width = min(dim, self.gcfg.rank + SKETCH_OVERSAMPLE)
        device = self.stats[key].value().device
        gen = torch.Generator().manual_seed(self.seed * 7919 + version * 131 + self.names.index(key))
        cols = torch.randn(dim, width, generator=gen, dtype=torch.float64)
        prev = self.lowrank.get(key)
        if prev is not None:
            cols[:, :prev.rank] = prev.U.double().cpu()
        return torch.linalg.qr(cols).Q.float().to(device)

    def _power_step(self, omegas: Dict[str, torch.Tensor]) -> None:
        """Layers without previous factors start from a random test matrix, which one
        Nystrom pass sees poorly (eigenvalues underestimated by 10-40%); one power step
        ``Omega <- orth(A_avg @ Omega)``, all-reduced so every rank holds it, fixes that.
        Later refreshes warm-start from the previous eigenvectors instead."""
        cold = [k for k in sorted(omegas) if k not in self.lowrank]
        if not cold:
            return
        # Only the subspace matters here, so the sum may travel (and round) in bf16.
        flat = torch.cat([(self.stats[k].value() @ omegas[k]).reshape(-1) for k in cold]).to(GEOMETRY_WIRE_DTYPE)
        self.comm.all_reduce_sum(flat, kind=ByteKind.GEOMETRY)
        flat = flat.float()
        pos = 0
        for k in cold:
            n = omegas[k].numel()
            omegas[k] = torch.linalg.qr(flat[pos:pos + n].view_as(omegas[k]).double()).Q.float()
            pos += n

    def _fit_one(self, key: str, flat: torch.Tensor, omega: Optional[torch.Tensor]) -> Optional[geo.LowRankDiag]:
        dim = self.stats[key].dim
        if not bool(torch.isfinite(flat).all()):
            logger.warning("gift: non-finite input statistics for layer '%s'; keeping its previous whitener", key)
            return None
        prev = self.lowrank.get(key)
        fd = self.gcfg.factor_decay
        if omega is None:
            A = flat.view(dim, dim)
            if prev is not None:
                A = geo.blend_low_rank(prev, A, factor_decay=fd)
            return geo.fit_low_rank_diag(A, rank=self.gcfg.rank, damping=self._damping_floor(torch.diagonal(A)),
                                         method=self.gcfg.method, seed=self.seed)
        Y = flat[:dim * omega.shape[1]].view(dim, omega.shape[1])
        diag = flat[dim * omega.shape[1]:]
        if prev is not None:
            Y = fd * geo.low_rank_matmul(prev, omega) + (1.0 - fd) * Y
            diag = fd * geo.low_rank_diagonal(prev) + (1.0 - fd) * diag
        return geo.nystrom_low_rank_diag(omega, Y, diag, rank=self.gcfg.rank, damping=self._damping_floor(diag))

    def _damping_floor(self, diag: torch.Tensor) -> float:
        if self.gcfg.damping_mode == DampingMode.ABSOLUTE:
            return self.gcfg.damping
        mean = float(diag.double().mean())
        # an all-zero input (a dead layer) still needs a positive floor
        return self.gcfg.damping * mean if mean > 0 and mean == mean else self.gcfg.damping

    def _share(self, mine: Dict[str, geo.LowRankDiag], keys: List[str]) -> Dict[str, geo.LowRankDiag]:
        """Every fitter sends its factors (per layer: fp32 ``[index, lam, d]`` then ``U`` in
        the wire dtype); all ranks rebuild them from the same bits."""
        rank = self.gcfg.rank
        chunks = []
        for k, lrd in sorted(mine.items()):
            head = torch.cat([torch.tensor([float(keys.index(k))]), lrd.lam.float().cpu(), lrd.d.float().cpu()])
            chunks += [head.view(torch.uint8), lrd.U.to(GEOMETRY_WIRE_DTYPE).cpu().reshape(-1).view(torch.uint8)]
        blob = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        device = self.stats[keys[0]].value().device
        width = torch.finfo(GEOMETRY_WIRE_DTYPE).bits // 8
        shared = {}
        for b in self.comm.all_gather_bytes(blob.to(device), kind=ByteKind.GEOMETRY):
            raw = b.cpu().clone()
            pos = 0
            while pos < raw.numel():
                k = keys[int(raw[pos:pos + 4].view(torch.float32))]
                dim = self.stats[k].dim
                head = raw[pos + 4:pos + 4 * (1 + rank + dim)].view(torch.float32)
                pos += 4 * (1 + rank + dim)
                U = raw[pos:pos + width * dim * rank].view(GEOMETRY_WIRE_DTYPE).float().view(dim, rank)
                pos += width * dim * rank
                shared[k] = geo.LowRankDiag(U=U.to(device), lam=head[:rank].to(device), d=head[rank:].to(device))
        return shared


def refit_adam_scalings(names: List[str], modules: Dict[str, nn.Linear], optimizer, comm,
                        built: Dict[str, object], *, version: int) -> None:
    """Adam's factored second moment of every layer: each rank adds the row and column sums
    of the ``exp_avg_sq`` it owns (and the fraction of the weight it covers), one all-reduce
    gives every rank the same totals, each builds the same scaling. A layer without Adam
    state on every element (Muon trains it, or no step yet) has none: it stays Euclidean."""
    parts = []
    for name in names:
        out_dim, width = modules[name].weight.shape
        got = optimizer.second_moment_sums(name)
        device = modules[name].weight.device
        if got is None:
            parts.append(torch.zeros(out_dim + width + 1, device=device))
        else:
            rows, cols, covered = got
            parts.append(torch.cat([rows.float(), cols.float(),
                                    torch.tensor([covered / (out_dim * width)], device=rows.device)]).to(device))
    flat = torch.cat(parts)
    comm.all_reduce_sum(flat, kind=ByteKind.GEOMETRY)
    pos = 0
    for name in names:
        out_dim, width = modules[name].weight.shape
        rows, cols = flat[pos:pos + out_dim], flat[pos + out_dim:pos + out_dim + width]
        covered = float(flat[pos + out_dim + width])
        pos += out_dim + width + 1
        if abs(covered - 1.0) > 1e-3:  # not every element has Adam state
            built.pop(name, None)
            continue
        if not bool(torch.isfinite(rows).all() and torch.isfinite(cols).all()):
            logger.warning("gift: non-finite Adam second moment for layer '%s'; keeping its previous scaling",
                           name)
            continue
        scaling = geo.factored_scaling_from_sums(rows, cols, version=version)
        if scaling is None:
            built.pop(name, None)
        else:
            built[name] = scaling
