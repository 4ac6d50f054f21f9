"""Geometry lifecycle for one model: which layers take the geometry branch, their input
statistics, the fit of their whiteners, and the versions every rank must agree on.

Works on ``nn.Module`` names and a ``Comm``; knows nothing of DeepSpeed's optimizer.

Lifecycle, with ``k = global_step - start_step``:

* forward of step k: if ``k % collect_interval == 0`` or step k refreshes (below),
  pre-hooks on candidate ``nn.Linear`` modules add ``x^T x`` of their input to a per-step
  sum (modules that read the same input tensor, like q/k/v, share one statistic);
* end of step k: the step's statistic enters a local EMA (the average of local EMAs over
  ranks is the EMA of averaged statistics, so nothing is exchanged here);
* end of a refresh step (``k % refresh_interval == 0``, or ``selection.idle_backoff``'s
  schedule below): each statistic is averaged at the
  rank assigned to fit it - in full for narrow layers, as a one-round Nystrom sketch
  (O(in * (rank + oversample)) bytes instead of O(in^2)) for wide ones - that rank fits
  it, the factors are shared so every rank holds bit-identical whiteners,
  ``layers: "measured"`` re-profiles, and the version increases by one;
* ``adam_factored`` (Adam's geometry): at the end of a refresh step every rank sums the
  optimizer's ``exp_avg_sq`` over the rows and columns of the slices it owns (the seam's
  ``second_moment_sums``), one all-reduce of ``out + in + 1`` numbers per weight gives every
  rank the same sums, and each builds the same :class:`geometry.FactoredScaling`.

A refresh also judges every layer (``layers: "measured"``, or telemetry's profile). While
measured selection chooses no layer, ``selection.idle_backoff`` spaces the judged refreshes out
(twice the gap after each idle one, up to ``idle_backoff`` x ``refresh_interval``): the factors
are then refitted alone ``refresh_interval`` steps before each judgement, and the statistics
collected only in the ``2 x refresh_interval`` steps before it. The first collection and the
refit after such a gap age what came before by the steps that passed (``stats_decay`` once per
collection skipped, ``factor_decay`` once per refresh interval), as if nothing had been skipped.

``geometry.kind`` may list several kinds (with ``layers: "measured"``): every refresh judges each
layer in each of them and the layer takes the one that lowers the error most in
``selection.metric`` (or stays Euclidean).
"""

from __future__ import annotations

import fnmatch
import logging
import math
import time
from typing import Protocol, Dict, List, Optional

import torch
from torch import nn

from .config import Layers
from .core import geometry as geo
from .core.geometry import GeometryKind as K
from .exchange.stats import ByteKind
from .refresh import KfacRefresh, balance_over_ranks, refit_adam_scalings, weight_shape
from .selection import PROFILE_MAX_ROWS, Selection, rows_of_slice, summarize_profile
from .statistics import InputMoments

logger = logging.getLogger("deepspeed_gift")



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


# Linear layers of tensor-parallel frameworks, which are not nn.Linear: Megatron's and GPT-NeoX's
# ColumnParallelLinear / RowParallelLinear, DeepSpeed AutoTP's LinearLayer / LinearAllreduce. Their
# weight is (out, in) of this rank's shard and their input this rank's (row-parallel: its slice of
# the features; column-parallel: all of them): the input statistic of a shard is its own input's.
TENSOR_PARALLEL_LINEARS = ("ColumnParallelLinear", "RowParallelLinear", "LinearLayer", "LinearAllreduce")


def is_linear(module: nn.Module) -> bool:
    """A trainable linear layer GIFT can give geometry: an ``nn.Linear``, or a tensor-parallel
    framework's linear (by class name, ``TENSOR_PARALLEL_LINEARS``) with a 2-D ``weight``."""
    weight = getattr(module, "weight", None)
    if not isinstance(weight, nn.Parameter) or len(weight_shape(module)) != 2 or not weight.requires_grad:
        return False
    return isinstance(module, nn.Linear) or type(module).__name__ in TENSOR_PARALLEL_LINEARS


def input_width(module: nn.Module) -> int:
    """The features a linear layer reads: its weight's second dimension (``in_features`` of an
    ``nn.Linear``; of a tensor-parallel shard, what this rank's shard reads)."""
    return int(weight_shape(module)[1])


def find_candidates(cfg, model: nn.Module, gather=None) -> Dict[str, nn.Module]:
    """The layers ``gift.layers`` names: trainable linear layers (:func:`is_linear`) by name. A
    pattern must match somewhere: here, or, with ``gather`` (every process's view of an object,
    all-gathered over the job: pipeline stages hold different layers), on some process of the job;
    then every process raises alike instead of one stage dying while the others wait."""
    linears = {n: m for n, m in model.named_modules() if is_linear(m)}
    layers = cfg.layers
    if layers in (Layers.MEASURED, Layers.ALL):
        return linears
    chosen = {n: m for n, m in linears.items() if any(fnmatch.fnmatchcase(n, p) for p in layers)}
    matched = [p for p in layers if any(fnmatch.fnmatchcase(n, p) for n in linears)]
    names = sorted(linears)[:6]
    if gather is not None:
        views = gather((matched, names))
        matched = sorted({p for found, _ in views for p in found})
        names = sorted({n for _, sample in views for n in sample})[:6]
    unmatched = [p for p in layers if p not in matched]
    if unmatched:
        raise ValueError(f"gift.layers: pattern(s) {unmatched} match no trainable linear module (nn.Linear or "
                         f"{', '.join(TENSOR_PARALLEL_LINEARS)}){' on any process of the job' if gather else ''}; "
                         f"module names look like {names}")
    return chosen


def collections_between(last: Optional[int], k: int, collect_interval: int, refresh_interval: int) -> int:
    """The collections the unspaced schedule makes in steps ``(last, k]`` (at the multiples of
    ``collect_interval`` or of ``refresh_interval``), at least 1: what a collection at ``k``
    stands for when ``last`` was the previous one (1 on the unspaced schedule, more after a gap
    of ``selection.idle_backoff``'s). With both intervals ``refresh_interval``: the refresh
    intervals since the refit at ``last``. ``last`` None (none yet, or a checkpoint from before
    these were saved): 1."""
    if last is None:
        return 1
    c, r = collect_interval, refresh_interval
    both = c * r // math.gcd(c, r)

    def made(x: int) -> int:
        return x // c + x // r - x // both
    return max(1, made(k) - made(last))


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
        # When refreshes judge: every refresh_interval steps (next_judge None: at the multiples
        # of it) until a judgement selects no layer; then selection.idle_backoff spaces them
        # (``_schedule_after``), with a refit alone refresh_interval steps before each
        self.gap = self.gcfg.refresh_interval
        self.next_judge: Optional[int] = None
        self.next_refit: Optional[int] = None
        # the last steps that folded statistics and refitted: a spaced schedule's first
        # collection and refit after a gap age what came before by the steps that passed
        self.last_fold: Optional[int] = None
        self.last_refit: Optional[int] = None
        self.seconds = 0.0  # host time in captures, refits and judgements since take_seconds
        self.transforms: Dict[str, Dict[str, object]] = {kind: {} for kind in self.kinds}  # kind -> layer -> map
        self.active: Dict[str, str] = {}  # layer in the geometry branch -> the kind it uses
        # The optimizer's side: which rank captures a layer's gradient for the profile (one that
        # holds the layer's state), the update rule judged there, and this rank's part of the row
        # and column sums of Adam's second moment (adam_factored).
        self.optimizer = optimizer if optimizer is not None else NoOptimizer()
        self.capture_rank: Dict[str, int] = dict(self.optimizer.capture_rank)
        self.profile: Optional[dict] = None  # summary of the latest profile, until telemetry takes it
        self._check_widths()
        self.owner_of = balance_over_ranks({n: input_width(self.modules[n]) for n in self.names},
                                           self.comm.world_size)
        self.kfac = KfacRefresh(self.gcfg, cfg.seed, comm, self.names, self.owner_of)
        self.moments = InputMoments({n: self.modules[n] for n in self.names}, cfg.geometry.stats_tokens,
                                    test_matrix=self.kfac.test_matrix)
        self.selection = Selection(cfg, self.kinds, self.names, comm, main_codec)
        self.gains = self.selection.gains  # each layer's measured gain, kept in checkpoints
        for kind in self.kinds:  # data-independent kinds: built once here
            build = geo.FIXED_KINDS.get(kind)
            if build is not None:
                for i, name in enumerate(self.names):
                    self.transforms[kind][name] = build(input_width(self.modules[name]), cfg.seed * 1_000_003 + i)
        if not self.kinds or self.cfg.layers != Layers.MEASURED:
            self.active = {name: self.kinds[0] if self.kinds else K.IDENTITY.value for name in self.names}

    def remove_hooks(self) -> None:
        """Take the statistics hooks off the model (``deepspeed_gift.detach``)."""
        self.moments.detach()

    @property
    def whiteners(self) -> Dict[str, object]:
        """The transform each layer uses now (layers in the branch whose transform exists)."""
        return {name: self.transforms[kind][name] for name, kind in sorted(self.active.items())
                if name in self.transforms.get(kind, {})}

    def _check_widths(self) -> None:
        if K.KFAC_INPUT not in self.kinds:
            return
        for name in self.names:
            width = input_width(self.modules[name])
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
        window = self.next_judge is None or k >= self.next_judge - 2 * self.gcfg.refresh_interval
        return (K.KFAC_INPUT in self.kinds and k >= 0 and window
                and (k % self.gcfg.collect_interval == 0 or self.refresh_due(k)))

    def judging(self, k: int) -> bool:
        """Step ``k`` refreshes and judges the layers (``selection.idle_backoff``)."""
        if not self.kinds or k < 0:
            return False
        if self.next_judge is None:
            return k % self.gcfg.refresh_interval == 0
        return k >= self.next_judge

    def refresh_due(self, k: int) -> bool:
        """Step ``k`` refits the factors: a judged refresh, or the refit alone before one."""
        return self.judging(k) or (bool(self.kinds) and self.next_refit is not None and k >= self.next_refit)

    def _schedule_after(self, k: int, judged: bool) -> None:
        """After the refresh of step ``k``: the next judgement ``refresh_interval`` steps on, or,
        when measured selection judged layers and chose none, twice the last gap on (at most
        ``idle_backoff`` x ``refresh_interval``), its transforms refitted ``refresh_interval``
        steps before it (the first refresh, with no transform yet to judge, is no judgement).
        Every rank of the group holds the same selection, so the same steps."""
        interval = self.gcfg.refresh_interval
        idle = self.cfg.layers == Layers.MEASURED and judged and not self.active
        self.gap = min(2 * self.gap, self.cfg.selection.idle_backoff * interval) if idle else interval
        self.gap = max(self.gap, interval)
        self.next_judge = k + self.gap
        self.next_refit = self.next_judge - interval if self.gap > interval else None
        if idle and self.gap > interval and self.comm.rank == 0:
            logger.info("gift: no layer selected at step %d; the next judgement at step %d (refit at %d, "
                        "statistics from %d)", k, self.next_judge, self.next_refit, self.next_judge - 2 * interval)

    # ---- profile capture (called from the reduction on refresh steps) ----------------
    def profiling(self) -> bool:
        """Refresh steps judge every layer's coordinates: to select them (``layers: "measured"``) or,
        with sampled telemetry, to report their errors in every metric."""
        telemetry = self.cfg.telemetry
        return bool(self.kinds) and (self.cfg.layers == Layers.MEASURED or (telemetry.fidelity and telemetry.every > 0))

    def wants_capture(self, name: str) -> bool:
        return (self.profiling() and self.judging(self.step)
                and self.capture_rank.get(name, self.owner_of.get(name)) == self.comm.rank)

    def capture(self, name: str, grad2d: torch.Tensor) -> None:
        """Judge this step's local gradient of ``name`` now, with the optimizer's rule and its
        state now (the step about to run overwrites it) and the transforms in use (the refit at
        the end of the step replaces them): nothing of the gradient is kept."""
        t0 = time.perf_counter()
        self._capture(name, grad2d)
        self.seconds += time.perf_counter() - t0

    def _capture(self, name: str, grad2d: torch.Tensor) -> None:
        rows = grad2d.shape[0]
        # The optimizer's update (Muon's orthogonalization, Adam's state over a ZeRO slice) is
        # defined on the whole matrix; plain and whitened errors are row-wise, a sample will do
        # when selection does not use the optimizer's metric (which is then not reported) and
        # every transform acts on rows alike (Adam's scaling differs from row to row).
        rule = None
        if self.cfg.selection.metric == "optimizer" or rows <= PROFILE_MAX_ROWS or K.ADAM_FACTORED in self.kinds:
            rule = self.optimizer.update_rule(name)
        else:
            index = torch.linspace(0, rows - 1, PROFILE_MAX_ROWS, device=grad2d.device).round().long()
            grad2d = grad2d.index_select(0, index)
        transforms = {kind: self.transforms[kind][name] for kind in self.kinds if name in self.transforms[kind]}
        grad2d, rule, transforms = rows_of_slice(grad2d, rule, transforms)
        self.selection.judge_captured(name, grad2d.detach().float(), rule, transforms)

    # ---- end of step ----------------------------------------------------------------
    def end_step(self, k: int) -> None:
        """End of step k: fold its statistics; on a refresh step refit, share, judge and select,
        and the version goes up (a transform built now carries the new version)."""
        if not self.moments.sums and not self.refresh_due(k):
            self.moments.take()  # nothing collected, nothing due: nothing to fold or fit (nor to time)
        else:
            t0 = time.perf_counter()
            self._end_step(k)
            self.seconds += time.perf_counter() - t0
        # a step that collected (its hooks were on) counts as a collection made, data or not: the
        # next one ages by the collections skipped since, none on the unspaced schedule
        if self.moments.attached and self.step == k:
            self.last_fold = k

    def _end_step(self, k: int) -> None:
        if K.KFAC_INPUT in self.kinds:
            means = self.moments.take()
            if means:
                self.kfac.fold(means, collections_between(self.last_fold, k, self.gcfg.collect_interval,
                                                          self.gcfg.refresh_interval))
        if not self.refresh_due(k):
            return
        judging = self.judging(k)
        if K.KFAC_INPUT in self.kinds:
            periods = collections_between(self.last_refit, k, self.gcfg.refresh_interval, self.gcfg.refresh_interval)
            self._rebuild_whiteners(self.kfac.refit(self.version, periods), self.version + 1)
        self.last_refit = k
        if K.ADAM_FACTORED in self.kinds:
            refit_adam_scalings(self.names, self.modules, self.optimizer, self.comm,
                                self.transforms[K.ADAM_FACTORED], version=self.version + 1)
        judged = {}
        if judging and self.profiling():
            judged = self.selection.judge()
            if self.cfg.layers == Layers.MEASURED:
                self.active = self.selection.select(judged, self.version + 1)
            if judged:
                self.profile = summarize_profile(judged, self.active, self.cfg.selection.metric)
        if judging:
            self._schedule_after(k, bool(judged))
        else:
            self.next_refit = None
        self.version += 1

    def _rebuild_whiteners(self, keys, version: int) -> None:
        """Whiteners of every module whose statistic is among ``keys``, from the shared factors
        (modules sharing one input share one whitener object)."""
        built = {}
        for name in self.names:
            key = self.moments.key_of.get(name, name)
            if key in keys:
                if key not in built:
                    built[key] = geo.whitener_from_low_rank(self.kfac.lowrank[key], self.gcfg.solver, version=version)
                self.transforms[K.KFAC_INPUT][name] = built[key]



    # ---- checkpointing --------------------------------------------------------------
    def state_dict(self) -> dict:
        """Everything needed to continue exactly: statistics (this rank's EMAs), shared
        factors, Adam scalings, selection, gains, version."""
        scalings = self.transforms.get(K.ADAM_FACTORED, {})
        return {
            "version": self.version,
            "active": dict(sorted(self.active.items())),
            "gains": dict(self.gains),
            "stats_key": dict(self.moments.key_of),
            **self.kfac.state_dict(),
            "scalings": {k: (s.row.cpu(), s.col.cpu()) for k, s in sorted(scalings.items())},
            "schedule": {"gap": self.gap, "next_judge": self.next_judge, "next_refit": self.next_refit,
                         "last_fold": self.last_fold, "last_refit": self.last_refit,
                         "refresh_interval": self.gcfg.refresh_interval,
                         "idle_backoff": self.cfg.selection.idle_backoff},
        }

    def load_state_dict(self, state: dict) -> None:
        active = state["active"]
        if not isinstance(active, dict):  # checkpoints of one geometry kind kept a list of layers
            active = {name: self.kinds[0] if self.kinds else K.IDENTITY.value for name in active}
        unknown = sorted((set(active) | set(state["gains"]) | set(state.get("scalings", {}))) - set(self.names))
        if unknown:
            raise ValueError(f"gift checkpoint names layers this model does not have as candidates: {unknown[:5]}")
        kinds = set(self.kinds) or {K.IDENTITY}
        foreign = sorted({kind for kind in active.values() if kind not in kinds})
        if foreign:
            raise ValueError(f"gift checkpoint has layers on geometry kind(s) {foreign}; gift.geometry.kind is "
                             f"{self.gcfg.kind!r} now")
        self.version = int(state["version"])
        self.active = dict(active)
        self._load_schedule(state.get("schedule", {}))
        self.gains.clear()
        self.gains.update(state["gains"])
        self.moments.restore_keys(state["stats_key"])
        device = next(iter(self.modules.values())).weight.device if self.modules else torch.device("cpu")
        self.kfac.load_state_dict(state, device, self.version)
        if K.KFAC_INPUT in self.kinds:
            self._rebuild_whiteners(self.kfac.lowrank, self.version)
        if K.ADAM_FACTORED in self.kinds:
            self.transforms[K.ADAM_FACTORED] = {k: geo.FactoredScaling(row.to(device), col.to(device),
                                                                       version=self.version)
                                                for k, (row, col) in state.get("scalings", {}).items()}

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

    def _load_schedule(self, schedule: dict) -> None:
        """The saved schedule, where this run's ``refresh_interval`` and ``idle_backoff`` could have
        made it (a checkpoint that names neither: where its gap is one of this config's); else,
        and for checkpoints from before ``selection.idle_backoff``, judgements at the multiples
        of ``refresh_interval`` from here on."""
        interval, backoff = self.gcfg.refresh_interval, self.cfg.selection.idle_backoff
        gap = int(schedule.get("gap", interval))
        same = (schedule.get("refresh_interval", interval) == interval
                and schedule.get("idle_backoff", backoff) == backoff and gap % interval == 0
                and interval <= gap <= backoff * interval)
        if schedule and not same and self.comm.rank == 0:
            logger.info("gift: the checkpoint's refresh schedule (every %s steps, backoff %s, gap %d) is not "
                        "this config's (every %d, backoff %d): judging at the multiples of %d from here",
                        schedule.get("refresh_interval", "?"), schedule.get("idle_backoff", "?"), gap,
                        interval, backoff, interval)
        # what already happened holds whatever the config: the next fold and refit age by it
        self.last_fold, self.last_refit = schedule.get("last_fold"), schedule.get("last_refit")
        if not same:
            schedule = {}
        self.gap = int(schedule.get("gap", interval))
        self.next_judge, self.next_refit = schedule.get("next_judge"), schedule.get("next_refit")

    def take_seconds(self) -> float:
        """Host seconds in this geometry's own work since the last call: the statistics hooks'
        sums, the profile's captures, the refits and the judgements."""
        seconds, self.seconds, self.moments.seconds = self.seconds + self.moments.seconds, 0.0, 0.0
        return seconds

    def take_geometry_bytes(self) -> int:
        """Bytes this rank sent for statistics and factors since the last call."""
        return self.comm.bytes_sent.pop(ByteKind.GEOMETRY, 0)


def geometry_kinds(kind) -> tuple:
    """``geometry.kind`` as the kinds that have transforms, in configured order (identity: none)."""
    kinds = (kind,) if isinstance(kind, str) else tuple(kind)
    return tuple(k for k in kinds if k != K.IDENTITY)





