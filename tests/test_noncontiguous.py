"""``zero_optimization.contiguous_gradients: false``: DeepSpeed keeps each gradient in its own
tensor and reduces a bucket by an all-reduce of their flattened copy (``buffered_reduce_fallback``),
copied back into each. GIFT reduces the flattened copy as a bucket instead; what DeepSpeed reads
afterwards (each rank's partition of the gradients) is the same. Real engines on gloo ranks."""

import pytest

from launch.spawn import run_ranks
from tests.harness import FP8_KFAC_EF, resumed_as_uninterrupted, train_many

LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1}}
SCATTERED = {"contiguous_gradients": False}


@pytest.mark.parametrize("stage,overlap,rounds", [(2, False, True), (2, True, True), (1, False, True),
                                                  (1, False, False), (1, True, False)],
                         ids=["stage2", "stage2-overlap", "stage1-rounds", "stage1-buckets", "stage1-overlap"])
def test_lossless_gift_equals_deepspeed_bit_for_bit_with_scattered_gradients(stage, overlap, rounds):
    # 2 ranks: x/2 + y/2 (DeepSpeed divides before its all-reduce) == (x + y)/2 in fp32: the same
    # bits. ga=2: stage 2 reduces every micro step, into gradients it then accumulates into.
    base = dict(stage=stage, steps=3, ga=2, bucket=12000, overlap=overlap, zero=SCATTERED)
    gift = dict(LOSSLESS, stage1_rounds=rounds)
    native, lossless = run_ranks(train_many, 2, [base, dict(base, gift=gift)])[0]
    assert lossless["losses"] == native["losses"]
    assert lossless["digests"] == native["digests"]
    assert len(lossless["records"]) == 3 and all(r["fidelity_rel_err"] == 0.0 for r in lossless["records"])
    # GIFT's exchange carried every gradient: fp32 payload and headers, once a step (stage 1 with
    # its rounds: rounds, not buckets)
    assert all(r["bytes_per_elem"] > 4.0 for r in lossless["records"])
    assert all((r["rounds"] > 0) == (stage == 1 and rounds and not overlap) for r in lossless["records"])


def test_fp8_kfac_trains_with_scattered_gradients_and_resumes_exactly(tmp_path):
    base = dict(stage=2, steps=6, bucket=30000, overlap=True, zero=SCATTERED, gift=FP8_KFAC_EF)
    full, _, same = resumed_as_uninterrupted(base, str(tmp_path / "ckpt"), 3,
                                             [dict(base, zero={"contiguous_gradients": True})])
    assert full["losses"][-1] < full["losses"][0] - 0.3, full["losses"]
    assert full["version"] >= 2 and full["active"]  # whitened, refreshed
    # telemetry records every step's reduction: FP8 with its block scales and headers
    assert len(full["records"]) == 6, full["records"]
    assert all(1.0 < (r["bytes_payload"] + r["bytes_header"]) / r["elements_sent"] < 1.1 for r in full["records"])
    # the buckets hold the same gradients in the same order whether they share a buffer or not:
    # the same reduction, the same bits
    assert full["losses"] == same["losses"] and full["digests"] == same["digests"]
