r"""    .venv/bin/python benchmarks/scale_model.py --calibration runs/netns/results.json

An alpha-beta model of a ZeRO-2 step, calibrated on the namespace cluster
(``benchmarks/netns_cluster.py``), then carried to cluster scale (default: Llama-600M on
64 GPUs, the paper's setting).

The model, per rank and step (N gradient elements, W ranks, G ranks per node)::

    T = T_compute + T_gift + T_codec + (1 - overlap) * T_comm
    T_comm = T_grad + T_param
    T_grad  native DeepSpeed: ring all-reduce of the bucket (its default
            use_multi_rank_bucket_allreduce), 2 (W-1)/W N b_comm bytes through each NIC
            GIFT: one all-to-all to the partition owners, (W-G)/W N b_wire bytes leave
            the node per rank (the rest stays on NVLink/shared memory)
    T_param ring all-gather of the updated bf16 parameters, (W-1)/W N 2 bytes
    each collective: alpha * (W-1) + bytes / bandwidth

``b_wire`` is the codec's exact bytes per element (``formats.get_format(...).nbytes``),
``T_codec`` is encode + decode of N elements, from the codec's measured time relative to a
copy of the tensor (``benchmarks/codec_speed.py``, measured here unless ``--codec-json``)
times the copy time on the target (8 bytes per element at ``--hbm-tbs``), and ``T_gift``
is what geometry adds: the input statistics (2 tokens n^2 flops per distinct layer input
every ``collect_interval`` steps), the whitening and its inverse on selected layers
(8 m n r flops each), and the refit (the fitter's share of an n^3 eigendecomposition every
``refresh_interval`` steps).

Calibration (one rank per host, no delay): the bytes model is checked against the bytes
the hosts really sent; the link efficiency (bytes/s achieved / link rate) of the ring
collectives is fitted on the baseline's step times, that of GIFT's all-to-all on the time
GIFT measured inside its all-to-all (``comm_s`` in its telemetry); each config's fixed
time (compute + codec + latency) comes from its run at the highest bandwidth. Every other
GIFT step time is a prediction, printed next to its measurement.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path
from typing import Dict, List, Optional

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from deepspeed_gift.formats import get_format  # noqa: E402

PAPER_SAVINGS = {"euclidean_fp8": -10.79, "gift_fp8": -7.6}  # end-to-end step time vs full precision, 600M/64 GPUs


# ---- what a config sends ---------------------------------------------------------------
def config_wire(config: dict) -> dict:
    """Gradient path of a DeepSpeed config: native (all-reduce in the communication dtype)
    or GIFT (all-to-all of the codec's bytes), and the GIFT settings the cost model needs."""
    gift = config.get("gift") or {}
    zero = config.get("zero_optimization", {})
    if not gift or not gift.get("enabled", True):
        dtype = config.get("communication_data_type") or ("bf16" if config.get("bf16", {}).get("enabled") else "fp32")
        b = {"bf16": 2.0, "bfp16": 2.0, "fp16": 2.0, "fp32": 4.0}[dtype]
        allreduce = zero.get("use_multi_rank_bucket_allreduce", True) or not zero.get("reduce_scatter", True)
        return {"path": "allreduce" if allreduce else "reduce", "bytes_per_elem": b, "format": dtype}
    fmt = gift.get("format", "fp8_e4m3")
    kwargs = {k: gift[k] for k in ("block_size", "scale") if k in gift}
    codec = get_format(fmt, **kwargs)
    numel = 1 << 24
    geo = gift.get("geometry", {})
    return {"path": "alltoall", "format": fmt, "bytes_per_elem": codec.nbytes(numel) / numel,
            "kind": geo.get("kind", "kfac_input"), "rank": geo.get("rank", 32),
            "collect_interval": geo.get("collect_interval", 10), "refresh_interval": geo.get("refresh_interval", 50),
            "layers": gift.get("layers", "auto")}


def link_bytes(wire: dict, n: float, world: int, per_node: int = 1, param_bytes: float = 2.0) -> Dict[str, float]:
    """Bytes each rank puts through its network link per step: gradient collective, then
    the parameter all-gather (ZeRO-2). With ``per_node`` ranks per node only the all-to-all
    part bound for other nodes leaves; ring collectives cross the NIC in full."""
    w = world
    if w == 1:
        return {"grad": 0.0, "param": 0.0}
    b = wire["bytes_per_elem"]
    if wire["path"] == "allreduce":
        grad = 2 * (w - 1) / w * n * b
    elif wire["path"] == "reduce":
        grad = (w - 1) / w * n * b
    else:
        grad = (w - max(per_node, 1)) / w * n * b if world > per_node else (w - 1) / w * n * b
    return {"grad": grad, "param": (w - 1) / w * n * param_bytes}


# ---- calibration on the namespace cluster ------------------------------------------------
def load_configs(names: List[str], config_dir: Path) -> Dict[str, dict]:
    out = {}
    for name in names:
        path = config_dir / f"{name}.json"
        if not path.exists():
            raise SystemExit(f"--calibration names config {name!r}, but {path} does not exist (--config-dir)")
        out[name] = json.loads(path.read_text())
    return out


def fit_slope_through(points) -> float:
    """Least-squares slope s of y = a + s x (returns s)."""
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den > 0 else float("nan")


def calibrate(cal: dict, config_dir: Path) -> dict:
    """Fit the link efficiency of the ring collectives on the baseline's step times and that of
    GIFT's all-to-all on the time GIFT measured inside it; each config's fixed time from its
    run at the highest bandwidth; every other GIFT step time is then a prediction."""
    params, world = cal["params"], cal["ranks"]
    configs = load_configs(cal["configs"], config_dir)
    wires = {name: config_wire(cfg) for name, cfg in configs.items()}
    points = [p for p in cal["points"] if p["status"] == "ok" and p["bandwidth_bps"]]
    base = cal["configs"][0]
    if wires[base]["path"] == "alltoall":
        raise SystemExit(f"the first config ({base}) must be the native baseline, not a GIFT config")
    lb = {name: link_bytes(w, params, world) for name, w in wires.items()}
    bp = [p for p in points if p["config"] == base]
    if len(bp) < 2:
        raise SystemExit(f"calibration needs the baseline {base} at two or more bandwidths")
    # the baseline's gradient all-reduce and the parameter all-gather: ring collectives on the same link
    s = fit_slope_through([((lb[base]["grad"] + lb[base]["param"]) * 8 / p["bandwidth_bps"], p["median_step_s"])
                           for p in bp])
    eff = {"ring": 1.0 / s}
    a2a = [(lb[p["config"]]["grad"] * 8 / p["bandwidth_bps"], p["gift_comm_s"])
           for p in points if wires[p["config"]]["path"] == "alltoall" and "gift_comm_s" in p]
    if len({round(x, 12) for x, _ in a2a}) >= 2:
        eff["alltoall"] = 1.0 / fit_slope_through(a2a)

    def seconds_on_link(name, bps):
        grad_eff = eff["ring"] if wires[name]["path"] != "alltoall" else eff.get("alltoall", float("nan"))
        return (lb[name]["grad"] / grad_eff + lb[name]["param"] / eff["ring"]) * 8 / bps

    fixed, rows = {}, []
    for name in cal["configs"]:
        mine = sorted((p for p in points if p["config"] == name), key=lambda p: p["bandwidth_bps"])
        if not mine:
            continue
        anchor = mine[-1]
        fixed[name] = anchor["median_step_s"] - seconds_on_link(name, anchor["bandwidth_bps"])
        for p in mine:
            pred = fixed[name] + seconds_on_link(name, p["bandwidth_bps"])
            row = {"config": name, "bandwidth": p["bandwidth"], "bandwidth_bps": p["bandwidth_bps"],
                   "measured_s": p["median_step_s"], "predicted_s": pred,
                   "error_pct": 100 * (pred / p["median_step_s"] - 1),
                   "role": "anchor (fixed time)" if p is anchor else ("fit" if name == base else "prediction"),
                   "bytes_measured": p["tx_bytes_per_step"], "bytes_model": lb[name]["grad"] + lb[name]["param"]}
            if "gift_comm_s" in p:
                row["alltoall_measured_s"] = p["gift_comm_s"]
                row["alltoall_model_s"] = lb[name]["grad"] * 8 / p["bandwidth_bps"] / eff.get("alltoall", math.nan)
            rows.append(row)
    return {"efficiency": eff, "fixed_s": fixed, "rows": rows, "wires": wires}


def speedup_rows(rows: List[dict], base: str) -> None:
    by = {(r["config"], r["bandwidth"]): r for r in rows}
    for r in rows:
        b = by.get((base, r["bandwidth"]))
        if b:
            r["speedup_measured"] = b["measured_s"] / r["measured_s"]
            r["speedup_predicted"] = b["predicted_s"] / r["predicted_s"]


# ---- carrying it to cluster scale ---------------------------------------------------------
def llama_shapes(hidden: int, ffn: int, layers: int, vocab: int, kv_heads_ratio: float = 1.0) -> dict:
    """Parameter count and the linear layers (m, n) of a Llama decoder (untied embeddings)."""
    kv = int(hidden * kv_heads_ratio)
    linears = [(hidden, hidden), (kv, hidden), (kv, hidden), (hidden, hidden), (ffn, hidden), (ffn, hidden),
               (hidden, ffn)]
    per_layer = sum(m * n for m, n in linears) + 2 * hidden
    total = layers * per_layer + 2 * vocab * hidden + hidden
    # distinct layer inputs per block: attention input (q,k,v), o_proj input, MLP input (gate, up), down input
    inputs = [hidden, hidden, hidden, ffn]
    return {"params": total, "linears": linears * layers, "inputs": inputs * layers, "layers": layers}


def codec_ratios(args) -> Dict[str, float]:
    """encode + decode time of each format as a multiple of one fp32 copy of the tensor."""
    if args.codec_json:
        data = json.loads(Path(args.codec_json).read_text())
    else:
        import subprocess
        import tempfile

        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            subprocess.run([sys.executable, str(ROOT / "benchmarks" / "codec_speed.py"), "--numel",
                            str(args.codec_numel), "--repeats", "3", "--shapes", "--json", f.name], check=True,
                           capture_output=True)
            data = json.loads(Path(f.name).read_text())
    return {r["format"]: r["encode_vs_clone"] + r["decode_vs_clone"] for r in data["formats"]}


def step_model(kind: str, fmt: str, args, shapes: dict, ratios: Dict[str, float], inter_bps: float,
               all_layers: bool) -> dict:
    """Step time of one config at cluster scale (seconds), by term."""
    n, w, g = shapes["params"], args.world, args.gpus_per_node
    tokens = args.tokens_per_gpu
    flops = args.gpu_tflops * 1e12
    compute = 6 * n * tokens / (flops * args.mfu)
    intra_bps = args.intra_gbyte * 8e9
    alpha = args.alpha_us * 1e-6
    copy_s = n * 8 / (args.hbm_tbs * 1e12 * args.hbm_eff)
    if kind in ("native", "native_rs"):  # DeepSpeed's default all-reduce, or an ideal reduce-scatter
        wire = {"path": "allreduce" if kind == "native" else "reduce", "bytes_per_elem": 2.0}
        codec = 0.0
    else:
        wire = {"path": "alltoall", "bytes_per_elem": get_format(fmt).nbytes(1 << 24) / (1 << 24)}
        codec = ratios[fmt] * copy_s
    lb = link_bytes(wire, n, w, per_node=g if w > g else 1)
    intra_grad = (g - 1) / w * n * wire["bytes_per_elem"] if wire["path"] == "alltoall" and w > g else 0.0
    bw = inter_bps if w > g else intra_bps
    grad_eff = args.alltoall_eff if wire["path"] == "alltoall" else args.ring_eff
    t_grad = alpha * (w - 1) + max(lb["grad"] * 8 / bw, intra_grad * 8 / intra_bps) / grad_eff
    t_param = alpha * (w - 1) + lb["param"] * 8 / bw / args.ring_eff
    gift = 0.0
    if kind == "gift":
        r = args.rank
        stats = sum(2 * tokens * d * d for d in shapes["inputs"]) / args.collect_interval
        refit = sum(10 * d ** 3 for d in shapes["inputs"]) / args.refresh_interval / w
        transform = sum(8 * m * k * r for m, k in shapes["linears"]) if all_layers else 0.0
        gift = (stats + transform + refit) / (flops * args.matmul_eff)
    comm = (1 - args.overlap) * (t_grad + t_param)
    total = compute + gift + codec + comm
    return {"total": total, "compute": compute, "gift": gift, "codec": codec, "grad_comm": t_grad,
            "param_comm": t_param, "exposed_comm": comm}


def scale_table(args, ratios) -> dict:
    shapes = llama_shapes(args.hidden, args.ffn, args.layers, args.vocab)
    configs = [("bf16 (DeepSpeed all-reduce)", "native", "bf16", False),
               ("bf16 reduce-scatter", "native_rs", "bf16", False),
               ("Euclidean fp8_e4m3", "euclid", "fp8_e4m3", False),
               ("GIFT fp8_e4m3, auto (no layer selected)", "gift", "fp8_e4m3", False),
               ("GIFT fp8_e4m3, all layers", "gift", "fp8_e4m3", True),
               ("Euclidean nvfp4", "euclid", "nvfp4", False),
               ("GIFT nvfp4, all layers", "gift", "nvfp4", True)]
    out = {"params": shapes["params"], "bandwidths_gbit": args.inter_gbit, "rows": []}
    for label, kind, fmt, all_layers in configs:
        row = {"config": label, "by_bandwidth": []}  # in the order of args.inter_gbit
        for gbit in args.inter_gbit:
            base = step_model("native", "bf16", args, shapes, ratios, gbit * 1e9, False)
            m = step_model(kind, fmt, args, shapes, ratios, gbit * 1e9, all_layers)
            m["saving_pct"] = 100 * (m["total"] / base["total"] - 1)
            row["by_bandwidth"].append(dict(m, gbit=gbit))
        out["rows"].append(row)
    # the bandwidth at which Euclidean FP8 saves what the paper measured, against each baseline:
    # DeepSpeed's all-reduce (what a DeepSpeed user runs) and a bf16 reduce-scatter (the
    # paper's Megatron baseline reduces each gradient shard once)
    out["paper_match"] = {}
    for base_kind in ("native", "native_rs"):
        def saving(gbit, kind, fmt, al):
            base = step_model(base_kind, "bf16", args, shapes, ratios, gbit * 1e9, False)["total"]
            return 100 * (step_model(kind, fmt, args, shapes, ratios, gbit * 1e9, al)["total"] / base - 1)

        lo, hi = 0.1, 1e5
        for _ in range(80):  # saving grows as bandwidth falls: bisect on a log scale
            mid = math.sqrt(lo * hi)
            lo, hi = (mid, hi) if saving(mid, "euclid", "fp8_e4m3", False) < PAPER_SAVINGS["euclidean_fp8"] \
                else (lo, mid)
        match = math.sqrt(lo * hi)
        out["paper_match"][base_kind] = {"gbit": match, "savings": {label: saving(match, kind, fmt, al)
                                                                    for label, kind, fmt, al in configs}}
        out["paper_match"][base_kind]["terms"] = {
            label: step_model(kind, fmt, args, shapes, ratios, match * 1e9, al) for label, kind, fmt, al in configs}
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Alpha-beta step-time model of ZeRO-2 with GIFT (see the docstring).")
    p.add_argument("--calibration", help="JSON from benchmarks/netns_cluster.py --json")
    p.add_argument("--config-dir", default=str(ROOT / "ds_configs"), help="where the calibration's configs live")
    p.add_argument("--codec-json", help="benchmarks/codec_speed.py --json output (default: measure now)")
    p.add_argument("--codec-numel", type=int, default=16_000_000,
                   help="tensor size of the codec measurement (large enough to leave the CPU caches)")
    g = p.add_argument_group("target cluster (defaults: Llama-600M, 64 H100-class GPUs, 8 per node)")
    g.add_argument("--world", type=int, default=64)
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--hidden", type=int, default=1280)
    g.add_argument("--ffn", type=int, default=3456)
    g.add_argument("--layers", type=int, default=32)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--tokens-per-gpu", type=int, default=16384, help="tokens per GPU per optimizer step")
    g.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 peak")
    g.add_argument("--mfu", type=float, default=0.4, help="model flops utilisation of forward+backward")
    g.add_argument("--matmul-eff", type=float, default=0.5, help="of peak, for GIFT's statistics/transforms")
    g.add_argument("--hbm-tbs", type=float, default=3.35, help="GPU memory bandwidth, TB/s")
    g.add_argument("--hbm-eff", type=float, default=0.8, help="of --hbm-tbs reached by a copy")
    g.add_argument("--inter-gbit", type=float, nargs="+", default=[25, 50, 100, 200, 400],
                   help="network bandwidth per GPU, Gbit/s each way")
    g.add_argument("--intra-gbyte", type=float, default=450.0, help="NVLink GB/s each way per GPU")
    g.add_argument("--alpha-us", type=float, default=10.0, help="latency per collective step")
    g.add_argument("--ring-eff", type=float, help="link efficiency of ring collectives (default: the calibrated "
                                                  "one with --calibration, else 1)")
    g.add_argument("--alltoall-eff", type=float, help="link efficiency of GIFT's all-to-all (default: the "
                                                      "calibrated one with --calibration, else 1)")
    g.add_argument("--overlap", type=float, default=0.0, help="fraction of communication hidden by backward")
    g.add_argument("--rank", type=int, default=32, help="GIFT geometry.rank")
    g.add_argument("--collect-interval", type=int, default=10)
    g.add_argument("--refresh-interval", type=int, default=50)
    p.add_argument("--json", help="write calibration and predictions here")
    args = p.parse_args(argv)
    result: dict = {}
    if args.calibration:
        cal = json.loads(Path(args.calibration).read_text())
        fit = calibrate(cal, Path(args.config_dir))
        speedup_rows(fit["rows"], cal["configs"][0])
        result["calibration"] = {k: v for k, v in fit.items() if k != "wires"}
        print_calibration(cal, fit)
        if args.ring_eff is None:
            args.ring_eff = fit["efficiency"]["ring"]
        if args.alltoall_eff is None:
            args.alltoall_eff = fit["efficiency"].get("alltoall", args.ring_eff)
    args.ring_eff = 1.0 if args.ring_eff is None else args.ring_eff
    args.alltoall_eff = 1.0 if args.alltoall_eff is None else args.alltoall_eff
    for name in ("ring_eff", "alltoall_eff"):
        if not 0 < getattr(args, name) <= 1:
            p.error(f"--{name.replace('_', '-')} {getattr(args, name)}: must be in (0, 1]")
    ratios = codec_ratios(args)
    result["codec_vs_copy"] = ratios
    scale = scale_table(args, ratios)
    result["scale"] = scale
    print_scale(args, scale)
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(result, indent=1, default=str))
        print(f"wrote {args.json}")
    return result


def print_calibration(cal: dict, fit: dict) -> None:
    eff = ", ".join(f"{k} {v:.2f}" for k, v in fit["efficiency"].items())
    print(f"calibration: {cal['ranks']} hosts, {cal['params']} params; link efficiency (achieved / rate) {eff}\n")
    print("| config | link | measured s/step | model s/step | error | speedup measured | speedup model | "
          "MB sent measured | MB model | all-to-all s measured | model | role |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    for r in fit["rows"]:
        a2a = (f"{r['alltoall_measured_s']:.3f} | {r['alltoall_model_s']:.3f}" if "alltoall_measured_s" in r
               else "- | -")
        print(f"| {r['config']} | {r['bandwidth']} | {r['measured_s']:.3f} | {r['predicted_s']:.3f} | "
              f"{r['error_pct']:+.1f}% | {r.get('speedup_measured', float('nan')):.2f} | "
              f"{r.get('speedup_predicted', float('nan')):.2f} | {r['bytes_measured'] / 1e6:.2f} | "
              f"{r['bytes_model'] / 1e6:.2f} | {a2a} | {r['role']} |")
    pred = [abs(r["error_pct"]) for r in fit["rows"] if r["role"] == "prediction"]
    if pred:
        print(f"\nprediction error over {len(pred)} points: median {statistics.median(pred):.1f}%, "
              f"max {max(pred):.1f}%\n")


def print_scale(args, scale: dict) -> None:
    print(f"Llama {scale['params'] / 1e6:.0f}M params on {args.world} GPUs ({args.gpus_per_node} per node), "
          f"{args.tokens_per_gpu} tokens/GPU/step, {args.gpu_tflops:g} TFLOPs x MFU {args.mfu}, overlap "
          f"{args.overlap}, link efficiency ring {args.ring_eff:.2f} / all-to-all {args.alltoall_eff:.2f}: "
          f"step time change vs bf16 by network bandwidth per GPU\n")
    head = "| config | " + " | ".join(f"{g:g} Gbit/s" for g in scale["bandwidths_gbit"]) + " |"
    print(head)
    print("|---|" + "---:|" * len(scale["bandwidths_gbit"]))
    for row in scale["rows"]:
        cells = []
        for m in row["by_bandwidth"]:
            cells.append(f"{m['total'] * 1e3:.0f} ms ({m['saving_pct']:+.1f}%)")
        print(f"| {row['config']} | " + " | ".join(cells) + " |")
    for base_kind, name in (("native", "DeepSpeed's bf16 all-reduce"), ("native_rs", "a bf16 reduce-scatter")):
        m = scale["paper_match"][base_kind]
        print(f"\nAgainst {name}, Euclidean FP8 saves the paper's {PAPER_SAVINGS['euclidean_fp8']}% at "
              f"{m['gbit']:.0f} Gbit/s per GPU; there: "
              + ", ".join(f"{k} {v:+.1f}%" for k, v in m["savings"].items() if not k.startswith("bf16"))
              + f" (paper: GIFT {PAPER_SAVINGS['gift_fp8']}%)")
    m = scale["paper_match"]["native_rs"]
    print(f"\nWhere the time goes at {m['gbit']:.0f} Gbit/s per GPU (ms per step):\n")
    print("| config | compute | GIFT geometry | codec | gradient comm | parameter all-gather | total |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for label, t in m["terms"].items():
        print(f"| {label} | {t['compute'] * 1e3:.1f} | {t['gift'] * 1e3:.1f} | {t['codec'] * 1e3:.1f} | "
              f"{t['grad_comm'] * 1e3:.1f} | {t['param_comm'] * 1e3:.1f} | {t['total'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
