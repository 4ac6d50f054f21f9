"""DeepSpeed's BF16_Optimizer (bf16 parameters + ZeRO stage 1 + ``data_types.grad_accum_dtype:
"fp32"``, Megatron-DeepSpeed's bf16 recipe) with GIFT. DeepSpeed accumulates the gradients in flat
fp32 buffers and all-reduces them whole after the backward (cast to the communication dtype and
back); GIFT reduces them in balanced rounds instead, each owner's part written back into its fp32
buffer, and takes the gradient norm per partition, then over the ranks. Real engines on gloo ranks."""

import pytest

from launch.spawn import run_ranks
from tests.harness import FP8_KFAC_EF, resumed_as_uninterrupted, train_many

LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1}}
BF16_FP32_ACCUM = dict(stage=1, dtype="bf16", grad_accum_dtype="fp32")
# The norm summed per partition and then over the ranks, against DeepSpeed's per gradient over the
# whole: fp32 sums of ~1e5 squares in another order, each within log2(n) u ~ 17 * 2^-24 ~ 1e-6
# relative (sqrt halves it); 4x that for the squares' own roundings and the cross-rank sum.
NORM_RTOL = 4e-6


@pytest.mark.parametrize("ga", [1, 2])
def test_lossless_gift_equals_deepspeed_bit_for_bit_under_bf16_optimizer(ga):
    # 2 ranks: bf16(x) + bf16(y) summed in fp32 is exact, so its one rounding to bf16 is DeepSpeed's
    # bf16 all-reduce's; the halving is exact. ga=2: the fp32 buffers accumulate two micro-steps.
    base = dict(BF16_FP32_ACCUM, steps=3, ga=ga, bucket=12000)
    native, lossless = run_ranks(train_many, 2, [base, dict(base, gift=LOSSLESS)])[0]
    assert lossless["losses"] == native["losses"] and lossless["digests"] == native["digests"]
    # GIFT's exchange carried the step, in rounds: fp32 payloads and headers
    assert len(lossless["records"]) == 3
    assert all(r["rounds"] > 0 and r["bytes_per_elem"] > 4.0 and r["fidelity_rel_err"] == 0.0
               for r in lossless["records"])
    # the norm from the partitions: DeepSpeed's, to the last bits of another summation order
    assert all(g == pytest.approx(n, rel=NORM_RTOL) for g, n in zip(lossless["grad_norms"], native["grad_norms"]))


def test_clipping_takes_the_norm_of_the_reduced_partitions():
    # gradient_clipping 0.5 clips every step here (the norms are above it): a norm that missed the
    # other ranks' partitions (or summed unreduced gradients) would clip by another factor
    base = dict(BF16_FP32_ACCUM, steps=4, bucket=12000, clip=0.5)
    native, lossless = run_ranks(train_many, 2, [base, dict(base, gift=LOSSLESS)])[0]
    assert all(n > 0.5 for n in native["grad_norms"]), native["grad_norms"]
    assert all(g == pytest.approx(n, rel=NORM_RTOL) for g, n in zip(lossless["grad_norms"], native["grad_norms"]))
    # Adam's update does not change with the gradient's scale (but for eps): the clip factor's last
    # bits move the parameters by ulps at most, and the losses by less than bf16's spacing
    assert lossless["losses"] == pytest.approx(native["losses"], rel=2.0**-8)


def test_fp8_kfac_and_adam_geometry_train_and_resume_exactly(tmp_path):
    adam = dict(FP8_KFAC_EF, geometry={"kind": "adam_factored", "refresh_interval": 2})
    base = dict(BF16_FP32_ACCUM, steps=6, bucket=30000, gift=FP8_KFAC_EF)
    # ga=1: the fp32 buffer holds a bf16 gradient, cast back to bf16 for the exchange: the bits
    # ZeRO-1 with bf16 accumulation reduces, through the same rounds
    zero1 = dict(base, grad_accum_dtype="bf16")
    full, _, same, scaled = resumed_as_uninterrupted(base, str(tmp_path / "ckpt"), 3, [zero1, dict(base, gift=adam)])
    assert full["losses"][-1] < full["losses"][0] - 0.3, full["losses"]
    assert full["version"] >= 2 and full["active"]  # whitened, refreshed
    assert len(full["records"]) == 6 and all(r["rounds"] > 0 for r in full["records"])
    assert all(1.0 < (r["bytes_payload"] + r["bytes_header"]) / r["elements_sent"] < 1.1 for r in full["records"])
    assert full["losses"] == same["losses"] and full["digests"] == same["digests"]
    # Adam's geometry reads BF16_Optimizer's second moment (its fp32 partition's state)
    assert scaled["version"] >= 2 and scaled["kinds"] and set(scaled["kinds"].values()) == {"adam_factored"}
    assert scaled["losses"][-1] < scaled["losses"][0] - 0.3, scaled["losses"]


def test_what_bf16_optimizer_cannot_serve_fails_at_initialize_naming_the_key():
    from tests.harness import initialize_error

    cases = [
        (dict(gift={"format": "fp8_e4m3", "params": {}}), "gift.params: the compressed parameter all-gather"),
        (dict(gift={"format": "fp8_e4m3", "stage1_rounds": False}), "gift.stage1_rounds: got false"),
        (dict(gift={"format": "fp8_e4m3"}, extra={"gradient_predivide_factor": 2.0}),
         "gift.enabled: gradient_predivide_factor 2.0"),
        (dict(gift={"format": "fp8_e4m3"}, optimizer="muon"), "BF16_Optimizer with Muon"),
    ]
    for spec, expected in cases:
        per_rank = run_ranks(initialize_error, 2, dict(BF16_FP32_ACCUM, **spec))
        assert all(expected in message for message in per_rank), (expected, per_rank)


def _full_grads_body(rank, world, specs):
    """After the boundary micro-step's backward (before the step), DeepSpeed's own reader of a
    parameter's whole reduced gradient (``safe_get_full_grad``) for every parameter, per spec."""
    from deepspeed.utils import safe_get_full_grad

    from tests.harness import batches, build_engine

    out = []
    for spec in specs:
        engine = build_engine(spec)
        for i, tokens in enumerate(batches(rank, 2, 2, 32)):
            engine.set_gradient_accumulation_boundary(i == 1)
            engine.backward(engine(input_ids=tokens, labels=tokens).loss)
        out.append({n: safe_get_full_grad(p).clone() for n, p in engine.module.named_parameters()})
        engine.destroy()
    return out


def test_deepspeeds_full_gradient_reader_gives_the_reduced_gradient():
    # GIFT leaves the reduced gradient in each owner's partition of the fp32 buffer (the rest of the
    # buffer holds this rank's own sum); DeepSpeed reads a whole gradient from the owners' fragments
    # (tensor_fragment.get_full_hp_grad), so it gets native's reduced gradient, bit for bit at 2 ranks
    base = dict(BF16_FP32_ACCUM, ga=2, bucket=12000)
    native, lossless = run_ranks(_full_grads_body, 2, [base, dict(base, gift=LOSSLESS)])[0]
    assert native.keys() == lossless.keys()
    assert all(bool((native[n] == lossless[n]).all()) for n in native), \
        [n for n in native if not bool((native[n] == lossless[n]).all())]
