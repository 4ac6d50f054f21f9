"""Selection: which layers take which transform. On refresh steps each layer's coordinates
are judged on its real gradient (captured by the rank holding its optimizer state) in every
configured kind and every metric; ``layers: "measured"`` gives each layer the kind that lowers its
error most in ``selection.metric``, if by at least ``min_gain``; telemetry reports the errors."""

from __future__ import annotations

import logging
from typing import Dict, List, Tuple

import torch

from .core import metrics
from .core.geometry import full_fp32_matmuls
from .exchange.stats import ByteKind

logger = logging.getLogger("deepspeed_gift")

PROFILE_MAX_ROWS = 256  # rows of a layer's local gradient kept for the profile when row-wise errors do


def rows_of_slice(G: torch.Tensor, rule, transforms: Dict[str, object]):
    """A layer's local gradient cut to the rows its update rule's state covers, when that rule
    acts element by element on a slice (Adam's moments of a ZeRO partition): the judgement of
    the update then needs only those rows, and the plain and whitened errors are measured on
    the same rows (a sample of whole rows: ~1/W of the layer instead of all of it, which for an
    lm_head of 131M elements was ~2 GB of transients). A rule of the whole matrix (Muon) or
    none: unchanged."""
    start = getattr(rule, "start", None)
    if rule is None or getattr(rule, "whole_matrix", True) or start is None:
        return G, rule, transforms
    cols = G.shape[1]
    row0, row1 = start // cols, -(-(start + rule.exp_avg.numel()) // cols)
    if row1 - row0 >= G.shape[0]:
        return G, rule, transforms
    return (G[row0:row1], metrics.rule_on_rows(rule, row0, row1, cols),
            {kind: metrics.RowBlock(t, row0, cols) for kind, t in transforms.items()})


class Selection:
    """The layers' judgement and choice for one model (``kinds`` in configured order)."""

    def __init__(self, cfg, kinds: tuple, names: List[str], comm, main_codec) -> None:
        self.cfg = cfg
        self.kinds = kinds
        self.names = names
        self.comm = comm
        self.main_codec = main_codec
        # name -> its profile row (every kind x every metric) and update-rule code, judged when
        # the layer's gradient was captured: nothing of the gradient is held to the end of the step
        self.judged_rows: Dict[str, Tuple[torch.Tensor, float]] = {}
        self.gains: Dict[str, float] = {}

    def judge_captured(self, name: str, G: torch.Tensor, rule, transforms: Dict[str, object]) -> None:
        """Judge layer ``name`` in every kind on this step's local gradient ``G`` with the
        optimizer's ``rule`` then (called as the reduction meets the gradient, so only one
        layer's gradient and optimizer state copy live at a time). ``transforms`` (kind -> the
        layer's transform now) are the ones built a refresh interval ago, not the fresh ones of
        this step's refit: that is how stale a transform gets before its next refresh, and a
        fresh fit judged on the gradient of its own step flatters layers whose input statistics
        drift (it selects them on in-sample gains)."""
        if not transforms or not torch.isfinite(G).all() or G.abs().max() == 0:
            return
        row = torch.zeros(len(self.kinds), len(PROFILE_COLUMNS), dtype=torch.float64)
        # a layer judged a tile of rows at a time (its temporaries ~30 B an element of a tile, not of the layer),
        # in full fp32 whatever the run sets (TF32, bf16 autocast): the judgement compares errors of ~1e-2
        tile_rows = max(1, self.cfg.tile_elements // G.shape[1])
        with torch.autocast(G.device.type, enabled=False), full_fp32_matmuls():
            judged = metrics.judge_geometries(G, self.main_codec, transforms, rule=rule, tile_rows=tile_rows)
        for kind, (euclid, geom) in judged.items():
            row[self.kinds.index(kind)] = torch.tensor(
                [euclid[m] for m in metrics.METRICS] + [geom[m] for m in metrics.METRICS] + [1.0],
                dtype=torch.float64)
        self.judged_rows[name] = (row, float(RULE_CODES[metrics.rule_kind(rule)]))

    def judge(self) -> Dict[str, Dict[str, dict]]:
        """Every layer's judgement of this step (:meth:`judge_captured`, on the rank that captured
        it) in every kind and metric: layer -> kind -> its profile row, the same on every rank
        (one all-reduce)."""
        metric = self.cfg.selection.metric
        kinds = self.kinds
        table = torch.zeros(len(self.names), len(kinds), len(PROFILE_COLUMNS), dtype=torch.float64)
        rule_codes = torch.zeros(len(self.names), dtype=torch.float64)
        for i, name in enumerate(self.names):
            if name in self.judged_rows:
                table[i], rule_codes[i] = self.judged_rows[name]
        self.judged_rows.clear()
        flat = torch.cat([table.reshape(-1), rule_codes])
        self.comm.all_reduce_sum(flat, kind=ByteKind.CONTROL)
        table = flat[:table.numel()].view_as(table)
        judged = {}  # layer -> kind -> its profile row (every kind measured on the layer)
        for i, name in enumerate(self.names):
            rows = {kind: {**dict(zip(PROFILE_COLUMNS, table[i, j].tolist())), "rule": float(flat[table.numel() + i])}
                    for j, kind in enumerate(kinds)}
            rows = {kind: row for kind, row in rows.items() if row["measured"] and row["euclid_" + metric] > 0}
            if rows:
                judged[name] = rows
        return judged

    def select(self, judged: Dict[str, Dict[str, dict]], version: int) -> Dict[str, str]:
        """``layers: "measured"``: each judged layer's best kind when it gains at least ``min_gain``
        (at most ``max_layers``, largest gains first): layer -> kind."""
        metric, kinds = self.cfg.selection.metric, self.kinds
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
        active = {name: kind for _, name, kind in chosen}
        if self.comm.rank == 0:
            counts = {kind: sum(k == kind for k in active.values()) for kind in kinds}
            logger.info("gift auto selection by %s error (version %d): %d of %d layers (%s); gains %s", metric,
                        version, len(active), len(self.names),
                        ", ".join(f"{kind} {n}" for kind, n in counts.items()),
                        ", ".join(f"{n}={self.gains[n]:+.2f}" for n in sorted(self.gains)))
        return active


PROFILE_COLUMNS = tuple([f"euclid_{m}" for m in metrics.METRICS] + [f"geo_{m}" for m in metrics.METRICS]
                        + ["measured"])
RULE_CODES = {kind: code for code, kind in enumerate(metrics.RuleKind)}  # the rule travels as a number


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
