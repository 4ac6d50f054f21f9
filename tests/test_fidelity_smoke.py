"""Tiny runs of benchmarks/fidelity.py (AdamW and Muon): they print their tables and write a
complete JSON whose numbers would be wrong if the reduction, the metrics or the Muon training were."""

import json
import math
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FORMATS = ("fp8_e4m3", "fp8_e5m2", "nvfp4", "int8", "int4")
GEOMETRIES = ("identity", "hadamard", "kfac_s8", "kfac_s32", "kfac_c32")
KFAC = GEOMETRIES[2:]
TINY = ["--preset", "tiny", "--ranks", "2", "--micro", "1", "--seq", "32", "--train-steps", "2",
        "--refresh-interval", "2", "--formats", *FORMATS, "fp32"]
# Euclidean / Hadamard fp8 on real gradients is a few percent off (e4m3 ~2%, e5m2 with one
# scale per tensor ~4%); 0.1 leaves room for a tiny model's noise and still catches a broken
# codec. kfac errors are not bounded by the format (they depend on how S is conditioned, and
# on a tiny model after 6 steps whitening does raise them: e5m2 r32 measured 0.16), so for
# kfac only "better than sending zeros" is an invariant.
FP8_MAX_REL_ERR = 0.1
KFAC_MAX_REL_ERR = 1.0
# fp32 through a whitener and back: float32 rounding of S and S^{-1} only (measured <= 1.2e-6).
FP32_MAX_REL_ERR = 1e-5
# Newton-Schulz amplifies that rounding along the gradient's weak directions (NS5(G) measured
# 4.4e-5, NS5(M+G) 1e-5); a broken codec or geometry is off by 1e-2 or more.
FP32_MAX_NS_REL_ERR = 1e-3
ERROR_KEYS = ("rel_l2", "whitened_rel_err", "muon_ns_rel_err", "muon_update_rel_err", "optimizer_rel_err",
              "adam_update_rel_err", "adam_metric_rel_err")
METRIC_KEYS = ERROR_KEYS + ("cosine", "max_err_rel", "saturation_rate", "underflow_rate")
# One layer's numbers read two ways (a "mean" and an "rms" of one layer), or per-layer numbers
# against their mean: float64 rounding apart.
AGGREGATE_TOL = 1e-9


def run_fidelity(tmp_path, *extra):
    out = tmp_path / "fidelity.json"
    cmd = [sys.executable, "benchmarks/fidelity.py", *TINY, "--json", str(out), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    for heading in ("Aggregate over all Linear weights", "Per layer, format fp8_e4m3", 'layers: "measured"'):
        assert heading in proc.stdout, proc.stdout[-3000:]
    return json.loads(out.read_text())


def check_common(data, covered):
    """Invariants of either optimizer; ``covered[key]`` is the set of layers a column covers."""
    results = data["results"]
    names = [layer["name"] for layer in data["layers"]]
    for f in FORMATS:
        for g in GEOMETRIES:
            agg, per_layer = results[f][g]["aggregate"], results[f][g]["layers"]
            assert set(per_layer) == set(names)
            for key in METRIC_KEYS:
                assert math.isfinite(agg[key]), (f, g, key, agg[key])
            for key in ERROR_KEYS:  # a lossy format is never exact in any metric
                assert agg[key] > 0, (f, g, key)
                assert {n for n in names if per_layer[n][key] is not None} == covered[key], (f, g, key)
            assert agg["elements_sent"] > 0
            if f.startswith("fp8"):
                bound = KFAC_MAX_REL_ERR if g in KFAC else FP8_MAX_REL_ERR
                assert agg["rel_l2"] < bound, (f, g, agg["rel_l2"])
            # "mean" columns are the plain mean of the per-layer numbers
            for key, how in data["protocol"]["aggregate"].items():
                if how == "mean":
                    values = [per_layer[n][key] for n in covered[key]]
                    assert abs(agg[key] - sum(values) / len(values)) < AGGREGATE_TOL, (f, g, key)
        for g in KFAC:
            auto = data["auto"][f][g]
            assert set(auto["gains_heldout"]) == set(names)
            for key in ERROR_KEYS:
                assert math.isfinite(auto["aggregate"]["auto"][key]), (f, g, key)

    # The reduction itself is exact: fp32 without geometry is bit-exact in every metric, with
    # geometry close.
    for key in ERROR_KEYS:
        assert results["fp32"]["identity"]["aggregate"][key] == 0.0, key
        for g in GEOMETRIES:
            bound = FP32_MAX_NS_REL_ERR if key.startswith("muon") or key == "optimizer_rel_err" else FP32_MAX_REL_ERR
            assert results["fp32"][g]["aggregate"][key] < bound, (g, key)
    for g in KFAC:  # nothing to gain on a lossless wire
        assert data["auto"]["fp32"][g]["selected"] == []

    # More bits, less error: int8 (8 bits per 128) < fp8 e4m3 (3 mantissa bits) < nvfp4 (1).
    err = {f: results[f]["identity"]["aggregate"]["rel_l2"] for f in ("int8", "fp8_e4m3", "nvfp4")}
    assert err["int8"] < err["fp8_e4m3"] < err["nvfp4"], err
    return results


def test_fidelity_smoke_adamw(tmp_path):
    data = run_fidelity(tmp_path, "--damping-mode", "relative", "--selection-metric", "l2")
    names = {layer["name"] for layer in data["layers"]}
    assert {layer["trained_by"] for layer in data["layers"]} == {"adamw"}
    results = check_common(data, {key: names for key in ERROR_KEYS})
    for f in FORMATS:  # AdamW trains every layer: its update is the optimizer column
        agg = results[f]["identity"]["layers"]
        assert all(math.isclose(agg[n]["optimizer_rel_err"], agg[n]["adam_update_rel_err"], rel_tol=AGGREGATE_TOL)
                   for n in names)
    # relative damping: one floor per statistic, 1e-3 of its mean diagonal, not one shared value
    floors = data["damping_floors"]["t1"]
    assert len(set(floors.values())) == len(floors) > 1, floors


def test_fidelity_smoke_muon(tmp_path):
    data = run_fidelity(tmp_path, "--optimizer", "muon", "--plugin-stats", "8")
    by = {layer["name"]: layer["trained_by"] for layer in data["layers"]}
    muon = {n for n, t in by.items() if t == "muon"}
    adam = set(by) - muon
    # DeepSpeed's split: every hidden matrix to Muon, lm_head (and embeddings, no Linear) to AdamW
    assert adam == {"lm_head"}, adam
    covered = {"rel_l2": set(by), "whitened_rel_err": set(by), "optimizer_rel_err": set(by),
               "muon_ns_rel_err": muon, "muon_update_rel_err": muon,
               "adam_update_rel_err": adam, "adam_metric_rel_err": adam}
    results = check_common(data, covered)
    assert data["protocol"]["training"].startswith("Muon"), data["protocol"]["training"]
    # the kfac geometry as the plugin holds and fits it (sketched statistics, Nystrom refits)
    for f in FORMATS:
        agg = results[f]["plugin_s8"]["aggregate"]
        assert all(math.isfinite(agg[key]) and agg[key] > 0 for key in ERROR_KEYS), (f, agg)
    assert results["fp32"]["plugin_s8"]["aggregate"]["rel_l2"] < FP32_MAX_REL_ERR
    for f in FORMATS:
        layers = results[f]["identity"]["layers"]
        for n in by:
            own = "muon_update_rel_err" if by[n] == "muon" else "adam_update_rel_err"
            assert math.isclose(layers[n]["optimizer_rel_err"], layers[n][own], rel_tol=AGGREGATE_TOL), (f, n)
        # Nesterov momentum puts ~0.1 of the fresh gradient into the update, so its error is a
        # fraction of NS5(G)'s (measured 0.2-0.6x); a rule that ignored the momentum would give 1x.
        agg = results[f]["identity"]["aggregate"]
        assert agg["muon_update_rel_err"] < 0.8 * agg["muon_ns_rel_err"], (f, agg)
    # GIFT's point: in the whitened norm a kfac geometry's error is smaller than Euclidean's
    # (nvfp4 measured 0.077-0.089 vs 0.126).
    whitened = {g: results["nvfp4"][g]["aggregate"]["whitened_rel_err"] for g in GEOMETRIES}
    for g in KFAC:
        assert whitened[g] < whitened["identity"], whitened


# The relay needs 3+ ranks; two formats keep it short: fp8 and fp32 (exact but for the sums' order).
RELAY_RUN = ["--preset", "tiny", "--ranks", "4", "--micro", "1", "--seq", "32", "--train-steps", "2",
             "--refresh-interval", "2", "--formats", "fp8_e4m3", "fp32", "--kfac", "structured:8", "structured:32"]


def run_route(tmp_path, *extra):
    out = tmp_path / f"fidelity_{len(extra)}.json"
    proc = subprocess.run([sys.executable, "benchmarks/fidelity.py", *RELAY_RUN, "--json", str(out), *extra],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout, json.loads(out.read_text())


def test_fidelity_smoke_relay(tmp_path):
    from deepspeed_gift.config import GiftConfig
    from deepspeed_gift.zero import _relay_codec

    out, relay = run_route(tmp_path, "--route", "relay")
    _, direct = run_route(tmp_path)
    names = [layer["name"] for layer in relay["layers"]]
    hop = _relay_codec(GiftConfig(format="fp8_e4m3"))  # the default config's second hop (int8/32 today)
    assert hop is not None
    label = f"{hop.name}/{hop.block_size}"
    assert relay["protocol"]["route"] == "relay" and relay["protocol"]["relay_second_hop"]["fp8_e4m3"] == label
    assert "route relay, second hop" in out and label in out, out[:2000]
    assert direct["protocol"]["route"] == "direct" and not direct["protocol"]["relay_second_hop"]
    for f in ("fp8_e4m3", "fp32"):
        for g in ("identity", "kfac_s32"):
            # every layer (owned by one rank) went through the relay, and none did on the direct route
            assert relay["results"][f][g]["aggregate"]["relay_layers"] == len(names), (f, g)
            assert direct["results"][f][g]["aggregate"]["relay_layers"] == 0, (f, g)
    for g in ("identity", "kfac_s32"):
        # fp32 stays exact through both hops (fp32's own codec is its default second hop)
        assert relay["results"]["fp32"][g]["aggregate"]["rel_l2"] < FP32_MAX_REL_ERR, g
        # the same trained model and captures, another path: another fp8 error, still an fp8 error
        r, d = (x["results"]["fp8_e4m3"][g]["aggregate"]["rel_l2"] for x in (relay, direct))
        assert r != d and r < (FP8_MAX_REL_ERR if g == "identity" else KFAC_MAX_REL_ERR), (g, r, d)
    assert relay["losses"] == direct["losses"]


@pytest.mark.parametrize("flags, message", [
    (["--damping", "0"], "--damping > 0"),
    (["--auto-geometry", "kfac_x9"], "--auto-geometry"),
    (["--relay-format", "int8/32"], "--route relay"),
    (["--route", "relay", "--relay-format", "int9"], "--relay-format"),
    (["--route", "relay", "--relay-format", "bf16/32"], "--relay-format bf16/32"),
])
def test_fidelity_rejects_bad_flags(flags, message):
    proc = subprocess.run([sys.executable, "benchmarks/fidelity.py", *TINY, *flags], cwd=ROOT,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode != 0 and message in proc.stderr, proc.stderr[-2000:]
