"""python benchmarks/fidelity.py --preset small --ranks 4 [--optimizer muon]

Gradient fidelity of every wire format x geometry, measured on real gradients, in plain L2,
in the whitened norm and in the error of the update the optimizer takes.

What it does, in order:

1. Builds the model (``--preset``, a Llama preset of ``launch/pretrain.py``, ``--model-config``
   for any HF causal-LM config json, or ``--hf-model`` for a local pretrained directory;
   nothing is downloaded; tokens are bytes of the Python standard library's sources) and
   trains it, global batch ``ranks x micro`` sequences, so the gradients are not only those
   of the initialization. ``--optimizer adamw``: torch AdamW on everything. ``--optimizer
   muon``: as DeepSpeed's MuonWithAuxAdam splits a model, matrices whose name holds neither
   "embed" nor "lm_head" train with Muon (momentum ``--muon-momentum``, Nesterov, update
   ``NS5(lerp(g, m', beta)) * sqrt(max(1, rows / cols))``, ``--muon-lr``), the rest with the
   same AdamW. Input statistics are collected as the plugin does: every
   ``--collect-interval`` steps (and on capture steps) the rank-averaged ``x x^T`` of every
   ``nn.Linear`` input (forward pre-hooks; q/k/v and gate/up share one) goes into an EMA
   (``--stats-decay``; 0 = one step's statistics).
2. Three capture steps t0, t1, t2, ``--refresh-interval`` steps apart after
   ``--train-steps``: ``--ranks`` simulated ranks run their own micro-batch, and every
   rank's gradient of every ``nn.Linear`` weight is kept, with the optimizer's state before
   the step; the optimizer then steps on the exact average (training goes on as it would).
   A refresh on a capture step fits ``fit_low_rank_diag`` to the statistics at that step,
   with a floor on the residual diagonal of ``--damping`` (``--damping-mode absolute``) or
   ``--damping`` times the mean of ``diag(A)`` of that statistic (``relative``).
3. Reduction at t2 for every format x geometry by the plugin's own ``GiftReducer``, the
   ranks simulated as threads: each rank sends ``Z_r = G_r S`` encoded once; the owner
   decodes, sums in fp32, maps back with ``S^{-1}``, adds its own contribution exact (it
   never goes through the codec) and divides by the number of ranks. The kfac whiteners are the ones fitted at t1, a refresh interval
   earlier: as stale as the plugin's get before their next refresh. Compared with the
   exact fp32 average (``deepspeed_gift.core.metrics`` does the measuring), per layer and in
   aggregate:

   * ``rel L2``, cosine, max abs error / max abs exact, saturation and underflow rates;
   * ``whitened``: ``||E S|| / ||G S||`` with one ruler for every row, the whitener of
     ``--auto-geometry`` fitted at t1 (``S^T A_hat S = I``, so this is the norm
     ``tr(E A^-1 E^T)`` in which GIFT's error is isotropic);
   * ``NS5(G)``: the error of Muon's Newton-Schulz output of the gradient alone;
     ``NS5(M+G)``: of Muon's real next update, Nesterov blend with the momentum before t2
     (``metrics.MuonRule``). Under ``--optimizer muon`` both cover the Muon layers; under
     ``adamw`` they are a what-if on every layer, the momentum an EMA (beta
     ``--muon-momentum``) of that run's gradients;
   * ``Adam upd``: the error of AdamW's next direction ``m_hat / (sqrt(v_hat) + eps)`` from
     its real state (``metrics.AdamRule``; weight decay left out: it does not depend on the
     gradient), and ``Adam g/sqrt(v)``, the gradient's own error in Adam's diagonal metric
     with the state before t2; both cover the layers AdamW trains. They weight
     small-gradient coordinates up, so formats that flush them to zero look worse here;
   * ``opt``: every layer in the update of the optimizer that trains it.

   Layers combine as ``sqrt(sum err^2 / sum ref^2)`` for L2, whitened and Adam (the big
   layers weigh most, as in the norm of the whole gradient) and as the mean of per-layer
   relative errors for NS5 and opt (a Newton-Schulz output's norm is ~sqrt(min(out, in))
   whatever the gradient's scale, so a sum of squares would only count layer widths).
4. ``layers: "measured"`` as the plugin runs it: at the refresh on t1, each layer's whitener
   fitted at the previous refresh (t0) is judged on t1's local gradient of the rank that
   owns the layer with ``metrics.judge_geometry`` (one round trip through the format) in
   ``--selection-metric``: ``optimizer`` (the update of the layer's own optimizer, from its
   state at t1: ``MuonRule`` with the real momentum, or ``AdamRule``), ``l2`` or
   ``whitened`` (the judged whitener's norm); gain = 1 - err_geo / err_euclid. Layers with
   gain >= ``--min-gain`` use the geometry, with the whitener fitted at t1, until the next
   refresh, i.e. at t2. The aggregate at t2 with that selection is shown in every metric
   next to all-Euclidean, and in the selection metric next to all-geometry and the oracle
   (per layer the better of the two, judged in-sample at t2: the best any selection could
   do). ``WORSE`` marks where auto loses to Euclidean in the selection metric, with the
   selected layers that did.

Simplifications against the plugin, on purpose: the unit of encoding is one layer of one
rank (the plugin encodes per owner chunk, which may span layers, so per-tensor scales,
e5m2 with block 0 and nvfp4's global scale, cover more there); the fit is exact
(``fit_low_rank_diag``; the plugin uses a Nystrom sketch for wide layers and blends with
the previous factors, ``factor_decay``); every row is whitened (the plugin keeps rows cut by
a partition boundary Euclidean); layer i is owned by rank ``i % ranks``; Newton-Schulz runs
in fp32 in training and in the metrics (DeepSpeed runs it in bf16/fp16, a rounding the
metrics would otherwise mistake for communication error).
``adam factored`` is Adam's geometry (``geometry.kind: "adam_factored"``): every element scaled by
``a_i b_j`` from the row and column means of AdamW's ``exp_avg_sq`` (``geometry.FactoredScaling``),
built from the state before t1's step (the plugin's refresh at the end of t1 sees it one step
later); layers AdamW does not train keep the identity. The auto table also judges it alone and
as ``per-layer choice``: every layer takes whichever of ``--auto-geometry`` and Adam's geometry
has the better held-out gain (``geometry.kind`` as a list), or Euclidean. ``adam full v (bound)``
scales by Adam's whole ``v`` instead of its factors: what the factorization leaves on the table
(every rank would need all of ``v``: not a geometry the plugin offers). ``--beta2`` sets AdamW's.
``nvfp4/up`` is NVFP4 with the block-scale rule of earlier versions (the smallest E4M3 scale
that clips nothing) instead of the per-block choice among three scales.
``--all-quantized`` also puts the owner's contribution through the codec (an all-reduce,
as in the paper). ``--route relay`` (3+ ranks) reduces every layer owned by one rank through the
relay, as ZeRO-2's default route (``by_layout``) does a bucket that reaches one owner: chunk j of
every rank's ``Z_r`` to rank j, summed there in fp32, the sum encoded again on its way to the
owner in the second-hop codec the default config resolves for the format (``zero._relay_codec``)
or ``--relay-format NAME[/BLOCK]``'s; shared sections (``--all-quantized``) stay direct, as in
the plugin. The aggregate's ``relay_layers`` in the JSON counts the layers that took the relay. Saturation counts elements coded at the format's largest magnitude: with
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
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch
from torch import Tensor, nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepspeed_gift.core import geometry as geo  # noqa: E402
from deepspeed_gift.core import metrics as fm  # noqa: E402
from deepspeed_gift.config import GeometryConfig  # noqa: E402
from deepspeed_gift.exchange.comm import LocalComm, run_local  # noqa: E402
from deepspeed_gift.core.formats import FORMAT_NAMES, NvFp4Codec, get_format  # noqa: E402
from deepspeed_gift.statistics import InputMoments  # noqa: E402
from deepspeed_gift.exchange.plan import GEO, ParamSlice  # noqa: E402
from deepspeed_gift.exchange.reducer import GiftReducer  # noqa: E402
from deepspeed_gift.exchange.stats import StepStats  # noqa: E402
from deepspeed_gift.refresh import KfacRefresh  # noqa: E402
from launch.data import corpus_bytes  # noqa: E402
from launch.pretrain import PRESETS  # noqa: E402

# The formats compared and their block sizes (None: the format's default, 16 for nvfp4 and
# 128 for int; 0: one scale per encoded tensor, the paper's e5m2 layout).
FORMAT_BLOCKS: Dict[str, Optional[int]] = {"fp8_e4m3": 128, "fp8_e5m2": 0, "nvfp4": None, "int8": None, "int4": None}
DEFAULT_KFAC = ("structured:8", "structured:32", "cholesky:32")

# Every error column: JSON key -> (printed label, how layers combine). "rms" is
# sqrt(sum err^2 / sum ref^2); "mean" the mean of per-layer relative errors (see the docstring).
COLUMNS: Dict[str, Tuple[str, str]] = {
    "rel_l2": ("rel L2", "rms"),
    "whitened_rel_err": ("whitened", "rms"),
    "muon_ns_rel_err": ("NS5(G)", "mean"),
    "muon_update_rel_err": ("NS5(M+G)", "mean"),
    "optimizer_rel_err": ("opt", "mean"),
    "adam_update_rel_err": ("Adam upd", "rms"),
    "adam_metric_rel_err": ("Adam g/sqrt(v)", "rms"),
}
# --selection-metric -> the column it reads at t2.
SELECTION_COLUMN = {"optimizer": "optimizer_rel_err", "l2": "rel_l2", "whitened": "whitened_rel_err"}


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


class MomentHooks(InputMoments):
    """The plugin's statistics hooks, switched on while ``active`` (with ``companion``, a second
    set switched with them)."""

    def __init__(self, layers: List[Tuple[str, nn.Linear]], tokens: Optional[int] = None,
                 companion: Optional[InputMoments] = None):
        super().__init__(dict(layers), tokens)
        self.companion = companion

    @property
    def active(self) -> bool:
        return self.attached

    @active.setter
    def active(self, on: bool) -> None:
        for hooks in (self, self.companion) if self.companion is not None else (self,):
            hooks.new_forward()
            hooks.attach() if on else hooks.detach()


class PluginStatistics:
    """``--plugin-stats``: the kfac geometry as the plugin holds and fits it (its own
    :class:`KfacRefresh` on one rank fed the rank-averaged inputs: sketched statistics, the
    power step on first sight, Nystrom refits every ``--refresh-interval`` steps from step 0,
    factor blending), beside the benchmark's exact fit of the whole ``x x^T`` EMA."""

    def __init__(self, layers: List[Tuple[str, nn.Linear]], args, rank: int):
        gcfg = GeometryConfig(rank=rank, stats_decay=args.stats_decay, damping=args.damping,
                              damping_mode=args.damping_mode, refresh_interval=args.refresh_interval,
                              collect_interval=args.collect_interval)
        comm = LocalComm(0, 1, [None], threading.Barrier(1))
        self.kfac = KfacRefresh(gcfg, args.seed, comm, sorted(n for n, _ in layers), {})
        self.hooks = InputMoments(dict(layers), args.stats_tokens, test_matrix=self.kfac.test_matrix)
        self.refresh_interval = args.refresh_interval
        self.version = 0

    def end_step(self, k: int) -> None:
        means = self.hooks.take()
        if means:
            self.kfac.fold(means)
        if k % self.refresh_interval == 0:
            self.kfac.refit(self.version)
            self.version += 1


# ------------------------------------------------------------------------------- optimizers


def trains_with_muon(name: str, param: Tensor) -> bool:
    """DeepSpeed's split for MuonWithAuxAdam (``deepspeed.set_optimizer_flags``): matrices
    whose name holds neither "embed" nor "lm_head" go to Muon, everything else to Adam."""
    return param.dim() >= 2 and not any(k in name.lower() for k in ("embed", "lm_head"))


class Muon(torch.optim.Optimizer):
    """The Muon half of DeepSpeed's MuonWithAuxAdam on whole matrices (no ZeRO partition):
    ``m <- lerp(m, g, 1 - beta)``, update ``NS5(lerp(g, m, beta)) * sqrt(max(1, rows / cols))``,
    decoupled weight decay. State key ``momentum_buffer``, as DeepSpeed's."""

    def __init__(self, params, *, lr: float, momentum: float, weight_decay: float = 0.0):
        super().__init__(params, dict(lr=lr, momentum=momentum, weight_decay=weight_decay))

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            beta, lr = group["momentum"], group["lr"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                state = self.state[p]
                if "momentum_buffer" not in state:
                    state["momentum_buffer"] = torch.zeros_like(p)
                m = state["momentum_buffer"].lerp_(p.grad, 1.0 - beta)
                g = p.grad.reshape(len(p), -1)  # conv filters as DeepSpeed flattens them
                update = fm.newton_schulz5(g.lerp(m.reshape_as(g), beta))
                update.mul_(max(1.0, g.shape[0] / g.shape[1]) ** 0.5)
                p.mul_(1.0 - lr * group["weight_decay"]).add_(update.view_as(p), alpha=-lr)


@dataclass
class LayerRules:
    """One layer's optimizer state before a step, as ``deepspeed_gift.core.metrics`` rules."""

    trained_by: str  # "muon" | "adamw"
    muon: Optional[fm.MuonRule]  # real momentum, a what-if EMA under --optimizer adamw, None for Adam layers under muon
    adam: Optional[fm.AdamRule]  # AdamW's state where AdamW trains the layer

    @property
    def own(self):
        return self.muon if self.trained_by == "muon" else self.adam


class Training:
    """The run's optimizers stepped together, each with the same linear warm-up.

    ``--optimizer adamw``: one torch AdamW, as before. ``muon``: ``Muon`` on the matrices
    ``trains_with_muon`` picks and the same AdamW on the rest. Under ``adamw`` every Linear
    weight also gets a what-if Muon momentum (an EMA of its averaged gradients), so that the
    NS5(M+G) column exists for both optimizers."""

    def __init__(self, model: nn.Module, layers: List[Tuple[str, nn.Linear]], args):
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        use_muon = args.optimizer == "muon"
        muon_params = [p for n, p in named if use_muon and trains_with_muon(n, p)]
        muon_ids = {id(p) for p in muon_params}
        adam_params = [p for _, p in named if id(p) not in muon_ids]
        self.muon = Muon(muon_params, lr=args.muon_lr, momentum=args.muon_momentum) if muon_params else None
        self.adamw = (torch.optim.AdamW(adam_params, lr=args.lr, betas=(0.9, args.beta2)) if adam_params
                      else None)
        self.optimizers = [o for o in (self.muon, self.adamw) if o is not None]
        warmup = max(args.warmup, 1)
        self.schedulers = [torch.optim.lr_scheduler.LambdaLR(o, lambda k: min(1.0, (k + 1) / warmup))
                           for o in self.optimizers]
        self.beta = args.muon_momentum
        self.layers = layers
        self.trained_by = {n: "muon" if id(m.weight) in muon_ids else "adamw" for n, m in layers}
        self.what_if = {} if use_muon else {n: torch.zeros_like(m.weight) for n, m in layers}

    def zero_grad(self) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=True)

    @torch.no_grad()
    def step(self) -> None:
        for n, m in self.layers:
            if n in self.what_if and m.weight.grad is not None:
                self.what_if[n].lerp_(m.weight.grad, 1.0 - self.beta)
        for o in self.optimizers:
            o.step()
        for s in self.schedulers:
            s.step()

    def rules(self) -> Dict[str, LayerRules]:
        """Every Linear weight's state now (copies: the step that follows changes it)."""
        out = {}
        for n, m in self.layers:
            p = m.weight
            muon = adam = None
            if self.trained_by[n] == "muon":
                momentum = self.muon.state[p].get("momentum_buffer", torch.zeros_like(p))
                muon = fm.MuonRule(momentum=momentum.clone(), beta=self.beta)
            else:
                if n in self.what_if:
                    muon = fm.MuonRule(momentum=self.what_if[n].clone(), beta=self.beta)
                state, group = self.adamw.state.get(p, {}), self.adamw.param_groups[0]
                adam = fm.AdamRule(
                    exp_avg=state["exp_avg"].clone() if "exp_avg" in state else torch.zeros_like(p),
                    exp_avg_sq=state["exp_avg_sq"].clone() if "exp_avg_sq" in state else torch.zeros_like(p),
                    step=int(state["step"]) if "step" in state else 0,
                    betas=tuple(group["betas"]), eps=group["eps"])
            out[n] = LayerRules(self.trained_by[n], muon, adam)
        return out


@dataclass
class Capture:
    grads: Dict[str, Tensor]  # name -> (ranks, out, in) per-rank gradients
    moments: Dict[str, Tensor]  # key -> (in, in), this step's moments averaged over ranks
    rules: Optional[Dict[str, LayerRules]]  # name -> optimizer state before this step's update
    loss: float
    stats: Optional[Dict[str, Tensor]] = None  # key -> (in, in), the statistic a refresh here fits (EMA)
    plugin_fits: Optional[Dict[str, geo.LowRankDiag]] = None  # key -> the plugin's factors refit here


def train_step(model, training: Training, hooks: MomentHooks, tokens: Tensor, collect: bool) -> float:
    training.zero_grad()
    hooks.active = collect
    loss = model(input_ids=tokens, labels=tokens).loss
    hooks.active = False
    loss.backward()
    training.step()
    return float(loss.detach())


def capture_step(model, training: Training, layers, hooks: MomentHooks, batches: List[Tensor],
                 want_rules: bool) -> Capture:
    """One data-parallel step, rank by rank: per-rank gradients and input moments, then an
    optimizer step on the exact average (what every rank would hold after a native all-reduce)."""
    params = [p for p in model.parameters() if p.requires_grad]
    total = [torch.zeros_like(p) for p in params]
    per_rank: Dict[str, List[Tensor]] = {n: [] for n, _ in layers}
    moments: Dict[str, Tensor] = {}
    losses = []
    for tokens in batches:
        training.zero_grad()
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
    rules = training.rules() if want_rules else None
    for t, p in zip(total, params):
        p.grad = t.div_(ranks)
    training.step()
    return Capture(grads={n: torch.stack(g) for n, g in per_rank.items()},
                   moments={k: a.div_(ranks) for k, a in moments.items()},
                   rules=rules, loss=sum(losses) / ranks)


# ------------------------------------------------------------------------------- geometries


@dataclass(frozen=True)
class GeometrySpec:
    key: str  # "identity", "hadamard", "kfac_s32", ...
    kind: str  # identity | hadamard | kfac_input
    solver: str = ""
    rank: int = 0

    @property
    def label(self) -> str:
        if self.kind == "adam_factored":
            return "adam factored"
        if self.kind == "adam_full_v":
            return "adam full v (bound)"
        if self.kind == "choice":
            return "per-layer choice"
        if self.kind == "kfac_plugin":
            return f"kfac {self.solver} r{self.rank} plugin"
        if self.kind != "kfac_input":
            return self.kind
        return f"kfac {self.solver} r{self.rank}"


ADAM_SPEC = GeometrySpec("adam", "adam_factored")
FULL_V_SPEC = GeometrySpec("adam_full", "adam_full_v")


class FullSecondMomentScaling:
    """The bound Adam's factored geometry approaches, not shippable: every element scaled by
    ``sqrt(mean(v) / v_ij)`` with Adam's own ``v`` (every rank would need all of ``v``)."""

    kind = "adam_full_v"

    def __init__(self, v: Tensor):
        v = v.double()
        floor = geo.SCALING_FLOOR * float(v.mean())
        self.scale = (v.mean() / v.clamp_min(floor)).sqrt().float()

    def apply(self, G: Tensor) -> Tensor:
        return G.float() * self.scale

    def invert(self, Z: Tensor) -> Tensor:
        return Z.float() / self.scale

    # what the reducer calls: elementwise, so any run of the flat weight is a unit
    version, run_unit = 0, 1

    def apply_run(self, values: Tensor, start: int) -> Tensor:
        return values.float() * self.scale.reshape(-1).narrow(0, start, values.numel())

    def invert_run(self, values: Tensor, start: int) -> Tensor:
        return values.float() / self.scale.reshape(-1).narrow(0, start, values.numel())


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
    rank), shared by the solvers and by modules that read the same input.

    The residual diagonal's floor is ``damping`` (``mode="absolute"``, the plugin's
    ``geometry.damping``) or ``damping * mean(diag(A))`` (``"relative"``), so that a layer whose
    inputs are small (o_proj, down_proj) is not floored at a level meant for unit-scale ones."""

    def __init__(self, layers, key_of: Dict[str, str], damping: float, mode: str):
        self.layers = layers
        self.key_of = key_of
        self.damping = damping
        self.mode = mode
        self.sorted_names = sorted(n for n, _ in layers)
        self._fits: Dict[tuple, geo.LowRankDiag] = {}
        self.floors: Dict[int, Dict[str, float]] = {}  # capture -> statistic key -> floor used

    def floor(self, capture: int, key: str, A: Tensor) -> float:
        if self.mode == "absolute":
            value = self.damping
        else:
            value = self.damping * float(A.diagonal().double().mean())
            if not value > 0:
                raise SystemExit(f"--damping-mode relative: statistic {key!r} has mean diagonal "
                                 f"{float(A.diagonal().mean())!r}, so the floor would be {value!r}; "
                                 "use --damping-mode absolute")
        self.floors.setdefault(capture, {})[key] = value
        return value

    def build(self, spec: GeometrySpec, capture: int, cap: "Capture") -> Dict[str, geo.Whitener]:
        """Every layer's transform of ``spec`` built at ``capture`` (``cap``): kfac from the
        statistics there, Adam's factored scaling from ``exp_avg_sq`` before that step (a layer
        AdamW does not train, or without state yet, gets the identity)."""
        out = {}
        stats = cap.stats
        for name, module in self.layers:
            dim = module.in_features
            if spec.kind in ("adam_factored", "adam_full_v"):
                adam = cap.rules[name].adam
                v = adam.exp_avg_sq if adam is not None and bool((adam.exp_avg_sq > 0).any()) else None
                if v is None:
                    out[name] = geo.make_whitener("identity", dim)
                elif spec.kind == "adam_full_v":
                    out[name] = FullSecondMomentScaling(v)
                else:
                    out[name] = geo.factored_scaling_from_sums(*geo.row_col_sums(v.reshape(-1), 0, v.shape))
            elif spec.kind == "identity":
                out[name] = geo.make_whitener("identity", dim)
            elif spec.kind == "hadamard":  # the plugin seeds by the index among sorted names
                out[name] = geo.make_whitener("hadamard", dim, seed=self.sorted_names.index(name))
            elif spec.kind == "kfac_plugin":
                out[name] = geo.whitener_from_low_rank(cap.plugin_fits[self.key_of.get(name, name)], spec.solver)
            else:
                key, rank = self.key_of.get(name, name), min(spec.rank, dim)
                lrd = self._fits.get((capture, key, rank))
                if lrd is None:
                    lrd = self._fits[(capture, key, rank)] = geo.fit_low_rank_diag(
                        stats[key], rank=rank, damping=self.floor(capture, key, stats[key]))
                out[name] = geo.whitener_from_low_rank(lrd, spec.solver)
        return out


# ----------------------------------------------------------------------------- the reduction


def reduce_ranks(G: Tensor, codec, whitener: geo.Whitener, *, owner: Optional[int], stats: bool = True,
                 route: str = "direct", relay_codec=None) -> Tuple[Tensor, Dict[str, int]]:
    """The plugin's reduction of one layer, ``G`` (ranks, out, in) -> averaged (out, in), run by
    the plugin's own :class:`GiftReducer` on ``G.shape[0]`` ranks simulated as threads.

    ``route="direct"``: every rank but ``owner`` sends ``Z_r = G_r S`` encoded once; the owner
    decodes, sums in fp32, maps back with ``S^{-1}``, adds its own exact gradient and divides by
    the number of ranks. ``route="relay"`` (3+ ranks): chunk j of ``Z_r`` goes to rank j, which
    sums the chunks in fp32 (its own exact) and sends the sum on to the owner encoded again in
    ``relay_codec`` (None: ``codec``), as ZeRO-2's default route (``by_layout``) does with a
    bucket that reaches one owner. ``owner=None`` quantizes every rank (the layer is a shared
    section: every rank receives it whole, as Muon's copy ranks do; direct on either route, as
    in the plugin). ``stats`` adds the codec counters (elements sent, saturated, underflow) of
    every payload; ``relay_buckets`` is 1 where the relay ran.
    """
    world, numel = G.shape[0], G[0].numel()
    dst = 0 if owner is None else owner
    copies = tuple(range(world)) if owner is None else ()
    slices = [ParamSlice(dst, 0, numel, 0, 0, whitener.run_unit, GEO, copies)]
    route = "direct" if owner is None else route

    def rank_body(comm):
        bucket = G[comm.rank].reshape(-1).to(torch.float32, copy=True)
        reducer = GiftReducer(comm, codec, route=route, relay_codec=relay_codec)
        counters = reducer.reduce(bucket, slices, {0: whitener}, divisor=float(world), sample=stats)
        return bucket if comm.rank == dst else None, counters

    per_rank = run_local(world, rank_body)
    total = StepStats()
    for _, counters in per_rank:
        total.add(counters)
    counts = {"sent": total.quantized, "saturated": total.saturated, "underflow": total.underflow,
              "relay_buckets": per_rank[dst][1].relay_buckets}
    return per_rank[dst][0].view(G.shape[1:]), counts


def adam_scale(rule: fm.AdamRule, g_exact: Tensor) -> Tensor:
    """``1 / (sqrt(v_hat) + eps)`` of the state before this step (the exact gradient's own
    magnitude when there is no state yet)."""
    if rule.step == 0:
        return 1.0 / (g_exact.abs() + rule.eps)
    v_hat = rule.exp_avg_sq.float() / (1.0 - rule.betas[1] ** rule.step)
    return 1.0 / (v_hat.sqrt() + rule.eps)


def _sq(x: Tensor) -> float:
    return float(x.double().square().sum())


class LayerReference:
    """The exact average of one layer and what every comparison with it needs, computed once
    (the exact side of each metric: the whitened gradient, NS5 outputs, Adam's direction)."""

    def __init__(self, exact: Tensor, rules: LayerRules, ruler: geo.Whitener):
        self.exact = exact
        self.rules = rules
        self.ruler = ruler
        self.ref_sq = _sq(exact)
        self.max_ref = float(exact.abs().max())
        self.whitened_ref_sq = _sq(ruler.apply(exact))
        self.ns = fm.newton_schulz5(exact) if rules.muon is not None else None
        self.muon = rules.muon.direction(exact) if rules.muon is not None else None
        if rules.adam is not None:
            self.adam = rules.adam.direction(exact)
            self.scale = adam_scale(rules.adam, exact)
            self.scaled = exact * self.scale


def compare(avg: Tensor, ref: LayerReference, counts: Dict[str, int]) -> dict:
    """One layer's reduced vs exact gradient: per-metric relative errors (``rel``) with the
    reference's squared norm (``ref``, the weight of an "rms" aggregate), and the sums and
    maxima of cosine, max error and the codec counters."""
    exact, rules = ref.exact, ref.rules
    rel = {"rel_l2": fm.relative_error(avg, exact),
           "whitened_rel_err": fm.whitened_relative_error(avg, exact, ref.ruler)}
    weight = {"rel_l2": ref.ref_sq, "whitened_rel_err": ref.whitened_ref_sq}
    if rules.muon is not None:
        rel["muon_ns_rel_err"] = fm.relative_error(fm.newton_schulz5(avg), ref.ns)
        rel["muon_update_rel_err"] = fm.relative_error(rules.muon.direction(avg), ref.muon)
    if rules.adam is not None:
        rel["adam_update_rel_err"] = fm.relative_error(rules.adam.direction(avg), ref.adam)
        rel["adam_metric_rel_err"] = fm.relative_error(avg * ref.scale, ref.scaled)
        weight.update(adam_update_rel_err=_sq(ref.adam), adam_metric_rel_err=_sq(ref.scaled))
    rel["optimizer_rel_err"] = rel["muon_update_rel_err" if rules.trained_by == "muon" else "adam_update_rel_err"]
    out = {"rel": rel, "ref": weight, "dot": float(torch.dot(avg.reshape(-1).double(), exact.reshape(-1).double())),
           "q_sq": _sq(avg), "ref_sq": ref.ref_sq, "max_err": float((avg - exact).abs().max()), "max_ref": ref.max_ref}
    out.update(counts)
    return out


def combine(key: str, parts: List[dict]) -> Optional[float]:
    """One column over the layers that have it (``COLUMNS`` says how); None if none has."""
    have = [p for p in parts if key in p["rel"]]
    if not have:
        return None
    if COLUMNS[key][1] == "mean":
        return sum(p["rel"][key] for p in have) / len(have)
    ref = sum(p["ref"][key] for p in have)
    err = sum(p["rel"][key] ** 2 * p["ref"][key] for p in have)
    return math.sqrt(err / ref) if ref > 0 else 0.0


def metrics(parts: List[dict]) -> dict:
    """Every column from one layer's parts or several (an aggregate)."""
    s = {k: sum(p[k] for p in parts) for k in ("dot", "q_sq", "ref_sq", "sent", "saturated", "underflow")}
    max_err = max(p["max_err"] for p in parts)
    max_ref = max(p["max_ref"] for p in parts)
    denom = math.sqrt(s["q_sq"] * s["ref_sq"])
    out = {key: combine(key, parts) for key in COLUMNS}
    out.update({
        "cosine": s["dot"] / denom if denom > 0 else 1.0,
        "max_err_rel": max_err / max_ref if max_ref > 0 else 0.0,
        "saturation_rate": s["saturated"] / s["sent"] if s["sent"] else 0.0,
        "underflow_rate": s["underflow"] / s["sent"] if s["sent"] else 0.0,
        "elements_sent": int(s["sent"]),
        "relay_layers": sum(p.get("relay_buckets", 0) for p in parts),
        "layers_per_column": {key: sum(key in p["rel"] for p in parts) for key in COLUMNS},
    })
    return out


def _gain(geo_err: Optional[float], euclid_err: Optional[float]) -> float:
    return 1.0 - geo_err / euclid_err if euclid_err else 0.0


# ------------------------------------------------------------------------------------ output


def short(name: str) -> str:
    return name[len("model."):] if name.startswith("model.") else name


def _num(x: Optional[float], width: int, digits: int = 4) -> str:
    return f"{'-':>{width}}" if x is None else f"{x:>{width}.{digits}f}"


# Update columns of the aggregate table: the NS pair first under Muon, Adam's pair first under AdamW.
def _update_columns(optimizer: str) -> List[str]:
    muon = ["muon_ns_rel_err", "muon_update_rel_err"]
    adam = ["adam_update_rel_err", "adam_metric_rel_err"]
    return muon + ["optimizer_rel_err"] + adam if optimizer == "muon" else adam + ["optimizer_rel_err"] + muon


def print_aggregate(results, formats, geoms, ranks: int, owner_note: str, optimizer: str, ruler: str,
                    coverage: Dict[str, int], n_layers: int) -> None:
    print(f"\nAggregate over all Linear weights at t2 ({ranks} ranks, {owner_note})")
    cover = ", ".join(f"{COLUMNS[k][0]} {coverage[k]}" for k in _update_columns(optimizer))
    print(f"  whitened = ||E S|| / ||G S|| with the {ruler} whitener fitted at t1 for every row; layers per "
          f"column: {cover} of {n_layers}")
    print("  rel L2, whitened, Adam: sqrt(sum err^2 / sum ref^2) over layers; NS5(G), NS5(M+G), opt: mean of "
          "per-layer relative errors" + ("" if optimizer == "muon" else
                                         "; NS5 columns are a what-if (AdamW trains every layer)"))
    cols = ["rel_l2", "whitened_rel_err"] + _update_columns(optimizer)
    widths = {k: max(9, len(COLUMNS[k][0]) + 1) for k in cols}
    head = (f"{'format':<9} {'geometry':<19} {'cosine':>9} {'max err':>8} {'sat %':>7} {'uflow %':>8}"
            + "".join(f"{COLUMNS[k][0]:>{widths[k]}}" for k in cols))
    print(head)
    print("-" * len(head))
    for fkey in formats:
        for g in geoms:
            m = results[fkey][g.key]["aggregate"]
            print(f"{fkey:<9} {g.label:<19} {m['cosine']:>9.6f} {m['max_err_rel']:>8.4f} "
                  f"{100 * m['saturation_rate']:>7.3f} {100 * m['underflow_rate']:>8.3f}"
                  + "".join(_num(m[k], widths[k]) for k in cols))
        print()


def print_per_layer(results, auto, fkey: str, layers, auto_key: str, trained_by: Dict[str, str],
                    selection_col: str) -> None:
    cols = ["rel_l2", "whitened_rel_err", "muon_ns_rel_err", "optimizer_rel_err"]
    print(f"Per layer, format {fkey}: identity / {auto_key} (fitted at t1) in {', '.join(COLUMNS[k][0] for k in cols)}"
          f" (opt: the layer's own optimizer's update); auto gains of {auto_key} in {COLUMNS[selection_col][0]}")
    head = (f"{'layer':<26} {'out x in':>10} {'opt':>5}" + "".join(f" {COLUMNS[k][0] + ' id/geo':>17}" for k in cols)
            + f" {'gain t1':>8} {'gain t2':>8} {'auto':>5}")
    print(head)
    print("-" * len(head))
    a = auto[fkey][auto_key]
    for name, module in layers:
        eu = results[fkey]["identity"]["layers"][name]
        ge = results[fkey][auto_key]["layers"][name]
        pairs = "".join(f" {_num(eu[k], 8)}/{_num(ge[k], 8).strip():<8}" for k in cols)
        shape = f"{module.out_features}x{module.in_features}"
        print(f"{short(name):<26} {shape:>10} {trained_by[name]:>5}{pairs} "
              f"{a['gains_heldout'][name]:>+8.3f} {a['gains_t2'][name]:>+8.3f} "
              f"{'geo' if name in a['selected'] else '-':>5}")
    print()


def print_auto(auto, formats, kfac, n_layers: int, min_gain: float, selection_metric: str, optimizer: str) -> None:
    col = SELECTION_COLUMN[selection_metric]
    shown = ["rel_l2", "whitened_rel_err", "muon_update_rel_err" if optimizer == "muon" else "adam_update_rel_err",
             "optimizer_rel_err"]
    print(f"layers: \"measured\" judged in {selection_metric} ({COLUMNS[col][0]}; gain >= {min_gain} on t1 with the t0 "
          f"whitener; applied at t2 with the t1 one). Aggregates at t2, Euclidean -> auto per metric; all-geometry "
          f"and oracle in {COLUMNS[col][0]}")
    head = (f"{'format':<9} {'geometry':<19} {'sel':>6}" + "".join(f" {COLUMNS[k][0] + ' eu->au':>19}" for k in shown)
            + f" {'all-geo':>8} {'oracle':>8}  verdict")
    print(head)
    print("-" * len(head))
    worse = []
    for fkey in formats:
        for g in kfac:
            a = auto[fkey][g.key]
            agg = a["aggregate"]
            e, au = agg["euclidean"][col], agg["auto"][col]
            verdict = "ok" if au <= e else f"WORSE {100 * (au / e - 1):+.3f}%"
            if au > e:
                worse.append((fkey, g, a))
            pairs = "".join(f" {_num(agg['euclidean'][k], 9)}->{_num(agg['auto'][k], 8).strip():<8}" for k in shown)
            print(f"{fkey:<9} {g.label:<19} {len(a['selected']):>3}/{n_layers:<2}{pairs} "
                  f"{_num(agg['geometry'][col], 8)} {_num(agg['oracle'][col], 8)}  {verdict}")
    choices = [(fkey, auto[fkey]["choice"]) for fkey in formats if "choice" in auto[fkey]]
    if choices:
        print("\nper-layer choice, layers taking each geometry: " + "; ".join(
            f"{fkey} " + ", ".join(f"{k} {sum(v == k for v in a['kinds'].values())}"
                                   for k in sorted(set(a["kinds"].values()))) for fkey, a in choices))
    if worse:
        print(f"\nwhere auto loses to Euclidean in {COLUMNS[col][0]} (selected layers that are worse at t2, "
              "gain t1 -> t2):")
        for fkey, g, a in worse:
            bad = ", ".join(f"{short(n)} ({a['gains_heldout'][n]:+.2f} -> {a['gains_t2'][n]:+.2f})"
                            for n in a["regressed"])
            print(f"  {fkey} {g.label}: {bad}")
    else:
        print(f"\nauto is never worse than Euclidean in {COLUMNS[col][0]} here.")


# -------------------------------------------------------------------------------------- main


def parse_args(argv):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[2])
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="small", choices=sorted(PRESETS), help="a launch/pretrain.py Llama preset")
    src.add_argument("--model-config", default=None, help="HF config json (with model_type) of a causal LM")
    src.add_argument("--hf-model", default=None, help="local pretrained model directory (save_pretrained)")
    p.add_argument("--ranks", type=int, default=4, help="simulated data-parallel ranks")
    p.add_argument("--micro", type=int, default=2, help="sequences per rank per step")
    p.add_argument("--seq", type=int, default=128, help="tokens per sequence")
    p.add_argument("--train-steps", type=int, default=300, help="optimizer steps before the first capture")
    p.add_argument("--refresh-interval", type=int, default=50,
                   help="steps from one capture to the next (geometry.refresh_interval)")
    p.add_argument("--collect-interval", type=int, default=10,
                   help="input statistics are collected every this many steps (geometry.collect_interval)")
    p.add_argument("--stats-tokens", type=int, default=None,
                   help="geometry.stats_tokens: at most this many tokens per layer and forward enter the statistics")
    p.add_argument("--stats-decay", type=float, default=0.95,
                   help="EMA of the statistics (geometry.stats_decay); 0 fits one step's statistics")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"),
                   help="adamw: AdamW on everything; muon: DeepSpeed's MuonWithAuxAdam split (Muon on hidden "
                        "matrices, AdamW on embeddings, lm_head, norms)")
    p.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (the Adam half under muon)")
    p.add_argument("--beta2", type=float, default=0.999,
                   help="AdamW's beta2 (torch's default; the ds_configs and most LLM recipes use 0.95)")
    p.add_argument("--muon-lr", type=float, default=0.02, help="Muon learning rate")
    p.add_argument("--muon-momentum", type=float, default=0.95,
                   help="Muon's beta (also the what-if momentum's under adamw)")
    p.add_argument("--warmup", type=int, default=20, help="linear lr warm-up steps")
    p.add_argument("--damping", type=float, default=1e-3, help="geometry.damping of the kfac fits")
    p.add_argument("--damping-mode", default="absolute", choices=("absolute", "relative"),
                   help="absolute: floor the residual diagonal at --damping (the plugin's rule); relative: at "
                        "--damping * mean(diag(A)) of each statistic")
    p.add_argument("--kfac", nargs="+", default=list(DEFAULT_KFAC), metavar="SOLVER:RANK",
                   help="kfac_input variants (solver structured|cholesky, rank; clamped to the layer width)")
    p.add_argument("--formats", nargs="+", default=list(FORMAT_BLOCKS), choices=FORMAT_NAMES,
                   help="wire formats (the five by default; bf16/fp32 also accepted, default block sizes)")
    p.add_argument("--per-layer-format", default="fp8_e4m3", choices=FORMAT_NAMES)
    p.add_argument("--auto-geometry", default=None,
                   help="kfac variant whose gains the per-layer table shows and whose t1 whitener is the "
                        "whitened column's ruler, e.g. kfac_s32 (default: the second --kfac entry)")
    p.add_argument("--selection-metric", default="optimizer", choices=tuple(SELECTION_COLUMN),
                   help="what auto's gain is judged in: the layer's optimizer's update, plain L2, or the "
                        "whitened norm")
    p.add_argument("--min-gain", type=float, default=0.05, help="selection.min_gain of layers: auto")
    p.add_argument("--all-quantized", action="store_true",
                   help="quantize the owner's contribution too (all-reduce; the plugin keeps it exact)")
    p.add_argument("--route", default="direct", choices=("direct", "relay"),
                   help="direct: every rank sends the owner its layer, encoded once; relay (3+ ranks): through "
                        "every rank, the sums encoded again on their way to the owner (what ZeRO-2's default "
                        "by_layout route does with a bucket that reaches one owner)")
    p.add_argument("--relay-format", default=None, metavar="NAME[/BLOCK]",
                   help="the relay's second hop (gift.relay_format / relay_block_size), e.g. int8/128 or bf16; "
                        "default: what the default config resolves for each format (zero._relay_codec)")
    p.add_argument("--plugin-stats", type=int, default=None, metavar="RANK",
                   help="also the kfac geometry of this rank as the plugin holds and fits it (sketched "
                        "statistics, Nystrom refits from step 0): rows 'kfac SOLVER rRANK plugin'")
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
    if args.relay_format is not None:
        name, _, block = args.relay_format.partition("/")
        if args.route != "relay":
            raise SystemExit(f"--relay-format {args.relay_format}: the second hop is the relay's; add --route relay")
        if name not in FORMAT_NAMES or (block and not block.isdigit()):
            raise SystemExit(f"--relay-format: got {args.relay_format!r}; NAME[/BLOCK] with NAME one of "
                             f"{list(FORMAT_NAMES)} and BLOCK elements per scale")
    if not 0.0 <= args.muon_momentum < 1.0 or not args.damping > 0:
        raise SystemExit(f"need 0 <= --muon-momentum < 1 and --damping > 0, got {args.muon_momentum} and "
                         f"{args.damping}")
    return args


def relay_codecs_of(codecs: Dict[str, object], relay_format: Optional[str]) -> Dict[str, object]:
    """Each format's relay second-hop codec, as the plugin makes it (``zero._relay_codec``) from a
    config of that format with ``--relay-format`` (NAME[/BLOCK]) or, without it, every other key at its
    default; the format's own codec where that resolves to the main one."""
    from deepspeed_gift.config import GiftConfig
    from deepspeed_gift.zero import _relay_codec

    keys = {}
    if relay_format is not None:
        name, _, block = relay_format.partition("/")
        keys = {"relay_format": name, "relay_block_size": int(block) if block else None}
    out = {}
    for f, codec in codecs.items():
        try:
            cfg = GiftConfig(format=f.split("/")[0], **keys)  # nvfp4/up: nvfp4's
        except ValueError as exc:
            raise SystemExit(f"--relay-format {relay_format} with format {f}: {exc}") from None
        out[f] = _relay_codec(cfg) or codec
    return out


def codec_label(codec) -> str:
    """``int8/32``: a codec's format and elements per scale (none for bf16, fp32 or one scale per tensor)."""
    return f"{codec.name}/{codec.block_size}" if codec.block_size else codec.name


def select_layers(local: Dict[str, Tensor], codec, whiteners: Dict[str, geo.Whitener],
                  rules: Dict[str, LayerRules], metric: str) -> Dict[str, float]:
    """Held-out gain of every layer's geometry in ``metric``, judged by one round trip of the
    owner's local gradient with ``metrics.judge_geometry`` and the layer's own update rule."""
    gains = {}
    for n, G in local.items():
        euclid, geom = fm.judge_geometry(G, codec, whiteners[n], rule=rules[n].own)
        gains[n] = _gain(geom[metric], euclid[metric])
    return gains


@dataclass
class TrainedRun:
    """Step 1's product: the trained model's layers, its three captures and how it got there."""

    model_label: str
    layers: List[Tuple[str, nn.Linear]]
    key_of: Dict[str, str]  # layer -> the statistic it reads (q/k/v and gate/up share one)
    trained_by: Dict[str, str]
    caps: List[Capture]
    losses: List[float]
    capture_at: List[int]
    opt_note: str
    seconds: float


def train_and_capture(args) -> TrainedRun:
    """Train (statistics collected as the plugin does) and capture t0, t1, t2."""
    t_start = time.perf_counter()
    model, model_label = build_model(args)
    layers = linear_layers(model)
    plugin = PluginStatistics(layers, args, args.plugin_stats) if args.plugin_stats else None
    hooks = MomentHooks(layers, args.stats_tokens, companion=plugin.hooks if plugin else None)
    training = Training(model, layers, args)
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
            cap = capture_step(model, training, layers, hooks, [s.batch(args.micro) for s in samplers],
                               want_rules=True)  # Adam's geometry at t0/t1, selection at t1, reference at t2
            fold(cap.moments)
            cap.stats = {key: ema.value().clone() for key, ema in emas.items()}
            if plugin is not None:
                plugin.end_step(k)
                cap.plugin_fits = dict(plugin.kfac.lowrank)
            caps.append(cap)
            losses.append(cap.loss)
        else:
            tokens = torch.cat([s.batch(args.micro) for s in samplers])  # the global batch: rank moments averaged
            losses.append(train_step(model, training, hooks, tokens, collect=k % args.collect_interval == 0))
            fold(hooks.take())
            if plugin is not None:
                plugin.end_step(k)
    n_muon = sum(t == "muon" for t in training.trained_by.values())
    opt_note = (f"Muon (lr {args.muon_lr}, momentum {args.muon_momentum}) on {n_muon} of {len(layers)} Linear "
                f"weights + AdamW (lr {args.lr})" if args.optimizer == "muon" else f"AdamW (lr {args.lr})")
    return TrainedRun(model_label, layers, dict(hooks.key_of), dict(training.trained_by), caps, losses, capture_at,
                      opt_note, time.perf_counter() - t_start)


def reduce_at_t2(run: TrainedRun, factory: WhitenerFactory, geoms, codecs, owner_of, ruler_key: str,
                 route: str = "direct", relay_codecs: Optional[Dict[str, object]] = None):
    """Step 2: every format x geometry reduced at t2 with the whiteners fitted at t1, on ``route``
    (``relay_codecs``: format -> the relay's second-hop codec).
    Returns (results as printed, per-layer ``compare`` parts: format -> geometry -> layer)."""
    relay_codecs = relay_codecs or {}
    names = [n for n, _ in run.layers]
    G2 = run.caps[2].grads
    whiteners_t1 = {g.key: factory.build(g, 1, run.caps[1]) for g in geoms}
    ruler = whiteners_t1[ruler_key]
    refs = {n: LayerReference(G2[n].mean(0), run.caps[2].rules[n], ruler[n]) for n in names}
    parts = {f: {g.key: {} for g in geoms} for f in codecs}
    for g in geoms:
        ws = whiteners_t1[g.key]
        for n in names:
            for f, codec in codecs.items():
                avg, counts = reduce_ranks(G2[n], codec, ws[n], owner=owner_of[n], route=route,
                                           relay_codec=relay_codecs.get(f))
                parts[f][g.key][n] = compare(avg, refs[n], counts)
    results = {f: {g.key: {"aggregate": metrics(list(parts[f][g.key].values())),
                           "layers": {n: metrics([parts[f][g.key][n]]) for n in names}} for g in geoms}
               for f in codecs}
    return results, parts


def simulate_auto(run: TrainedRun, factory: WhitenerFactory, judged_specs, choice_specs, codecs, parts,
                  args) -> dict:
    """Step 3: gains of the t0 transforms on t1's owner-local gradient, selection applied at t2,
    for each judged geometry alone, and ``choice``: every layer takes the geometry of
    ``choice_specs`` with the best held-out gain (``geometry.kind`` as a list: the auto kfac
    geometry and Adam's), or Euclidean below ``--min-gain``."""
    names = [n for n, _ in run.layers]
    sel_col = SELECTION_COLUMN[args.selection_metric]
    local = {n: run.caps[1].grads[n][i % args.ranks] for i, n in enumerate(names)}
    auto = {f: {} for f in codecs}
    transforms_t0 = {g.key: factory.build(g, 0, run.caps[0]) for g in judged_specs}

    def summarize(f, pick_t1, gains, pick_t2):
        """pick_*: layer -> geometry key it would take (None: Euclidean)."""
        eu = parts[f]["identity"]
        selected = [n for n in names if gains[n] >= args.min_gain]
        at = {n: parts[f][pick_t1[n]][n] for n in names}  # every layer on its geometry (all-geo)
        agg = {"euclidean": metrics(list(eu.values())),
               "auto": metrics([at[n] if n in selected else eu[n] for n in names]),
               "geometry": metrics(list(at.values())),
               "oracle": metrics([min([eu[n]] + [parts[f][k][n] for k in pick_t2[n]], key=lambda p: p["rel"][sel_col])
                                  for n in names])}
        return {"gains_heldout": gains,
                "gains_t2": {n: _gain(at[n]["rel"][sel_col], eu[n]["rel"][sel_col]) for n in names},
                "selected": selected,
                "kinds": {n: pick_t1[n] for n in selected},
                "regressed": [n for n in selected if at[n]["rel"][sel_col] > eu[n]["rel"][sel_col]],
                "aggregate": agg,
                "worse_than_euclidean": agg["auto"][sel_col] > agg["euclidean"][sel_col]}

    for f, codec in codecs.items():
        gains = {}
        for g in judged_specs:
            gains[g.key] = select_layers(local, codec, transforms_t0[g.key], run.caps[1].rules, args.selection_metric)
            auto[f][g.key] = summarize(f, {n: g.key for n in names}, gains[g.key], {n: [g.key] for n in names})
        if len(choice_specs) > 1:
            best = {n: max(choice_specs, key=lambda g: gains[g.key][n]).key for n in names}
            auto[f]["choice"] = summarize(f, best, {n: gains[best[n]][n] for n in names},
                                          {n: [g.key for g in choice_specs] for n in names})
    return auto


def main(argv: Optional[List[str]] = None) -> int:
    args = parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    t_start = time.perf_counter()
    formats = list(dict.fromkeys(args.formats))
    if args.per_layer_format not in formats:
        formats.append(args.per_layer_format)
    codecs = {f: get_format(f, block_size=FORMAT_BLOCKS.get(f)) for f in formats}
    if "nvfp4" in codecs:  # the single block-scale rule of earlier versions, beside the per-block choice
        codecs["nvfp4/up"] = NvFp4Codec(scale_candidates=("up",))
        formats.insert(formats.index("nvfp4") + 1, "nvfp4/up")
    kfac = parse_kfac(args.kfac)
    plugin_specs = ([GeometrySpec(f"plugin_{g.solver[0]}{g.rank}", "kfac_plugin", g.solver, g.rank)
                     for g in kfac if g.rank == args.plugin_stats] if args.plugin_stats else [])
    if args.plugin_stats and not plugin_specs:
        raise SystemExit(f"--plugin-stats {args.plugin_stats}: no --kfac entry has that rank")
    geoms = [GeometrySpec("identity", "identity"), GeometrySpec("hadamard", "hadamard")] + kfac + plugin_specs + [
        ADAM_SPEC, FULL_V_SPEC]
    auto_key = args.auto_geometry or (kfac[1].key if len(kfac) > 1 else kfac[0].key)
    if auto_key not in {g.key for g in kfac}:
        raise SystemExit(f"--auto-geometry {auto_key!r} is not one of {[g.key for g in kfac]}")
    auto_spec = next(g for g in kfac if g.key == auto_key)
    relay_codecs = relay_codecs_of(codecs, args.relay_format) if args.route == "relay" else {}
    second_hop = {f: codec_label(c) for f, c in relay_codecs.items()}
    route_note = "route direct"
    if args.route == "relay":
        hops = set(second_hop.values())
        route_note = ("route relay, second hop " + (next(iter(hops)) if len(hops) == 1 else
                                                     ", ".join(f"{f} {h}" for f, h in second_hop.items()))
                      + f" ({'--relay-format' if args.relay_format else 'the default config'}'s"
                      + (", shared sections direct)" if args.all_quantized else ")"))

    run = train_and_capture(args)
    layers, names = run.layers, [n for n, _ in run.layers]
    n_params = sum(m.weight.numel() for _, m in layers)
    owner_of = {n: (None if args.all_quantized else i % args.ranks) for i, n in enumerate(names)}
    owner_note = "every rank quantized (all-reduce)" if args.all_quantized else "owner's own contribution exact"
    stats_note = (f"EMA {args.stats_decay} of moments every {args.collect_interval} steps"
                  + (f", {args.stats_tokens} tokens per layer and forward" if args.stats_tokens else "")
                  if args.stats_decay
                  else "one step's moments")
    damping_note = (f"{args.damping}" if args.damping_mode == "absolute"
                    else f"{args.damping} x mean(diag(A))")
    print(f"model: {run.model_label}, {len(layers)} Linear weights, {n_params / 1e6:.2f}M elements; ranks "
          f"{args.ranks} x {args.micro} x {args.seq} tokens; {run.capture_at[-1] + 1} steps of {run.opt_note}; "
          f"captures t0, t1, t2 at steps {', '.join(map(str, run.capture_at))}; loss {run.losses[0]:.3f} -> "
          f"{run.losses[-1]:.3f}; kfac statistics: {stats_note}, damping floor {damping_note}; model + captures "
          f"{run.seconds:.1f} s")
    print(f"{route_note}" + ("; relay needs 3+ ranks: every layer goes direct" if args.route == "relay"
                             and args.ranks < 3 else ""))

    factory = WhitenerFactory(layers, run.key_of, args.damping, args.damping_mode)
    results, parts = reduce_at_t2(run, factory, geoms, codecs, owner_of, auto_key, args.route, relay_codecs)
    t_reduce = time.perf_counter() - t_start - run.seconds
    choice_specs = [auto_spec, ADAM_SPEC]
    auto = simulate_auto(run, factory, kfac + [ADAM_SPEC], choice_specs, codecs, parts, args)
    judged = kfac + [ADAM_SPEC, GeometrySpec("choice", "choice")]

    coverage = results[formats[0]]["identity"]["aggregate"]["layers_per_column"]
    print_aggregate(results, formats, geoms, args.ranks, f"{owner_note}, {route_note}", args.optimizer,
                    auto_spec.label, coverage, len(names))
    print_per_layer(results, auto, args.per_layer_format, layers, auto_key, run.trained_by,
                    SELECTION_COLUMN[args.selection_metric])
    print_auto(auto, formats, judged, len(names), args.min_gain, args.selection_metric, args.optimizer)
    wall = time.perf_counter() - t_start
    print(f"\nwall time {wall:.1f} s (model + captures {run.seconds:.1f} s, reductions {t_reduce:.1f} s, "
          f"{torch.get_num_threads()} threads)")
    if args.json is not None:
        out = {
            "command": [Path(sys.argv[0]).name] + (sys.argv[1:] if argv is None else list(argv)),
            "model": run.model_label,
            "args": {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()},
            "protocol": {"capture_steps": run.capture_at,
                         "training": run.opt_note,
                         "statistics": stats_note,
                         "damping": damping_note,
                         "whitener_at_t2": "fitted at t1 on the rank-averaged statistics",
                         "whitened_ruler": f"{auto_spec.label} whitener fitted at t1, the same for every geometry",
                         "auto_gain": f"t0 whitener judged on t1's owner-local gradient (metrics.judge_geometry, "
                                      f"one round trip) in {args.selection_metric}, 1 - err_geo / err_euclid",
                         "owner_exact": not args.all_quantized,
                         "route": args.route,
                         "relay_second_hop": second_hop,
                         "relay_second_hop_from": (args.relay_format or "default config") if second_hop else None,
                         "aggregate": {k: how for k, (_, how) in COLUMNS.items()},
                         "muon_ns": "relative error of NS5(G), fp32 Newton-Schulz, no momentum",
                         "muon_update": "relative error of NS5(lerp(g, lerp(m, g, 1-beta), beta)), momentum before "
                                        "t2" + ("" if args.optimizer == "muon" else
                                                " (what-if: EMA of the AdamW run's averaged gradients)"),
                         "optimizer_metric": "each layer in its own optimizer's update (muon_update or adam_update)",
                         "adam_update": "relative L2 error of m_hat/(sqrt(v_hat)+eps) after this step, AdamW's "
                                        "real state, weight decay excluded",
                         "adam_metric": "relative L2 error of g/(sqrt(v_hat)+eps), v_hat before this step"},
            "formats": {f: {"name": f, "block_size": codecs[f].block_size} for f in formats},
            "geometries": {g.key: {"kind": g.kind, "solver": g.solver, "rank": g.rank, "label": g.label}
                           for g in geoms},
            "layers": [{"name": n, "out": m.out_features, "in": m.in_features, "owner": owner_of[n],
                        "statistic": run.key_of.get(n, n), "trained_by": run.trained_by[n]}
                       for n, m in layers],
            "damping_floors": {f"t{c}": floors for c, floors in sorted(factory.floors.items())},
            "losses": run.losses,
            "results": results,
            "auto": auto,
            "wall_s": wall,
            "model_and_capture_s": run.seconds,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "machine": platform.machine(),
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(out, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
