"""Tiny versions of the benchmarks: they run, print their table and write JSON."""

import json
import math
import os
import subprocess
import sys

import pytest
import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_codec_speed_smoke(tmp_path):
    # every format eager, and the compiled mode for one: compiling every format took ~80 s of
    # this test's ~90 (tests/test_kernels.py compiles each format's kernels against eager)
    compiled = tmp_path / "compiled.json"
    proc = subprocess.run([sys.executable, "benchmarks/codec_speed.py", "--numel", "100000", "--repeats", "2",
                           "--kernels", "compiled", "--formats", "fp8_e4m3", "--json", str(compiled)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    [row] = json.loads(compiled.read_text())["formats"]
    assert row["format"] == "fp8_e4m3+c" and row["kernels"] == "compiled" and row["encode_ms"] > 0
    out = tmp_path / "codec.json"
    proc = subprocess.run([sys.executable, "benchmarks/codec_speed.py", "--numel", "100000", "--repeats", "2",
                           "--kernels", "eager", "--shapes", "64x32", "--json", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "fp8_e4m3" in proc.stdout and "nvfp4" in proc.stdout
    data = json.loads(out.read_text())
    text = json.dumps(data)
    for name in ("fp8_e4m3", "fp8_e5m2", "nvfp4", "int8", "int4", "bf16", "fp32"):
        assert name in text
    rows = {r["format"]: r for r in data["formats"]}
    assert rows["nvfp4"]["bytes_per_element"] < rows["fp8_e4m3"]["bytes_per_element"] < rows["bf16"]["bytes_per_element"]
    assert all(r["encode_ms"] > 0 and r["decode_ms"] > 0 for r in data["formats"])
    solvers = {(t["shape"], t["solver"]) for t in data["transforms"]}
    assert solvers == {("64x32", "structured"), ("64x32", "cholesky"), ("64x32", "hadamard")}
    assert all(t["apply_invert_ms"] > 0 and t["vs_clone"] > 0 for t in data["transforms"])


# ---- scale model and the namespace cluster -------------------------------------------------
sys.path.insert(0, ROOT)
from benchmarks import scale_model  # noqa: E402

N_TINY = 119104  # parameters of launch/pretrain.py --preset tiny


def test_link_bytes_follow_the_collectives():
    n = 1_000_000
    bf16 = scale_model.config_wire(json.load(open(os.path.join(ROOT, "ds_configs/bf16_baseline_zero2.json"))))
    fp8 = scale_model.config_wire(json.load(open(os.path.join(ROOT, "ds_configs/euclid_fp8_e4m3_block_zero2.json"))))
    assert bf16["collective"] == "allreduce" and bf16["bytes_per_elem"] == 2.0
    assert fp8["collective"] == "alltoall" and abs(fp8["bytes_per_elem"] - (1 + 4 / 128)) < 1e-3
    # one rank per host: ring all-reduce 2 (W-1)/W N b; all-to-all (W-1)/W N b; bf16 all-gather (W-1)/W N 2
    assert scale_model.link_bytes(bf16, n, 4) == {"grad": 2 * 0.75 * n * 2, "param": 0.75 * n * 2}
    assert abs(scale_model.link_bytes(fp8, n, 4)["grad"] - 0.75 * n * fp8["bytes_per_elem"]) < 1
    # 8 per node, one NIC each: G rings share the G NICs, each crossing a node boundary once, so a
    # ring puts 1/G of its traffic on a NIC; a flat all-to-all sends all that leaves the node
    cb = scale_model.collective_bytes
    assert cb("allreduce", n, 64, 8)["nic"] == 2 * 63 / 64 * n / 8
    assert cb("allgather", n, 64, 8)["nic"] == 63 / 64 * n / 8
    assert cb("alltoall", n, 64, 8)["nic"] == 56 / 64 * n and cb("alltoall", n, 64, 8)["nvlink"] == 7 / 64 * n
    assert cb("two_level", n, 64, 8, nvlink_s=2 * n) == {"nic": 7 / 8 * n / 8, "nvlink": 7 / 8 * 2 * n,
                                                         "steps": 7 + 7}
    # inside one node nothing touches a NIC
    assert cb("allreduce", n, 8, 8)["nic"] == 0 and cb("allreduce", n, 8, 8)["nvlink"] == 2 * 7 / 8 * n


def test_calibration_recovers_a_known_link():
    """Points made by the model's own equations, ring collectives at efficiency 0.7 and GIFT's
    all-to-all at 0.5 (its measured time with 3 ms of skew): the fit returns those and
    predicts every point exactly; a point that breaks the model shows as prediction error."""
    configs = ["bf16_baseline_zero2", "euclid_fp8_e4m3_block_zero2", "euclid_nvfp4_zero2"]
    wires = {c: scale_model.config_wire(json.load(open(os.path.join(ROOT, "ds_configs", c + ".json"))))
             for c in configs}
    eff = {"ring": 0.7, "alltoall": 0.5}
    fixed = {"bf16_baseline_zero2": 0.30, "euclid_fp8_e4m3_block_zero2": 0.33, "euclid_nvfp4_zero2": 0.36}
    n, points = 3_000_000, []
    for bps in (1e8, 3e8, 1e9, 1e10):
        for c in configs:
            lb = scale_model.link_bytes(wires[c], n, 2)
            grad_eff = eff["alltoall"] if wires[c]["collective"] == "alltoall" else eff["ring"]
            grad_s = lb["grad"] * 8 / bps / grad_eff
            pt = {"config": c, "bandwidth": f"{bps:g}", "bandwidth_bps": bps, "status": "ok",
                  "median_step_s": fixed[c] + grad_s + lb["param"] * 8 / bps / eff["ring"],
                  "tx_bytes_per_step": lb["grad"] + lb["param"]}
            if wires[c]["collective"] == "alltoall":
                pt["gift_comm_s"] = 0.003 + grad_s
            points.append(pt)

    def fit():
        return scale_model.calibrate({"params": n, "ranks": 2, "configs": configs, "points": points},
                                     scale_model.ROOT / "ds_configs")

    got = fit()
    for k, v in eff.items():
        assert abs(got["efficiency"][k] - v) < 1e-9, (k, got["efficiency"])
    for c, v in fixed.items():
        assert abs(got["fixed_s"][c] - v) < 1e-9
    assert max(abs(r["error_pct"]) for r in got["rows"]) < 1e-6
    assert {r["role"] for r in got["rows"] if r["config"] != configs[0]} == {"prediction", "anchor (fixed time)"}
    slow_nvfp4 = next(p for p in points if p["config"] == "euclid_nvfp4_zero2" and p["bandwidth_bps"] == 1e8)
    slow_nvfp4["median_step_s"] *= 1.5
    row = next(r for r in fit()["rows"] if r["config"] == "euclid_nvfp4_zero2" and r["bandwidth_bps"] == 1e8)
    assert abs(row["error_pct"] - 100 * (1 / 1.5 - 1)) < 1e-6


@pytest.mark.parametrize("width", [24, 40, 41, 200])
def test_scale_model_counts_the_statistics_the_plugin_computes(width):
    """The model's flops of one statistic's collection are those torch counts in the plugin's own
    ``moment_of``, with the test matrix ``KfacRefresh`` makes (sketched past rank + 9 columns,
    whole below); the diagonal's 2 T n is elementwise, which torch's counter leaves out."""
    from torch.utils.flop_counter import FlopCounterMode

    from deepspeed_gift.config import GeometryConfig
    from deepspeed_gift.refresh import KfacRefresh
    from deepspeed_gift.statistics import moment_of

    class OneRank:
        rank, world_size = 0, 1

        def all_reduce_sum(self, t, kind=None):
            return t

    rank, tokens = 32, 300
    refresh = KfacRefresh(GeometryConfig(rank=rank), 0, OneRank(), ["x"], {})
    rows = torch.randn(tokens, width)
    omega = refresh.test_matrix("x", rows)
    assert (omega is None) == (scale_model.sketch_width(width, rank) == 0)
    with FlopCounterMode(display=False) as counter:
        moment_of(rows, omega)
    diagonal = 2 * tokens * width if omega is not None else 0
    assert counter.get_total_flops() + diagonal == scale_model.statistic_flops(tokens, width, rank)


def test_scale_models_pipeline_charges_each_collective_its_own_latency_steps():
    """Two-level's pipeline in the scale model: a node stage of G ranks is G - 1 latency steps, an
    exchange among the nodes one a node less, a relay's second hop as many again: the rule of
    the whole-bucket path (``collective_bytes``), not the larger count for every collective."""
    from benchmarks import layout_model

    w, g, alpha = 64, 4, 1e-3
    net = {"world": w, "per_node": g, "nic_bps": 1e30, "nvlink_bps": 1e30, "alpha_s": alpha, "ring_eff": 1.0,
           "alltoall_eff": 1.0, "node_pieces": 2, "node_piece_min_elements": 1, "carry_buckets": True}
    owners = {d: 1000 for d in range(0, w, g)}  # one owner a node: balanced, its slot's results forwarded
    rates = layout_model.Rates(1e30, 1e30, a2a_step_s=alpha)
    stage = layout_model.bucket_stages(owners, w, g, 1.03125, rates)["two_level_by_layout"]
    steps = stage.node_steps + sum(s for _, s in stage.nic) + stage.forward_steps
    assert stage.node_steps == g - 1 and all(s == w // g - 1 for _, s in stage.nic)
    # serial pieces: the sum of every collective's steps; carried, the second piece's node stage and
    # the first's forwards hide under the exchanges: the first node stage, both exchanges, the last
    # forwards (every collective charged 15 steps, this was 60 alpha)
    assert abs(layout_model.scheme_seconds([stage, stage], rates, overlap=False) - 2 * steps * alpha) < 1e-12
    nic = sum(s for _, s in stage.nic)
    got = scale_model.gift_grad_seconds("two_level", [owners], 1.03125, net)
    assert abs(got - (stage.node_steps + 2 * nic + stage.forward_steps) * alpha) < 1e-12


def test_scale_model_runs_the_codec_on_the_pipelines_gpu_stream():
    """``--codec-in-pipeline``: two-level's pipeline takes the gradients' codec and the node
    stage's sum as the layout model's GPU stream (``pipeline_codec_work``'s rates). With links
    that take no time, the exchange's time is that stream's work alone, piece after piece: the
    node sums, the encodes, a relay's sums and encodes, the owners' decodes; without the work
    (the codec a term of its own) the links' nothing."""
    from benchmarks import layout_model

    w, g = 64, 4
    work = {"hbm_bps": 1e12, "launch_s": 5e-6, "encode_bpe": 5.1, "encode_kernels": 2, "decode_a": 4.0,
            "decode_b": 1.0, "fp32_flops": math.inf}
    net = {"world": w, "per_node": g, "nic_bps": 1e30, "nvlink_bps": 1e30, "alpha_s": 0.0, "ring_eff": 1.0,
           "alltoall_eff": 1.0, "node_pieces": 2, "node_piece_min_elements": 1, "carry_buckets": True}
    owners = {d: 1 << 20 for d in range(w)}
    rates = layout_model.Rates(1e30, 1e30, **work)
    stages = [layout_model.bucket_stages(o, w, g, 1.03125, rates)["two_level_by_layout"]
              for o in layout_model.cut_pieces(list(owners.items()), 2, 1)]
    gpu = sum(st.sum_s + st.encode_s + st.relay_s + st.decode_s for st in stages)
    assert gpu > 0 and all(st.sum_s > 0 and st.encode_s > 0 and st.decode_s > 0 for st in stages)
    got = scale_model.gift_grad_seconds("two_level", [owners], 1.03125, dict(net, codec_work=work))
    assert abs(got - gpu) < 1e-9 * gpu
    assert scale_model.gift_grad_seconds("two_level", [owners], 1.03125, net) < 1e-9 * gpu


def test_scale_model_prints_the_paper_setting(tmp_path):
    out = tmp_path / "scale.json"
    proc = subprocess.run([sys.executable, "benchmarks/scale_model.py", "--codec-numel", "1000000", "--json",
                           str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "Gbit/s per GPU" in proc.stdout and "Where the time goes" in proc.stdout
    data = json.loads(out.read_text())
    assert set(data["codec_vs_copy"]) >= {"fp8_e4m3", "nvfp4"}  # measured by codec_speed.py in the run
    # Llama-600M: 32 x (4 d^2 + 3 d f + 2 d) = 634M in the blocks, + 2 x 32000 x d untied embeddings + final norm
    d, f = 1280, 3456
    assert data["scale"]["params"] == 32 * (4 * d * d + 3 * d * f + 2 * d) + 2 * 32000 * d + d


def test_scale_model_on_a_two_level_network(tmp_path):
    codec = tmp_path / "codec.json"  # codec cost fixed at 2 copies of the tensor, to test the network terms
    codec.write_text(json.dumps({"formats": [{"format": f, "encode_vs_clone": 1.0, "decode_vs_clone": 1.0}
                                             for f in ("fp8_e4m3", "nvfp4")]}))

    def rows(*extra):
        scale = scale_model.main(["--codec-json", str(codec), *extra])["scale"]
        return {r["config"]: r["by_bandwidth"] for r in scale["rows"]}

    eight = rows()
    # 8 GPUs per node, one NIC each: the flat all-to-all puts (W-G)/W of the fp8 gradient on a NIC,
    # DeepSpeed's bf16 ring all-reduce 2 (W-1)/W x 2 / G: 0.90 against 0.49 bytes per element
    assert all(m["saving_pct"] > 0 for m in eight["Euclidean fp8_e4m3"])
    assert all(m["grad_comm"] > b["grad_comm"] for m, b in zip(eight["Euclidean fp8_e4m3"],
                                                                  eight["bf16 (DeepSpeed all-reduce)"]))
    # reducing inside the node first leaves 1/G of it per NIC: saves, more on slower networks
    hier = eight["Euclidean fp8_e4m3, two-level"]
    assert hier[0]["saving_pct"] < hier[-1]["saving_pct"] < 0
    # one GPU per node (the namespace cluster's shape): the flat all-to-all is the cheaper collective
    one = rows("--gpus-per-node", "1")
    assert one["Euclidean fp8_e4m3"][0]["saving_pct"] < one["Euclidean fp8_e4m3"][-1]["saving_pct"] < 0
    assert one["Euclidean nvfp4"][0]["grad_comm"] < one["Euclidean fp8_e4m3"][0]["grad_comm"]
    # GIFT without selected layers costs its statistics (every input here is wider than the sketch
    # of w = 32 + 8 columns: 4 T n w + 2 T n flops each, every 10 steps) and the refresh's fits
    # (8 n w^2, spread over 64 ranks, every 50 steps) at fp32 matmul speed, and every rank's QR of
    # the next test matrices (4 n w^2 at 20 GFLOP/s on the host); with idle_backoff 8 a quarter as often
    shapes = scale_model.llama_shapes(1280, 3456, 32, 32000)
    n_w = sum(n * 40 for n in shapes["inputs"])
    device = (4 * 16384 * n_w + 2 * 16384 * sum(shapes["inputs"])) / 10 + 8 * 40 * n_w / 64 / 50
    host = 4 * 40 * n_w / 20e9 / 50
    # and the judgement of every layer's elements (spread over the ranks) every 8 x 50 steps, at
    # its counted bytes (HBM 3.35 TB/s x 0.8) and flops
    judged_bytes, judged_flops = scale_model.judgement_counts("fp8_e4m3", 32)
    lin = sum(m * k for m, k in shapes["linears"]) / 64
    judge = lin * (judged_bytes / (3.35e12 * 0.8) + judged_flops / (67e12 * 0.7)) / (50 * 8)
    expected = 2 / 8 * (device / (67e12 * 0.7) + host) + judge
    assert abs(eight["GIFT fp8_e4m3, auto (no layer selected)"][0]["gift"] - expected) < 1e-12
    # gift.params: the all-gather carries fp8 changes (1 + 4/128 B, not 2), two-level: the NIC carries
    # (W-G)/W / G of them where the ring carries (W-1)/W / G (1.03/2 x 56/63 = 0.46), plus the NVLink
    # stage and latency; the replicas' decode of all N elements (+ one copy for the add) lands in codec
    n = shapes["params"]
    for with_p, without in zip(eight["GIFT fp8_e4m3 all layers, two-level, stats_tokens, params fp8_e4m3"],
                               eight["GIFT fp8_e4m3 all layers, two-level, stats_tokens"]):
        copy_s = 8 / (3.35e12 * 0.8)
        assert abs(with_p["codec"] - without["codec"] - (1 / 64 + 1 + 1) * copy_s * n) < 1e-12
        if with_p["gbit"] == 25:  # faster networks: the NVLink stage and latency weigh in (0.77 at 400)
            assert 0.45 < with_p["param_comm"] / without["param_comm"] < 0.5
        if with_p["gbit"] <= 100:
            assert with_p["total"] < without["total"]


def _netns_usable() -> str:
    import shutil

    if os.geteuid() != 0:
        return "needs root"
    if not (shutil.which("ip") and shutil.which("tc")):
        return "needs iproute2"
    name = f"giftprobe{os.getpid()}"
    p = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if p.returncode != 0:
        return f"ip netns add failed: {p.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ""


@pytest.mark.slow  # namespaces, tc shaping and fresh interpreters per rank: long by nature
@pytest.mark.parametrize("ranks,per_host,in_host", [(2, 1, None), (4, 2, None), (4, 2, 8)])
def test_netns_cluster_smoke(tmp_path, ranks, per_host, in_host):
    """Hosts in namespaces at 1 Gbit/s, one rank each or two sharing a host's link (in the host's
    namespace, or each in its own behind a shaped in-host link): bf16 and GIFT fp8 run and the
    bytes on each host's link are what the two-level model says (a ring's per-host traffic does
    not grow with ranks per host, the flat all-to-all's does); a job that fails is reported, the
    run exits 1, and nothing is left behind."""
    why = _netns_usable()
    if why:
        pytest.skip(why)
    prefix = f"gifttest{os.getpid() % 10000}r{ranks}{'i' if in_host else ''}"
    out = tmp_path / "netns.json"
    configs = ["ds_configs/bf16_baseline_zero2.json", "ds_configs/gift_fp8_zero2.json"]
    if per_host == 1:
        bad = tmp_path / "bad.json"  # a config the job refuses: the run goes on and still tears down
        cfg = json.load(open(os.path.join(ROOT, "ds_configs/gift_fp8_zero2.json")))
        cfg["zero_optimization"]["stage"] = 0  # GIFT replaces a ZeRO reduce-scatter: stage 0 has none
        bad.write_text(json.dumps(cfg))
        configs.append(str(bad))
    proc = subprocess.run([sys.executable, "benchmarks/netns_cluster.py", "--preset", "tiny", "--steps", "24",
                           "--skip", "4", "--bandwidths", "1gbit", "--repeats", "1", "--prefix", prefix,
                           "--ranks", str(ranks), "--ranks-per-host", str(per_host), "--timeout", "240",
                           "--configs", *configs, "--json", str(out)]
                          + (["--in-host-times", str(in_host)] if in_host else []),
                          cwd=ROOT, capture_output=True, text=True, timeout=900)
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert prefix not in left, left
    if per_host == 1:  # the refused config makes the whole run exit 1, after the table and the JSON
        assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
        assert "1 run(s) did not finish: bad at 1gbit" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    assert data["params"] == N_TINY and data["ranks_per_host"] == per_host and data["in_host_times"] == in_host
    pts = {p["config"]: p for p in data["points"]}
    if per_host == 1:
        assert pts["bad"]["status"] == "failed" and "stage" in pts["bad"]["log_tail"]
    for name in ("bf16_baseline_zero2", "gift_fp8_zero2"):
        pt = pts[name]
        assert pt["status"] == "ok", pt
        # hosts of 2 ranks: the gift block's default hierarchy (by_topology) runs two-level there
        wire = scale_model.config_wire(json.load(open(os.path.join(ROOT, "ds_configs", name + ".json"))), ranks,
                                       per_host)
        model = per_host * sum(scale_model.link_bytes(wire, N_TINY, ranks, per_node=per_host).values())
        # headers and small control messages add a few percent; counter sampling blurs the edges
        assert 0.85 * model < pt["tx_bytes_per_step"] < 1.25 * model, (name, pt["tx_bytes_per_step"], model)
    assert pts["bf16_baseline_zero2"]["tx_bytes_per_step"] > 1.5 * pts["gift_fp8_zero2"]["tx_bytes_per_step"]
    assert "| bf16_baseline_zero2 |" in proc.stdout


def test_replica_gap_reports_every_step():
    from benchmarks import replica_gap

    out = replica_gap.main(["--preset", "tiny", "--steps", "6", "--window", "3"])
    assert [w["steps"] for w in out["windows"]] == [(1, 3), (4, 6)]
    # fp8 changes of bf16 replicas: within a bf16 ulp or two of the target, measured on every step
    assert len(out["gaps"]) == 6 and all(0 < g < 2 * replica_gap.BF16_ULP for g in out["gaps"])


def test_gpu_check_cpu_part(tmp_path):
    """benchmarks/gpu_check.py's checks on the CPU at small sizes (its GPU part needs a GPU)."""
    from benchmarks import gpu_check

    out = gpu_check.main(["--device", "cpu", "--quick", "--json", str(tmp_path / "c.json")])
    assert json.loads((tmp_path / "c.json").read_text())["device"] == "cpu"
    assert [r["format"] for r in out["parity"]] == ["fp8_e4m3", "fp8_e5m2", "nvfp4", "int8", "int4", "bf16", "fp32"]
    assert all(r["bytes_equal"] and r["count_equal"] and r["decode_equal"] and r["batch_decode_equal"]
               for r in out["parity"])
    stochastic = [r for r in out["parity"] if r["format"] != "fp32"]  # fp32 is exact: no rounding to draw
    assert all(r["stochastic_equal"] and r["stochastic_eager_equal"] for r in stochastic)
    assert all(r["feedback_equal"] for r in out["parity"])
    assert all(r["spans_equal"] == "-" for r in out["parity"])  # eager on a CPU by default: no batched spans
    assert len(out["codec"]) == 4 and all(r["encode_gbs"] > 0 and r["decode_gbs"] > 0 for r in out["codec"])
    # fp32 round trip through a whitener of condition ~1e2: a few ulps (no TF32 on a CPU)
    assert all(r["round_trip_rel_err"] < 1e-5 for r in out["whitener"])
    for r in out["reducer"]:  # fp8 e4m3 + whitening + error feedback, ordinary steps
        assert r["host_conversions_per_bucket"] == 0 and 0 < r["max_rel_err"] < 0.0625, r
    engine, processes = out["engine"], out["processes"]
    assert engine["world1_lossless_equals_native"] and engine["world1_overlap_comm_lossless_equals_native"]
    assert engine["world1_fp8_trains"] and engine["world1_fp8_new_tf32_api_trains"]
    assert "error" not in processes, processes.get("error")
    assert processes["w2_two_level_lossless_equals_native"] and processes["w2_param_gather_lossless_equals_native"]
    assert processes["w2_overlap_comm_lossless_equals_native"] and processes["w4_relay_fp8_trains"]
    assert processes["w4_relay_lossless_within_spread"] and processes["w4_relay_buckets"] > 0, processes
    assert not out["errors"], out["errors"]
    # the counted operations timed (codec_traffic's cases x encode, decode-and-sum, stochastic,
    # feedback); eager on a CPU, the device's kernels counted by the profiler only on CUDA
    from benchmarks import codec_traffic

    assert [(r["case"], r["op"]) for r in out["traffic"]] == [
        (case, op) for case, _, _ in codec_traffic.CASES
        for op in ("encode", "decode_sum S=7", "encode stochastic", "encode+feedback", "encode bf16", "encode short")]
    for r in out["traffic"]:  # timed, the floor codec_traffic's own, no device kernels seen on a CPU
        assert "error" not in r and r["seconds"] > 0 and r["kernels"] is None, r
        fmt, options = next((f, o) for c, f, o in codec_traffic.CASES if c == r["case"])
        op = {"encode": "encode", "encode stochastic": "encode", "encode+feedback": "feedback",
              "encode bf16": "encode_bf16", "encode short": "encode_short"}.get(r["op"], "decode_sum")
        senders = 7 if op == "decode_sum" else 1
        assert r["floor_bytes_per_elem"] == codec_traffic.floor_bytes(
            codec_traffic._codec(fmt, options, "eager"), op, senders, r["numel"])
    step = out["step_work"]  # each config built, trained and timed in its own engine
    assert sorted(step["runs"]) == ["euclidean fp8", "gift fp8", "native bf16"]
    for runs in step["runs"].values():
        assert [r["steps"] for r in runs] == [2] and all(0 < r["last_loss"] < 10 for r in runs), runs
    assert out["provenance"]["compile_options"]["emulate_precision_casts"] is True


def test_ef_study_measures_the_residual_and_adams_second_moment(tmp_path):
    # Euclidean NVFP4 without and with error feedback beside bf16, one seed, 12 tiny steps: the
    # probe runs on the very runs the losses come from and the report pairs what differs in EF.
    from benchmarks import ef_study

    report = ef_study.main(["--seeds", "1", "--steps", "12", "--preset", "tiny", "--probe-every", "5",
                            "--configs", "euclid_nvfp4", "euclid_nvfp4_ef", "--out-dir", str(tmp_path)])
    assert set(report["pairs"]) == {"euclid_nvfp4_ef vs euclid_nvfp4"}
    assert report["pairs"]["euclid_nvfp4_ef vs euclid_nvfp4"]["differs_in"] == "error feedback (Euclidean)"
    runs = json.loads((tmp_path / "results.json").read_text())["runs"]
    ef_probe = runs["euclid_nvfp4_ef"]["0"]["probes"]["10"]
    # NVFP4 leaves a few percent of the gradient out each step; EF carries exactly that
    assert 0.01 < ef_probe["residual_over_grad"] < 0.5
    # the residual is stored at int8 with a scale per 128: off by at most half a step of its
    # block's scale, so by sqrt(128) / 254 of its norm at worst (measured 0.0075 here)
    assert 0 < ef_probe["residual_roundoff"] < (128 ** 0.5) / 254
    assert "residual_over_grad" not in runs["euclid_nvfp4"]["0"]["probes"]["10"]  # no EF, no residual
    # 10 steps in, Adam's second moment of the quantized run is near bf16's (same seed, same batches)
    assert 0.5 < ef_probe["v_ratio_median"] < 2.0
    assert (tmp_path / "report.md").read_text().count("| euclid_nvfp4") >= 2


def test_owner_ops_decode_is_one_batch_whatever_the_world(tmp_path):
    # issue 34: an owner checks and decodes its W - 1 senders as one batch (direct: their
    # payloads of its section; relay: each relay's sum of its chunk, and the owner's assembly
    # from the relays' chunks, in runs), so those ATen ops per section do not depend on W;
    # the relay's senders encode a run of relays' chunks at once
    # (before: 10-15 per sender; 37 per sender for fp8 in all); the sum in rank order stays one
    # add per sender
    from benchmarks import owner_ops

    rows = owner_ops.main(["--worlds", "4", "8", "--bucket", "16384", "--json", str(tmp_path / "o.json")])
    parts = [(route, part) for route in ("direct", "relay") for part in owner_ops.PARTS[route]]
    assert {(r["route"], r["part"]) for r in rows} == set(parts)
    for route, part in parts:
        for fmt in owner_ops.FORMATS:
            counts = [r for r in rows if (r["route"], r["part"], r["format"]) == (route, part, fmt)]
            assert [r["world"] for r in counts] == [4, 8]
            if part == "sender":  # a few runs of relays a section, each one encode (one a relay: 2.3x)
                assert counts[1]["ops_per_section"] <= 1.5 * counts[0]["ops_per_section"], counts
                continue
            assert len({r["decode_ops"] for r in counts}) == 1 and counts[0]["decode_ops"] > 5, counts
            adds = [0, 0] if part == "owner" and route == "relay" else [3, 7]  # the owner only places chunks
            assert [r["sum_ops"] for r in counts] == adds, counts

def test_codec_traffic_counts_kernels_and_bytes_against_the_floor():
    # issue 41: the eager codec is a chain (each op a kernel and a pass over the tile, one add
    # per sender in the sum); compiled, the owner's decode-and-sum of every sender is one kernel
    # that reads each payload once and writes the sum once (inductor's count: the output twice)
    from benchmarks import codec_traffic as ct

    enc = ct._measure("eager", "fp8_e4m3", {}, "encode", 1)
    assert enc["floor"] == pytest.approx(4 + 1 + 4 / 128) and enc["kernels"] >= 8
    assert enc["bytes_per_element"] > 2 * enc["floor"]
    sums = [ct._measure("eager", "fp8_e4m3", {}, "decode_sum", s) for s in (3, 7)]
    assert sums[1]["kernels"] - sums[0]["kernels"] >= 4  # at least one add per sender more
    fused = ct._measure("compiled", "fp8_e4m3", {}, "decode_sum", 3)
    assert fused["kernels"] == 1 and fused["eager_ops"] == 0
    floor = 3 * (1 + 4 / 128) + 4
    assert fused["floor"] == pytest.approx(floor)
    assert floor <= fused["bytes_per_element"] <= floor + 4 + 1e-6


def test_models_take_the_codec_time_measured_on_a_gpu():
    """``--codec-gpu``: the scale and layout models charge a codec operation the time the GPU run
    measured (docs/measured: one H200 tile), whatever copy rate the model assumes."""
    import argparse

    from benchmarks import layout_model

    path = os.path.join(ROOT, "docs", "measured", "gpu_check_h200_20261204.json")
    rows = {(r["case"], r["op"], r["mode"]): r for r in json.load(open(path))["traffic"]}
    enc, dec = rows[("fp8_e4m3/128", "encode", "compiled")], rows[("fp8_e4m3/128", "decode_sum S=7", "compiled")]
    ratios = scale_model.measured_gpu_ratios(path)
    assert abs(ratios["fp8_e4m3"]["encode"] - enc["us"] / enc["copy_us"]) < 1e-12
    assert abs(ratios["fp8_e4m3"]["decode"] - dec["us"] / 7 / dec["copy_us"]) < 1e-12
    for hbm in (3.35, 4.8):
        args = argparse.Namespace(kernels="compiled", hbm_tbs=hbm, hbm_eff=0.8, nic_gbit=400.0, nvlink_gbyte=450.0,
                                  alpha_us=0.0, a2a_us=0.0, whiten_rank=32, fp32_tflops=67.0, fp32_eff=0.7)
        rates = layout_model.measured_rates(path, args)
        tile = enc["numel"]
        assert abs(rates.encode(tile, whiten=False) - enc["us"] * 1e-6) < 1e-12
        assert abs(rates.decode(tile, 7, inverse=False) - dec["us"] * 1e-6) < 1e-12
        assert abs(rates.decode(tile, 14, inverse=False) - 2 * dec["us"] * 1e-6) < 1e-12  # taken as linear in S


def test_step_pair_alternates_the_order_and_reads_each_runs_steps(tmp_path):
    # two rounds of two tiny configs: A first, then B first; the ratios are the runs' own means
    from benchmarks import step_pair

    a, b = "ds_configs/bf16_baseline_zero2.json", "ds_configs/euclid_fp8_e5m2_tensor_zero2.json"
    out = step_pair.main(["--configs", a, b, "--rounds", "2", "--skip", "1", "--out-dir", str(tmp_path),
                          "--preset", "tiny", "--steps", "4", "--eval-every", "4", "--eval-batches", "1"])
    firsts = [json.load(open(tmp_path / f"round{i}" / "results.json"))["results"][0]["config"] for i in (1, 2)]
    assert firsts == [a, b]
    A, B = "bf16_baseline_zero2", "euclid_fp8_e5m2_tensor_zero2"
    for r, q in zip(out["rounds"], out["ratios"]["per_round"]):
        assert r[A]["steps"] == r[B]["steps"] == 3
        assert q["wall"] == r[B]["mean_s"] / r[A]["mean_s"] > 0
    assert out["rounds"][0][B]["geometry_s"] == 0.0  # identity geometry does no geometry work


def test_the_judgements_count_is_per_element():
    # the scale model multiplies the counted judgement by the layers' elements: a layer twice as
    # tall moves the same bytes per element (only its few scalars and headers differ); the
    # flops are the whitener's matmuls, rows x in x rank each: per element exactly proportional
    # to the rank, whatever the rows
    small, tall = scale_model.judgement_counts("fp8_e4m3", 32, rows=128), scale_model.judgement_counts("fp8_e4m3", 32)
    assert abs(small[0] / tall[0] - 1) < 0.02 and small[1] == tall[1]
    wide = scale_model.judgement_counts("fp8_e4m3", 64)
    assert wide[1] == 2 * tall[1] and abs(wide[0] / tall[0] - 1) < 0.2
