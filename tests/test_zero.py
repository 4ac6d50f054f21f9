"""GIFT inside real DeepSpeed ZeRO-1/2 engines on real gloo ranks, compared with
DeepSpeed's own reduction of the same model, data and seed."""

import pytest
import torch

from launch.spawn import run_ranks
from tests.harness import train_many
from tests.spread import assert_within_native_spread, max_param_diff, native_perturbed

# bf16 model: native sums in bf16, GIFT in fp32 then rounds once: losses agree to bf16 noise.
BF16_LOSS_RTOL = 2e-2
# fp32 lossless against native at 3 ranks and more: tests/spread.py (native's own spread).

LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1}}


@pytest.mark.parametrize("stage", [1, 2])
def test_lossless_config_matches_deepspeed_w2(stage):
    # small buckets: many buckets per step, parameters cut by partition boundaries;
    # ga=2: stage 2 reduces every micro step, stage 1 only at the boundary.
    base = dict(stage=stage, steps=3, ga=2, bucket=12000)
    # zero_optimization.reduce_scatter false: DeepSpeed all-reduces the bucket instead; what
    # the optimizer reads (the owner's partition, Muon's whole matrices) is the same, so GIFT's
    # reduce-scatter serves it, and must match it. With parameter_alignment and widths that are
    # not multiples of 4, the flat buffer also holds padding between parameters.
    zero = {"stage": stage, "reduce_bucket_size": 12000, "allgather_bucket_size": 10**6, "overlap_comm": False,
            "contiguous_gradients": True, "reduce_scatter": False, "parameter_alignment": True}
    odd = {"hidden_size": 66, "num_attention_heads": 3, "num_key_value_heads": 3, "intermediate_size": 161}
    all_reduce = dict(base, model=odd, extra={"zero_optimization": zero})
    native, gift, native_ar, gift_ar = run_ranks(train_many, 2, [base, dict(base, gift=LOSSLESS), all_reduce,
                                                                 dict(all_reduce, gift=LOSSLESS)])[0]
    # W=2: x/2 + y/2 == (x + y)/2 in fp32, one addition in any order: the very same bits
    assert gift_ar["losses"] == native_ar["losses"] and max_param_diff(native_ar, gift_ar) == 0.0
    assert gift["losses"] == native["losses"] and max_param_diff(native, gift) == 0.0
    assert len(gift["records"]) == 3  # GIFT reduced every step
    assert all(r["fidelity_rel_err"] == 0.0 for r in gift["records"])
    assert all(r["bytes_per_elem"] > 4.0 for r in gift["records"])  # fp32 payload + headers


@pytest.mark.isa
def test_lossless_config_matches_deepspeed_odd_world():
    # W=3: x/3 + y/3 + z/3 (native) against (x + y + z)/3 (GIFT): another rounding of the division
    # besides another order of the sum, within native's own spread
    base = dict(stage=2, steps=3, bucket=15000)
    results = run_ranks(train_many, 3, [base, native_perturbed(base, 3), dict(base, gift=LOSSLESS)])
    for native, perturbed, gift in results:  # every rank holds the same updated parameters
        assert_within_native_spread(native, perturbed, gift)


@pytest.mark.parametrize("stage", [pytest.param(1, marks=pytest.mark.isa), 2])
def test_lossless_config_under_muon_matches_deepspeed_with_split_matrices(stage):
    # DeepSpeed's Muon orthogonalizes whole matrices: a Muon matrix cut by a partition
    # boundary must reach every owner of a slice whole (native: all-reduce to copy_ranks).
    # Without that, the lossless config drifts from native by ~1e-2 within 5 steps.
    base = dict(stage=stage, steps=5, bucket=20000, optimizer="muon", lr=2e-2)
    for world in (2, 3):
        # world 3: fp32 sums in another order differ from native by ulps, and DeepSpeed's
        # Newton-Schulz in half precision (its default on CPU: fp16) turns ulps of a gradient into
        # ~1e-4 of a parameter within one step, for native itself (a 2^-20 change of one rank's
        # gradient of one matrix moves native by 5.5e-5). In fp32 it keeps them at ulps, so the
        # comparison sees GIFT's reduction and not the iteration's precision.
        spec = base if world == 2 else dict(base, muon_ns_fp32=True)
        specs = [spec, dict(spec, gift=LOSSLESS)] + ([native_perturbed(spec, world)] if world > 2 else [])
        for native, gift, *perturbed in run_ranks(train_many, world, specs):
            assert gift["split_muon"], "the bucket/partition layout no longer splits a Muon matrix"
            assert len(gift["records"]) == 5
            if world == 2:  # x/2 + y/2 == (x + y)/2 in fp32: the very same bits
                assert native["losses"] == gift["losses"]
                assert max_param_diff(native, gift) == 0.0
            else:
                assert_within_native_spread(native, perturbed[0], gift)


# Adam's geometry scales every element by a_i b_j and back by the reciprocals: a few fp32 ulps
# per element on top of the lossless Euclidean path, relative to the parameters' magnitude.
ADAM_SCALING_RTOL = 1e-6
ADAM = dict(LOSSLESS, geometry={"kind": "adam_factored", "refresh_interval": 2})


def _max_rel_param_diff(a, b):
    return max(((a["params"][k] - b["params"][k]).abs().max() / a["params"][k].abs().max().clamp_min(1e-30)).item()
               for k in a["params"])


def _norm_rel_param_diff(a, b):
    diff = sum(float((a["params"][k] - b["params"][k]).double().square().sum()) for k in a["params"])
    ref = sum(float(a["params"][k].double().square().sum()) for k in a["params"])
    return (diff / ref) ** 0.5


@pytest.mark.parametrize("stage", [1, 2])
def test_lossless_config_with_adam_geometry_matches_deepspeed(stage):
    # Cuts through rows are scaled too (elementwise); the row/column sums of exp_avg_sq are
    # all-reduced at each refresh: (out + in + 1) fp32 numbers per weight.
    base = dict(stage=stage, steps=5, ga=2, bucket=12000)
    for world in (2, 3):
        results = run_ranks(train_many, world, [base, dict(base, gift=LOSSLESS), dict(base, gift=ADAM)])
        for native, euclid, adam in results:
            assert [r["geometry_layers"] for r in adam["records"]] == [15] * 5  # scaled from step 1 on
            numbers = sum(p.shape[0] + p.shape[1] + 1 for n, p in adam["params"].items()
                          if p.dim() == 2 and "embed" not in n)
            sums = 2 * (world - 1) * numbers * 4 // world  # what one rank sends in a ring all-reduce
            assert [r["bytes_geometry"] for r in adam["records"]] == [sums, 0, sums, 0, sums]
            assert _norm_rel_param_diff(native, adam) <= ADAM_SCALING_RTOL
            # elementwise: at 2 ranks against native; at 3 against GIFT's Euclidean lossless
            # path, since native's x/3 + y/3 + z/3 already differs from (x + y + z)/3 by more
            assert _max_rel_param_diff(native if world == 2 else euclid, adam) <= ADAM_SCALING_RTOL
            assert adam["losses"] == pytest.approx(native["losses"], rel=1e-6)


def test_adam_geometry_leaves_muon_matrices_euclidean():
    # Muon's matrices have no exp_avg_sq: only the Adam half's Linear (lm_head) is scaled.
    spec = dict(stage=2, steps=3, bucket=20000, optimizer="muon", lr=2e-2,
                gift=dict(LOSSLESS, format="int4", geometry={"kind": "adam_factored", "refresh_interval": 1}))
    (gift,) = run_ranks(train_many, 2, [spec])[0]
    assert [k for k in gift["whitener_digest"]] == ["adam_factored:lm_head"]
    assert [r["geometry_layers"] for r in gift["records"]] == [1, 1, 1]


@pytest.mark.isa
def test_bf16_model_lossless_and_fp8_gift_train():
    base = dict(stage=2, steps=4, dtype="bf16", bucket=30000)
    fp8 = {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 8, "refresh_interval": 2},
           "telemetry": {"every": 1}}
    native, lossless, gift = run_ranks(train_many, 2, [base, dict(base, gift=LOSSLESS), dict(base, gift=fp8)])[0]
    assert lossless["losses"] == pytest.approx(native["losses"], rel=BF16_LOSS_RTOL)
    assert gift["losses"] == pytest.approx(native["losses"], rel=BF16_LOSS_RTOL)
    assert gift["losses"][-1] < gift["losses"][0]
    assert gift["version"] == 2 and len(gift["active"]) == 15


def test_fp8_kfac_w4_ranks_agree_and_error_is_bounded():
    base = dict(stage=2, steps=5, bucket=25000)
    spec = dict(base, gift={"format": "fp8_e4m3", "layers": "measured", "geometry": {"rank": 8, "refresh_interval": 2},
                            "selection": {"min_gain": 0.0}, "telemetry": {"every": 1}})
    results = run_ranks(train_many, 4, [base, spec])
    native0, gift0 = results[0]
    for native, gift in results:
        assert gift["version"] == gift0["version"] == 3  # refreshes at steps 0, 2, 4
        assert gift["whitener_digest"] == gift0["whitener_digest"]  # bit-identical factors
        assert gift["active"] == gift0["active"]
        assert gift["gains"] == gift0["gains"]
    # FP8 e4m3 with 128-element blocks: per-element relative error <= 2^-4; the reduced
    # gradient's relative L2 error stays well under that.
    errs = [r["fidelity_rel_err"] for r in gift0["records"]]
    assert max(errs) < 0.0625, errs
    assert gift0["losses"] == pytest.approx(native0["losses"], rel=1e-2)


def test_world_size_one_runs_and_sends_nothing():
    spec = dict(stage=2, steps=2, gift={"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 4}})
    (gift,) = run_ranks(train_many, 1, [spec])[0]
    assert len(gift["records"]) == 2
    assert all(r["elements_sent"] == 0 and r["bytes_payload"] == 0 for r in gift["records"])
    assert torch.isfinite(torch.tensor(gift["losses"])).all()


def test_detach_restores_deepspeed_exactly():
    # kfac (forward pre-hooks on every linear layer) at fp8, fp8 parameter all-gather (the optimizer
    # step and DeepSpeed's all-gather routed): attached, then detached before step 1; the run must
    # then be DeepSpeed's own to the last bit, with no GIFT hook left on the model.
    gift = {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 8, "refresh_interval": 2},
            "telemetry": {"every": 1}, "params": {"format": "fp8_e4m3"}}
    base = dict(stage=2, steps=3, bucket=20000)
    for native, detached in run_ranks(train_many, 2, [base, dict(base, gift=gift, detach=True)]):
        assert detached["hooks"] == native["hooks"]  # DeepSpeed's own hooks only
        assert "records" not in detached or detached["records"] == []
        assert detached["losses"] == native["losses"] and detached["digests"] == native["digests"]
        assert max_param_diff(native, detached) == 0.0


def _missing_internal_body(rank, world, name):
    import deepspeed_gift
    from tests.harness import build_engine

    engine = build_engine(dict(stage=2, steps=1, bucket=20000, builder="deepspeed",
                               gift={"format": "fp8_e4m3", "layers": "all"}))
    delattr(engine.optimizer, name)  # a DeepSpeed without this internal
    try:
        deepspeed_gift.attach(engine)
    except ValueError as exc:
        return str(exc)
    return ""


def test_a_deepspeed_without_an_internal_gift_reads_fails_at_attach():
    import deepspeed

    for message in run_ranks(_missing_internal_body, 2, "grad_partition_insertion_offset"):
        assert f"DeepSpeed {deepspeed.__version__}" in message
        assert "has no grad_partition_insertion_offset, which GIFT reads" in message


def _errors(world, specs):
    from tests.harness import initialize_error

    return [run_ranks(initialize_error, world, spec) for spec in specs]


def test_unsupported_setups_fail_at_initialize_with_a_message():
    fp8 = {"format": "fp8_e4m3"}
    cases = [
        (dict(stage=0, gift=fp8), "zero_optimization.stage is 0"),
        (dict(stage=2, gift={"geometry": {"rank": 100}}), "gift.geometry.rank: got 100"),
        (dict(stage=2, gift={"layers": ["*.mlp.nothing"]}), "gift.layers"),
        (dict(stage=2, gift={"format": "nvfp4", "block_size": 32}), "gift.block_size"),
        (dict(stage=2, gift={"geometry": {"rank": 8}}, gift_on_rank={"1": {"geometry": {"rank": 4}}}),
         "gift.geometry.rank differs between ranks: rank 0 has 8, rank 1 has 4"),
    ]
    results = _errors(2, [spec for spec, _ in cases])
    for (spec, expected), per_rank in zip(cases, results):
        assert all(expected in message for message in per_rank), (expected, per_rank)


def test_start_step_runs_native_first_and_telemetry_goes_to_jsonl(tmp_path):
    path = str(tmp_path / "gift.jsonl")
    base = dict(stage=2, steps=4, bucket=30000)
    gift = {"format": "fp8_e4m3", "start_step": 2, "layers": "all", "geometry": {"rank": 8},
            "telemetry": {"every": 1, "jsonl": path}}
    native, late = run_ranks(train_many, 2, [base, dict(base, gift=gift)])[0]
    assert late["losses"][:3] == native["losses"][:3]  # steps 0, 1 native; step 2's loss precedes its reduction
    assert late["losses"][3] != native["losses"][3]
    import json

    with open(path) as f:
        records = [json.loads(line) for line in f]
    assert [r["step"] for r in records] == [2, 3]
    assert all(1.03 < (r["bytes_payload"] + r["bytes_header"]) / r["elements_sent"] < 1.05 for r in records)
    assert records[0]["bytes_geometry"] > 0 and records[1]["bytes_geometry"] == 0  # refresh at GIFT step 0 only
    assert all(0 < r["fidelity_rel_err"] < 0.0625 for r in records)
    assert all(r["nonfinite"] == 0 and 0 <= r["underflow_rate"] < 0.5 and r["quantized"] > 0 for r in records)


def test_every_format_trains_with_bounded_error_and_reaches_the_monitor(tmp_path):
    # One bound per format: the reduced gradient's relative L2 error vs an exact reduction.
    # fp8/int8: 3-7 mantissa bits -> ~1e-2; 4-bit formats: ~1e-1; bf16: 2^-9; fp32: only the
    # Hadamard round trip (fp32 rounding).
    bounds = {"fp8_e4m3": 0.06, "fp8_e5m2": 0.12, "int8": 0.02, "nvfp4": 0.3, "int4": 0.3, "bf16": 4e-3, "fp32": 1e-6}
    base = dict(stage=1, steps=3, bucket=40000)
    specs = []
    for fmt in bounds:
        gift = {"format": fmt, "layers": "all", "geometry": {"kind": "hadamard"}, "telemetry": {"every": 1}}
        if fmt == "nvfp4":
            gift.update(error_feedback=True, geometry={"kind": "kfac_input", "rank": 8})
        specs.append(dict(base, gift=gift))
    specs[0]["extra"] = {"csv_monitor": {"enabled": True, "output_path": str(tmp_path), "job_name": "gift"}}
    results = run_ranks(train_many, 2, specs)[0]
    for fmt, r in zip(bounds, results):
        errs = [rec["fidelity_rel_err"] for rec in r["records"]]
        assert len(errs) == 3 and max(errs) <= bounds[fmt], (fmt, errs)
        assert r["losses"][-1] < r["losses"][0], (fmt, r["losses"])
        assert all(rec["nonfinite"] == 0 for rec in r["records"] if "nonfinite" in rec)
    nvfp4 = results[list(bounds).index("nvfp4")]
    assert all(rec["error_feedback_bytes"] > 0 for rec in nvfp4["records"])
    assert all(0.55 < (rec["bytes_payload"] + rec["bytes_header"]) / rec["elements_sent"] < 0.6
               for rec in nvfp4["records"])
    import os

    written = os.listdir(os.path.join(str(tmp_path), "gift"))
    assert "Gift_fidelity_rel_err.csv" in written and "Gift_bytes_per_elem.csv" in written


def test_a_nan_in_one_ranks_gradient_reaches_deepspeed_as_natively():
    # (DeepSpeed's CPU accelerator has no fp16, so loss-scale skipping is a GPU-only check.)
    # A nan injected into one rank's gradient at step 1 must not be hidden by quantization:
    # the run goes non-finite exactly when the native one does, and telemetry counts it.
    poison = {"step": 1, "rank": 1, "param": "model.layers.1.mlp.down_proj.weight"}
    base = dict(stage=2, steps=4, bucket=30000, poison=poison)
    gift = {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 8, "refresh_interval": 2},
            "error_feedback": True, "telemetry": {"every": 1}}
    results = run_ranks(train_many, 2, [base, dict(base, gift=gift)])
    for native, lowp in results:
        assert native["skipped"] == 1  # DeepSpeed saw the nan and skipped the step
        assert lowp["skipped"] == 1  # ... and sees it through GIFT's fp8 path too
        assert all(x == x for x in lowp["losses"])
        assert lowp["losses"] == pytest.approx(native["losses"], rel=1e-3)
    poisoned = [r for res in results for r in res[1]["records"] if r["step"] == 1]
    assert sum(r["nonfinite"] for r in poisoned) > 0
    assert any(r["fidelity_rel_err"] != r["fidelity_rel_err"] for r in poisoned)  # nan, not a finite lie
    for _, lowp in results:  # the skipped step's residuals dropped on every rank, whichever section held the nan
        held = {r["step"]: r["error_feedback_bytes"] for r in lowp["records"]}
        assert held[1] == 0 and held[0] > 0 and held[2] > 0


# The Hadamard rotation and its inverse of a lossless reduction: 2 x log2(block) butterfly levels
# (blocks up to 128 in the tiny Llama) and two 1/sqrt(block) scalings, each within an fp32 ulp
# (u = 2^-24) of the gradient's norm: the reduced gradient's relative L2 error stays below
# depth x u. (Measured: 3.5e-8 - 4.8e-8, under 1 u.)
HADAMARD_ROUNDTRIP_RTOL = (2 * 7 + 2) * 2.0 ** -24


def test_frozen_unused_and_zero_gradients_match_deepspeed():
    # Frozen parameters never enter ZeRO's buckets, an unused layer gets no gradient, and a
    # layer whose gradient is all zeros must stay exactly zero (no nan from a 0/0 scale).
    zero = {"ranks": [0, 1], "param": "model.layers.1.self_attn.v_proj.weight", "scale": 0.0}
    base = dict(stage=2, steps=3, bucket=20000, freeze=["model.layers.0.mlp.*"], unused_layer=True, poison=zero)
    hadamard = dict(LOSSLESS, geometry={"kind": "hadamard"})
    native, euclid, rotated = run_ranks(train_many, 2, [base, dict(base, gift=LOSSLESS), dict(base, gift=hadamard)])[0]
    # two ranks: x/2 + y/2 == (x + y)/2 in fp32, so the Euclidean lossless run is native's, bit for bit
    assert euclid["losses"] == native["losses"] and max_param_diff(native, euclid) == 0.0
    # rotated: each step's reduced gradient within the round trip's ulps (what Adam then makes of
    # them is the Euclidean case's business); frozen and all-zero layers untouched by it, exactly
    assert len(rotated["records"]) == 3
    assert all(0.0 <= r["fidelity_rel_err"] <= HADAMARD_ROUNDTRIP_RTOL for r in rotated["records"]), \
        [r["fidelity_rel_err"] for r in rotated["records"]]
    for name in ("model.layers.1.self_attn.v_proj.weight", "model.layers.0.mlp.up_proj.weight"):
        assert torch.equal(rotated["params"][name], native["params"][name]), name
    assert all(x == x for x in rotated["losses"])


def test_a_vanishing_layer_is_reported_as_underflow():
    # nvfp4 shares one fp32 scale per chunk: a layer 1e-12 times smaller than the rest of its
    # chunk underflows to zero. That must show in telemetry, not pass silently.
    tiny = {"ranks": [0, 1], "param": "model.layers.1.mlp.down_proj.weight", "scale": 1e-12}
    spec = dict(stage=2, steps=2, bucket=10**6, poison=tiny,
                gift={"format": "nvfp4", "geometry": {"kind": "identity"}, "layers": "all",
                      "telemetry": {"every": 1}})
    results = run_ranks(train_many, 2, [spec, dict(spec, poison=None)])
    vanishing = sum(r["underflow"] for res in results for r in res[0]["records"])
    normal = sum(r["underflow"] for res in results for r in res[1]["records"])
    assert vanishing > normal + 10_000  # down_proj has 10,240 elements; most of them now read as zero
