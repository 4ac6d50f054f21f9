r"""    .venv/bin/python benchmarks/scale_model.py --calibration runs/netns/results.json

An alpha-beta model of a ZeRO-2 step, calibrated on the namespace cluster
(``benchmarks/netns_cluster.py``), then carried to cluster scale (default: Llama-600M on
64 GPUs, 8 per node, the paper's setting).

The model, per rank and step (N gradient elements, W ranks, G ranks per node, one NIC
per GPU, NVLink inside a node)::

    T = T_compute + T_gift + T_codec + (1 - overlap) * (T_grad + T_param)

Each collective costs ``alpha * steps + max(NIC bytes / NIC rate, NVLink bytes / NVLink
rate) / efficiency``, with the bytes of one rank's tensor S (:func:`collective_bytes`):

    ring all-reduce      NIC 2 (W-1)/W S / G   (a ring crosses each node boundary once,
                                                G rings share the G NICs)
    ring reduce-scatter  NIC   (W-1)/W S / G   (same for the ring all-gather)
    flat all-to-all      NIC   (W-G)/W S       (what leaves the node, through this GPU's NIC)
    two-level            GIFT's ``hierarchy: two_level``: an exchange inside the node in the
                         bucket's dtype (NVLink, (G-1)/G of the bf16 bucket), then the quantized
                         all-to-all of the node's partial sums among the W/G same-slot GPUs of
                         the nodes: NIC (W/G - 1)/(W/G) S / G, in whole buckets the two stages one
                         after the other (the accounting the namespace cluster measures with 2
                         ranks per host); in pieces (``--node-pieces``, gift's default) the layout
                         model's pipeline, whose GPU stream runs the gradients' codec and the node
                         stage's sum beside the links (``--codec-in-pipeline`` with
                         ``--codec-traffic``; their time is then in the gradient column, not in
                         T_codec)

    T_grad   bucket by bucket over the model's real layout (HF's Llama on the meta device,
             DeepSpeed's buckets of ``--bucket`` elements and contiguous partitions:
             ``benchmarks/layout_model.py``). DeepSpeed: ring all-reduce of bf16 (its default
             use_multi_rank_bucket_allreduce), or an ideal bf16 reduce-scatter; GIFT: the
             busiest NIC's and NVLink's bytes of its ``by_layout`` exchange per bucket (flat, or
             two-level with the lighter node split), the codec's bytes
             (``formats.get_format(...).nbytes``), stages one after the other
    T_param  ring all-gather of the updated bf16 parameters; with ``gift.params``, of the
             quantized changes of the replicas (the codec's bytes), two-level where the
             gradients are: across nodes among same-slot GPUs, then inside the node, still
             quantized (NIC bytes as the ring's; NVLink carries the quantized bytes)

``T_codec`` is encode + decode of the elements a rank codes (N flat, N/G two-level), from
the codec's measured time relative to a copy of the tensor (``benchmarks/codec_speed.py``,
measured here unless ``--codec-json``) times a copy on the target (8 bytes per element at
``--hbm-tbs``); with ``gift.params`` also the parameters' encode of N/W elements and decode
plus add of all N (one more copy's worth per element). With ``--codec-traffic`` the GPU codec
time comes from counted traffic instead (``benchmarks/codec_traffic.py``: bytes per element over
the copy bandwidth, plus ``--launch-us`` per kernel per tile), the compiled kernels' in the
tables, the CPU ratio and the eager count printed beside it; ``--codec-gpu`` takes the times
measured on a GPU (``benchmarks/gpu_check.py``'s traffic rows) over both. ``T_gift`` is what
geometry adds, at fp32 matrix speed (GIFT's statistics
and factors are fp32): the input statistics every ``collect_interval`` steps, per distinct
layer input of width n, as the plugin keeps them: a sketch ``x^T (x Omega)`` of w = rank + 8
columns and the diagonal (4 tokens n w + 2 tokens n flops), or the whole ``x^T x`` (2 tokens
n^2) for a layer no wider than its sketch; whitening of what a rank sends and the inverse of
what it owns (8 and 4 m n r flops, for selected layers); and every ``refresh_interval`` steps
the Nystrom fits (8 n w^2 each, spread over the ranks) and every rank's next test matrices (a
float64 QR of n x w each, 4 n w^2 flops on the host at ``--host-gflops``); where no layer is
selected, statistics and refits 2 / ``--idle-backoff`` as often (``selection.idle_backoff``'s
steady state); and each judged refresh's judgement of every layer (``judgement_counts``: its
counted bytes at HBM speed and flops at fp32 speed per element, spread over the ranks), every
``refresh_interval`` steps with layers selected, every ``--idle-backoff`` x that without (the
plugin judges under ``layers: "measured"``, and under ``"all"`` while telemetry samples the
fidelity, its default). Compute is 6 flops per weight and token plus attention (12 L d seq per
token).

Calibration (usually one rank per host, G = 1; no delay): the bytes formulas are checked
against the bytes the hosts really sent (into the busiest host, where the run counted it;
GIFT's gradient bytes from the preset's real layout at the config's ``reduce_bucket_size``);
the link efficiency (achieved / link rate) of the ring collectives is fitted on the baseline's
step times, that of GIFT's all-to-all on the time GIFT measured inside its all-to-all
(``comm_s`` in its telemetry) of the configs whose buckets reach every owner, leaving out the
config being predicted; each config's fixed time (compute + codec + latency) is its run at the
highest bandwidth. Every other GIFT step time is a prediction, printed next to its
measurement.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks import layout_model  # noqa: E402
from deepspeed_gift.core.formats import get_format  # noqa: E402
from deepspeed_gift.config import GiftConfig, SelectionConfig  # noqa: E402
from deepspeed_gift.refresh import sketch_columns  # noqa: E402

PAPER_SAVINGS = {"euclidean_fp8": -10.79, "gift_fp8": -7.6}  # end-to-end step time vs full precision, 600M/64 GPUs
COLLECTIVES = ("allreduce", "reducescatter", "allgather", "alltoall", "two_level")
GIFT_COLLECTIVES = ("alltoall", "two_level")


# ---- collectives on a two-level network ---------------------------------------------------
def collective_bytes(kind: str, s: float, world: int, per_node: int = 1, nvlink_s: float = 0.0) -> dict:
    """Bytes one rank moves through its NIC and over NVLink for a collective on a tensor of
    ``s`` bytes per rank, and its latency steps. ``nvlink_s``: bytes of the tensor in the
    two-level scheme's NVLink stage (the bucket's dtype), when it differs from ``s``."""
    w, g = world, max(1, min(per_node, world))
    nodes = w // g
    if kind not in COLLECTIVES:
        raise ValueError(f"collective {kind!r} not in {COLLECTIVES}")
    if w == 1:
        return {"nic": 0.0, "nvlink": 0.0, "steps": 0}
    if kind in ("allreduce", "reducescatter", "allgather"):
        total = (2 if kind == "allreduce" else 1) * (w - 1) / w * s  # what a rank sends around its rings
        nic = total / g if nodes > 1 else 0.0
        nvlink = total * (g - 1) / g if nodes > 1 else total
        return {"nic": nic, "nvlink": nvlink, "steps": (2 if kind == "allreduce" else 1) * (w - 1)}
    if kind == "alltoall":
        return {"nic": (w - g) / w * s, "nvlink": (g - 1) / w * s, "steps": w - 1}
    # two-level: exchange inside the node (the bucket's dtype), then the quantized
    # all-to-all of one 1/G slice among the node's peers on the other nodes
    nic = (nodes - 1) / nodes * s / g if nodes > 1 else 0.0
    return {"nic": nic, "nvlink": (g - 1) / g * (nvlink_s or s), "steps": (g - 1) + (nodes - 1)}


def collective_seconds(kind: str, s: float, net: dict, nvlink_s: float = 0.0) -> float:
    """Seconds of a collective: NVLink and NIC traffic of one collective flow at once (the
    slower sets the time); the two-level scheme's two stages run one after the other
    (a ring reduce-scatter over NVLink, then the all-to-all over the NICs)."""
    b = collective_bytes(kind, s, net["world"], net["per_node"], nvlink_s)
    nic_s, nvlink_s_ = b["nic"] * 8 / net["nic_bps"], b["nvlink"] * 8 / net["nvlink_bps"]
    if kind == "two_level":
        return net["alpha_s"] * b["steps"] + nvlink_s_ / net["ring_eff"] + nic_s / net["alltoall_eff"]
    eff = net["alltoall_eff"] if kind == "alltoall" else net["ring_eff"]
    return net["alpha_s"] * b["steps"] + max(nic_s, nvlink_s_) / eff


# ---- what a config sends ---------------------------------------------------------------
def wire_bytes_per_element(fmt: str, **options) -> float:
    """Bytes per element of a format on the wire, scales included (exact for a large tensor)."""
    numel = 1 << 24
    return get_format(fmt, **options).nbytes(numel) / numel


def config_wire(config: dict, world: int = 1, per_node: int = 1) -> dict:
    """Gradient collective of a DeepSpeed config: native (all-reduce, or reduce with
    ``use_multi_rank_bucket_allreduce: false``, in the communication dtype) or GIFT (all-to-all
    of the codec's bytes, or the two-level exchange where ``gift.hierarchy`` picks it on
    ``world`` ranks of ``per_node`` per node)."""
    gift = config.get("gift") or {}
    zero = config.get("zero_optimization", {})
    replica = "bf16" if config.get("bf16", {}).get("enabled") or config.get("fp16", {}).get("enabled") else "fp32"
    replica_bytes = {"bf16": 2.0, "fp32": 4.0}[replica]
    if not gift or not gift.get("enabled", True):
        dtype = config.get("communication_data_type") or replica
        b = {"bf16": 2.0, "bfp16": 2.0, "fp16": 2.0, "fp32": 4.0}[dtype]
        allreduce = zero.get("use_multi_rank_bucket_allreduce", True) or not zero.get("reduce_scatter", True)
        return {"collective": "allreduce" if allreduce else "reducescatter", "bytes_per_elem": b, "format": dtype,
                "param_collective": "allgather", "param_bytes_per_elem": replica_bytes}
    fmt = gift.get("format", "fp8_e4m3")
    b = wire_bytes_per_element(fmt, **{k: gift[k] for k in ("block_size", "scale") if k in gift})
    per_node = gift.get("ranks_per_node") or per_node
    hierarchy = gift.get("hierarchy", "by_topology")
    two = hierarchy == "two_level" or (hierarchy == "by_topology" and per_node > 1 and world // per_node > 1)
    out = {"collective": "two_level" if two else "alltoall", "format": fmt, "bytes_per_elem": b,
           "param_collective": "allgather", "param_bytes_per_elem": replica_bytes}
    params = gift.get("params")
    if params is not None and params.get("format", "fp8_e4m3") != replica:  # the replicas' own dtype: DeepSpeed's
        pfmt = params.get("format", "fp8_e4m3")
        out.update(param_collective="two_level" if two else "allgather", param_format=pfmt,
                   param_bytes_per_elem=wire_bytes_per_element(pfmt, **{k: params[k] for k in ("block_size",)
                                                                        if k in params}))
    return out


def link_bytes(wire: dict, n: float, world: int, per_node: int = 1) -> Dict[str, float]:
    """NIC bytes per rank and step: the gradient collective, then the parameter all-gather."""
    grad = collective_bytes(wire["collective"], n * wire["bytes_per_elem"], world, per_node)["nic"]
    param = collective_bytes(wire["param_collective"], n * wire["param_bytes_per_elem"], world, per_node)["nic"]
    return {"grad": grad, "param": param}


# ---- calibration on the namespace cluster ------------------------------------------------
def set_gift_keys(cfg: dict, overrides: str) -> dict:
    """``cfg`` with the keys of ``key=value,key=value`` set: gift keys (dotted keys reach nested
    blocks), or DeepSpeed's ZeRO keys as ``zero_optimization.key`` (``reduce_bucket_size``);
    values are read as JSON, else as strings."""
    for item in overrides.split(","):
        key, eq, text = item.partition("=")
        if not eq:
            raise SystemExit(f"config overrides {overrides!r}: expected key=value,key=value")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        *parents, leaf = key.split(".")
        if parents[:1] == ["zero_optimization"]:
            block = cfg
        elif "gift" not in cfg:
            raise SystemExit(f"config overrides {overrides!r}: the config has no gift block for {key!r}")
        else:
            block = cfg["gift"]
        for part in parents:
            block = block.setdefault(part, {})
        block[leaf] = value
    return cfg


def load_configs(names: List[str], config_dir: Path) -> Dict[str, dict]:
    """The configs of a calibration by label (``name`` or ``name:key=value,...``, the namespace
    cluster's gift overrides)."""
    out = {}
    for name in names:
        stem, _, overrides = name.partition(":")
        path = config_dir / f"{stem}.json"
        if not path.exists():
            raise SystemExit(f"--calibration names config {name!r}, but {path} does not exist (--config-dir)")
        cfg = json.loads(path.read_text())
        out[name] = set_gift_keys(cfg, overrides) if overrides else cfg
    return out


def least_squares_slope(points) -> float:
    """Slope s of the least-squares line y = a + s x."""
    xs, ys = zip(*points)
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    den = sum((x - mx) ** 2 for x in xs)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / den if den > 0 else float("nan")


def calibrate(cal: dict, config_dir: Path) -> dict:
    """Link efficiencies and fixed times from a netns_cluster.py result; per-point predictions
    beside the measurements (see the module docstring for what is fitted on what)."""
    params, world, g = cal["params"], cal["ranks"], cal.get("ranks_per_host", 1)
    configs = load_configs(cal["configs"], config_dir)
    wires = {name: config_wire(cfg, world, g) for name, cfg in configs.items()}
    points = [p for p in cal["points"] if p["status"] == "ok" and p["bandwidth_bps"]]
    dropped = len(cal["points"]) - len(points)
    base = cal["configs"][0]
    if wires[base]["collective"] in GIFT_COLLECTIVES:
        raise SystemExit(f"the first config ({base}) must be the native baseline, not a GIFT config")
    # bytes on a host's link: its G ranks' NIC shares; GIFT's gradient exchange bucket by bucket
    # on the preset's real layout at the config's reduce_bucket_size (its busiest NIC)
    lb = {name: {k: g * v for k, v in link_bytes(w, params, world, per_node=g).items()}
          for name, w in wires.items()}
    balanced = {name: lb[name]["grad"] for name in wires}
    if cal.get("preset"):
        layout = preset_layout(cal["preset"])
        for name, w in wires.items():
            if w["collective"] in GIFT_COLLECTIVES:
                buckets = layout_model.buckets_of(*layout, world, bucket_size(configs[name]))
                lb[name]["grad"] = g * layout_nic_bytes(w, configs[name], buckets, world, g)
    bp = [p for p in points if p["config"] == base]
    if len({p["bandwidth_bps"] for p in bp}) < 2:
        raise SystemExit(f"calibration needs the baseline {base} at two or more bandwidths")
    # the baseline's all-reduce and the parameter all-gather: ring collectives on the same link
    ring = 1.0 / least_squares_slope([((lb[base]["grad"] + lb[base]["param"]) * 8 / p["bandwidth_bps"],
                                       p["median_step_s"]) for p in bp])

    # The efficiency is fitted where a bucket reaches every owner (the layout's bytes are the balanced
    # ones): where it funnels, TCP's socket buffers let a bucket's transfers run on while the next
    # bucket goes to other owners, which the model (collectives one after another, as NCCL's on one
    # stream) does not carry; those configs are predicted, not fitted.
    even = {name for name in wires if lb[name]["grad"] <= 1.05 * balanced[name]}

    def a2a_eff(without=None):  # GIFT's own all-to-all timer against its modelled seconds at rate 1
        pts = [(lb[p["config"]]["grad"] * 8 / p["bandwidth_bps"], p["gift_comm_s"]) for p in points
               if wires[p["config"]]["collective"] in GIFT_COLLECTIVES and "gift_comm_s" in p
               and p["config"] != without and p["config"] in even]
        return 1.0 / least_squares_slope(pts) if len({round(x, 12) for x, _ in pts}) >= 2 else math.nan

    eff = {"ring": ring, "alltoall": a2a_eff()}
    fixed, rows = {}, []
    for name in cal["configs"]:
        mine = sorted((p for p in points if p["config"] == name), key=lambda p: p["bandwidth_bps"])
        if not mine:
            continue
        gift = wires[name]["collective"] in GIFT_COLLECTIVES
        grad_eff = a2a_eff(without=name) if gift else ring  # out of sample for the config predicted

        def on_link(bps):
            return (lb[name]["grad"] / grad_eff + lb[name]["param"] / ring) * 8 / bps

        anchor = mine[-1]
        fixed[name] = anchor["median_step_s"] - on_link(anchor["bandwidth_bps"])
        for p in mine:
            pred = fixed[name] + on_link(p["bandwidth_bps"])
            row = {"config": name, "bandwidth": p["bandwidth"], "bandwidth_bps": p["bandwidth_bps"],
                   "measured_s": p["median_step_s"], "predicted_s": pred,
                   "error_pct": 100 * (pred / p["median_step_s"] - 1),
                   "role": "anchor (fixed time)" if p is anchor else ("fit" if name == base else "prediction"),
                   # into the busiest host where the run counted it (the model's figure), else sent, mean
                   "bytes_measured": p.get("rx_max_bytes_per_step", p["tx_bytes_per_step"]),
                   "bytes_model": lb[name]["grad"] + lb[name]["param"]}
            if "gift_comm_s" in p:
                row["alltoall_measured_s"] = p["gift_comm_s"]
                row["alltoall_model_s"] = lb[name]["grad"] * 8 / p["bandwidth_bps"] / grad_eff
            rows.append(row)
    return {"efficiency": eff, "fixed_s": fixed, "rows": rows, "dropped": dropped}


def speedup_rows(rows: List[dict], base: str) -> None:
    by = {(r["config"], r["bandwidth"]): r for r in rows}
    for r in rows:
        b = by.get((base, r["bandwidth"]))
        if b:
            r["speedup_measured"] = b["measured_s"] / r["measured_s"]
            r["speedup_predicted"] = b["predicted_s"] / r["predicted_s"]


# ---- the real bucket layout ----------------------------------------------------------------
DEEPSPEED_BUCKET = 500_000_000  # DeepSpeed's default reduce_bucket_size


def bucket_size(cfg: dict) -> int:
    return int(cfg.get("zero_optimization", {}).get("reduce_bucket_size", DEEPSPEED_BUCKET))


def preset_layout(preset: str):
    """Parameter sizes and gradient arrival order of a ``launch/pretrain.py`` preset's model."""
    from launch.pretrain import PRESETS

    return layout_model.parameter_layout(PRESETS[preset])


def llama_layout(hidden: int, ffn: int, layers: int, vocab: int):
    """The same for the Llama of ``llama_shapes`` (HF's definition on the meta device)."""
    heads = hidden // 128 if hidden % 128 == 0 else 1  # any divisor: the parameter sizes do not depend on it
    return layout_model.parameter_layout(dict(hidden_size=hidden, intermediate_size=ffn, num_hidden_layers=layers,
                                              num_attention_heads=heads, num_key_value_heads=heads,
                                              vocab_size=vocab))


def gift_scheme(wire: dict, cfg: dict, world: int, per_node: int) -> str:
    """The layout model's scheme of a GIFT config: its route, flat or two-level (when the
    two-level exchange has nodes to cross)."""
    route = (cfg.get("gift") or {}).get("route", "by_layout")
    if wire["collective"] == "two_level" and per_node > 1 and world // per_node > 1:
        return {"direct": "two_level_direct", "relay": "two_level_balanced"}.get(route, "two_level_by_layout")
    return route


def layout_nic_bytes(wire: dict, cfg: dict, buckets, world: int, per_node: int) -> float:
    """Bytes into a rank's NIC (the busiest) for GIFT's gradient exchange over ``buckets``."""
    scheme = gift_scheme(wire, cfg, world, per_node)
    return sum(layout_model.bucket_link_bytes(o, world, per_node, wire["bytes_per_elem"])[scheme][0]
               for o in buckets if o)


# ---- carrying it to cluster scale ---------------------------------------------------------
def llama_shapes(hidden: int, ffn: int, layers: int, vocab: int) -> dict:
    """Parameters of a Llama decoder (untied embeddings, as many kv heads as heads), its
    ``nn.Linear`` weights (out, in) and the distinct inputs GIFT keeps statistics of."""
    block = [(hidden, hidden)] * 4 + [(ffn, hidden), (ffn, hidden), (hidden, ffn)]  # q k v o, gate up, down
    per_layer = sum(m * n for m, n in block) + 2 * hidden  # + two RMSNorm weights
    return {
        "params": layers * per_layer + 2 * vocab * hidden + hidden,
        "non_embedding": layers * per_layer + hidden,
        "matmul": layers * sum(m * n for m, n in block) + vocab * hidden,  # weights in a matmul (+ lm_head)
        "linears": block * layers + [(vocab, hidden)],  # + lm_head
        # per block: attention input (q, k, v share it), o_proj's, the MLP input (gate, up), down_proj's
        "inputs": [hidden, hidden, hidden, ffn] * layers + [hidden],  # + lm_head's
    }


def codec_ratios(args) -> Dict[str, float]:
    """encode and decode time of each format as multiples of one fp32 copy of the tensor."""
    if args.codec_json:
        data = json.loads(Path(args.codec_json).read_text())
    else:
        with tempfile.NamedTemporaryFile(suffix=".json") as f:
            proc = subprocess.run([sys.executable, str(ROOT / "benchmarks" / "codec_speed.py"), "--numel",
                                   str(args.codec_numel), "--repeats", "3", "--shapes", "--kernels", "eager",
                                   "--json", f.name],
                                  capture_output=True, text=True)
            if proc.returncode != 0:
                raise SystemExit(f"benchmarks/codec_speed.py failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
            data = json.loads(Path(f.name).read_text())
    return {r["format"]: {"encode": r["encode_vs_clone"], "decode": r["decode_vs_clone"]} for r in data["formats"]
            if r.get("kernels", "eager") == "eager"}


# codec_traffic's cases by the format names the configs use
TRAFFIC_CASES = {"fp8_e4m3": "fp8_e4m3/128", "nvfp4": "nvfp4", "int8": "int8/128", "int4": "int4/128"}


def traffic_ratios(args, mode: str) -> Dict[str, dict]:
    """encode and decode time of each format on the target GPU as multiples of one fp32 copy,
    from the counted traffic (``benchmarks/codec_traffic.py --json``, ``mode`` eager or
    compiled): bytes per element over the GPU's copy bandwidth, plus each kernel's launch
    latency spread over a tile of 2^24 elements. Decode is the owner's decode-and-sum of
    ``--traffic-senders`` senders, per payload element (what the model's decode counts)."""
    rows = json.loads(Path(args.codec_traffic).read_text())["rows"]
    bw = args.hbm_tbs * 1e12 * args.hbm_eff
    copy_s = 8 / bw
    tile = 1 << 24
    out = {}
    for fmt, case in TRAFFIC_CASES.items():
        def seconds(op, per):
            r = next((r for r in rows if (r["case"], r["op"], r["mode"]) == (case, op, mode)), None)
            if r is None:
                raise SystemExit(f"--codec-traffic has no row {case} / {op} / {mode}")
            return (r["bytes_per_element"] / bw + r["kernels"] * args.launch_us * 1e-6 / tile) / per
        s = args.traffic_senders
        out[fmt] = {"encode": seconds("encode", 1) / copy_s, "decode": seconds(f"decode_sum S={s}", s) / copy_s}
    return out


def measured_gpu_ratios(path: str, senders: int = 7, mode: str = "compiled") -> Dict[str, dict]:
    """encode and decode time of each format as multiples of one fp32 copy, measured on a GPU:
    ``benchmarks/gpu_check.py --json``'s ``traffic`` rows (one 2^24-element tile a call, the
    device's own copy of the tile timed in the same run). Decode is the owner's decode-and-sum
    of ``senders`` per payload element, as in :func:`traffic_ratios`. A format the run did not
    reach is left out, unless a config of the tables needs it: then it fails naming it."""
    data = json.loads(Path(path).read_text())
    rows = {(r["case"], r["op"], r["mode"]): r for r in data.get("traffic", []) if "error" not in r}
    needed = {c[2] for c in CONFIGS} | {c[6] for c in CONFIGS if c[6]}
    out = {}
    for fmt, case in TRAFFIC_CASES.items():
        enc, dec = rows.get((case, "encode", mode)), rows.get((case, f"decode_sum S={senders}", mode))
        if enc is None or dec is None:
            if fmt in needed:
                raise SystemExit(f"--codec-gpu {path}: no {case} {mode} encode and decode_sum S={senders} rows "
                                 f"(the run's traffic operations: {sorted({r['op'] for r in data.get('traffic', [])})})")
            continue
        out[fmt] = {"encode": enc["us"] / enc["copy_us"], "decode": dec["us"] / senders / dec["copy_us"]}
    return out


# label, gradient path ("native" all-reduce, "native_rs", GIFT "flat" or "two_level"),
# format, whiten all layers (else: measured selects none, statistics only), geometry on,
# statistics on at most --stats-tokens tokens per forward (geometry.stats_tokens), else on every
# token, format of the parameter all-gather (gift.params; None: DeepSpeed's bf16 all-gather)
CONFIGS = [
    ("bf16 (DeepSpeed all-reduce)", "native", "bf16", False, False, False, None),
    ("bf16 reduce-scatter", "native_rs", "bf16", False, False, False, None),
    ("Euclidean fp8_e4m3", "flat", "fp8_e4m3", False, False, False, None),
    ("GIFT fp8_e4m3, auto (no layer selected)", "flat", "fp8_e4m3", False, True, False, None),
    ("GIFT fp8_e4m3, all layers", "flat", "fp8_e4m3", True, True, False, None),
    ("Euclidean nvfp4", "flat", "nvfp4", False, False, False, None),
    ("GIFT nvfp4, all layers", "flat", "nvfp4", True, True, False, None),
    ("Euclidean fp8_e4m3, two-level", "two_level", "fp8_e4m3", False, False, False, None),
    ("GIFT fp8_e4m3 all layers, two-level", "two_level", "fp8_e4m3", True, True, False, None),
    ("GIFT nvfp4 all layers, two-level", "two_level", "nvfp4", True, True, False, None),
    ("GIFT fp8_e4m3 all layers, two-level, stats_tokens", "two_level", "fp8_e4m3", True, True, True, None),
    ("GIFT nvfp4 all layers, two-level, stats_tokens", "two_level", "nvfp4", True, True, True, None),
    ("Euclidean fp8_e4m3, two-level, params fp8_e4m3", "two_level", "fp8_e4m3", False, False, False, "fp8_e4m3"),
    ("GIFT fp8_e4m3 all layers, two-level, stats_tokens, params fp8_e4m3", "two_level", "fp8_e4m3", True, True, True,
     "fp8_e4m3"),
    ("GIFT nvfp4 all layers, two-level, stats_tokens, params nvfp4", "two_level", "nvfp4", True, True, True, "nvfp4"),
]
NATIVE = ("bf16", False, False, False, None)  # what a native path's entry holds after its path


sketch_width = sketch_columns  # the plugin's own rule: 0 where it keeps the whole x^T x


def statistic_flops(tokens: int, d: int, rank: int) -> float:
    """One collection of one input statistic, as ``statistics.moment_of`` computes it: the
    sketch ``x^T (x Omega)`` and the diagonal of a wide one, or the whole ``x^T x``."""
    w = sketch_width(d, rank)
    return 4 * tokens * d * w + 2 * tokens * d if w else 2 * tokens * d * d


def fit_flops(d: int, rank: int) -> float:
    """The fitter's Nystrom fit of one sketched statistic (a few d x w products and
    factorizations; ``geometry.fit_low_rank_diag`` on a whole one: d^2 r)."""
    w = sketch_width(d, rank)
    return 8 * d * w * w if w else 2 * d * d * rank


def test_matrix_flops(d: int, rank: int) -> float:
    """A statistic's next test matrix, on every rank: a QR of d x w in float64 on the host."""
    w = sketch_width(d, rank)
    return 4 * d * w * w if w else 0.0


@functools.lru_cache(maxsize=None)
def judgement_counts(fmt: str, rank: int, rows: int = 256, cols: int = 688) -> Tuple[float, float]:
    """Bytes and matmul flops per element of one layer's judgement (``metrics.judge_geometries``,
    as a judged refresh runs it on the rank holding the layer's Adam state: the Euclidean and the
    whitened round trip, the whitened norms and AdamW's three directions), counted here on a
    ``rows`` x ``cols`` layer (every term is per element; the whitener's matmuls per element
    and rank) with the dispatch counter of ``benchmarks/codec_traffic.py`` (every ATen kernel's
    reads and writes: the element-wise work, AdamW's directions among it, is in the bytes) and
    torch's ``FlopCounterMode`` (the matmuls). The codec runs eager here, more bytes than the
    compiled one a GPU runs: an upper bound."""
    from torch.utils.flop_counter import FlopCounterMode

    from benchmarks.codec_traffic import TrafficCounter
    from deepspeed_gift.core import geometry as geo, metrics

    g = torch.Generator().manual_seed(0)
    x = torch.randn(4 * cols, cols, generator=g)
    whitener = geo.fit_whitener(x.T @ x / x.shape[0], rank=rank, damping=1e-3)
    G = torch.randn(rows, cols, generator=g)
    rule = metrics.AdamRule(exp_avg=torch.randn(rows * cols, generator=g) * 1e-2,
                            exp_avg_sq=torch.rand(rows * cols, generator=g) * 1e-4, step=50, betas=(0.9, 0.95))
    codec = get_format(fmt)

    def judge():
        metrics.judge_geometries(G, codec, {"kfac": whitener}, rule=rule)

    judge()  # warm: lazily made tables
    traffic, flops = TrafficCounter(), FlopCounterMode(display=False)
    with traffic, flops:
        judge()
    return (traffic.read + traffic.written) / G.numel(), flops.get_total_flops() / G.numel()


def step_model(path: str, fmt: str, all_layers: bool, geometry: bool, subsampled: bool, param_fmt, args,
               shapes: dict, ratios: Dict[str, dict], nic_gbit: float) -> dict:
    """Step time of one config at cluster scale (seconds), by term."""
    n, w, g = shapes["params"], args.world, min(args.gpus_per_node, args.world)
    tokens = args.tokens_per_gpu
    net = {"world": w, "per_node": g, "nic_bps": nic_gbit * 1e9, "nvlink_bps": args.nvlink_gbyte * 8e9,
           "alpha_s": args.alpha_us * 1e-6, "ring_eff": args.ring_eff, "alltoall_eff": args.alltoall_eff,
           "node_pieces": args.node_pieces or (layout_model.NODE_PIECES_CARRIED if args.carry_buckets
                                               else layout_model.NODE_PIECES_BY_BUCKET),
           "node_piece_min_elements": args.node_piece_min_elements,
           "carry_buckets": args.carry_buckets, "host_call_s": args.host_us * 1e-6,
           "section_join_s": args.join_us * 1e-6, "plain_sections": not all_layers,
           "codec_work": pipeline_codec_work(args, fmt) if path == "two_level" else {}}
    # 6 flops per weight per token, + attention scores and values (12 L d seq per token, causal
    # masking not discounted)
    compute = (6 * shapes["matmul"] + 12 * args.layers * args.hidden * args.seq) * tokens \
        / (args.gpu_tflops * 1e12 * args.mfu)
    copy_s = 8 / (args.hbm_tbs * 1e12 * args.hbm_eff)  # per element
    fp32 = args.fp32_tflops * 1e12 * args.fp32_eff
    codec = gift = 0.0
    buckets = [o for o in shapes["buckets"] if o]
    if path == "native":
        t_grad = sum(collective_seconds("allreduce", 2 * sum(o.values()), net) for o in buckets)
    elif path == "native_rs":
        t_grad = sum(collective_seconds("reducescatter", 2 * sum(o.values()), net) for o in buckets)
    else:
        b = wire_bytes_per_element(fmt)
        t_grad = gift_grad_seconds(path, buckets, b, net)
        if path == "flat":
            coded = n  # every rank encodes its whole gradient, decodes W pieces of N/W
            sent = n * (w - 1) / w  # what leaves the rank (its own partition stays unwhitened)
        else:
            coded = n / g
            sent = n / g * (w // g - 1) / (w // g)
        # the gradients' codec: a term of its own, unless two-level's pipeline runs it on the
        # GPU's stream beside the links (``--codec-in-pipeline``, :func:`pipeline_codec_work`)
        if not (net["codec_work"] and pipelined(net)):
            codec = (ratios[fmt]["encode"] + ratios[fmt]["decode"]) * copy_s * coded
        if geometry:
            forwards = max(1, tokens // (args.micro_batch * args.seq))
            counted = min(tokens, args.stats_tokens * forwards) if subsampled else tokens
            stats = sum(statistic_flops(counted, d, args.rank) for d in shapes["inputs"]) / args.collect_interval
            # refresh: the fitters' Nystrom fits of the sketches (spread over the ranks) and every
            # rank's next test matrix of each statistic, a QR made on the host in float64
            fits = sum(fit_flops(d, args.rank) for d in shapes["inputs"]) / w
            host = sum(test_matrix_flops(d, args.rank) for d in shapes["inputs"]) / (args.host_gflops * 1e9)
            refit = fits / args.refresh_interval
            # structured whitener: apply is 4 (rows x n x r) GEMMs on what a rank sends, the
            # inverse 2 on what it owns
            whiten = sum(m * k * args.rank for m, k in shapes["linears"]) * (8 * sent / n + 4 / w) \
                if all_layers else 0.0
            # no layer selected: a long run's judgements spaced idle_backoff x refresh_interval apart,
            # with two refits and two intervals of statistics in each (selection.idle_backoff)
            idle = 1.0 if all_layers else min(1.0, 2.0 / args.idle_backoff)
            # the judgement: every layer once a judged refresh, on the rank holding its state
            # (spread over the ranks); every idle_backoff-th refresh where none is selected
            judged_bytes, judged_flops = judgement_counts(fmt, args.rank)
            lin = sum(m * k for m, k in shapes["linears"]) / w
            judge = lin * (judged_bytes / (args.hbm_tbs * 1e12 * args.hbm_eff) + judged_flops / fp32) \
                / (args.refresh_interval * (1 if all_layers else args.idle_backoff))
            gift = (idle * (stats + refit) + whiten) / fp32 + idle * host / args.refresh_interval + judge
    if param_fmt is None:
        t_param = collective_seconds("allgather", 2 * n, net)
    else:  # the owner encodes N/W; every rank decodes all N and adds them to its replicas
        pb = wire_bytes_per_element(param_fmt) * n
        t_param = collective_seconds("two_level" if path == "two_level" else "allgather", pb, net, nvlink_s=pb)
        codec += (ratios[param_fmt]["encode"] / w + ratios[param_fmt]["decode"] + 1) * copy_s * n
    comm = (1 - args.overlap) * (t_grad + t_param)
    return {"total": compute + gift + codec + comm, "compute": compute, "gift": gift, "codec": codec,
            "grad_comm": t_grad, "param_comm": t_param, "exposed_comm": comm}


def pipelined(net: dict) -> bool:
    """Whether two-level's exchange is modelled as its pipeline of pieces (``node_pieces`` > 1)."""
    return net.get("node_pieces", 1) > 1


def pipeline_codec_work(args, fmt: str) -> dict:
    """The GPU work of two-level's pipeline (``--codec-in-pipeline``, with ``--codec-traffic``),
    as ``layout_model.Rates`` takes it: the codec's counted bytes and kernels of ``fmt``'s
    compiled rows (each piece's encode, the owner's decode-and-sum as a line in its senders, a
    relay's sums and their encode) and the node stage's fp32 sum of the node's parts, each on the
    GPU's stream of :func:`layout_model.scheme_seconds`, in order with the links, as the layout
    model runs them. Empty (the codec a term of the step of its own, as before): without
    ``--codec-traffic`` or with ``--no-codec-in-pipeline``. Whitening is left to the geometry's
    term, which counts it already (its flops free here: ``whiten_rank`` stays what the host's
    calls need, whether a rank's sections are plain)."""
    if not (args.codec_in_pipeline and args.codec_traffic):
        return {}
    return dict(_counted_work(args.codec_traffic, TRAFFIC_CASES[fmt], args.hbm_tbs, args.hbm_eff, args.launch_us))


@functools.lru_cache(maxsize=None)
def _counted_work(path: str, case: str, hbm_tbs: float, hbm_eff: float, launch_us: float) -> Tuple[tuple, ...]:
    """:func:`pipeline_codec_work`'s rates, the traffic file read once (the model is evaluated
    per config, rate and bisection step)."""
    view = argparse.Namespace(nic_gbit=1.0, nvlink_gbyte=1.0, alpha_us=0.0, a2a_us=0.0, hbm_tbs=hbm_tbs,
                              hbm_eff=hbm_eff, launch_us=launch_us, whiten_rank=0, fp32_tflops=1.0, fp32_eff=1.0,
                              kernels="compiled")
    r = layout_model.traffic_rates(path, view, case)
    work = {k: getattr(r, k) for k in ("hbm_bps", "launch_s", "encode_bpe", "encode_kernels", "decode_a", "decode_b")}
    return tuple(dict(work, fp32_flops=math.inf).items())


def gift_grad_seconds(path: str, buckets: List[Dict[int, int]], b: float, net: dict) -> float:
    """Seconds of GIFT's exchange of the step's buckets of the real layout (``by_layout``, flat or
    two-level): the layout model's busiest NIC and NVLink bytes at the calibrated efficiencies,
    and the latency steps of the collective (one pass). Flat, or two-level in whole buckets
    (``node_pieces`` 1): stages one after the other. Two-level's pipeline (``gift.node_pieces``):
    the layout model's schedule of its pieces' link stages, each collective its latency steps
    (the codec's work is its own term of the step, not overlapped here), one pipeline per
    bucket, or carried from bucket to bucket over the step (``gift.carry_buckets``). The host's
    time per codec call (``host_call_s``, ``--host-us``): a resource of the pipeline, or added
    call by call where the stages run one after the other."""
    w, g = net["world"], min(net["per_node"], net["world"])
    pieces = net.get("node_pieces", 1)
    host_call_s = net.get("host_call_s", 0.0)
    # the calls' count where ``--join-us`` is given (``layout_model.Rates.calls``): a rank's
    # sections to its owners one encode a piece where they are plain (no layer whitened), a
    # relay's sums for their owners one encode
    calls_of = dict(host_call_s=host_call_s, section_join_s=net.get("section_join_s", 0.0),
                    whiten_rank=0 if net.get("plain_sections") else 1)
    links = [layout_model.bucket_link_bytes(o, w, g, b) for o in buckets]
    if path != "two_level" or not pipelined(net) or not all("two_level_by_layout" in x for x in links):
        scheme = "two_level_by_layout" if path == "two_level" and all("two_level_by_layout" in x for x in links) \
            else "by_layout"
        steps = collective_bytes("two_level" if scheme != "by_layout" else "alltoall", 1.0, w, g)["steps"]
        unit = layout_model.Rates(1.0, 1.0, **calls_of)  # the calls do not depend on the rates
        calls = sum(layout_model.host_calls(layout_model.bucket_stages(o, w, g, b, unit)[scheme])
                    for o in buckets) if host_call_s else 0
        links_s = sum(net["alpha_s"] * steps + x[scheme][0] * 8 / net["nic_bps"] / net["alltoall_eff"]
                      + x[scheme][1] * 8 / net["nvlink_bps"] / net["ring_eff"] for x in links)
        return calls * host_call_s + links_s
    # each collective its own latency steps, as whole buckets (``collective_bytes``): a node
    # stage's or forward's G - 1, an exchange's one a node less (until the commit after
    # 5dd1139 every one of them was charged the larger count, a 4-GPU node stage 15 steps at
    # the paper's shape)
    rates = layout_model.Rates(net["nic_bps"] / 8 * net["alltoall_eff"], net["nvlink_bps"] / 8 * net["ring_eff"],
                               a2a_step_s=net["alpha_s"], **calls_of, **net.get("codec_work", {}))
    per_bucket = [[layout_model.bucket_stages(o, w, g, b, rates)["two_level_by_layout"]
                   for o in layout_model.cut_pieces(list(owners.items()), pieces, net["node_piece_min_elements"])]
                  for owners in buckets]
    if net.get("carry_buckets", True):
        return layout_model.scheme_seconds([st for stages in per_bucket for st in stages], rates, overlap=True)
    return sum(layout_model.scheme_seconds(stages, rates, overlap=True) for stages in per_bucket)


def saving_pct(entry, base_path: str, args, shapes, ratios, gbit: float) -> float:
    base = step_model(base_path, *NATIVE, args, shapes, ratios, gbit)["total"]
    return 100 * (step_model(*entry[1:], args, shapes, ratios, gbit)["total"] / base - 1)


def bandwidth_for_saving(entry, base_path: str, target: float, args, shapes, ratios):
    """Network rate (Gbit/s per GPU) at which ``entry`` saves ``target`` % over the baseline;
    None when it does not within 0.1 Gbit/s .. 100 Tbit/s (the saving shrinks as the rate grows)."""
    lo, hi = 0.1, 1e5
    f = [saving_pct(entry, base_path, args, shapes, ratios, x) - target for x in (lo, hi)]
    if f[0] > 0 or f[1] < 0:
        return None
    for _ in range(80):
        mid = math.sqrt(lo * hi)
        lo, hi = (mid, hi) if saving_pct(entry, base_path, args, shapes, ratios, mid) < target else (lo, mid)
    return math.sqrt(lo * hi)


def scale_table(args, ratios) -> dict:
    shapes = llama_shapes(args.hidden, args.ffn, args.layers, args.vocab)
    sizes, arrival = llama_layout(args.hidden, args.ffn, args.layers, args.vocab)
    if sum(sizes) != shapes["params"]:
        raise SystemExit(f"the Llama definition has {sum(sizes)} parameters, llama_shapes counts {shapes['params']}")
    shapes["buckets"] = layout_model.buckets_of(sizes, arrival, args.world, int(args.bucket))
    out = {"params": shapes["params"], "non_embedding": shapes["non_embedding"], "bandwidths_gbit": args.nic_gbit,
           "rows": []}
    bases = [tuple(step_model(path, *NATIVE, args, shapes, ratios, gbit)["total"]
                   for path in ("native", "native_rs")) for gbit in args.nic_gbit]
    for entry in CONFIGS:
        row = {"config": entry[0], "by_bandwidth": []}  # in the order of args.nic_gbit
        for gbit, (native, native_rs) in zip(args.nic_gbit, bases):
            m = step_model(*entry[1:], args, shapes, ratios, gbit)
            m["saving_pct"] = 100 * (m["total"] / native - 1)
            m["saving_vs_reduce_scatter_pct"] = 100 * (m["total"] / native_rs - 1)
            row["by_bandwidth"].append(dict(m, gbit=gbit))
        out["rows"].append(row)
    # the paper's Euclidean FP8 saving, against the paper's kind of baseline (each gradient
    # shard reduced once: a reduce-scatter), for the flat and the two-level exchange
    out["paper_match"] = {}
    for label, entry in (("flat", CONFIGS[2]), ("two-level", CONFIGS[7])):
        gbit = bandwidth_for_saving(entry, "native_rs", PAPER_SAVINGS["euclidean_fp8"], args, shapes, ratios)
        match = {"gbit": gbit}
        if gbit is not None:
            match["savings"] = {e[0]: saving_pct(e, "native_rs", args, shapes, ratios, gbit) for e in CONFIGS}
            match["terms"] = {e[0]: step_model(*e[1:], args, shapes, ratios, gbit) for e in CONFIGS}
        out["paper_match"][label] = match
    return out


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Alpha-beta step-time model of ZeRO-2 with GIFT (see the docstring).")
    p.add_argument("--calibration", help="JSON from benchmarks/netns_cluster.py --json")
    p.add_argument("--config-dir", default=str(ROOT / "ds_configs"), help="where the calibration's configs live")
    p.add_argument("--codec-json", help="benchmarks/codec_speed.py --json output (default: measure now)")
    p.add_argument("--codec-numel", type=int, default=16_000_000,
                   help="tensor size of the codec measurement (large enough to leave the CPU caches)")
    p.add_argument("--codec-traffic", help="benchmarks/codec_traffic.py --json output: the GPU codec time from "
                                           "counted bytes and kernels (compiled) replaces the CPU-measured ratio "
                                           "in the tables; both are printed side by side")
    p.add_argument("--codec-gpu", help="benchmarks/gpu_check.py --json output from a GPU: the codec time measured "
                                       "there (its traffic rows, compiled), before the counted one")
    p.add_argument("--traffic-senders", type=int, default=7, choices=(3, 7, 31),
                   help="senders of the decode-and-sum row taken from --codec-traffic")
    p.add_argument("--launch-us", type=float, default=5.0, help="launch latency per kernel, microseconds")
    p.add_argument("--host-us", type=float, default=0.0,
                   help="host time per codec call of GIFT's exchange, microseconds (benchmarks/layout_model.py's "
                        "--host-us: an encode per section sent, a decode-and-sum per section received; 0: not "
                        "counted)")
    p.add_argument("--join-us", type=float, default=0.0,
                   help="with --host-us: a rank's plain sections (configs with no layer whitened) and a relay's "
                        "sums encoded by one call a piece and joined into the send buffer at this many "
                        "microseconds each (benchmarks/layout_model.py's --join-us; 0: a call per section)")
    g = p.add_argument_group("target cluster (defaults: Llama-600M, 64 H100-class GPUs, 8 per node)")
    g.add_argument("--world", type=int, default=64)
    g.add_argument("--bucket", type=float, default=DEEPSPEED_BUCKET, help="reduce_bucket_size (DeepSpeed's default)")
    g.add_argument("--gpus-per-node", type=int, default=8)
    g.add_argument("--hidden", type=int, default=1280)
    g.add_argument("--ffn", type=int, default=3456)
    g.add_argument("--layers", type=int, default=32)
    g.add_argument("--vocab", type=int, default=32000)
    g.add_argument("--tokens-per-gpu", type=int, default=16384, help="tokens per GPU per optimizer step")
    g.add_argument("--seq", type=int, default=2048, help="sequence length (attention flops)")
    g.add_argument("--gpu-tflops", type=float, default=989.0, help="dense bf16 peak")
    g.add_argument("--mfu", type=float, default=0.4, help="model flops utilisation of forward+backward")
    g.add_argument("--fp32-tflops", type=float, default=67.0, help="fp32 matmul peak (GIFT's statistics, "
                                                                   "whitening and fits are fp32)")
    g.add_argument("--fp32-eff", type=float, default=0.7, help="of --fp32-tflops reached by those matmuls")
    g.add_argument("--hbm-tbs", type=float, default=3.35, help="GPU memory bandwidth, TB/s")
    g.add_argument("--hbm-eff", type=float, default=0.8, help="of --hbm-tbs reached by a copy")
    g.add_argument("--nic-gbit", type=float, nargs="+", default=[25, 50, 100, 200, 400],
                   help="network rate per GPU (one NIC each), Gbit/s each way")
    g.add_argument("--nvlink-gbyte", type=float, default=450.0, help="NVLink GB/s each way per GPU")
    g.add_argument("--alpha-us", type=float, default=10.0, help="latency per collective step")
    g.add_argument("--node-pieces", type=int, default=None,
                   help="gift.node_pieces: two-level's pipeline (1: its stages one after another; default "
                        "gift's: 4 carried from bucket to bucket, 6 bucket by bucket)")
    g.add_argument("--node-piece-min-elements", type=int, default=1 << 22, help="gift.node_piece_min_elements")
    g.add_argument("--carry-buckets", action=argparse.BooleanOptionalAction,
                   default=GiftConfig.model_fields["carry_buckets"].default,
                   help="gift.carry_buckets (under overlap_comm): two-level's pipeline carried from bucket to bucket")
    g.add_argument("--codec-in-pipeline", action=argparse.BooleanOptionalAction, default=True,
                   help="with --codec-traffic: two-level's pipeline runs the gradients' codec and the node "
                        "stage's sum on the GPU's stream beside the links, as the layout model does (off: the "
                        "codec a term of the step of its own, the node stage's sum not counted)")
    g.add_argument("--ring-eff", type=float, help="link efficiency of ring collectives (default: the calibrated "
                                                  "one with --calibration, else 1)")
    g.add_argument("--alltoall-eff", type=float, help="link efficiency of all-to-all (default: the calibrated "
                                                      "one with --calibration, else 1)")
    g.add_argument("--overlap", type=float, default=0.0, help="fraction of communication hidden by backward")
    g.add_argument("--rank", type=int, default=32, help="GIFT geometry.rank")
    g.add_argument("--collect-interval", type=int, default=10, help="GIFT geometry.collect_interval")
    g.add_argument("--stats-tokens", type=int, default=2048,
                   help="GIFT geometry.stats_tokens of the stats_tokens rows (tokens per layer and forward)")
    g.add_argument("--micro-batch", type=int, default=8, help="sequences per forward (forwards per step: "
                                                              "tokens per GPU / (micro batch x seq))")
    g.add_argument("--refresh-interval", type=int, default=50, help="GIFT geometry.refresh_interval")
    g.add_argument("--idle-backoff", type=int, default=SelectionConfig.model_fields["idle_backoff"].default,
                   help="GIFT selection.idle_backoff (the rows where no layer is selected, a long run's steady state)")
    g.add_argument("--host-gflops", type=float, default=20.0,
                   help="float64 QR rate of a host core (each refresh's test matrices)")
    p.add_argument("--json", help="write calibration and predictions here")
    args = p.parse_args(argv)
    if args.world % min(args.gpus_per_node, args.world):
        p.error(f"--world {args.world} is not a multiple of --gpus-per-node {args.gpus_per_node}")
    result: dict = {}
    if args.calibration:
        cal = json.loads(Path(args.calibration).read_text())
        fit = calibrate(cal, Path(args.config_dir))
        speedup_rows(fit["rows"], cal["configs"][0])
        result["calibration"] = fit
        print_calibration(cal, fit)
        for name, key in (("ring_eff", "ring"), ("alltoall_eff", "alltoall")):
            if getattr(args, name) is None:
                if not math.isfinite(fit["efficiency"][key]):
                    p.error(f"the calibration gives no {key} efficiency (too few points with GIFT's all-to-all "
                            f"timer, or no traffic on the links): pass --{name.replace('_', '-')}")
                setattr(args, name, fit["efficiency"][key])
    for name in ("ring_eff", "alltoall_eff"):
        value = 1.0 if getattr(args, name) is None else getattr(args, name)
        if not 0 < value <= 1:
            p.error(f"{name.replace('_', '-')} {value}: must be in (0, 1] (from --{name.replace('_', '-')} "
                    f"or the calibration)")
        setattr(args, name, value)
    ratios = codec_ratios(args)
    result["codec_vs_copy"] = ratios
    counted: Dict[str, Dict[str, dict]] = {}
    if args.codec_traffic:
        counted = {mode: traffic_ratios(args, mode) for mode in ("eager", "compiled")}
        result["codec_vs_copy_counted"] = counted
    if args.codec_gpu:
        counted["measured"] = measured_gpu_ratios(args.codec_gpu, args.traffic_senders)
        result["codec_vs_copy_measured_gpu"] = counted["measured"]
    if counted:
        print_codec_sources(ratios, counted)
        # the best evidence there is: measured on a GPU, else counted, else the CPU ratio
        for source in ("compiled", "measured"):
            ratios = dict(ratios, **counted.get(source, {}))
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
    g = cal.get("ranks_per_host", 1)
    print(f"calibration: {cal['ranks']} ranks on {cal['ranks'] // g} hosts, {cal['params']} params; link efficiency "
          f"(achieved / rate) {eff}; {fit['dropped']} points left out (failed or unlimited)\n")
    print("| config | link | measured s/step | model s/step | error | speedup measured | speedup model | "
          "MB measured | MB model | all-to-all s measured | model | role |")
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


def print_codec_sources(cpu: Dict[str, dict], counted: Dict[str, Dict[str, dict]]) -> None:
    """The codec's encode + decode per element as multiples of a GPU copy, by where it comes from."""
    print("codec encode + decode, x a copy on the target GPU: (a) the CPU-measured ratio carried over, "
          "(b) counted traffic, eager, (c) counted traffic, compiled, (d) compiled, measured on a GPU "
          "(--codec-gpu; used below where given, else (c))\n")
    print("| format | (a) CPU ratio | (b) eager, counted | (c) compiled, counted | (d) compiled, measured |")
    print("|---|---:|---:|---:|---:|")
    for fmt in TRAFFIC_CASES:
        cells = [cpu.get(fmt)] + [counted.get(k, {}).get(fmt) for k in ("eager", "compiled", "measured")]
        print(f"| {fmt} | " + " | ".join("-" if c is None else f"{c['encode'] + c['decode']:.2f}" for c in cells) + " |")
    print()


def print_scale(args, scale: dict) -> None:
    print(f"Llama {scale['params'] / 1e6:.0f}M params ({scale['non_embedding'] / 1e6:.0f}M without embeddings) on "
          f"{args.world} GPUs, {args.gpus_per_node} per node, {args.tokens_per_gpu} tokens/GPU/step, "
          f"{args.gpu_tflops:g} TFLOP/s x MFU {args.mfu}, overlap {args.overlap}, link efficiency ring "
          f"{args.ring_eff:.2f} / all-to-all {args.alltoall_eff:.2f}: step time and change vs DeepSpeed's bf16 "
          f"all-reduce by network rate per GPU\n")
    print("| config | " + " | ".join(f"{g:g} Gbit/s" for g in scale["bandwidths_gbit"]) + " |")
    print("|---|" + "---:|" * len(scale["bandwidths_gbit"]))
    for row in scale["rows"]:
        cells = [f"{m['total'] * 1e3:.0f} ms ({m['saving_pct']:+.1f}%)" for m in row["by_bandwidth"]]
        print(f"| {row['config']} | " + " | ".join(cells) + " |")
    for label, m in scale["paper_match"].items():
        if m["gbit"] is None:
            print(f"\n{label}: Euclidean FP8 never saves the paper's {PAPER_SAVINGS['euclidean_fp8']}% over a bf16 "
                  f"reduce-scatter at any network rate")
            continue
        print(f"\n{label}: Euclidean FP8 saves the paper's {PAPER_SAVINGS['euclidean_fp8']}% over a bf16 "
              f"reduce-scatter at {m['gbit']:.0f} Gbit/s per GPU; there (vs that baseline): "
              + ", ".join(f"{k} {v:+.1f}%" for k, v in m["savings"].items() if not k.startswith("bf16"))
              + f" (paper: GIFT {PAPER_SAVINGS['gift_fp8']}%)")
        print(f"\nWhere the time goes at {m['gbit']:.0f} Gbit/s per GPU (ms per step):\n")
        print("| config | compute | GIFT geometry | codec | gradient comm | parameter all-gather | total |")
        print("|---|---:|---:|---:|---:|---:|---:|")
        for name, t in m["terms"].items():
            print(f"| {name} | {t['compute'] * 1e3:.1f} | {t['gift'] * 1e3:.1f} | {t['codec'] * 1e3:.1f} | "
                  f"{t['grad_comm'] * 1e3:.1f} | {t['param_comm'] * 1e3:.1f} | {t['total'] * 1e3:.1f} |")


if __name__ == "__main__":
    main()
