"""Geometry lifecycle for one model: which layers take the geometry branch, their input
statistics, the fit of their whiteners, and the versions every rank must agree on.

Works on ``nn.Module`` names and a ``Comm``; knows nothing of DeepSpeed's optimizer.

Lifecycle, with ``k = global_step - start_step``:

* forward of step k: if ``k % collect_interval == 0`` or ``k % refresh_interval == 0``,
  pre-hooks on candidate ``nn.Linear`` modules add ``x^T x`` of their input to a per-step
  sum (modules that read the same input tensor, like q/k/v, share one statistic);
* end of step k: the step's statistic enters a local EMA (the average of local EMAs over
  ranks is the EMA of averaged statistics, so nothing is exchanged here);
* end of a refresh step (``k % refresh_interval == 0``): each statistic is averaged at the
  rank assigned to fit it - in full for narrow layers, as a one-round Nystrom sketch
  (O(in * (rank + oversample)) bytes instead of O(in^2)) for wide ones - that rank fits
  it, the factors are shared so every rank holds bit-identical whiteners,
  ``layers: "measured"`` re-profiles, and the version increases by one;
* ``adam_factored`` (Adam's geometry): at the end of a refresh step every rank sums the
  optimizer's ``exp_avg_sq`` over the rows and columns of the slices it owns (the seam's
  ``second_moment_sums``), one all-reduce of ``out + in + 1`` numbers per weight gives every
  rank the same sums, and each builds the same :class:`geometry.FactoredScaling`.

``geometry.kind`` may list several kinds (with ``layers: "measured"``): every refresh judges each
layer in each of them and the layer takes the one that lowers the error most in
``selection.metric`` (or stays Euclidean).
"""

from __future__ import annotations

import fnmatch
import logging
from typing import Protocol, Dict, List, Optional

import torch
from torch import nn

from .core import geometry as geo
from .core import metrics

logger = logging.getLogger("deepspeed_gift")

SKETCH_OVERSAMPLE = 8
PROFILE_MAX_ROWS = 256
# Statistics and eigenvectors travel as bf16: a 2^-8 relative perturbation of A_hat is far
# below what a low-rank + diagonal fit already discards, and it halves the metadata. The
# fitter rounds its factors the same way, so every rank still holds the same bits.
GEOMETRY_WIRE_DTYPE = torch.bfloat16  # rows of a layer's local gradient kept for the auto profile


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
                with torch.no_grad():
                    flat = subsample_tokens(x.detach().reshape(-1, x.shape[-1]), self.tokens).float()
                    moment = flat.T @ flat
                prev = self.sums.get(key)
                self.sums[key] = moment if prev is None else prev.add_(moment)
                self.counts[key] = self.counts.get(key, 0) + flat.shape[0]
            self._last = (x, key)
            return None

        return hook

    def take(self) -> Dict[str, torch.Tensor]:
        """Mean ``x x^T`` per statistic since the last call."""
        out = {key: total / max(self.counts[key], 1) for key, total in self.sums.items()}
        self.sums.clear()
        self.counts.clear()
        self._last = None
        return out


class OptimizerView(Protocol):
    """What geometry reads of the optimizer (``zero.ZeroOptimizerState`` for DeepSpeed's)."""

    capture_rank: Dict[str, int]  # the rank that captures a layer's gradient for the profile

    def update_rule(self, name: str):
        """The update rule judged for layer ``name`` (``core.metrics``), or None: plain L2."""

    def second_moment_sums(self, name: str):
        """This rank's (row sums, column sums, elements) of Adam's second moment of ``name``, or None."""


class NoOptimizer:
    """An optimizer GIFT does not read: every layer judged in plain L2, no Adam state."""

    capture_rank: Dict[str, int] = {}

    def update_rule(self, name: str):
        return None

    def second_moment_sums(self, name: str):
        return None


def find_candidates(cfg, model: nn.Module) -> Dict[str, nn.Linear]:
    """The layers ``gift.layers`` names: trainable ``nn.Linear`` modules by name."""
    linears = {n: m for n, m in model.named_modules()
               if isinstance(m, nn.Linear) and m.weight.requires_grad}
    layers = cfg.layers
    if layers in ("measured", "all"):
        return linears
    chosen = {n: m for n, m in linears.items() if any(fnmatch.fnmatchcase(n, p) for p in layers)}
    unmatched = [p for p in layers if not any(fnmatch.fnmatchcase(n, p) for n in linears)]
    if unmatched:
        sample = sorted(linears)[:6]
        raise ValueError(f"gift.layers: pattern(s) {unmatched} match no trainable nn.Linear module; "
                         f"module names look like {sample}")
    return chosen


class GeometryManager:
    """Each candidate layer's geometry: its input statistics, the transforms fitted from them and
    shared between ranks, and which layers take which transform (see the module docstring)."""

    def __init__(self, cfg, modules: Dict[str, nn.Linear], comm, *, main_codec,
                 optimizer: Optional[OptimizerView] = None) -> None:
        self.cfg = cfg
        self.gcfg = cfg.geometry
        self.comm = comm
        self.main_codec = main_codec
        self.kinds = geometry_kinds(self.gcfg.kind)  # () = identity: every layer Euclidean
        self.modules: Dict[str, nn.Linear] = dict(modules)
        self.names: List[str] = sorted(self.modules)
        self.version = 0
        self.step = -1  # k of the step being run (set by begin_step)
        self.transforms: Dict[str, Dict[str, object]] = {kind: {} for kind in self.kinds}  # kind -> layer -> map
        self.active: Dict[str, str] = {}  # layer in the geometry branch -> the kind it uses
        self.gains: Dict[str, float] = {}
        # The optimizer's side: which rank captures a layer's gradient for the profile (one that
        # holds the layer's state), the update rule judged there, and this rank's part of the row
        # and column sums of Adam's second moment (adam_factored).
        self.optimizer = optimizer if optimizer is not None else NoOptimizer()
        self.capture_rank: Dict[str, int] = dict(self.optimizer.capture_rank)
        self.profile: Optional[dict] = None  # summary of the latest profile, until telemetry takes it
        self.moments = InputMoments({n: self.modules[n] for n in self.names}, cfg.geometry.stats_tokens)
        self._stats: Dict[str, geo.CovarianceEMA] = {}
        self._lowrank: Dict[str, geo.LowRankDiag] = {}
        self._captured: Dict[str, tuple] = {}  # name -> (local gradient, the optimizer's rule then)
        self._check_widths()
        self.owner_of = balance_over_ranks({n: self.modules[n].in_features for n in self.names},
                                           self.comm.world_size)
        if "hadamard" in self.kinds:
            for i, name in enumerate(self.names):
                width = self.modules[name].in_features
                self.transforms["hadamard"][name] = geo.make_whitener("hadamard", width,
                                                                      seed=cfg.seed * 1_000_003 + i)
        if not self.kinds or self.cfg.layers != "measured":
            self.active = {name: self.kinds[0] if self.kinds else "identity" for name in self.names}

    def remove_hooks(self) -> None:
        """Take the statistics hooks off the model (``deepspeed_gift.detach``)."""
        self.moments.detach()

    @property
    def whiteners(self) -> Dict[str, object]:
        """The transform each layer uses now (layers in the branch whose transform exists)."""
        return {name: self.transforms[kind][name] for name, kind in sorted(self.active.items())
                if name in self.transforms.get(kind, {})}

    def _check_widths(self) -> None:
        if "kfac_input" not in self.kinds:
            return
        for name in self.names:
            width = self.modules[name].in_features
            if self.gcfg.rank > width:
                raise ValueError(f"gift.geometry.rank: got {self.gcfg.rank}; layer '{name}' has only "
                                 f"{width} input features, rank must be <= the narrowest selected layer "
                                 "(or narrow gift.layers)")

    # ---- statistics -----------------------------------------------------------------
    def begin_step(self, k: int) -> None:
        """Called before the forward of step k: the statistics hooks are on the model only on
        collect steps, so other steps run the model with no GIFT code in its forward."""
        self.step = k
        self.moments.new_forward()
        if self.collecting():
            self.moments.attach()
        else:
            self.moments.detach()

    def collecting(self) -> bool:
        k = self.step
        return ("kfac_input" in self.kinds and k >= 0
                and (k % self.gcfg.collect_interval == 0 or k % self.gcfg.refresh_interval == 0))

    def refresh_due(self, k: int) -> bool:
        return k >= 0 and k % self.gcfg.refresh_interval == 0 and bool(self.kinds)

    def _fold_step_statistics(self) -> None:
        for key, mean in self.moments.take().items():
            ema = self._stats.get(key)
            if ema is None:
                ema = self._stats[key] = geo.CovarianceEMA(mean.shape[0], decay=self.gcfg.stats_decay,
                                                           device=mean.device)
            ema.update_from_moment(mean)

    # ---- profile capture (called from the reduction on refresh steps) ----------------
    def profiling(self) -> bool:
        """Refresh steps judge every layer's coordinates: to select them (``layers: "measured"``) or,
        with sampled telemetry, to report their errors in every metric."""
        telemetry = self.cfg.telemetry
        return bool(self.kinds) and (self.cfg.layers == "measured" or (telemetry.fidelity and telemetry.every > 0))

    def wants_capture(self, name: str) -> bool:
        return (self.profiling() and self.refresh_due(self.step)
                and self.capture_rank.get(name, self.owner_of.get(name)) == self.comm.rank)

    def capture(self, name: str, grad2d: torch.Tensor) -> None:
        """Keep this step's local gradient of ``name`` and the optimizer's rule with its state
        now (the step about to run overwrites it)."""
        rows = grad2d.shape[0]
        # The optimizer's update (Muon's orthogonalization, Adam's state over a ZeRO slice) is
        # defined on the whole matrix; plain and whitened errors are row-wise, a sample will do
        # when selection does not use the optimizer's metric (which is then not reported) and
        # every transform acts on rows alike (Adam's scaling differs from row to row).
        rule = None
        if self.cfg.selection.metric == "optimizer" or rows <= PROFILE_MAX_ROWS or "adam_factored" in self.kinds:
            rule = self.optimizer.update_rule(name)
        else:
            index = torch.linspace(0, rows - 1, PROFILE_MAX_ROWS, device=grad2d.device).round().long()
            grad2d = grad2d.index_select(0, index)
        self._captured[name] = (grad2d.detach().float().clone(), rule)

    # ---- end of step ----------------------------------------------------------------
    def end_step(self, k: int) -> None:
        if "kfac_input" in self.kinds:
            self._fold_step_statistics()
        if not self.refresh_due(k):
            return
        previous = {kind: dict(maps) for kind, maps in self.transforms.items()}
        if "kfac_input" in self.kinds:
            self._refit()
        if "adam_factored" in self.kinds:
            self._refit_adam()
        if self.profiling():
            self._profile_and_select(previous)
        self.version += 1
        self._stamp_versions()

    def _stamp_versions(self) -> None:
        for maps in self.transforms.values():
            for w in maps.values():
                w.version = self.version

    def _refit_adam(self) -> None:
        """Adam's factored second moment of every layer: each rank adds the row and column sums
        of the ``exp_avg_sq`` it owns (and the fraction of the weight it covers), one all-reduce
        gives every rank the same totals, each builds the same scaling. A layer without Adam
        state on every element (Muon trains it, or no step yet) has none: it stays Euclidean."""
        parts = []
        for name in self.names:
            out_dim, width = self.modules[name].weight.shape
            got = self.optimizer.second_moment_sums(name)
            device = self.modules[name].weight.device
            if got is None:
                parts.append(torch.zeros(out_dim + width + 1, device=device))
            else:
                rows, cols, covered = got
                parts.append(torch.cat([rows.float(), cols.float(),
                                        torch.tensor([covered / (out_dim * width)], device=rows.device)]).to(device))
        flat = torch.cat(parts)
        self.comm.all_reduce_sum(flat, kind="geometry")
        built, pos = self.transforms["adam_factored"], 0
        for name in self.names:
            out_dim, width = self.modules[name].weight.shape
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
            scaling = geo.factored_scaling_from_sums(rows, cols)
            if scaling is None:
                built.pop(name, None)
            else:
                built[name] = scaling

    def _refit(self) -> None:
        """Average the statistics at each layer's fitter, fit there, share the factors.

        Each rank sends every statistic only to the rank that fits it (not an all-reduce:
        half the bytes of a ring). A narrow layer sends its full ``A``; a wide one a
        Nystrom sketch ``A @ Omega`` (in x (rank + oversample)) plus ``diag(A)``, with
        ``Omega`` warm-started from the previous factors so one round tracks the EMA."""
        keys = sorted(self._stats)
        if not keys:
            return
        world, me = self.comm.world_size, self.comm.rank
        fitter = self._assign(keys)
        omegas = {k: self._omega(k) for k in keys if not self._dense_exchange(self._stats[k].dim)}
        self._power_step(omegas)
        parts = [[] for _ in range(world)]
        for k in keys:
            A = self._stats[k].value()
            if k in omegas:
                contrib = torch.cat([(A @ omegas[k]).reshape(-1), torch.diagonal(A)])
            else:
                contrib = A.reshape(-1)
            parts[fitter[k]].append(contrib.to(GEOMETRY_WIRE_DTYPE))
        device = self._stats[keys[0]].value().device
        sends = [torch.cat(p) if p else torch.empty(0, dtype=GEOMETRY_WIRE_DTYPE, device=device) for p in parts]
        width = torch.finfo(GEOMETRY_WIRE_DTYPE).bits // 8
        recv_len = sum(self._contrib_numel(k, omegas) for k in keys if fitter[k] == me)
        total = sends[me].float()
        sends[me] = sends[me][:0]
        recv = self.comm.all_to_all_bytes(torch.cat([t.view(torch.uint8) for t in sends]),
                                          [t.numel() * width for t in sends],
                                          [0 if r == me else recv_len * width for r in range(world)],
                                          kind="geometry")
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
        self._lowrank.update(shared)
        self._rebuild_whiteners(shared)

    def _assign(self, keys: List[str]) -> Dict[str, int]:
        out = balance_over_ranks({k: self._stats[k].dim for k in keys}, self.comm.world_size)
        self.owner_of.update(out)
        return out

    def _dense_exchange(self, dim: int) -> bool:
        width = min(dim, self.gcfg.rank + SKETCH_OVERSAMPLE)
        return dim * dim <= dim * (width + 1)

    def _contrib_numel(self, key: str, omegas) -> int:
        dim = self._stats[key].dim
        return dim * omegas[key].shape[1] + dim if key in omegas else dim * dim

    def _omega(self, key: str) -> torch.Tensor:
        """Orthonormal test matrix: the previous eigenvectors plus seeded random columns."""
        dim = self._stats[key].dim
        width = min(dim, self.gcfg.rank + SKETCH_OVERSAMPLE)
        device = self._stats[key].value().device
        gen = torch.Generator().manual_seed(self.cfg.seed * 7919 + self.version * 131 + self.names.index(key))
        cols = torch.randn(dim, width, generator=gen, dtype=torch.float64)
        prev = self._lowrank.get(key)
        if prev is not None:
            cols[:, :prev.rank] = prev.U.double().cpu()
        return torch.linalg.qr(cols).Q.float().to(device)

    def _power_step(self, omegas: Dict[str, torch.Tensor]) -> None:
        """Layers without previous factors start from a random test matrix, which one
        Nystrom pass sees poorly (eigenvalues underestimated by 10-40%); one power step
        ``Omega <- orth(A_avg @ Omega)``, all-reduced so every rank holds it, fixes that.
        Later refreshes warm-start from the previous eigenvectors instead."""
        cold = [k for k in sorted(omegas) if k not in self._lowrank]
        if not cold:
            return
        # Only the subspace matters here, so the sum may travel (and round) in bf16.
        flat = torch.cat([(self._stats[k].value() @ omegas[k]).reshape(-1) for k in cold]).to(GEOMETRY_WIRE_DTYPE)
        self.comm.all_reduce_sum(flat, kind="geometry")
        flat = flat.float()
        pos = 0
        for k in cold:
            n = omegas[k].numel()
            omegas[k] = torch.linalg.qr(flat[pos:pos + n].view_as(omegas[k]).double()).Q.float()
            pos += n

    def _fit_one(self, key: str, flat: torch.Tensor, omega: Optional[torch.Tensor]) -> Optional[geo.LowRankDiag]:
        dim = self._stats[key].dim
        if not bool(torch.isfinite(flat).all()):
            logger.warning("gift: non-finite input statistics for layer '%s'; keeping its previous whitener", key)
            return None
        prev = self._lowrank.get(key)
        fd = self.gcfg.factor_decay
        if omega is None:
            A = flat.view(dim, dim)
            if prev is not None:
                A = geo.blend_low_rank(prev, A, factor_decay=fd)
            return geo.fit_low_rank_diag(A, rank=self.gcfg.rank, damping=self._damping_floor(torch.diagonal(A)),
                                         method=self.gcfg.method, seed=self.cfg.seed)
        Y = flat[:dim * omega.shape[1]].view(dim, omega.shape[1])
        diag = flat[dim * omega.shape[1]:]
        if prev is not None:
            Y = fd * geo.low_rank_matmul(prev, omega) + (1.0 - fd) * Y
            diag = fd * geo.low_rank_diagonal(prev) + (1.0 - fd) * diag
        return geo.nystrom_low_rank_diag(omega, Y, diag, rank=self.gcfg.rank, damping=self._damping_floor(diag))

    def _damping_floor(self, diag: torch.Tensor) -> float:
        if self.gcfg.damping_mode == "absolute":
            return self.gcfg.damping
        mean = float(diag.double().mean())
        # an all-zero input (a dead layer) still needs a positive floor
        return self.gcfg.damping * mean if mean > 0 and mean == mean else self.gcfg.damping

    def _rebuild_whiteners(self, keys) -> None:
        """Whiteners of every module whose statistic is among ``keys``, from the shared factors
        (modules sharing one input share one whitener object)."""
        built = {}
        for name in self.names:
            key = self.moments.key_of.get(name, name)
            if key in keys:
                if key not in built:
                    built[key] = geo.whitener_from_low_rank(self._lowrank[key], self.gcfg.solver)
                self.transforms["kfac_input"][name] = built[key]

    def _share(self, mine: Dict[str, geo.LowRankDiag], keys: List[str]) -> Dict[str, geo.LowRankDiag]:
        """Every fitter sends its factors (per layer: fp32 ``[index, lam, d]`` then ``U`` in
        the wire dtype); all ranks rebuild them from the same bits."""
        rank = self.gcfg.rank
        chunks = []
        for k, lrd in sorted(mine.items()):
            head = torch.cat([torch.tensor([float(keys.index(k))]), lrd.lam.float().cpu(), lrd.d.float().cpu()])
            chunks += [head.view(torch.uint8), lrd.U.to(GEOMETRY_WIRE_DTYPE).cpu().reshape(-1).view(torch.uint8)]
        blob = torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8)
        device = self._stats[keys[0]].value().device
        width = torch.finfo(GEOMETRY_WIRE_DTYPE).bits // 8
        shared = {}
        for b in self.comm.all_gather_bytes(blob.to(device), kind="geometry"):
            raw = b.cpu().clone()
            pos = 0
            while pos < raw.numel():
                k = keys[int(raw[pos:pos + 4].view(torch.float32))]
                dim = self._stats[k].dim
                head = raw[pos + 4:pos + 4 * (1 + rank + dim)].view(torch.float32)
                pos += 4 * (1 + rank + dim)
                U = raw[pos:pos + width * dim * rank].view(GEOMETRY_WIRE_DTYPE).float().view(dim, rank)
                pos += width * dim * rank
                shared[k] = geo.LowRankDiag(U=U.to(device), lam=head[:rank].to(device), d=head[rank:].to(device))
        return shared

    # ---- auto selection -------------------------------------------------------------
    def _profile_and_select(self, previous: Dict[str, Dict[str, object]]) -> None:
        """Judge each layer's coordinates in every configured kind on this step's real gradient,
        in every metric, and (``layers: "measured"``) give each layer the kind that lowers its error
        most in ``selection.metric``, if by at least ``min_gain``. The transform judged is the
        one built a refresh interval ago, not the fresh one: that is how stale a transform gets
        before its next refresh, and a fresh fit judged on the gradient of its own step flatters
        layers whose input statistics drift (measured: selected on in-sample gains, such layers
        tripled the error)."""
        metric = self.cfg.selection.metric
        kinds = self.kinds
        table = torch.zeros(len(self.names), len(kinds), len(PROFILE_COLUMNS), dtype=torch.float64)
        rule_codes = torch.zeros(len(self.names), dtype=torch.float64)
        for i, name in enumerate(self.names):
            G, rule = self._captured.get(name, (None, None))
            judged_by = {kind: previous[kind][name] for kind in kinds if name in previous[kind]}
            if G is None or not judged_by or not torch.isfinite(G).all() or G.abs().max() == 0:
                continue
            for kind, (euclid, geom) in metrics.judge_geometries(G, self.main_codec, judged_by, rule=rule).items():
                table[i, kinds.index(kind)] = torch.tensor(
                    [euclid[m] for m in metrics.METRICS] + [geom[m] for m in metrics.METRICS] + [1.0],
                    dtype=torch.float64)
            rule_codes[i] = float(RULE_CODES[metrics.rule_kind(rule)])
        self._captured.clear()
        flat = torch.cat([table.reshape(-1), rule_codes])
        self.comm.all_reduce_sum(flat, kind="control")
        table = flat[:table.numel()].view_as(table)
        judged = {}  # layer -> kind -> its profile row (every kind measured on the layer)
        for i, name in enumerate(self.names):
            rows = {kind: {**dict(zip(PROFILE_COLUMNS, table[i, j].tolist())), "rule": float(flat[table.numel() + i])}
                    for j, kind in enumerate(kinds)}
            rows = {kind: row for kind, row in rows.items() if row["measured"] and row["euclid_" + metric] > 0}
            if rows:
                judged[name] = rows
        if self.cfg.layers == "measured":
            chosen = []
            for name, rows in judged.items():
                # the first kind in configured order wins a tie
                gain, kind = max((1.0 - row["geo_" + metric] / row["euclid_" + metric], -kinds.index(kind))
                                 for kind, row in rows.items())
                kind = kinds[-kind]
                self.gains[name] = gain
                if gain >= self.cfg.selection.min_gain:
                    chosen.append((gain, name, kind))
            chosen.sort(key=lambda t: (-t[0], t[1]))
            if self.cfg.selection.max_layers is not None:
                chosen = chosen[:self.cfg.selection.max_layers]
            self.active = {name: kind for _, name, kind in chosen}
            if self.comm.rank == 0:
                counts = {kind: sum(k == kind for k in self.active.values()) for kind in kinds}
                logger.info("gift auto selection by %s error (version %d): %d of %d layers (%s); gains %s", metric,
                            self.version + 1, len(self.active), len(self.names),
                            ", ".join(f"{kind} {n}" for kind, n in counts.items()),
                            ", ".join(f"{n}={self.gains[n]:+.2f}" for n in sorted(self.gains)))
        if judged:
            self.profile = summarize_profile(judged, self.active, metric)

    # ---- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: statistics (this rank's EMAs), shared
        factors, Adam scalings, selection, gains, version."""
        scalings = self.transforms.get("adam_factored", {})
        return {
            "version": self.version,
            "active": dict(sorted(self.active.items())),
            "gains": dict(self.gains),
            "stats_key": dict(self.moments.key_of),
            "stats": {k: ema.state_dict() for k, ema in self._stats.items()},
            "lowrank": {k: (v.U.cpu(), v.lam.cpu(), v.d.cpu()) for k, v in self._lowrank.items()},
            "scalings": {k: (s.row.cpu(), s.col.cpu()) for k, s in sorted(scalings.items())},
        }

    def load_state_dict(self, state: dict) -> None:
        active = state["active"]
        if not isinstance(active, dict):  # checkpoints of one geometry kind kept a list of layers
            active = {name: self.kinds[0] if self.kinds else "identity" for name in active}
        unknown = sorted((set(active) | set(state["gains"]) | set(state.get("scalings", {}))) - set(self.names))
        if unknown:
            raise ValueError(f"gift checkpoint names layers this model does not have as candidates: {unknown[:5]}")
        kinds = set(self.kinds) or {"identity"}
        foreign = sorted({kind for kind in active.values() if kind not in kinds})
        if foreign:
            raise ValueError(f"gift checkpoint has layers on geometry kind(s) {foreign}; gift.geometry.kind is "
                             f"{self.gcfg.kind!r} now")
        self.version = int(state["version"])
        self.active = dict(active)
        self.gains = dict(state["gains"])
        self.moments.key_of = dict(state["stats_key"])
        device = next(iter(self.modules.values())).weight.device if self.modules else torch.device("cpu")
        self._stats = {}
        for k, ema_state in state["stats"].items():
            ema = geo.CovarianceEMA(ema_state["dim"], decay=self.gcfg.stats_decay, device=device)
            ema.load_state_dict(ema_state)
            self._stats[k] = ema
        self._lowrank = {k: geo.LowRankDiag(U=U.to(device), lam=lam.to(device), d=d.to(device))
                         for k, (U, lam, d) in state["lowrank"].items()}
        if "kfac_input" in self.kinds:
            self._rebuild_whiteners(self._lowrank)
        if "adam_factored" in self.kinds:
            self.transforms["adam_factored"] = {k: geo.FactoredScaling(row.to(device), col.to(device))
                                                for k, (row, col) in state.get("scalings", {}).items()}
        self._stamp_versions()

    # ---- what the reduction asks ----------------------------------------------------
    def whitener_for(self, name: str) -> Optional[object]:
        """The transform to use for ``name`` now, or None if it goes without one."""
        kind = self.active.get(name)
        return None if kind is None else self.transforms.get(kind, {}).get(name)

    def in_branch(self, name: str) -> bool:
        return name in self.active

    def take_profile(self) -> Optional[dict]:
        """The summary of the latest profile, once (telemetry's record of the step takes it)."""
        profile, self.profile = self.profile, None
        return profile

    def take_geometry_bytes(self) -> int:
        """Bytes this rank sent for statistics and factors since the last call."""
        return self.comm.bytes_sent.pop("geometry", 0)


def subsample_tokens(rows: torch.Tensor, limit: Optional[int]) -> torch.Tensor:
    """At most ``limit`` rows, evenly strided (a view: nothing is copied before the cast)."""
    if limit is None or rows.shape[0] <= limit:
        return rows
    return rows[::-(-rows.shape[0] // limit)]


def geometry_kinds(kind) -> tuple:
    """``geometry.kind`` as the kinds that have transforms, in configured order (identity: none)."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    return tuple(k for k in kinds if k != "identity")


def balance_over_ranks(widths: Dict[str, int], world_size: int) -> Dict[str, int]:
    """Greedy balance of fit cost (~ width^2) over ranks, widest first; identical on every rank."""
    load = [0.0] * world_size
    owner = {}
    for name in sorted(widths, key=lambda n: (-widths[n], n)):
        r = min(range(world_size), key=lambda j: (load[j], j))
        owner[name] = r
        load[r] += float(widths[name]) ** 2
    return owner


PROFILE_COLUMNS = tuple([f"euclid_{m}" for m in metrics.METRICS] + [f"geo_{m}" for m in metrics.METRICS]
                        + ["measured"])
RULE_CODES = {"l2": 0, "adam": 1, "muon": 2}


def summarize_profile(judged: Dict[str, Dict[str, dict]], active: Dict[str, str], metric: str) -> dict:
    """Telemetry of one profile: per layer and on average over the judged layers, the error of
    the coordinates in use (its geometry for a selected layer, Euclidean for the rest) and of
    all-Euclidean, in each metric; which update rules the optimizer metric used. A layer's
    ``geo_*`` are those of its kind in use, or else of the kind that measured best in
    ``metric``; with several kinds ``kinds`` has every kind's errors."""
    names = sorted(judged)
    out = {"profile_layers": len([n for n in names if n in active]), "profile_judged": len(names)}
    kind_of = {code: kind for kind, code in RULE_CODES.items()}
    kinds = sorted({kind_of[int(next(iter(judged[n].values()))["rule"])] for n in names})
    out["update_metric"] = "+".join(kinds) if kinds else "none"
    if not names:
        return out
    shown = {}
    for n in names:
        rows = judged[n]
        kind = active.get(n)
        if kind not in rows:
            kind = min(rows, key=lambda k: rows[k]["geo_" + metric])
        shown[n] = (kind, rows[kind])
    for m, label in (("l2", "l2"), ("whitened", "whitened"), ("optimizer", "update")):
        used = [row[("geo_" if n in active else "euclid_") + m] for n, (_, row) in shown.items()]
        euclid = [row["euclid_" + m] for _, row in shown.values()]
        out[f"profile_{label}"] = sum(used) / len(used)
        out[f"profile_{label}_euclid"] = sum(euclid) / len(euclid)
    per_layer = {}
    for n, (kind, row) in shown.items():
        entry = {"selected": n in active, "kind": kind,
                 **{k: round(v, 6) for k, v in row.items() if k not in ("measured", "rule")}}
        if len(judged[n]) > 1:
            entry["kinds"] = {k: {m: round(r["geo_" + m], 6) for m in metrics.METRICS} for k, r in judged[n].items()}
        per_layer[n] = entry
    out["profile_per_layer"] = per_layer
    return out
