"""    .venv/bin/python launch/compare.py

Runs several ds_configs on the same model, data, seed and steps; writes report.md and a
loss-curve PNG and prints where they are. By default (``DEFAULT_SUITE``): under AdamW the
bf16 baseline and Euclidean vs GIFT at FP8 e5m2 per-tensor (the paper's pair) and at NVFP4;
under DeepSpeed's Muon the bf16 baseline and Euclidean vs GIFT at FP8 e5m2 per-tensor. Each
GIFT config is paired with the Euclidean config that differs from it in the geometry only
(``matched_pairs``: same format, block, scale, rounding, error feedback, ``others`` and
``params``), and the report opens with one verdict line per pair; the
``small`` Llama on the embedded standard-library corpus, 2 ranks on CPU (gloo), 250 steps:
about 7 minutes on 2 idle CPU cores with fast bf16 matmuls (measured 6.9), about 11 on an
AVX2-only CPU, where the bf16 configs compute in fp32 with bf16 on the wire (``--compute-dtype``,
``launch/compute.py``; measured 11.1), more with other jobs on the machine. Other choices:

    .venv/bin/python launch/compare.py --all        # every stage-2 config of ds_configs/ (~14 min idle)
    .venv/bin/python launch/compare.py --configs ds_configs/bf16_baseline_zero1.json ds_configs/gift_fp8_zero1.json
    .venv/bin/python launch/compare.py --preset tiny --steps 20 --out-dir runs/quick
    .venv/bin/python launch/compare.py --seeds 3 --configs ds_configs/muon_euclid_fp8_e5m2_tensor_zero2.json \\
        ds_configs/muon_gift_fp8_e5m2_tensor_zero2.json --out-dir runs/seeds

Each config runs in its own set of ranks (``launch.spawn.run_ranks`` calling
``launch/pretrain.py``'s ``main``), so one that fails or hangs is reported as such and
the next still runs. ``--seeds N`` runs every config with seeds ``--seed`` .. ``--seed``+N-1
(a seed sets the model's initialization and the order of the training batches; the
validation batches are the same for every seed) and adds mean +- std of the final
validation loss per config and, for each GIFT-vs-Euclidean pair at the same format and
optimizer, whether the difference of the means exceeds two standard errors.

Writes, under ``--out-dir``: ``report.md`` (final train/validation loss and gap to the bf16
baseline of the same optimizer, next-token accuracy, wire bytes per gradient element,
sampled fidelity, GIFT's selection profile where the records have it, step time and ratio
to the baseline; GIFT vs Euclidean at the same format, under AdamW and under Muon; the
seed statistics), ``loss_curves.png`` (needs matplotlib), ``results.json`` (every run,
per seed) and one metrics JSONL per run in ``runs/``.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import platform
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from launch.pretrain import (PROFILE_ERRORS, finite, read_metrics, resolve_path, run_rank,  # noqa: E402
                             summarize)
from launch.spawn import run_ranks  # noqa: E402
from launch.compute import COMPUTE_DTYPES, bf16_path, choose_compute_dtype  # noqa: E402

# lr for the small preset (the configs ship 3e-4, for 300M+ models); Muon's matrices keep the
# configs' muon_lr 0.02, which also suits the small preset (250 steps: val loss 1.855; 0.05: 1.865)
DEFAULTS = dict(preset="small", steps=250, seq_len=128, micro_batch=4, lr=2e-3, eval_every=25, eval_batches=4)
# Sized by measurement (small preset, 250 steps, 2 ranks on 2 CPU cores): an AdamW run ~50 s
# idle, ~90 s with other jobs on the machine; a Muon run ~90 s / ~150 s (Newton-Schulz of every
# matrix: 1.6x AdamW's CPU time per step). The e4m3 per-block pair, GIFT on all layers and the
# Muon NVFP4 pair stay available through --all / --configs.
DEFAULT_SUITE = (
    "bf16_baseline_zero2", "euclid_fp8_e5m2_tensor_zero2", "gift_fp8_e5m2_tensor_zero2",
    "euclid_nvfp4_zero2", "gift_nvfp4_zero2",
    "muon_bf16_baseline_zero2", "muon_euclid_fp8_e5m2_tensor_zero2", "muon_gift_fp8_e5m2_tensor_zero2",
)
RUN_TIMEOUT_S = 900
# A GIFT-vs-Euclidean difference of means counts when it exceeds this many standard errors.
SE_THRESHOLD = 2.0


def stage2_configs() -> list:
    """Every stage-2 config in ds_configs/ except the mpi-backend variant."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json"))):
        with open(path) as f:
            cfg = json.load(f)
        gift = cfg.get("gift")
        if cfg.get("zero_optimization", {}).get("stage") != 2 or (gift and gift.get("backend") == "mpi"):
            continue
        out.append(os.path.relpath(path, ROOT))
    return sorted(out, key=_report_order)


def default_configs() -> list:
    """``DEFAULT_SUITE``, baseline of each optimizer first."""
    paths = [os.path.join("ds_configs", name + ".json") for name in DEFAULT_SUITE]
    return sorted(paths, key=_report_order)


FORMAT_ORDER = ("fp8_e5m2", "fp8_e4m3", "int8", "nvfp4", "int4", "bf16", "fp32")
OPTIMIZER_ORDER = ("adamw", "adam", "muon")


def _report_order(path: str):
    """By optimizer; within one, the baseline first, then by format, each Euclidean run before
    its GIFT variants."""
    g = describe_gift(path)
    opt = OPTIMIZER_ORDER.index(g["optimizer"]) if g["optimizer"] in OPTIMIZER_ORDER else len(OPTIMIZER_ORDER)
    if g["wire"] == "native":
        return (opt, 0)
    return (opt, 1, FORMAT_ORDER.index(g["format"]), g["block"], g["geometry"] != "identity",
            str(g["layers"]) == "all", g.get("params") is not None, path)


def is_baseline(path: str) -> bool:
    with open(resolve_path(path)) as f:
        gift = json.load(f).get("gift")
    return not gift or gift.get("enabled") is False


def config_label(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def describe_gift(path: str) -> dict:
    """Optimizer and format / block / geometry of a config, to pair GIFT with Euclidean runs."""
    import deepspeed_gift

    with open(resolve_path(path)) as f:
        raw = json.load(f)
    cfg = deepspeed_gift.get_gift_config(raw)
    optimizer = str(raw.get("optimizer", {}).get("type", "none")).lower()
    if not cfg.enabled:
        return {"wire": "native", "optimizer": optimizer}
    return {"wire": "gift", "optimizer": optimizer, "format": cfg.format, "block": cfg.effective_block_size,
            "scale": cfg.scale, "rounding": cfg.rounding, "others": cfg.others, "geometry": cfg.geometry.kind,
            "error_feedback": cfg.error_feedback, "layers": cfg.layers,
            "params": cfg.params.format if cfg.params is not None else None}


# What a GIFT run and its Euclidean pair may differ in: the geometry and which layers take it.
# Everything else describe_gift reports (optimizer, format, block, scale, rounding, error
# feedback, others, params) must be equal, so a pair's difference is the geometry's.
GEOMETRY_KEYS = ("geometry", "layers")


def same_but_geometry(g: dict, e: dict) -> bool:
    keys = (set(g) | set(e)) - set(GEOMETRY_KEYS)
    return all(g.get(k) == e.get(k) for k in keys)


def geometry_difference(g: dict, e: dict) -> str:
    """How a pair differs, e.g. ``geometry kfac_input vs identity, layers measured vs all``."""
    return ", ".join(f"{k} {_setting(g.get(k))} vs {_setting(e.get(k))}" for k in GEOMETRY_KEYS
                     if g.get(k) != e.get(k)) or "nothing"


def _setting(x) -> str:
    return "+".join(map(str, x)) if isinstance(x, (list, tuple)) else str(x)


def optimizer_name(g: dict) -> str:
    return {"adamw": "AdamW", "adam": "Adam", "muon": "Muon"}.get(g["optimizer"], g["optimizer"])


def pretrain_argv(path: str, seed: int, *, preset: str, steps: int, seq_len: int, micro_batch: int, lr: float,
                  eval_every: int, eval_batches: int, compute_dtype: str = "auto") -> list:
    """``launch/pretrain.py``'s arguments for one run of ``path`` (what every run of a
    comparison shares; ``benchmarks/ef_study.py`` runs the same)."""
    return ["--ds-config", path, "--preset", preset, "--steps", str(steps), "--seed", str(seed),
            "--seq-len", str(seq_len), "--micro-batch", str(micro_batch), "--lr", str(lr),
            "--eval-every", str(eval_every), "--eval-batches", str(eval_batches), "--compute-dtype", compute_dtype,
            "--no-progress"]


def run_one(path: str, args, metrics_path: str, seed: int) -> dict:
    argv = pretrain_argv(path, seed, preset=args.preset, steps=args.steps, seq_len=args.seq_len,
                         micro_batch=args.micro_batch, lr=args.lr, eval_every=args.eval_every,
                         eval_batches=args.eval_batches, compute_dtype=args.compute_dtype)
    argv += ["--log-every", str(args.log_every), "--metrics", metrics_path]
    desc = describe_gift(path)
    if args.muon_lr is not None and desc["optimizer"] == "muon":
        argv += ["--muon-lr", str(args.muon_lr)]
    if args.data:
        argv += ["--data", *args.data]
    if args.tokenizer:
        argv += ["--tokenizer", args.tokenizer]
    if os.path.exists(metrics_path):
        os.remove(metrics_path)
    t0 = time.perf_counter()
    load_before = os.getloadavg()[0]
    error = None
    try:
        run_ranks(run_rank, args.world_size, argv, timeout=args.timeout)
    except Exception as exc:  # a failed run is a result, not the end of the comparison
        error = str(exc)
    wall = time.perf_counter() - t0
    result = {"config": path, "label": config_label(path), "seed": seed, "wall_s": wall, "gift": desc}
    result["load_avg"] = [round(load_before, 2), round(os.getloadavg()[0], 2)]
    metrics = read_metrics(metrics_path) if os.path.exists(metrics_path) else None
    if metrics and metrics["train"]:
        result.update(summarize(metrics["train"], metrics["eval"]))
        result["curve"] = [(r["step"], r["loss"]) for r in metrics["train"]]
        result["val_curve"] = [(r["step"], r["val_loss"]) for r in metrics["eval"]]
        for key in ("geometry_gains", "geometry_active"):
            if (metrics["end"] or {}).get(key) is not None:
                result[key] = metrics["end"][key]
        if metrics["start"]:
            result["params"] = metrics["start"]["params"]
            result["tokens_per_step"] = metrics["start"]["tokens_per_step"]
            result["corpus"] = metrics["start"]["corpus"]
            for key in ("compute_dtype", "compute_note", "bf16_path"):
                result[key] = metrics["start"].get(key)
            opt = metrics["start"]["ds_config"].get("optimizer", {}).get("params", {})
            result["lr"], result["muon_lr"] = opt.get("lr"), opt.get("muon_lr")
    result["status"] = status_of(result, metrics, error, args.steps)
    if error:
        result["error"] = error.strip().splitlines()[-1][:300] if error.strip() else "failed"
        result["error_full"] = error[-4000:]
    return result


def planned_compute(configs: list, requested: str) -> str:
    """One line before the runs: the dtype the configs will compute in on this machine."""
    lines = set()
    for path in configs:
        with open(resolve_path(path)) as f:
            dtype, note = choose_compute_dtype(requested, json.load(f))
        lines.add(note or f"compute dtype {dtype} ({bf16_path()})")
    return "; ".join(sorted(lines))


def compute_line(runs: list) -> str:
    """What the runs computed in, as their metrics recorded it (one line of the report)."""
    seen = sorted({(r.get("compute_dtype"), r.get("compute_note") or "") for r in runs if r.get("compute_dtype")})
    if not seen:
        return "not recorded"
    where = next((r["bf16_path"] for r in runs if r.get("bf16_path")), "")
    parts = [note or f"{dtype} (the configs' own dtype; {where})" for dtype, note in seen]
    return "; ".join(parts)


def status_of(result: dict, metrics, error, steps: int) -> str:
    losses = [loss for _, loss in result.get("curve", [])]
    ended = (metrics or {}).get("end") or {}
    if any(not math.isfinite(x) for x in losses) or ended.get("status") == "diverged":
        return "diverged"
    if error:
        return "timeout" if "no result" in error else "failed"
    if not losses or len(losses) < steps:
        return "failed"
    if result.get("final_train_loss") is not None and result["final_train_loss"] > losses[0]:
        return "diverged"  # ended above where it started
    return "ok"


# ---- seeds ------------------------------------------------------------------------------
def combine_seeds(runs: list) -> dict:
    """One config's runs (one per seed) as one result: numbers are means over the runs that
    finished normally, ``final_val_losses`` keeps the per-seed values. With one seed, the run."""
    if len(runs) == 1:
        return dict(runs[0], seeds=[runs[0]["seed"]])
    ok = [r for r in runs if r["status"] == "ok"]
    out = {k: runs[0][k] for k in ("config", "label", "gift")}
    out["seeds"] = [r["seed"] for r in runs]
    out["status"] = "ok" if len(ok) == len(runs) else f"{len(ok)}/{len(runs)} ok"
    for key in {k for r in ok for k, v in r.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}:
        values = [r[key] for r in ok if finite(r.get(key))]
        if key not in ("seed", "wall_s") and values:
            out[key] = statistics.fmean(values)
    for key in ("update_metric", "params", "tokens_per_step", "corpus", "lr", "muon_lr", "compute_dtype",
                "compute_note", "bf16_path"):
        if ok and ok[0].get(key) is not None:
            out[key] = ok[0][key]
    # a run that stopped early may still have a validation loss from before it stopped
    out["final_val_losses"] = {r["seed"]: r.get("final_val_loss") if r["status"] == "ok" else None for r in runs}
    return out


def seed_stats(values: list) -> dict:
    """n, mean and sample standard deviation of the finite values."""
    xs = [v for v in values if finite(v)]
    return {"n": len(xs), "mean": statistics.fmean(xs) if xs else None,
            "std": statistics.stdev(xs) if len(xs) > 1 else None}


def seed_verdict(gift_values: list, euclid_values: list) -> dict:
    """GIFT minus Euclidean difference of mean validation loss against
    ``SE_THRESHOLD * sqrt(s_g^2/n_g + s_e^2/n_e)``; lower loss is better."""
    g, e = seed_stats(gift_values), seed_stats(euclid_values)
    out = {"gift": g, "euclid": e, "diff": None, "se": None}
    if g["n"] < 2 or e["n"] < 2:
        out["verdict"] = "not enough seeds (needs 2 finished runs per side)"
        return out
    out["diff"] = g["mean"] - e["mean"]
    out["se"] = math.sqrt(g["std"] ** 2 / g["n"] + e["std"] ** 2 / e["n"])
    if abs(out["diff"]) > SE_THRESHOLD * out["se"]:
        out["verdict"] = "GIFT better" if out["diff"] < 0 else "Euclidean better"
    else:
        out["verdict"] = f"no difference at {SE_THRESHOLD:g} SE"
    return out


def paired_verdict(gift_by_seed: dict, euclid_by_seed: dict, names=("GIFT", "Euclidean")) -> dict:
    """The same comparison over the seeds both sides finished, paired by seed: a seed fixes the
    initialization and the batches of both runs, so the per-seed differences drop the
    seed-to-seed spread that the unpaired standard error carries. ``SE_THRESHOLD`` standard
    errors of the mean difference ``s_d / sqrt(n)``. ``names``: how the verdict calls the two sides."""
    seeds = sorted(s for s in gift_by_seed if s in euclid_by_seed
                   and finite(gift_by_seed[s]) and finite(euclid_by_seed[s]))
    diffs = [gift_by_seed[s] - euclid_by_seed[s] for s in seeds]
    out = {"seeds": seeds, "diffs": diffs, "n": len(diffs), "diff": None, "se": None}
    if len(diffs) < 2:
        out["verdict"] = "not enough paired seeds (needs 2)"
        return out
    out["diff"] = statistics.fmean(diffs)
    out["se"] = statistics.stdev(diffs) / math.sqrt(len(diffs))
    if abs(out["diff"]) > SE_THRESHOLD * out["se"]:
        out["verdict"] = f"{names[0]} better" if out["diff"] < 0 else f"{names[1]} better"
    else:
        out["verdict"] = f"no difference at {SE_THRESHOLD:g} SE"
    return out


# ---- report -----------------------------------------------------------------------------
def _f(x, spec=".4f", none="-"):
    return format(x, spec) if finite(x) else none


def _count(x) -> str:
    """A layer count, or its mean over seeds to one decimal."""
    return _f(x, "g" if finite(x) and float(x).is_integer() else ".1f")


def _gap(x, base):
    if not (finite(x) and finite(base)) or base == 0:
        return "-"
    return f"{100.0 * (x - base) / base:+.2f}%"


def _ratio(x, base):
    return _f(x / base, ".2f") if finite(x) and finite(base) and base > 0 else "-"


def wire_name(g: dict) -> str:
    if g.get("wire") != "gift":
        return "native bf16"
    block = "per-tensor" if g["block"] == 0 else f"block {g['block']}"
    names = {"identity": "Euclidean", "kfac_input": "GIFT", "hadamard": "Hadamard", "adam_factored": "Adam-factored"}
    kinds = g["geometry"] if isinstance(g["geometry"], list) else [g["geometry"]]
    geo = "/".join(names[k] for k in kinds)
    layers = "" if g["geometry"] == "identity" else f" (layers {g['layers']})"
    return (f"{geo} {g['format']} {block}{layers}" + (" + EF" if g.get("error_feedback") else "")
            + (f" + params {g['params']}" if g.get("params") else ""))


def baseline_of(r: dict, results: list):
    """The finished native run with the same optimizer (and seed, when runs have one)."""
    return next((b for b in results if b["gift"].get("wire") == "native" and b["status"] == "ok"
                 and b["gift"]["optimizer"] == r["gift"]["optimizer"] and b.get("seed") == r.get("seed")), None)


def report_table(results: list, with_seed: bool = False) -> list:
    rows = ["| config | optim | " + ("seed | " if with_seed else "") + "wire | status | train loss | vs bf16 | "
            "val loss | vs bf16 | val acc | B/elem | total B/elem | fidelity err | geo layers | step s | x bf16 | "
            "cpu s | x bf16 |",
            "|---|---|" + ("---:|" if with_seed else "") + "---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"
            "---:|---:|---:|---:|"]
    for r in results:
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**"
        if r.get("error"):
            status += f" ({r['error'].replace('|', '/')[:120]})"
        b = baseline_of(r, results) or {}
        rows.append("| " + " | ".join([
            r["label"], optimizer_name(r["gift"]), *([str(r["seed"])] if with_seed else []),
            wire_name(r["gift"]), status,
            _f(r.get("final_train_loss")), _gap(r.get("final_train_loss"), b.get("final_train_loss")),
            _f(r.get("final_val_loss")), _gap(r.get("final_val_loss"), b.get("final_val_loss")),
            _f(r.get("final_val_acc")), _f(r.get("bytes_per_elem"), ".3f"), _f(r.get("bytes_per_elem_total"), ".3f"),
            _f(r.get("fidelity_rel_err"), ".2e"),
            str(r["geometry_layers"]) if r.get("geometry_layers") is not None
            and r["gift"].get("geometry") not in (None, "identity") else "-",
            _f(r.get("median_step_s"), ".3f"), _ratio(r.get("median_step_s"), b.get("median_step_s")),
            _f(r.get("median_cpu_s"), ".3f"), _ratio(r.get("median_cpu_s"), b.get("median_cpu_s")),
        ]) + " |")
    return rows


def has_profile(r: dict) -> bool:
    return any(finite(r.get(k)) for k in PROFILE_ERRORS)


def _profile_value(r: dict, metric: str) -> str:
    """``in use`` error of one profile metric, with ``/ all-Euclidean`` where recorded."""
    used, euclid = r.get(f"profile_{metric}"), r.get(f"profile_{metric}_euclid")
    return _f(used, ".2e") + (f" / {_f(euclid, '.2e')}" if finite(euclid) else "")


def _profile_layers(r: dict) -> str:
    layers, judged = r.get("profile_layers"), r.get("profile_judged")
    return _count(layers) + (f" of {judged:g}" if finite(judged) else "")


def profile_text(r: dict) -> str:
    """GIFT's selection profile: plain L2 first, then the whitened norm and the optimizer's
    update (an update error alone would hide what the wire itself lost)."""
    metric = r.get("update_metric") or "optimizer"
    n = r.get("profile_refreshes")
    both = finite(r.get("profile_l2_euclid"))
    return (f"L2 {_profile_value(r, 'l2')}, whitened {_profile_value(r, 'whitened')}, "
            f"{metric} update {_profile_value(r, 'update')}" + (" (in use / all-Euclidean)" if both else "")
            + (f", {_profile_layers(r)} layers selected" if finite(r.get("profile_layers")) else "") + (f", mean of {n:g} refresh{'es' if n != 1 else ''}" if finite(n) else ""))


def telemetry_table(results: list) -> list:
    """Gradient errors of the GIFT-wire runs: the sampled fidelity (plain L2 against an exact
    reduction) beside the selection profile, where the records carry one."""
    wired = [r for r in results if r["gift"].get("wire") == "gift"]
    if not wired:
        return []
    lines = ["| config | optim | wire | fidelity err (L2) | profile L2 | profile whitened | profile update | "
             "update metric | layers selected |", "|---|---|---|---:|---:|---:|---:|---|---:|"]
    for r in wired:
        lines.append("| " + " | ".join([
            r["label"], optimizer_name(r["gift"]), wire_name(r["gift"]), _f(r.get("fidelity_rel_err"), ".2e"),
            _profile_value(r, "l2"), _profile_value(r, "whitened"), _profile_value(r, "update"),
            str(r.get("update_metric") or "-"), _profile_layers(r)]) + " |")
    if not any(has_profile(r) for r in wired):
        lines += ["", "No run recorded a selection profile (`profile_*` fields: GIFT versions before them, or "
                      "no refresh reached); the fidelity column is the plain L2 error only."]
    return lines


def _pair_line(g: dict, e: dict) -> str:
    fg, fe = g.get("fidelity_rel_err"), e.get("fidelity_rel_err")
    parts = [f"val loss {_f(g.get('final_val_loss'))} vs {_f(e.get('final_val_loss'))} "
             f"({_gap(g.get('final_val_loss'), e.get('final_val_loss'))})",
             f"train loss {_f(g.get('final_train_loss'))} vs {_f(e.get('final_train_loss'))}",
             f"fidelity err (L2) {_f(fg, '.2e')} vs {_f(fe, '.2e')}"
             + (f" ({fg / fe:.2f}x)" if finite(fe) and finite(fg) and fe > 0 else "")]
    for side, r in (("GIFT", g), ("Euclidean", e)):
        if has_profile(r):
            parts.append(f"{side} selection profile: {profile_text(r)}")
    layers = g.get("geometry_layers")
    geo = f"geometry on {_count(layers)} layers at the end"
    gains = g.get("geometry_gains")
    if gains:
        geo += (f" (auto profile, 1 - err_geometry/err_euclidean per layer: best {max(gains.values()):+.2f}, "
                f"median {statistics.median(gains.values()):+.2f})")
    parts += [geo, f"step time {_f(g.get('median_step_s'), '.3f')} vs {_f(e.get('median_step_s'), '.3f')} s"]
    if g.get("geometry_share") is not None:
        parts.append(f"GIFT's geometry work {100 * g['geometry_share']:.1f}% of its step time")
    line = f"- {wire_name(g['gift'])} vs {wire_name(e['gift'])}: " + ", ".join(parts)
    if g["status"] != "ok" or e["status"] != "ok":
        line += f" [{g['status']} / {e['status']}]"
    return line


def matched_pairs(results: list) -> list:
    """(run with a geometry - input whitening, Adam's, a per-layer choice -, Euclidean run) that
    differ in the geometry only (``same_but_geometry``)."""
    out = []
    for g in results:
        gg = g["gift"]
        if gg.get("wire") != "gift" or gg["geometry"] in ("identity", "hadamard"):
            continue
        for e in results:
            ee = e["gift"]
            if ee.get("wire") == "gift" and ee["geometry"] == "identity" and same_but_geometry(gg, ee):
                out.append((g, e))
    return out


def unpaired(results: list) -> list:
    """GIFT-wire runs that are in no pair (a comparison the report cannot make like with like)."""
    paired = {id(r) for pair in matched_pairs(results) for r in pair}
    return [r for r in results if r["gift"].get("wire") == "gift" and id(r) not in paired
            and r["gift"]["geometry"] not in ("hadamard",) and r["gift"].get("params") is None]


def verdict_lines(combined: list) -> list:
    """One line per pair: what differs, the validation losses, and whether the difference exceeds
    ``SE_THRESHOLD`` standard errors (paired by seed; one seed has no standard error)."""
    lines = []
    for g, e in matched_pairs(combined):
        gl, el = g.get("final_val_losses", {}), e.get("final_val_losses", {})
        paired = paired_verdict(gl, el)
        head = (f"- {optimizer_name(g['gift'])}, `{g['label']}` vs `{e['label']}`, differ in "
                f"{geometry_difference(g['gift'], e['gift'])}: val loss {_f(g.get('final_val_loss'))} vs "
                f"{_f(e.get('final_val_loss'))} ({_gap(g.get('final_val_loss'), e.get('final_val_loss'))})")
        if paired["n"] >= 2:
            head += (f"; paired over {paired['n']} seeds {_f(paired['diff'], '+.4f')} against {SE_THRESHOLD:g} SE = "
                     f"{_f(paired['se'] * SE_THRESHOLD)}: **{paired['verdict']}**")
        else:
            head += f"; one seed, no standard error: `--seeds 3` says whether it exceeds {SE_THRESHOLD:g} SE"
        lines.append(head)
    for r in unpaired(combined):
        lines.append(f"- `{r['label']}` has no Euclidean config here that differs from it in the geometry only")
    return lines


def params_pairs(results: list) -> list:
    """(run with a compressed parameter all-gather, the same config with DeepSpeed's own)."""
    out = []
    for c in results:
        if c["gift"].get("params") is None:
            continue
        same = {k: v for k, v in c["gift"].items() if k != "params"}
        for b in results:
            if b["gift"].get("params") is None and {k: v for k, v in b["gift"].items() if k != "params"} == same:
                out.append((c, b))
    return out


def params_lines(results: list) -> list:
    lines = []
    for c, b in params_pairs(results):
        lines.append(
            f"- {optimizer_name(c['gift'])}, {wire_name(c['gift'])} vs without `params`: val loss "
            f"{_f(c.get('final_val_loss'))} vs {_f(b.get('final_val_loss'))} "
            f"({_gap(c.get('final_val_loss'), b.get('final_val_loss'))}), train loss "
            f"{_f(c.get('final_train_loss'))} vs {_f(b.get('final_train_loss'))}, total B/elem "
            f"{_f(c.get('bytes_per_elem_total'), '.3f')} vs {_f(b.get('bytes_per_elem_total'), '.3f')} "
            f"({_ratio(c.get('bytes_per_elem_total'), b.get('bytes_per_elem_total'))}x), largest replica gap "
            f"{_f(c.get('params_gap_rel_max'), '.2e')}, step time {_f(c.get('median_step_s'), '.3f')} vs "
            f"{_f(b.get('median_step_s'), '.3f')} s")
    return lines


def pairs(results: list, optimizer: str = None) -> list:
    return [_pair_line(g, e) for g, e in matched_pairs(results)
            if optimizer is None or g["gift"]["optimizer"] == optimizer]


def seed_section(runs: list, combined: list, args) -> tuple:
    """Report lines and the JSON rows of the seed statistics."""
    seeds = sorted({r["seed"] for r in runs})
    lines = [f"## Seeds: final validation loss over {len(seeds)} seeds ({', '.join(map(str, seeds))})", "",
             "A seed sets the model's initialization and the order of the training batches; every config runs "
             "with every seed and the validation batches are the same. std = sample standard deviation; a run "
             "that did not finish is left out of n.", "",
             "| config | optim | wire | n | mean val loss | std | per seed |", "|---|---|---|---:|---:|---:|---|"]
    by_config = []
    for c in combined:
        values = [c["final_val_losses"][s] for s in c["seeds"]]
        st = seed_stats(values)
        by_config.append({"config": c["config"], "label": c["label"], "optimizer": c["gift"]["optimizer"],
                          "seeds": c["seeds"], "final_val_loss": values, **st})
        lines.append("| " + " | ".join([
            c["label"], optimizer_name(c["gift"]), wire_name(c["gift"]), str(st["n"]), _f(st["mean"]),
            _f(st["std"]), ", ".join(f"{s}: {_f(v)}" for s, v in zip(c["seeds"], values))]) + " |")
    lines += ["", f"GIFT vs the Euclidean config that differs in the geometry only: difference of mean validation loss "
                  f"(GIFT - Euclidean, negative = GIFT lower) against {SE_THRESHOLD:g} standard errors "
                  f"sqrt(s_g^2/n_g + s_e^2/n_e); then paired by seed (the same initialization and batches on "
                  f"both sides): the mean of the per-seed differences against {SE_THRESHOLD:g} s_d/sqrt(n).", ""]
    verdicts = []
    for g, e in matched_pairs(combined):
        v = seed_verdict([g["final_val_losses"][s] for s in g["seeds"]],
                         [e["final_val_losses"][s] for s in e["seeds"]])
        paired = paired_verdict({s: g["final_val_losses"][s] for s in g["seeds"]},
                                {s: e["final_val_losses"][s] for s in e["seeds"]})
        verdicts.append({"gift_config": g["label"], "euclid_config": e["label"], "optimizer": g["gift"]["optimizer"],
                         **v, "paired": paired})
        gs, es = v["gift"], v["euclid"]
        lines.append(
            f"- {optimizer_name(g['gift'])}, {wire_name(g['gift'])} vs {wire_name(e['gift'])}: "
            f"{_f(gs['mean'])} ± {_f(gs['std'])} (n={gs['n']}) vs {_f(es['mean'])} ± {_f(es['std'])} "
            f"(n={es['n']}), difference {_f(v['diff'], '+.4f')}, {SE_THRESHOLD:g} SE = "
            f"{_f(v['se'] * SE_THRESHOLD if finite(v['se']) else None)}: **{v['verdict']}**; paired by seed "
            f"(n={paired['n']}, differences {', '.join(_f(d, '+.4f') for d in paired['diffs'])}): mean "
            f"{_f(paired['diff'], '+.4f')}, {SE_THRESHOLD:g} SE = "
            f"{_f(paired['se'] * SE_THRESHOLD if finite(paired['se']) else None)}: **{paired['verdict']}**")
    if not verdicts:
        lines.append("- no GIFT/Euclidean pair at the same format and optimizer among these configs")
    lines.append("")
    return lines, by_config, verdicts


def write_report(runs: list, combined: list, args, path: str, plot_path, plot_note: str, wall: float) -> dict:
    """Writes report.md; returns the seed statistics (empty with one seed)."""
    import deepspeed
    import torch

    n_seeds = len({r["seed"] for r in runs})
    first = next((r for r in runs if r.get("params")), {})
    muon_lrs = sorted({r["muon_lr"] for r in runs if r.get("muon_lr") is not None})
    seeds = (f"seed {args.seed}" if n_seeds == 1
             else f"seeds {args.seed}..{args.seed + n_seeds - 1} (every config with every seed)")
    lines = [
        "# GIFT comparison report", "",
        f"{len(combined)} configs, same model, data and steps, {seeds}; {len(runs)} runs written by "
        f"`launch/compare.py` in {wall / 60:.1f} min.", "",
        f"- model: Llama preset `{args.preset}`"
        + (f", {first['params'] / 1e6:.2f}M parameters" if first.get("params") else ""),
        f"- data: {first.get('corpus', 'see runs/')}",
        f"- {args.world_size} ranks, {args.steps} steps, micro batch {args.micro_batch} x seq {args.seq_len}"
        + (f" = {first['tokens_per_step']} tokens/step" if first.get("tokens_per_step") else "")
        + f", peak lr {args.lr} (warmup + cosine)"
        + (f"; Muon: lr {args.lr} for the parameters it leaves to Adam (embeddings, head, norms), "
           f"{', '.join(f'{x:g}' for x in muon_lrs)} for its matrices" if muon_lrs else ""),
        f"- validation every {args.eval_every} steps on {args.eval_batches} batches per rank (fixed held-out files)",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU (gloo)'}; "
        f"torch {torch.__version__}, deepspeed {deepspeed.__version__}",
        f"- compute: {compute_line(runs)}",
        "- 1-minute load average before / after each run (step times are wall clock: other work on the "
        "machine inflates them): " + ", ".join(f"{r['label']}{'/' + str(r['seed']) if n_seeds > 1 else ''} "
                                               f"{r['load_avg'][0]:.1f}/{r['load_avg'][1]:.1f}" for r in runs),
        "", "## Verdict: each GIFT config against the Euclidean one that differs in the geometry only", "",
        *(verdict_lines(combined) or ["- no such pair among these configs"]), "",
        "## Every run", "", *report_table(runs, with_seed=n_seeds > 1), "",
        "Columns: train loss = mean of the last 10 steps; val loss / val acc = last validation (loss and "
        "next-token accuracy on held-out text); vs bf16 = gap in % to the bf16 baseline with the same optimizer"
        + (" and seed" if n_seeds > 1 else "") + "; B/elem = bytes on the wire per "
        "gradient element over the run, scales, headers and geometry exchange included (native bf16 = 2); "
        "total B/elem = that plus the parameter all-gather's bytes per element, mean per step (native bf16 = 4; "
        "6 where the runs computed in fp32, whose all-gather carries fp32 replicas); "
        "fidelity err = relative L2 error of the reduced gradient against an exact fp32 reduction, mean over "
        "sampled steps; geo layers = layers in the geometry branch at the end; step s = median wall-clock step "
        "time after 5 warm-up steps, cpu s = median CPU time of rank 0 per step (what the step computes, barely "
        "moved by other work on the machine, unlike wall clock), x bf16 = ratios to the baseline (on CPU the "
        "quantization arithmetic is not hidden behind a fast network: read them as overhead, not as a speed-up; "
        "GIFT pays off where communication, not arithmetic, bounds the step).", "",
    ]
    if any(r["gift"].get("error_feedback") for r in runs):
        lines += ["With error feedback the sampled fidelity error includes the residual carried over from the "
                  "previous step (what is sent is this step's gradient plus that residual), so it is larger by "
                  "design and comparable only between runs that both use error feedback.", ""]
    telemetry = telemetry_table(combined)
    if telemetry:
        lines += ["## Gradient error", "",
                  "fidelity err: plain relative L2 error of the reduced gradient (sampled steps). Profile: GIFT's "
                  "judgement of its layer selection at each refresh, the round-trip error of the coordinates in use "
                  "(whitened for selected layers, Euclidean for the others) in plain L2, in the whitened norm and "
                  "in the update the configured optimizer takes (update metric: the rule measured, e.g. `muon` = "
                  "Newton-Schulz of the momentum, `adam`; `adam+muon` when both halves of Muon were judged), "
                  "averaged over the judged layers and then over refreshes; `a / b` = in use / all-Euclidean "
                  "where recorded; layers selected = at the last refresh."
                  + (" Means over seeds." if n_seeds > 1 else ""), "", *telemetry, ""]
    mean_note = [f"Numbers are means over {n_seeds} seeds.", ""] if n_seeds > 1 else []
    for optimizer in sorted({r["gift"]["optimizer"] for r in combined},
                            key=lambda o: OPTIMIZER_ORDER.index(o) if o in OPTIMIZER_ORDER else 99):
        pair_lines = pairs(combined, optimizer)
        if not pair_lines:
            continue
        if optimizer == "muon":
            lines += ["## Muon: GIFT vs Euclidean at the same format", "",
                      "DeepSpeed's Muon (`MuonWithAuxAdam`: Newton-Schulz updates for the hidden matrices, Adam for "
                      "embeddings, head and norms); under ZeRO-2 each owner orthogonalizes the reduced gradient, "
                      "so what the wire loses reaches the update through the Newton-Schulz map.", ""]
            muon_base = next((c for c in combined if c["gift"]["wire"] == "native"
                              and c["gift"]["optimizer"] == "muon"), None)
            adam_base = next((c for c in combined if c["gift"]["wire"] == "native"
                              and c["gift"]["optimizer"] in ("adamw", "adam")), None)
            if muon_base and adam_base:
                lines += [f"bf16 baselines: Muon val loss {_f(muon_base.get('final_val_loss'))} vs AdamW "
                          f"{_f(adam_base.get('final_val_loss'))} "
                          f"({_gap(muon_base.get('final_val_loss'), adam_base.get('final_val_loss'))}).", ""]
        else:
            lines += [f"## GIFT vs Euclidean at the same format ({optimizer_name({'optimizer': optimizer})})", ""]
        lines += [*mean_note, *pair_lines, ""]
    compressed = params_lines(combined)
    if compressed:
        lines += ["## Compressed parameter all-gather", "",
                  "`gift.params`: after the step the owner sends the quantized change of the bf16 replica instead "
                  "of the replica; every rank applies the same decoded change. Against the same config with "
                  "DeepSpeed's own all-gather. total B/elem = gradient bytes (geometry included) plus parameter "
                  "bytes per element and step (native bf16: 2 + 2); replica gap = the largest |replica - "
                  "bf16(master)| over the run, relative to the largest value of its 128-element block.", "",
                  *mean_note, *compressed, ""]
    stats = {}
    if n_seeds > 1:
        seed_lines, by_config, verdicts = seed_section(runs, combined, args)
        lines += seed_lines
        stats = {"by_config": by_config, "pairs": verdicts}
    failed = [r for r in runs if r["status"] != "ok"]
    if failed:
        lines += ["## Runs that did not finish normally", ""]
        for r in failed:
            lines.append(f"- `{r['label']}`" + (f" seed {r['seed']}" if n_seeds > 1 else "") + f": {r['status']}"
                         + (f": {r['error']}" if r.get("error") else ""))
        lines.append("")
    lines += ["## Loss curves", ""]
    if n_seeds > 1:
        lines += [f"Seed {args.seed} only.", ""]
    lines.append(f"![loss curves]({os.path.basename(plot_path)})" if plot_path else plot_note)
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))
    return stats


def _moving_average(values, window: int) -> list:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(results: list, path: str):
    """Train loss (smoothed), its difference to the baseline of the same optimizer, validation
    loss; returns (path or None, note)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, ("matplotlib is not installed, so no plot was drawn "
                      "(pip install matplotlib, or pip install -e '.[train]').")
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 5))
    base_curves = {}
    for b in results:
        if b["gift"].get("wire") == "native" and b.get("curve"):
            base_curves.setdefault(b["gift"]["optimizer"], (b, dict(zip(
                [s for s, _ in b["curve"]], _moving_average([v for _, v in b["curve"]], 25)))))
    tails = []
    # the default cycle has 10 colours; more runs than that would share one
    colors = plt.get_cmap("tab10" if len(results) <= 10 else "tab20").colors
    for i, r in enumerate(results):
        curve = [(s, v) for s, v in r.get("curve", []) if math.isfinite(v)]
        if not curve:
            continue
        steps, losses = zip(*curve)
        smooth = _moving_average(list(losses), 10)
        tails += smooth[len(smooth) // 10:]
        label = r["label"] + ("" if r["status"] == "ok" else f" [{r['status']}]")
        style = "--" if r["gift"]["optimizer"] == "muon" else "-"
        line, = ax1.plot(steps, smooth, style, color=colors[i % len(colors)], label=label, lw=1.3)
        base, base_curve = base_curves.get(r["gift"]["optimizer"], (None, {}))
        if base_curve and r is not base:
            diff = [(s, v - base_curve[s]) for s, v in zip(steps, _moving_average(list(losses), 25))
                    if s in base_curve]
            if diff:
                ax2.plot(*zip(*diff), style, color=line.get_color(), lw=1.3, label=label)
        if r.get("val_curve"):
            ax3.plot(*zip(*r["val_curve"]), style, marker="o", ms=3, color=line.get_color(), label=label)
    if tails:  # the first steps (loss ~ ln vocab) would flatten the part worth reading
        ax1.set_ylim(min(tails) - 0.02 * (max(tails) - min(tails) + 1e-3), max(tails))
    ax1.set(title="train loss (10-step moving average; dashed: Muon)", xlabel="step",
            ylabel="cross-entropy (nats/token)")
    ax2.axhline(0.0, color="black", lw=0.8)
    ax2.set(title="train loss minus the bf16 baseline of its optimizer (25-step moving averages)", xlabel="step",
            ylabel="difference (nats/token)")
    ax3.set(title="validation loss", xlabel="step", ylabel="cross-entropy (nats/token)")
    for ax in (ax1, ax2, ax3):
        ax.grid(alpha=0.3)
    ax1.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path, ""


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Run several ds_configs on the same model, data, seed and steps; "
                                            "write report.md and a loss-curve PNG.",
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    which = p.add_mutually_exclusive_group()
    which.add_argument("--configs", nargs="+", help="ds_config paths (default: DEFAULT_SUITE, see the docstring)")
    which.add_argument("--all", action="store_true", help="every stage-2 config of ds_configs/ (not the mpi one)")
    p.add_argument("--out-dir", default=os.path.join("runs", "compare"))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--preset", default=DEFAULTS["preset"])
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"])
    p.add_argument("--micro-batch", type=int, default=DEFAULTS["micro_batch"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"],
                   help="peak lr (AdamW; under Muon the lr of what Muon leaves to Adam)")
    p.add_argument("--muon-lr", type=float, help="peak lr of Muon's matrices (default: each Muon config's muon_lr)")
    p.add_argument("--eval-every", type=int, default=DEFAULTS["eval_every"])
    p.add_argument("--eval-batches", type=int, default=DEFAULTS["eval_batches"])
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--seeds", type=int, default=1, help="run every config with seeds --seed .. --seed + N - 1 and "
                                                        "report mean +- std and GIFT-vs-Euclidean verdicts")
    p.add_argument("--data", nargs="+", help="passed to pretrain.py (default: embedded corpus)")
    p.add_argument("--tokenizer", help="passed to pretrain.py (default: bytes)")
    p.add_argument("--compute-dtype", choices=COMPUTE_DTYPES, default="auto",
                   help="passed to pretrain.py; auto: the configs' bf16, or fp32 with bf16 on the wire on a CPU "
                        "without a fast bf16 matmul")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds per run before it is killed")
    args = p.parse_args(argv)
    if args.seeds < 1:
        raise SystemExit(f"--seeds: got {args.seeds}; must be >= 1")

    configs = args.configs or (stage2_configs() if args.all else default_configs())
    missing = [c for c in configs if not os.path.exists(resolve_path(c))]
    if missing:
        raise SystemExit(f"--configs: not found: {missing}")
    os.makedirs(os.path.join(args.out_dir, "runs"), exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    print(f"[compare] {planned_compute(configs, args.compute_dtype)}", flush=True)
    t0 = time.perf_counter()
    seeds = list(range(args.seed, args.seed + args.seeds))
    runs = []
    # seed-major: an interrupted study still has complete comparisons for its first seeds
    for seed in seeds:
        for path in configs:
            name = config_label(path) + (f"_seed{seed}" if args.seeds > 1 else "")
            print(f"[compare] {len(runs) + 1}/{len(configs) * len(seeds)}: {path}"
                  + (f" seed {seed}" if args.seeds > 1 else ""), flush=True)
            r = run_one(path, args, os.path.join(args.out_dir, "runs", name + ".jsonl"), seed)
            print(f"[compare] {r['label']}: {r['status']}, val loss {_f(r.get('final_val_loss'))}, "
                  f"{_f(r.get('bytes_per_elem'), '.3f')} B/elem, {r['wall_s']:.0f} s"
                  + (f"\n{r['error_full']}" if r.get("error_full") else ""), flush=True)
            runs.append(r)
    wall = time.perf_counter() - t0
    combined = [combine_seeds([r for r in runs if r["config"] == path]) for path in configs]
    plot_path, note = plot([r for r in runs if r["seed"] == seeds[0]], os.path.join(args.out_dir, "loss_curves.png"))
    report = os.path.join(args.out_dir, "report.md")
    stats = write_report(runs, combined, args, report, plot_path, note, wall)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "wall_s": wall, "seeds": seeds,
                   "results": [{k: v for k, v in r.items() if k != "error_full"} for r in runs],
                   "seed_stats": stats}, f, indent=1)
    print("\n".join(report_table(runs, with_seed=args.seeds > 1)))
    for v in stats.get("pairs", []):
        print(f"[compare] {v['gift_config']} vs {v['euclid_config']}: {v['verdict']}")
    print(f"[compare] {len(runs)} runs in {wall / 60:.1f} min; report: {os.path.abspath(report)}")
    print(f"[compare] plot: {os.path.abspath(plot_path)}" if plot_path else f"[compare] NO PLOT: {note}")
    return {"report": report, "plot": plot_path, "results": runs, "combined": combined, "seed_stats": stats,
            "wall_s": wall}


if __name__ == "__main__":
    main()
