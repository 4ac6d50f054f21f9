"""    .venv/bin/python launch/compare.py

Runs several ds_configs on the same model, data, seed and steps; writes report.md and a
loss-curve PNG and prints where they are. By default: every stage-2 config in
``ds_configs/`` except the ``mpi``-backend variant (bf16 baseline; Euclidean and GIFT at
FP8 e5m2 per-tensor, FP8 e4m3 per-block and NVFP4; GIFT FP8 forced on all layers), the
``small`` Llama on the embedded standard-library corpus, 2 ranks on CPU (gloo), 250
steps: about 10 minutes on 2 CPU cores. Other choices:

    .venv/bin/python launch/compare.py --configs ds_configs/bf16_baseline_zero1.json ds_configs/gift_fp8_zero1.json
    .venv/bin/python launch/compare.py --preset tiny --steps 20 --out-dir runs/quick

Each config runs in its own set of ranks (``launch.spawn.run_ranks`` calling
``launch/pretrain.py``'s ``main``), so one that fails or hangs is reported as such and
the next still runs. Writes, under ``--out-dir``: ``report.md`` (final train/validation
loss and gap to the bf16 baseline, next-token accuracy, wire bytes per gradient element,
sampled fidelity, step time and ratio to the baseline; GIFT vs Euclidean at the same
format), ``loss_curves.png`` (needs matplotlib), ``results.json`` and one metrics JSONL
per run in ``runs/``.
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

from launch.pretrain import finite, read_metrics, resolve_path, run_rank, summarize  # noqa: E402
from launch.spawn import run_ranks  # noqa: E402

# Sized by measurement: the 8 default configs, small preset, 2 ranks on 2 CPU cores, ~10 min.
DEFAULTS = dict(preset="small", steps=250, seq_len=128, micro_batch=4, lr=2e-3, eval_every=25, eval_batches=4)
RUN_TIMEOUT_S = 900


def default_configs() -> list:
    """Stage-2 configs that differ in format/geometry: all ``*.json`` in ds_configs/ with
    ZeRO stage 2 and not the mpi backend; the baseline (no gift block) first."""
    out = []
    for path in sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json"))):
        with open(path) as f:
            cfg = json.load(f)
        gift = cfg.get("gift")
        if cfg.get("zero_optimization", {}).get("stage") != 2 or (gift and gift.get("backend") == "mpi"):
            continue
        out.append(os.path.relpath(path, ROOT))
    return sorted(out, key=_report_order)


FORMAT_ORDER = ("fp8_e5m2", "fp8_e4m3", "int8", "nvfp4", "int4", "bf16", "fp32")


def _report_order(path: str):
    """Baseline first, then by format, each Euclidean run before its GIFT variants."""
    g = describe_gift(path)
    if g["wire"] == "native":
        return (0,)
    return (1, FORMAT_ORDER.index(g["format"]), g["block"], g["geometry"] != "identity", str(g["layers"]) == "all",
            path)


def is_baseline(path: str) -> bool:
    with open(resolve_path(path)) as f:
        gift = json.load(f).get("gift")
    return not gift or gift.get("enabled") is False


def config_label(path: str) -> str:
    return os.path.splitext(os.path.basename(path))[0]


def describe_gift(path: str) -> dict:
    """Format / block / geometry of a config, to pair GIFT with Euclidean runs."""
    import deepspeed_gift

    with open(resolve_path(path)) as f:
        cfg = deepspeed_gift.get_gift_config(json.load(f))
    if not cfg.enabled:
        return {"wire": "native"}
    return {"wire": "gift", "format": cfg.format, "block": cfg.effective_block_size, "scale": cfg.scale,
            "geometry": cfg.geometry.kind, "error_feedback": cfg.error_feedback, "layers": cfg.layers}


def run_one(path: str, args, metrics_path: str) -> dict:
    argv = ["--ds-config", path, "--preset", args.preset, "--steps", str(args.steps), "--seed", str(args.seed),
            "--seq-len", str(args.seq_len), "--micro-batch", str(args.micro_batch), "--lr", str(args.lr),
            "--eval-every", str(args.eval_every), "--eval-batches", str(args.eval_batches),
            "--log-every", str(args.log_every), "--metrics", metrics_path, "--no-progress"]
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
    result = {"config": path, "label": config_label(path), "wall_s": wall, "gift": describe_gift(path)}
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
    result["status"] = status_of(result, metrics, error, args.steps)
    if error:
        result["error"] = error.strip().splitlines()[-1][:300] if error.strip() else "failed"
        result["error_full"] = error[-4000:]
    return result


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


# ---- report -----------------------------------------------------------------------------
def _f(x, spec=".4f", none="-"):
    return format(x, spec) if finite(x) else none


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
    geo = {"identity": "Euclidean", "kfac_input": "GIFT", "hadamard": "Hadamard"}[g["geometry"]]
    layers = "" if g["geometry"] == "identity" else f" (layers {g['layers']})"
    return f"{geo} {g['format']} {block}{layers}" + (" + EF" if g.get("error_feedback") else "")


def report_table(results: list) -> list:
    base = next((r for r in results if r["gift"].get("wire") == "native" and r["status"] == "ok"), None)
    rows = ["| config | wire | status | train loss | vs bf16 | val loss | vs bf16 | val acc | B/elem | "
            "fidelity err | geo layers | step s | x bf16 | cpu s | x bf16 |",
            "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        status = r["status"] if r["status"] == "ok" else f"**{r['status']}**"
        if r.get("error"):
            status += f" ({r['error'].replace('|', '/')[:120]})"
        b = base or {}
        rows.append("| " + " | ".join([
            r["label"], wire_name(r["gift"]), status,
            _f(r.get("final_train_loss")), _gap(r.get("final_train_loss"), b.get("final_train_loss")),
            _f(r.get("final_val_loss")), _gap(r.get("final_val_loss"), b.get("final_val_loss")),
            _f(r.get("final_val_acc")), _f(r.get("bytes_per_elem"), ".3f"),
            _f(r.get("fidelity_rel_err"), ".2e"),
            str(r["geometry_layers"]) if r.get("geometry_layers") is not None
            and r["gift"].get("geometry") not in (None, "identity") else "-",
            _f(r.get("median_step_s"), ".3f"), _ratio(r.get("median_step_s"), b.get("median_step_s")),
            _f(r.get("median_cpu_s"), ".3f"), _ratio(r.get("median_cpu_s"), b.get("median_cpu_s")),
        ]) + " |")
    return rows


def _pair_line(g: dict, e: dict) -> str:
    fg, fe = g.get("fidelity_rel_err"), e.get("fidelity_rel_err")
    parts = [f"val loss {_f(g.get('final_val_loss'))} vs {_f(e.get('final_val_loss'))} "
             f"({_gap(g.get('final_val_loss'), e.get('final_val_loss'))})",
             f"train loss {_f(g.get('final_train_loss'))} vs {_f(e.get('final_train_loss'))}",
             f"fidelity err {_f(fg, '.2e')} vs {_f(fe, '.2e')}"
             + (f" ({fg / fe:.2f}x)" if finite(fe) and finite(fg) and fe > 0 else "")]
    geo = f"geometry on {g.get('geometry_layers', '-')} layers at the end"
    gains = g.get("geometry_gains")
    if gains:
        geo += (f" (auto profile, 1 - err_geometry/err_euclidean per layer: best {max(gains.values()):+.2f}, "
                f"median {statistics.median(gains.values()):+.2f})")
    parts += [geo, f"step time {_f(g.get('median_step_s'), '.3f')} vs {_f(e.get('median_step_s'), '.3f')} s"]
    line = f"- {wire_name(g['gift'])} vs {wire_name(e['gift'])}: " + ", ".join(parts)
    if g["status"] != "ok" or e["status"] != "ok":
        line += f" [{g['status']} / {e['status']}]"
    return line


def pairs(results: list) -> list:
    """GIFT (kfac_input) runs next to the Euclidean run with the same format, block and scale."""
    lines = []
    for g in results:
        gg = g["gift"]
        if gg.get("wire") != "gift" or gg["geometry"] != "kfac_input":
            continue
        for e in results:
            ee = e["gift"]
            if (ee.get("wire") == "gift" and ee["geometry"] == "identity"
                    and (ee["format"], ee["block"], ee["scale"]) == (gg["format"], gg["block"], gg["scale"])):
                lines.append(_pair_line(g, e))
    return lines


def write_report(results: list, args, path: str, plot_path, plot_note: str, wall: float) -> None:
    import deepspeed
    import torch

    first = next((r for r in results if r.get("params")), {})
    lines = [
        "# GIFT comparison report", "",
        f"{len(results)} configs, same model, data, seed and steps; written by `launch/compare.py` "
        f"in {wall / 60:.1f} min.", "",
        f"- model: Llama preset `{args.preset}`"
        + (f", {first['params'] / 1e6:.2f}M parameters" if first.get("params") else ""),
        f"- data: {first.get('corpus', 'see runs/')}",
        f"- {args.world_size} ranks, {args.steps} steps, micro batch {args.micro_batch} x seq {args.seq_len}"
        + (f" = {first['tokens_per_step']} tokens/step" if first.get("tokens_per_step") else "")
        + f", peak lr {args.lr} (warmup + cosine), seed {args.seed}",
        f"- validation every {args.eval_every} steps on {args.eval_batches} batches per rank (fixed held-out files)",
        f"- machine: {platform.machine()}, {os.cpu_count()} CPUs, "
        f"{'GPU ' + torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU (gloo)'}; "
        f"torch {torch.__version__}, deepspeed {deepspeed.__version__}",
        "- 1-minute load average before / after each run (step times are wall clock: other work on the "
        "machine inflates them): " + ", ".join(f"{r['label']} {r['load_avg'][0]:.1f}/{r['load_avg'][1]:.1f}"
                                               for r in results),
        "", *report_table(results), "",
        "Columns: train loss = mean of the last 10 steps; val loss / val acc = last validation (loss and "
        "next-token accuracy on held-out text); vs bf16 = gap to the baseline in %; B/elem = bytes on the wire per "
        "gradient element over the run, scales, headers and geometry exchange included (native bf16 = 2); "
        "fidelity err = relative L2 error of the reduced gradient against an exact fp32 reduction, mean over "
        "sampled steps; geo layers = layers in the geometry branch at the end; step s = median wall-clock step "
        "time after 5 warm-up steps, cpu s = median CPU time of rank 0 per step (what the step computes, barely "
        "moved by other work on the machine, unlike wall clock), x bf16 = ratios to the baseline (on CPU the "
        "quantization arithmetic is not hidden behind a fast network: read them as overhead, not as a speed-up; "
        "GIFT pays off where communication, not arithmetic, bounds the step).", "",
    ]
    if any(r["gift"].get("error_feedback") for r in results):
        lines += ["With error feedback the sampled fidelity error includes the residual carried over from the "
                  "previous step (what is sent is this step's gradient plus that residual), so it is larger by "
                  "design and comparable only between runs that both use error feedback.", ""]
    pair_lines = pairs(results)
    if pair_lines:
        lines += ["## GIFT vs Euclidean at the same format", "", *pair_lines, ""]
    failed = [r for r in results if r["status"] != "ok"]
    if failed:
        lines += ["## Runs that did not finish normally", ""]
        for r in failed:
            lines.append(f"- `{r['label']}`: {r['status']}" + (f": {r['error']}" if r.get("error") else ""))
        lines.append("")
    lines += ["## Loss curves", ""]
    lines.append(f"![loss curves]({os.path.basename(plot_path)})" if plot_path else plot_note)
    lines.append("")
    with open(path, "w") as f:
        f.write("\n".join(lines))


def _moving_average(values, window: int) -> list:
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def plot(results: list, path: str):
    """Train loss (smoothed), its difference to the baseline, validation loss; returns
    (path or None, note)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None, ("matplotlib is not installed, so no plot was drawn "
                      "(pip install matplotlib, or pip install -e '.[train]').")
    fig, (ax1, ax2, ax3) = plt.subplots(1, 3, figsize=(18, 5))
    base = next((r for r in results if r["gift"].get("wire") == "native" and r.get("curve")), None)
    base_curve = dict(zip([s for s, _ in base["curve"]], _moving_average([v for _, v in base["curve"]], 25))) \
        if base else {}
    tails = []
    for r in results:
        curve = [(s, v) for s, v in r.get("curve", []) if math.isfinite(v)]
        if not curve:
            continue
        steps, losses = zip(*curve)
        smooth = _moving_average(list(losses), 10)
        tails += smooth[len(smooth) // 10:]
        label = r["label"] + ("" if r["status"] == "ok" else f" [{r['status']}]")
        line, = ax1.plot(steps, smooth, label=label, lw=1.3)
        if base_curve and r is not base:
            diff = [(s, v - base_curve[s]) for s, v in zip(steps, _moving_average(list(losses), 25))
                    if s in base_curve]
            if diff:
                ax2.plot(*zip(*diff), color=line.get_color(), lw=1.3, label=label)
        if r.get("val_curve"):
            ax3.plot(*zip(*r["val_curve"]), marker="o", ms=3, color=line.get_color(), label=label)
    if tails:  # the first steps (loss ~ ln vocab) would flatten the part worth reading
        ax1.set_ylim(min(tails) - 0.02 * (max(tails) - min(tails) + 1e-3), max(tails))
    ax1.set(title="train loss (10-step moving average)", xlabel="step", ylabel="cross-entropy (nats/token)")
    ax2.axhline(0.0, color="black", lw=0.8)
    ax2.set(title="train loss minus bf16 baseline (25-step moving averages)", xlabel="step",
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
    p.add_argument("--configs", nargs="+", help="ds_config paths (default: stage-2 configs of ds_configs/ "
                                                "that differ in format/geometry)")
    p.add_argument("--out-dir", default=os.path.join("runs", "compare"))
    p.add_argument("--world-size", type=int, default=2)
    p.add_argument("--preset", default=DEFAULTS["preset"])
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--seq-len", type=int, default=DEFAULTS["seq_len"])
    p.add_argument("--micro-batch", type=int, default=DEFAULTS["micro_batch"])
    p.add_argument("--lr", type=float, default=DEFAULTS["lr"])
    p.add_argument("--eval-every", type=int, default=DEFAULTS["eval_every"])
    p.add_argument("--eval-batches", type=int, default=DEFAULTS["eval_batches"])
    p.add_argument("--log-every", type=int, default=25)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data", nargs="+", help="passed to pretrain.py (default: embedded corpus)")
    p.add_argument("--tokenizer", help="passed to pretrain.py (default: bytes)")
    p.add_argument("--timeout", type=float, default=RUN_TIMEOUT_S, help="seconds per run before it is killed")
    args = p.parse_args(argv)

    configs = args.configs or default_configs()
    missing = [c for c in configs if not os.path.exists(resolve_path(c))]
    if missing:
        raise SystemExit(f"--configs: not found: {missing}")
    os.makedirs(os.path.join(args.out_dir, "runs"), exist_ok=True)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    t0 = time.perf_counter()
    results = []
    for i, path in enumerate(configs, 1):
        print(f"[compare] {i}/{len(configs)}: {path}", flush=True)
        r = run_one(path, args, os.path.join(args.out_dir, "runs", config_label(path) + ".jsonl"))
        print(f"[compare] {r['label']}: {r['status']}, val loss {_f(r.get('final_val_loss'))}, "
              f"{_f(r.get('bytes_per_elem'), '.3f')} B/elem, {r['wall_s']:.0f} s"
              + (f"\n{r['error_full']}" if r.get("error_full") else ""), flush=True)
        results.append(r)
    wall = time.perf_counter() - t0
    plot_path, note = plot(results, os.path.join(args.out_dir, "loss_curves.png"))
    report = os.path.join(args.out_dir, "report.md")
    write_report(results, args, report, plot_path, note, wall)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "wall_s": wall,
                   "results": [{k: v for k, v in r.items() if k != "error_full"} for r in results]}, f, indent=1)
    print("\n".join(report_table(results)))
    print(f"[compare] {len(results)} runs in {wall / 60:.1f} min; report: {os.path.abspath(report)}")
    print(f"[compare] plot: {os.path.abspath(plot_path)}" if plot_path else f"[compare] NO PLOT: {note}")
    return {"report": report, "plot": plot_path, "results": results, "wall_s": wall}


if __name__ == "__main__":
    main()
