"""Geometry refresh: fitting each layer's transform and sharing it, so every rank holds the
same bits.

* ``kfac_input`` (:class:`KfacRefresh`): each statistic is this rank's EMA of a sketch of its
  ``x^T x`` (``A @ Omega``, in x (rank + oversample), and the exact diagonal; :class:`SketchEMA`),
  so a rank holds O(in * (rank + oversample)) per layer, never in x in (a layer narrower than its
  sketch is kept whole). At a refresh each is averaged at the rank assigned to fit it; that rank
  fits a low-rank + diagonal approximation (Nystrom) and every fitter's factors are gathered by
  all ranks; the next test matrices are built from the new factors.
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


def sketch_width(dim: int, rank: int) -> int:
    """Columns of the test matrix of a statistic of width ``dim`` at factor rank ``rank``."""
    return min(dim, rank + SKETCH_OVERSAMPLE)


def sketch_columns(dim: int, rank: int) -> int:
    """Columns of the sketch of a statistic of width ``dim`` at factor rank ``rank``, or 0 where
    the whole ``A`` is kept: a layer whose ``A`` is no larger than its sketch and diagonal."""
    width = sketch_width(dim, rank)
    return 0 if dim * dim <= dim * (width + 1) else width


class SketchEMA:
    """This rank's EMA of one statistic as the fit reads it: ``Y = A @ omega`` (in x w) and
    ``diag(A)`` exactly, or, for a layer narrow enough that the sketch would not be smaller
    (``omega`` None), ``A`` itself. ``omega`` is fixed between refreshes, so the EMA of the
    sketches is the sketch of the EMA; a refresh moves the average onto the next test matrix
    (:meth:`rebase`). The first update sets the average, later ones blend
    ``decay * old + (1 - decay) * new`` (as :class:`core.geometry.CovarianceEMA`)."""

    def __init__(self, dim: int, omega: Optional[torch.Tensor], decay: float) -> None:
        self.dim = dim
        self.omega = omega
        self.decay = decay
        self.count = 0
        self.Y: Optional[torch.Tensor] = None  # A @ omega, or A
        self.diag: Optional[torch.Tensor] = None

    @property
    def dense(self) -> bool:
        return self.omega is None

    @torch.no_grad()
    def update(self, mean, periods: int = 1) -> None:
        """Blend this collection's ``mean`` in; ``periods``: the collections it stands for (those
        a spaced schedule skipped since the last, plus itself), so the old average ages by the
        steps that passed, not by the collections made."""
        Y, diag = (mean, None) if self.dense else (mean.Y, mean.diag)
        decay = self.decay ** periods
        if self.Y is None:
            self.Y = Y.float().clone()
            self.diag = None if diag is None else diag.float().clone()
        else:
            self.Y.mul_(decay).add_(Y, alpha=1.0 - decay)
            if diag is not None:
                self.diag.mul_(decay).add_(diag, alpha=1.0 - decay)
        self.count += 1

    def contribution(self) -> torch.Tensor:
        """What this rank sends its statistic's fitter: ``[Y, diag(A)]`` flat, or ``A`` flat."""
        return self.Y.reshape(-1) if self.dense else torch.cat([self.Y.reshape(-1), self.diag])

    @property
    def device(self) -> torch.device:
        return self.Y.device

    @torch.no_grad()
    def rebase(self, omega: torch.Tensor) -> None:
        """Sketch the average against the next test matrix. Only ``A @ old omega`` is held, so
        ``A`` is taken as its Nystrom approximation ``Y (omega^T Y)^+ Y^T`` (the PSD matrix of
        largest trace that sketch admits, and <= A): the directions the old test matrix saw
        carry over, the rest of ``A`` is left to the exact diagonal, which the fit gives what
        the low rank does not hold."""
        if self.dense:
            return
        if self.Y is not None:
            Y = self.Y.double()
            core = self.omega.double().T @ Y
            evals, evecs = torch.linalg.eigh(0.5 * (core + core.T))
            keep = evals > REBASE_RCOND * evals.abs().max().clamp_min(1e-300)
            half = Y @ (evecs[:, keep] / evals[keep].sqrt())  # A_nys = half @ half^T
            self.Y = (half @ (half.T @ omega.double())).float()
        self.omega = omega

    def state_dict(self) -> dict:
        return {"dim": self.dim, "count": self.count, "omega": None if self.dense else self.omega.cpu(),
                "Y": self.Y.cpu(), "diag": None if self.dense else self.diag.cpu()}

    @classmethod
    def from_state(cls, state: dict, decay: float, device) -> "SketchEMA":
        omega = state["omega"]
        ema = cls(int(state["dim"]), None if omega is None else omega.to(device), decay)
        ema.count = int(state["count"])
        ema.Y = state["Y"].to(device)
        ema.diag = None if state["diag"] is None else state["diag"].to(device)
        return ema


# eigenvalues of the sketch's core below this fraction of the largest are noise, not directions
REBASE_RCOND = 1e-7


class KfacRefresh:
    """The ``kfac_input`` statistics of one model on this rank and their refresh (see the module
    docstring). ``owner_of`` (layer or statistic -> fitting rank) is shared with the caller.

    A statistic is held as a :class:`SketchEMA` against a test matrix ``omega`` that every rank
    holds bit for bit: built from the latest shared factors and seeded random columns, or, for a
    statistic's very first sketch, by one power step agreed over the ranks (:meth:`test_matrix`)."""

    def __init__(self, gcfg, seed: int, comm, names: List[str], owner_of: Dict[str, int]) -> None:
        self.gcfg = gcfg
        self.seed = seed
        self.comm = comm
        self.names = names
        self.owner_of = owner_of
        self.version = 0  # the version the next refit makes factors for
        self.omegas: Dict[str, Optional[torch.Tensor]] = {}  # statistic -> its test matrix (None: whole)
        self.stats: Dict[str, SketchEMA] = {}
        self.lowrank: Dict[str, geo.LowRankDiag] = {}

    def sketch_width(self, dim: int) -> int:
        return sketch_width(dim, self.gcfg.rank)

    def _dense_exchange(self, dim: int) -> bool:
        """A layer whose whole ``A`` is no larger than its sketch and diagonal is kept whole."""
        return sketch_columns(dim, self.gcfg.rank) == 0

    def test_matrix(self, key: str, rows: torch.Tensor) -> Optional[torch.Tensor]:
        """The test matrix of statistic ``key`` (its hook's fp32 input ``rows``), made the first
        time the key is seen: warm from the shared factors where they exist (a resumed run);
        else random, which one Nystrom pass sees poorly (eigenvalues underestimated by 10-40%),
        so it takes one power step ``orth(A Omega)`` on this forward's inputs, all-reduced so
        every rank holds it (a collective inside the forward, once per statistic per run: every
        rank runs the same forward)."""
        if key in self.omegas:
            return self.omegas[key]
        dim = rows.shape[1]
        if self._dense_exchange(dim):
            self.omegas[key] = None
            return None
        omega = self._omega(key, dim, self.version, rows.device)
        if key not in self.lowrank:
            # Only the subspace matters here, so the sum may travel (and round) in bf16.
            flat = (rows.T @ (rows @ omega)).to(GEOMETRY_WIRE_DTYPE)
            self.comm.all_reduce_sum(flat, kind=ByteKind.GEOMETRY)
            omega = torch.linalg.qr(flat.double()).Q.float()
        self.omegas[key] = omega
        return omega

    def fold(self, means: Dict[str, object], periods: int = 1) -> None:
        """This step's mean ``x x^T`` (or its sketch) per statistic into its local EMA (the
        average of local EMAs over ranks is the EMA of averaged statistics, so nothing is
        exchanged here); ``periods`` as :meth:`SketchEMA.update`."""
        for key, mean in means.items():
            ema = self.stats.get(key)
            if ema is None:
                dim = mean.shape[0] if isinstance(mean, torch.Tensor) else mean.diag.shape[0]
                ema = self.stats[key] = SketchEMA(dim, self.omegas.get(key), self.gcfg.stats_decay)
            ema.update(mean, periods)

    def nbytes(self) -> int:
        """Bytes of everything this holds (statistics, test matrices, factors)."""
        total = 0
        for ema in self.stats.values():
            total += sum(t.numel() * t.element_size() for t in (ema.Y, ema.diag) if t is not None)
        total += sum(o.numel() * o.element_size() for o in self.omegas.values() if o is not None)
        for lrd in self.lowrank.values():
            total += sum(t.numel() * t.element_size() for t in (lrd.U, lrd.lam, lrd.d))
        return total

    def state_dict(self) -> dict:
        return {"sketches": {k: ema.state_dict() for k, ema in self.stats.items()},
                "omegas": {k: None if o is None else o.cpu() for k, o in self.omegas.items()},
                "lowrank": {k: (v.U.cpu(), v.lam.cpu(), v.d.cpu()) for k, v in self.lowrank.items()}}

    def load_state_dict(self, state: dict, device, version: int) -> None:
        self.version = version
        self.lowrank = {k: geo.LowRankDiag(U=U.to(device), lam=lam.to(device), d=d.to(device))
                        for k, (U, lam, d) in state["lowrank"].items()}
        decay = self.gcfg.stats_decay
        if "sketches" in state:
            self.stats = {k: SketchEMA.from_state(s, decay, device) for k, s in state["sketches"].items()}
            self.omegas = {k: None if o is None else o.to(device) for k, o in state["omegas"].items()}
            return
        # A checkpoint of whole in x in averages: each sketched against the test matrix the next
        # refit would have built from them (the same seeds), so the run goes on as it would have.
        self.stats, self.omegas = {}, {}
        for k, ema_state in state["stats"].items():
            A = ema_state["value"].to(device=device, dtype=torch.float32)
            dim = A.shape[0]
            omega = None if self._dense_exchange(dim) else self._omega(k, dim, version, device)
            ema = self.stats[k] = SketchEMA(dim, omega, decay)
            ema.count = int(ema_state["count"])
            ema.Y = A.clone() if omega is None else A @ omega
            ema.diag = None if omega is None else torch.diagonal(A).clone()
            self.omegas[k] = omega

    def refit(self, version: int, periods: int = 1) -> Dict[str, geo.LowRankDiag]:
        """Average the statistics at each layer's fitter, fit there, share the factors, and move
        every statistic onto the test matrix of the next refit. ``periods``: the refresh
        intervals since the last refit (more than one where a spaced schedule skipped refits),
        so the previous factors weigh ``factor_decay ** periods``.

        Each rank sends every statistic only to the rank that fits it (not an all-reduce:
        half the bytes of a ring): a narrow layer its full ``A``; a wide one its sketch
        ``A @ Omega`` (in x (rank + oversample)) plus ``diag(A)``."""
        keys = sorted(self.stats)
        if not keys:
            return {}
        world, me = self.comm.world_size, self.comm.rank
        fitter = self._assign(keys)
        parts = [[] for _ in range(world)]
        for k in keys:
            parts[fitter[k]].append(self.stats[k].contribution().to(GEOMETRY_WIRE_DTYPE))
        device = self.stats[keys[0]].device
        sends = [torch.cat(p) if p else torch.empty(0, dtype=GEOMETRY_WIRE_DTYPE, device=device) for p in parts]
        width = torch.finfo(GEOMETRY_WIRE_DTYPE).bits // 8
        recv_len = sum(self._contrib_numel(k) for k in keys if fitter[k] == me)
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
            n = self._contrib_numel(k)
            flat = total[pos:pos + n]
            pos += n
            lrd = self._fit_one(k, flat, self.stats[k].omega, self.gcfg.factor_decay ** periods)
            if lrd is not None:
                fitted[k] = geo.LowRankDiag(U=lrd.U.to(GEOMETRY_WIRE_DTYPE).float(), lam=lrd.lam, d=lrd.d)
        shared = self._share(fitted, keys)
        self.lowrank.update(shared)
        self.version = version + 1
        for k in keys:
            ema = self.stats[k]
            if not ema.dense:
                self.omegas[k] = self._omega(k, ema.dim, self.version, device)
                ema.rebase(self.omegas[k])
        return shared

    def _assign(self, keys: List[str]) -> Dict[str, int]:
        out = balance_over_ranks({k: self.stats[k].dim for k in keys}, self.comm.world_size)
        self.owner_of.update(out)
        return out

    def _contrib_numel(self, key: str) -> int:
        ema = self.stats[key]
        return ema.dim * ema.dim if ema.dense else ema.dim * ema.omega.shape[1] + ema.dim

    def _omega(self, key: str, dim: int, version: int, device) -> torch.Tensor:
        """Orthonormal test matrix: the latest shared eigenvectors plus seeded random columns
        (the same bits on every rank)."""
        width = self.sketch_width(dim)
        gen = torch.Generator().manual_seed(self.seed * 7919 + version * 131 + self.names.index(key))
        cols = torch.randn(dim, width, generator=gen, dtype=torch.float64)
        prev = self.lowrank.get(key)
        if prev is not None:
            cols[:, :prev.rank] = prev.U.double().cpu()
        return torch.linalg.qr(cols).Q.float().to(device)

    def _fit_one(self, key: str, flat: torch.Tensor, omega: Optional[torch.Tensor],
                 fd: float) -> Optional[geo.LowRankDiag]:
        dim = self.stats[key].dim
        if not bool(torch.isfinite(flat).all()):
            logger.warning("gift: non-finite input statistics for layer '%s'; keeping its previous whitener", key)
            return None
        prev = self.lowrank.get(key)
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
        device = self.stats[keys[0]].device
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


def weight_shape(module: nn.Module) -> torch.Size:
    """The whole shape of a layer's weight: ZeRO stage 3 keeps only a partition in the parameter
    (an empty tensor outside its forward and backward) and the whole shape in ``ds_shape``."""
    weight = module.weight
    return getattr(weight, "ds_shape", None) or weight.shape


def refit_adam_scalings(names: List[str], modules: Dict[str, nn.Linear], optimizer, comm,
                        built: Dict[str, object], *, version: int) -> None:
    """Adam's factored second moment of every layer: each rank adds the row and column sums
    of the ``exp_avg_sq`` it owns (and the fraction of the weight it covers), one all-reduce
    gives every rank the same totals, each builds the same scaling. A layer without Adam
    state on every element (Muon trains it, or no step yet) has none: it stays Euclidean."""
    parts = []
    for name in names:
        out_dim, width = weight_shape(modules[name])
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
        out_dim, width = weight_shape(modules[name])
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
