"""python benchmarks/fidelity.py --preset small --ranks 4

Gradient fidelity of every wire format x geometry, measured on real gradients.

What it does, in order:

1. Builds the model (``--preset`` tiny/small Llama from ``launch.common``, ``--model-config``
   for any HF causal-LM config json, or ``--hf-model`` for a local pretrained directory;
   nothing is downloaded; tokens are bytes of the Python standard library's sources) and
   trains it with plain AdamW, global batch ``ranks x micro`` sequences, so the gradients
   are not only those of the initialization. Input statistics are collected as the plugin
   does: every ``--collect-interval`` steps (and on capture steps) the rank-averaged
   ``x x^T`` of every ``nn.Linear`` input (forward pre-hooks; q/k/v and gate/up share one)
   goes into an EMA (``--stats-decay``; 0 = one step's statistics).
2. Three capture steps t0, t1, t2, ``--refresh-interval`` steps apart after
   ``--train-steps``: ``--ranks`` simulated ranks run their own micro-batch, and every
   rank's gradient of every ``nn.Linear`` weight is kept; the optimizer then steps on the
   exact average (training goes on as it would). A refresh on a capture step fits
   ``fit_low_rank_diag`` to the statistics at that step.
3. Reduction at t2 for every format x geometry, as the plugin does it: each rank sends
   ``Z_r = G_r S`` encoded once; the owner decodes, sums in fp32 with its own contribution
   exact (it never goes through the codec), divides by the number of ranks and maps back
   with ``S^{-1}``. The kfac whiteners are the ones fitted at t1, a refresh interval
   earlier: as stale as the plugin's get before their next refresh. Compared with the
   exact fp32 average: relative L2 error, cosine, max abs error / max abs exact,
   saturation and underflow rates (``quantization_stats``), per layer and in aggregate.
4. The error in the optimizer's metric, from AdamW's real state (``exp_avg``,
   ``exp_avg_sq``, step count, from the training so far): ``Adam upd`` is the relative L2
   error of the next update direction ``m_hat / (sqrt(v_hat) + eps)`` computed with the
   reduced instead of the exact gradient (decoupled weight decay left out: it does not
   depend on the gradient); ``Adam g/sqrt(v)`` is the gradient's own error in Adam's
   diagonal metric, ``|(g_q - g) / (sqrt(v_hat) + eps)|`` over ``|g / (sqrt(v_hat) + eps)|``
   with the state before t2. Both weight small-gradient coordinates up, so formats that
   flush them to zero (underflow) look worse here than in plain L2.
5. ``layers: "auto"`` as the plugin runs it: at the refresh on t1, each layer's whitener
   fitted at the previous refresh (t0) is judged on t1's local gradient of the rank that
   owns the layer, gain = 1 - err_geo / err_euclid (round trip through the format); layers
   with gain >= ``--min-gain`` use the geometry, with the whitener fitted at t1, until the
   next refresh, i.e. at t2. The aggregate at t2 with that selection is shown next to
   all-Euclidean, all-geometry and the oracle (per layer the better of the two, judged
   in-sample at t2: the best any selection could do). ``WORSE`` marks where auto loses to
   Euclidean, with the selected layers that did.

Simplifications against the plugin, on purpose: the unit of encoding is one layer of one
rank (the plugin encodes per owner chunk, which may span layers, so per-tensor scales,
e5m2 with block 0 and nvfp4's global scale, cover more there); the fit is exact
(``fit_low_rank_diag``; the plugin uses a Nystrom sketch for wide layers and blends with
the previous factors, ``factor_decay``); every row is whitened (the plugin keeps rows cut by
a partition boundary Euclidean); layer i is owned by rank ``i % ranks``.
``--all-quantized`` also puts the owner's contribution through the codec (an all-reduce,
as in the paper). Saturation counts elements coded at the format's largest magnitude: with
per-block amax scales every nonzero block has one (about 1/block_size).

Prints three tables: aggregate (format x geometry), per layer for ``--per-layer-format``,
and the auto selection summary; ``--json PATH`` writes every number. Smoke run (seconds):
``--preset tiny --ranks 2 --micro 1 --seq 32 --train-steps 2 --refresh-interval 2``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepspeed_gift import geometry as geo  # noqa: E402
from deepspeed_gift.formats import FORMAT_NAMES, get_format, quantization_stats  # noqa: E402
from launch.common import PRESETS, corpus_bytes  # noqa: E402

# The formats compared and their block sizes (None: the format's default, 16 for nvfp4 and
# 128 for int; 0: one scale per encoded tensor, the paper's e5m2 layout).
FORMAT_BLOCKS: Dict[str, Optional[int]] = {"fp8_e4m3": 128, "fp8_e5m2": 0, "nvfp4": None, "int8": None, "int4": None}
DEFAULT_KFAC = ("structured:8", "structured:32", "cholesky:32")


# ------------------------------------------------------------------------------ model and data


def build_model(args) -> Tuple[nn.Module, str]:
    from transformers import AutoConfig, AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(args.seed)
    if args.hf_model:
        if not os.path.isdir(args.hf_model):
            raise SystemExit(f"--hf-model: {args.hf_model!r} is not a directory (a local save_pretrained "
                             "directory; nothing is downloaded)")
        model = AutoModelForCausalLM.from_pretrained(args.hf_model, local_files_only=True, dtype=torch.float32)
        label = f"pretrained {Path(args.hf_model).name}"
    elif args.model_config:
        spec = json.loads(Path(args.model_config).read_text())
        model_type = spec.pop("model_type", None)
        if model_type is None:
            raise SystemExit(f"--model-config {args.model_config!r} has no 'model_type' key (e.g. \"llama\")")
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **spec))
        label = f"{model_type} from {Path(args.model_config).name}"
    else:
        model = LlamaForCausalLM(LlamaConfig(**PRESETS[args.preset]))
        label = f"llama preset {args.preset}"
    vocab = model.get_input_embeddings().num_embeddings
    if vocab < 256:
        raise SystemExit(f"the model's vocabulary has {vocab} tokens; byte tokens need at least 256")
    max_pos = getattr(model.config, "max_position_embeddings", None)
    if max_pos is not None and args.seq > max_pos:
        raise SystemExit(f"--seq {args.seq} exceeds the model's max_position_embeddings {max_pos}")
    model.float().train()
    return model, label


class Sampler:
    """Random windows of the byte corpus; rank r of step k reads its own micro-batch."""

    def __init__(self, seq: int, seed: int):
        self.data = torch.frombuffer(bytearray(corpus_bytes()), dtype=torch.uint8).long()
        self.seq = seq
        self.gen = torch.Generator().manual_seed(seed)

    def batch(self, n: int) -> Tensor:
        starts = torch.randint(0, self.data.numel() - self.seq - 1, (n,), generator=self.gen).tolist()
        return torch.stack([self.data[s:s + self.seq] for s in starts])


def linear_layers(model: nn.Module) -> List[Tuple[str, nn.Linear]]:
    """Trainable ``nn.Linear`` modules in model order, one per weight (tied weights once)."""
    seen, out = set(), []
    for name, module in model.named_modules():
        if isinstance(module, nn.Linear) and module.weight.requires_grad and id(module.weight) not in seen:
            seen.add(id(module.weight))
            out.append((name, module))
    return out


class MomentHooks:
    """Forward pre-hooks that sum ``x^T x`` per input while ``active``. Modules fed the
    same tensor (q/k/v, gate/up) share one statistic, keyed by the first of them, as in
    the plugin."""

    def __init__(self, layers: List[Tuple[str, nn.Linear]]):
        self.active = False
        self.key_of: Dict[str, str] = {}
        self.sums: Dict[str, Tensor] = {}
        self.counts: Dict[str, int] = {}
        self._last = None  # (input tensor, its key)
        self.handles = [m.register_forward_pre_hook(self._hook(n)) for n, m in layers]

    def _hook(self, name: str):
        def hook(module, inputs):
            if not self.active:
                return None
            x = inputs[0]
            if self._last is not None and self._last[0] is x:
                self.key_of.setdefault(name, self._last[1])
            key = self.key_of.setdefault(name, name)
            if key == name:
                with torch.no_grad():
                    flat = x.detach().reshape(-1, x.shape[-1]).float()
                    m = flat.T @ flat
                    self.sums[key] = m if key not in self.sums else self.sums[key].add_(m)
                    self.counts[key] = self.counts.get(key, 0) + flat.shape[0]
            self._last = (x, key)
            return None

        return hook

    def take(self) -> Dict[str, Tensor]:
        """Mean ``x x^T`` per statistic since the last call."""
        out = {k: s / self.counts[k] for k, s in self.sums.items()}
        self.sums.clear()
        self.counts.clear()
        self._last = None
        return out


@dataclass
class Capture:
    grads: Dict[str, Tensor]  # name -> (ranks, out, in) per-rank gradients
    moments: Dict[str, Tensor]  # key -> (in, in), this step's moments averaged over ranks
    adam: Optional[Dict[str, dict]]  # name -> optimizer state before this step's update
    loss: float
    stats: Optional[Dict[str, Tensor]] = None  # key -> (in, in), the statistic a refresh here fits (EMA)


def train_step(model, opt, sched, hooks: MomentHooks, tokens: Tensor, collect: bool) -> float:
    opt.zero_grad(set_to_none=True)
    hooks.active = collect
    loss = model(input_ids=tokens, labels=tokens).loss
    hooks.active = False
    loss.backward()
    opt.step()
    sched.step()
    return float(loss.detach())


def capture_step(model, opt, sched, layers, hooks: MomentHooks, batches: List[Tensor], want_adam: bool) -> Capture:
    """One data-parallel step, rank by rank: per-rank gradients and input moments, then an
    optimizer step on the exact average (what every rank would hold after a native all-reduce)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    per_rank: Dict[str, List[Tensor]] = {n: [] for n, _ in layers}
    moments: Dict[str, Tensor] = {}
    losses = []
    for tokens in batches:
        opt.zero_grad(set_to_none=True)
        hooks.active = True
        loss = model(input_ids=tokens, labels=tokens).loss
        hooks.active = False
        loss.backward()
        losses.append(float(loss.detach()))
        for t, p in zip(total, params):
            if p.grad is not None:
                t.add_(p.grad)
        for n, m in layers:
            per_rank[n].append(m.weight.grad.detach().float().clone())
        for k, a in hooks.take().items():
            moments[k] = a if k not in moments else moments[k].add_(a)
    ranks = len(batches)
    adam = None
    if want_adam:
        adam = {}
        group = opt.param_groups[0]
        for n, m in layers:
            state = opt.state.get(m.weight, {})
            adam[n] = {"step": int(state["step"]) if "step" in state else 0,
                       "m": state["exp_avg"].clone() if "exp_avg" in state else torch.zeros_like(m.weight),
                       "v": state["exp_avg_sq"].clone() if "exp_avg_sq" in state else torch.zeros_like(m.weight),
                       "betas": tuple(group["betas"]), "eps": group["eps"]}
    for t, p in zip(total, params):
        p.grad = t.div_(ranks)
    opt.step()
    sched.step()
    return Capture(grads={n: torch.stack(g) for n, g in per_rank.items()},
                   moments={k: a.div_(ranks) for k, a in moments.items()},
                   adam=adam, loss=sum(losses) / ranks)


# ------------------------------------------------------------------------------- geometries


@dataclass(frozen=True)
class GeometrySpec:
    key: str  # "identity", "hadamard", "kfac_s32", ...
    kind: str  # identity | hadamard | kfac_input
    solver: str = ""
    rank: int = 0

    @property
    def label(self) -> str:
        if self.kind != "kfac_input":
            return self.kind
        return f"kfac {self.solver} r{self.rank}"


def parse_kfac(items: List[str]) -> List[GeometrySpec]:
    out = []
    for item in items:
        solver, _, rank = item.partition(":")
        if solver not in geo.SOLVERS or not rank.isdigit() or int(rank) < 1:
            raise SystemExit(f"--kfac: expected SOLVER:RANK with SOLVER in {list(geo.SOLVERS)} and RANK >= 1, "
                             f"got {item!r}")
        out.append(GeometrySpec(f"kfac_{solver[0]}{rank}", "kfac_input", solver, int(rank)))
    return out


class WhitenerFactory:
    """Whiteners per capture, geometry and layer; one low-rank fit per (capture, statistic,
    rank), shared by the solvers and by modules that read the same input."""

    def __init__(self, layers, key_of: Dict[str, str], damping: float):
        self.layers = layers
        self.key_of = key_of
        self.damping = damping
        self.sorted_names = sorted(n for n, _ in layers)
        self._fits: Dict[tuple, geo.LowRankDiag] = {}

    def build(self, spec: GeometrySpec, capture: int, stats: Dict[str, Tensor]) -> Dict[str, geo.Whitener]:
        out = {}
        for name, module in self.layers:
            dim = module.in_features
            if spec.kind == "identity":
                out[name] = geo.make_whitener("identity", dim)
            elif spec.kind == "hadamard":  # the plugin seeds by the index among sorted names
                out[name] = geo.make_whitener("hadamard", dim, seed=self.sorted_names.index(name))
            else:
                key, rank = self.key_of.get(name, name), min(spec.rank, dim)
                lrd = self._fits.get((capture, key, rank))
                if lrd is None:
                    lrd = self._fits[(capture, key, rank)] = geo.fit_low_rank_diag(
                        stats[key], rank=rank, damping=self.damping)
                out[name] = geo.whitener_from_low_rank(lrd, spec.solver)
        return out


# ----------------------------------------------------------------------------- the reduction


def reduce_ranks(G: Tensor, codec, whitener: geo.Whitener, *, owner: Optional[int],
                 Z: Optional[Tensor] = None, stats: bool = True) -> Tuple[Tensor, Dict[str, int]]:
    """The plugin's reduction of one layer: ``G`` (ranks, out, in) -> averaged (out, in).

    Every rank but ``owner`` sends ``Z_r = G_r S`` encoded once; the owner decodes, sums in
    fp32 with its own exact ``Z``, divides by the number of ranks and maps back with
    ``S^{-1}``. ``owner=None`` quantizes every rank (an all-reduce); with one rank it is the
    round trip ``S^{-1} deq(q(G S))``. ``Z`` may be passed when already computed;
    ``stats`` adds ``quantization_stats`` counts (saturated, underflow) of every payload.
    """
    if Z is None:
        Z = whitener.apply(G)
    total = torch.zeros_like(Z[0])
    counts = {"sent": 0, "saturated": 0, "underflow": 0}
    for r in range(Z.shape[0]):
        if r == owner:
            total.add_(Z[r])
            continue
        payload = codec.encode(Z[r])
        total.add_(codec.decode(payload).view_as(total))
        if stats:
            q = quantization_stats(Z[r], payload, codec)
            counts["sent"] += q["numel"]
            counts["saturated"] += q["saturated"]
            counts["underflow"] += q["underflow"]
    return whitener.invert(total.div_(Z.shape[0])), counts


def adam_direction(g: Tensor, state: dict) -> Tensor:
    """AdamW's next update direction for gradient ``g`` (weight decay and lr left out)."""
    b1, b2 = state["betas"]
    t = state["step"] + 1
    m = state["m"].mul(b1).add_(g, alpha=1 - b1)
    v = state["v"].mul(b2).addcmul_(g, g, value=1 - b2)
    return (m / (1 - b1 ** t)).div_(v.div_(1 - b2 ** t).sqrt_().add_(state["eps"]))


def adam_metric(state: dict, g_exact: Tensor) -> Tensor:
    """``1 / (sqrt(v_hat) + eps)`` of the state before this step (the exact gradient's own
    magnitude when there is no state yet)."""
    if state["step"] == 0:
        return 1.0 / (g_exact.abs() + state["eps"])
    b2 = state["betas"][1]
    return 1.0 / (state["v"] / (1 - b2 ** state["step"])).sqrt_().add_(state["eps"])


class LayerReference:
    """The exact average of one layer and what the comparisons need from it."""

    def __init__(self, exact: Tensor, adam_state: dict):
        self.exact = exact
        self.state = adam_state
        self.u_exact = adam_direction(exact, adam_state)
        self.metric = adam_metric(adam_state, exact)
        flat = exact.reshape(-1)
        self.ref_sq = float(flat.double().square().sum())
        self.adam_ref_sq = float(self.u_exact.double().square().sum())
        self.pre_ref_sq = float((exact * self.metric).double().square().sum())
        self.max_ref = float(exact.abs().max())


SUM_KEYS = ("err_sq", "ref_sq", "dot", "q_sq", "adam_err_sq", "adam_ref_sq", "pre_err_sq", "pre_ref_sq",
            "sent", "saturated", "underflow")


def _sq(x: Tensor) -> float:
    x = x.reshape(-1)
    return float(torch.dot(x, x))


def compare(avg: Tensor, ref: LayerReference, counts: Dict[str, int]) -> dict:
    """Sums (additive over layers) and maxima of one layer's reduced vs exact gradient.
    fp32 dot products: their rounding (~1e-6 relative) is far below what is measured."""
    diff = avg - ref.exact
    du = adam_direction(avg, ref.state).sub_(ref.u_exact)
    out = {"err_sq": _sq(diff), "ref_sq": ref.ref_sq, "dot": float(torch.dot(avg.reshape(-1), ref.exact.reshape(-1))),
           "q_sq": _sq(avg), "adam_err_sq": _sq(du), "adam_ref_sq": ref.adam_ref_sq,
           "max_err": float(diff.abs().max()), "max_ref": ref.max_ref}
    out.update(pre_err_sq=_sq(diff.mul_(ref.metric)), pre_ref_sq=ref.pre_ref_sq)
    out.update(counts)
    return out


def _ratio(a: float, b: float) -> float:
    return math.sqrt(a / b) if b > 0 else 0.0


def metrics(parts: List[dict]) -> dict:
    """Relative errors from summed parts (one layer, or several for an aggregate)."""
    s = {k: sum(p[k] for p in parts) for k in SUM_KEYS}
    max_err = max(p["max_err"] for p in parts)
    max_ref = max(p["max_ref"] for p in parts)
    denom = math.sqrt(s["q_sq"] * s["ref_sq"])
    return {
        "rel_l2": _ratio(s["err_sq"], s["ref_sq"]),
        "cosine": s["dot"] / denom if denom > 0 else 1.0,
        "max_err_rel": max_err / max_ref if max_ref > 0 else 0.0,
        "saturation_rate": s["saturated"] / s["sent"] if s["sent"] else 0.0,
        "underflow_rate": s["underflow"] / s["sent"] if s["sent"] else 0.0,
        "adam_update_rel_err": _ratio(s["adam_err_sq"], s["adam_ref_sq"]),
        "adam_metric_rel_err": _ratio(s["pre_err_sq"], s["pre_ref_sq"]),
        "elements_sent": int(s["sent"]),
    }


# ------------------------------------------------------------------------------------ output


def short(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def print_aggregate(results, formats, geoms, ranks: int, owner_note: str) -> None:
    print(f"\nAggregate over all Linear weights at t2 ({ranks} ranks, {owner_note})")
    head = (f"{'format':<9} {'geometry':<19} {'rel L2':>8} {'cosine':>9} {'max err':>8} {'sat %':>7} "
            f"{'uflow %':>8} {'Adam upd':>9} {'Adam g/sqrt(v)':>14}")
    print(head)
    print("-" * len(head))
    for fkey in formats:
        for g in geoms:
            m = results[fkey][g.key]["aggregate"]
            print(f"{fkey:<9} {g.label:<19} {m['rel_l2']:>8.4f} {m['cosine']:>9.6f} {m['max_err_rel']:>8.4f} "
                  f"{100 * m['saturation_rate']:>7.3f} {100 * m['underflow_rate']:>8.3f} "
                  f"{m['adam_update_rel_err']:>9.4f} {m['adam_metric_rel_err']:>14.4f}")
        print()


def print_per_layer(results, auto, fkey: str, geoms, layers, auto_key: str) -> None:
    print(f"Per layer, format {fkey}: rel L2 error at t2 per geometry; underflow %; auto gains of {auto_key}")
    cols = "".join(f" {g.key:>9}" for g in geoms)
    head = (f"{'layer':<26} {'out x in':>10}{cols} {'uf% id':>7} {'uf% ' + auto_key[-3:]:>8} "
            f"{'gain t1':>8} {'gain t2':>8} {'auto':>5}")
    print(head)
    print("-" * len(head))
    a = auto[fkey][auto_key]
    for name, module in layers:
        errs = "".join(f" {results[fkey][g.key]['layers'][name]['rel_l2']:>9.4f}" for g in geoms)
        uf_id = results[fkey]["identity"]["layers"][name]["underflow_rate"]
        uf_geo = results[fkey][auto_key]["layers"][name]["underflow_rate"]
        shape = f"{module.out_features}x{module.in_features}"
        print(f"{short(name):<26} {shape:>10}{errs} {100 * uf_id:>7.3f} {100 * uf_geo:>8.3f} "
              f"{a['gains_heldout'][name]:>+8.3f} {a['gains_t2'][name]:>+8.3f} "
              f"{'geo' if name in a['selected'] else '-':>5}")
    print()


def print_auto(auto, formats, kfac, n_layers: int, min_gain: float) -> None:
    print(f"layers: \"auto\" (gain >= {min_gain} judged on t1 with the t0 whitener; applied at t2 with the t1 one)")
    head = (f"{'format':<9} {'geometry':<19} {'sel':>6} {'euclid':>8} {'auto':>8} {'all-geo':>8} {'oracle':>8} "
            f"{'Adam eu':>8} {'Adam au':>8}  verdict")
    print(head)
    print("-" * len(head))
    worse = []
    for fkey in formats:
        for g in kfac:
            a = auto[fkey][g.key]
            agg = a["aggregate"]
            e, au = agg["euclidean"]["rel_l2"], agg["auto"]["rel_l2"]
            verdict = "ok" if au <= e else f"WORSE {100 * (au / e - 1):+.3f}%"
            if au > e:
                worse.append((fkey, g, a))
            print(f"{fkey:<9} {g.label:<19} {len(a['selected']):>3}/{n_layers:<2} {e:>8.4f} {au:>8.4f} "
                  f"{agg['geometry']['rel_l2']:>8.4f} {agg['oracle']['rel_l2']:>8.4f} "
                  f"{agg['euclidean']['adam_update_rel_err']:>8.4f} {agg['auto']['adam_update_rel_err']:>8.4f}  "
                  f"{verdict}")
    if worse:
        print("\nwhere auto loses to Euclidean (selected layers that are worse at t2):")
        for fkey, g, a in worse:
            bad = ", ".join(f"{short(n)} ({a['gains_heldout'][n]:+.2f} -> {a['gains_t2'][n]:+.2f})"
                            for n in a["regressed"])
            print(f"  {fkey} {g.label}: {bad}")
    else:
        print("\nauto is never worse than Euclidean here.")


# -------------------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="small", choices=sorted(PRESETS), help="launch.common Llama preset")
    src.add_argument("--model-config", default=None, help="HF config json (with model_type) of a causal LM")
    src.add_argument("--hf-model", default=None, help="local pretrained model directory (save_pretrained)")
    p.add_argument("--ranks", type=int, default=4, help="simulated data-parallel ranks")
    p.add_argument("--micro", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--train-steps", type=int, default=300, help="AdamW steps before the first capture")
    p.add_argument("--refresh-interval", type=int, default=50,
                   help="steps from one capture to the next (geometry.refresh_interval)")
    p.add_argument("--collect-interval", type=int, default=10,
                   help="input statistics are collected every this many steps (geometry.collect_interval)")
    p.add_argument("--stats-decay", type=float, default=0.95,
                   help="EMA of the statistics (geometry.stats_decay); 0 fits one step's statistics")
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=20, help="linear lr warm-up steps")
    p.add_argument("--damping", type=float, default=1e-3, help="geometry.damping of the kfac fits")
    p.add_argument("--kfac", nargs="+", default=list(DEFAULT_KFAC), metavar="SOLVER:RANK",
                   help="kfac_input variants (solver structured|cholesky, rank; clamped to the layer width)")
    p.add_argument("--formats", nargs="+", default=list(FORMAT_BLOCKS), choices=FORMAT_NAMES,
                   help="wire formats (the five by default; bf16/fp32 also accepted, default block sizes)")
    p.add_argument("--per-layer-format", default="fp8_e4m3", choices=FORMAT_NAMES)
    p.add_argument("--auto-geometry", default=None,
                   help="kfac variant whose gains the per-layer table shows, e.g. kfac_s32 "
                        "(default: the second --kfac entry)")
    p.add_argument("--min-gain", type=float, default=0.05, help="selection.min_gain of layers: auto")
    p.add_argument("--all-quantized", action="store_true",
                   help="quantize the owner's contribution too (all-reduce; the plugin keeps it exact)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1,
                   help="torch CPU threads; 0 = torch's default. 1 by default: the work is small kernels, "
                        "and oversubscribed threads on a shared machine made it 10x slower")
    p.add_argument("--json", type=Path, default=None, help="also write every number here")
    args = p.parse_args(argv)
    if min(args.ranks, args.micro, args.refresh_interval, args.collect_interval) < 1 or args.seq < 2 \
            or args.train_steps < 0 or not 0.0 <= args.stats_decay < 1.0:
        raise SystemExit("need --ranks, --micro, --refresh-interval, --collect-interval >= 1, --seq >= 2, "
                         "--train-steps >= 0, 0 <= --stats-decay < 1")
    return args


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    formats = list(dict.fromkeys(args.formats))
    if args.per_layer_format not in formats:
        formats.append(args.per_layer_format)
    codecs = {f: get_format(f, block_size=FORMAT_BLOCKS.get(f)) for f in formats}
    kfac = parse_kfac(args.kfac)
    geoms = [GeometrySpec("identity", "identity"), GeometrySpec("hadamard", "hadamard")] + kfac
    auto_key = args.auto_geometry or (kfac[1].key if len(kfac) > 1 else kfac[0].key)
    if auto_key not in {g.key for g in kfac}:
        raise SystemExit(f"--auto-geometry {auto_key!r} is not one of {[g.key for g in kfac]}")

    # 1. model, training (statistics collected as the plugin does), three captures
    model, model_label = build_model(args)
    layers = linear_layers(model)
    names = [n for n, _ in layers]
    hooks = MomentHooks(layers)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda k: min(1.0, (k + 1) / max(args.warmup, 1)))
    samplers = [Sampler(args.seq, args.seed * 9973 + r) for r in range(args.ranks)]
    capture_at = [args.train_steps + j * args.refresh_interval for j in range(3)]
    emas: Dict[str, geo.CovarianceEMA] = {}

    def fold(moments: Dict[str, Tensor]) -> None:
        for key, a in moments.items():
            ema = emas.get(key)
            if ema is None:
                ema = emas[key] = geo.CovarianceEMA(a.shape[0], decay=args.stats_decay)
            ema.update_from_moment(a)

    losses, caps = [], []
    for k in range(capture_at[-1] + 1):
        if k in capture_at:
            cap = capture_step(model, opt, sched, layers, hooks, [s.batch(args.micro) for s in samplers],
                               want_adam=(k == capture_at[-1]))
            fold(cap.moments)
            cap.stats = {key: ema.value().clone() for key, ema in emas.items()}
            caps.append(cap)
            losses.append(cap.loss)
        else:
            tokens = torch.cat([s.batch(args.micro) for s in samplers])  # the global batch: rank moments averaged
            losses.append(train_step(model, opt, sched, hooks, tokens, collect=k % args.collect_interval == 0))
            fold(hooks.take())
    t_model = time.perf_counter() - t_start
    n_params = sum(m.weight.numel() for _, m in layers)
    owner_of = {n: (None if args.all_quantized else i % args.ranks) for i, n in enumerate(names)}
    owner_note = "every rank quantized (all-reduce)" if args.all_quantized else "owner's own contribution exact"
    stats_note = (f"EMA {args.stats_decay} of moments every {args.collect_interval} steps" if args.stats_decay
                  else "one step's moments")
    print(f"model: {model_label}, {len(layers)} Linear weights, {n_params / 1e6:.2f}M elements; ranks {args.ranks} x "
          f"{args.micro} x {args.seq} tokens; {capture_at[-1] + 1} AdamW steps, captures t0, t1, t2 at steps "
          f"{', '.join(map(str, capture_at))}; loss {losses[0]:.3f} -> {losses[-1]:.3f}; kfac statistics: "
          f"{stats_note}; model + captures {time.perf_counter() - t_start:.1f} s")

    # 2. reduction at t2 for every format x geometry (kfac whiteners fitted at t1)
    factory = WhitenerFactory(layers, hooks.key_of, args.damping)
    G2 = caps[2].grads
    refs = {n: LayerReference(G2[n].mean(0), caps[2].adam[n]) for n in names}
    parts = {f: {} for f in formats}  # format -> geometry -> layer -> sums
    whiteners_t1 = {}
    for g in geoms:
        ws = whiteners_t1[g.key] = factory.build(g, 1, caps[1].stats)
        for f in formats:
            parts[f][g.key] = {}
        for n in names:
            Z = ws[n].apply(G2[n])
            for f in formats:
                avg, counts = reduce_ranks(G2[n], codecs[f], ws[n], owner=owner_of[n], Z=Z)
                parts[f][g.key][n] = compare(avg, refs[n], counts)
    results = {f: {g.key: {"aggregate": metrics(list(parts[f][g.key].values())),
                           "layers": {n: metrics([parts[f][g.key][n]]) for n in names}} for g in geoms}
               for f in formats}

    # 3. auto: gains of the t0 whiteners on t1's owner-local gradient, selection applied at t2
    def roundtrip_err(G: Tensor, codec, w) -> float:
        return float((reduce_ranks(G[None], codec, w, owner=None, stats=False)[0] - G).norm())

    local = {n: caps[1].grads[n][i % args.ranks] for i, n in enumerate(names)}
    e_euc = {f: {n: roundtrip_err(local[n], codecs[f], whiteners_t1["identity"][n]) for n in names} for f in formats}
    auto = {f: {} for f in formats}
    for g in kfac:
        ws0 = factory.build(g, 0, caps[0].stats)
        for f in formats:
            gains = {}
            for n in names:
                e_geo = roundtrip_err(local[n], codecs[f], ws0[n])
                gains[n] = 1.0 - e_geo / e_euc[f][n] if e_euc[f][n] > 0 else 0.0
            eu, ge = parts[f]["identity"], parts[f][g.key]
            selected = [n for n in names if gains[n] >= args.min_gain]
            oracle = [n for n in names if ge[n]["err_sq"] < eu[n]["err_sq"]]
            agg = {"euclidean": metrics(list(eu.values())),
                   "auto": metrics([ge[n] if n in selected else eu[n] for n in names]),
                   "geometry": metrics(list(ge.values())),
                   "oracle": metrics([ge[n] if n in oracle else eu[n] for n in names])}
            auto[f][g.key] = {
                "gains_heldout": gains,
                "gains_t2": {n: 1.0 - _ratio(ge[n]["err_sq"], eu[n]["err_sq"]) if eu[n]["err_sq"] > 0 else 0.0
                             for n in names},
                "selected": selected,
                "regressed": [n for n in selected if ge[n]["err_sq"] > eu[n]["err_sq"]],
                "aggregate": agg,
                "worse_than_euclidean": agg["auto"]["rel_l2"] > agg["euclidean"]["rel_l2"],
            }

    # 4. output
    print_aggregate(results, formats, geoms, args.ranks, owner_note)
    print_per_layer(results, auto, args.per_layer_format, geoms, layers, auto_key)
    print_auto(auto, formats, kfac, len(names), args.min_gain)
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.1f} s (model + captures {t_model:.1f} s, {torch.get_num_threads()} threads)")
    if args.json is not None:
        out = {
            "command": [Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv)),
            "model": model_label,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "protocol": {"capture_steps": capture_at,
                         "statistics": stats_note,
                         "whitener_at_t2": "fitted at t1 on the rank-averaged statistics",
                         "auto_gain": "t0 whitener judged on t1's owner-local gradient (round trip), "
                                      "1 - err_geo / err_euclid",
                         "owner_exact": not args.all_quantized,
                         "adam_update": "relative L2 error of m_hat/(sqrt(v_hat)+eps) after this step, AdamW's "
                                        "real state, weight decay excluded",
                         "adam_metric": "relative L2 error of g/(sqrt(v_hat)+eps), v_hat before this step"},
            "formats": {f: {"name": f, "block_size": codecs[f].block_size} for f in formats},
            "geometries": {g.key: {"kind": g.kind, "solver": g.solver, "rank": g.rank, "label": g.label}
                           for g in geoms},
            "layers": [{"name": n, "out": m.out_features, "in": m.in_features, "owner": owner_of[n],
                        "statistic": hooks.key_of.get(n, n)} for n, m in layers],
            "losses": losses,
            "results": results,
            "auto": auto,
            "wall_s": wall,
            "model_and_capture_s": t_model,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
