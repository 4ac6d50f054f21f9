"""ZeRO-Offload (``zero_optimization.offload_optimizer: {"device": "cpu"}``) with GIFT: DeepSpeed's
offload path takes each owner's reduced slices from the bucket into its pinned buffers and its
fp32 CPU partition (accumulating across micro-steps there) as it does after its own reduce-scatter,
so GIFT's reduction serves it unchanged. Real engines on gloo ranks, DeepSpeed's CPU optimizer
path (torch's Adam on the host partition)."""

import pytest

from launch.spawn import run_ranks
from tests.harness import FP8_KFAC_EF, resumed_as_uninterrupted, train_many

LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1}}
OFFLOAD = {"offload_optimizer": {"device": "cpu"}}


@pytest.mark.parametrize("stage,overlap", [(2, False), (2, True), (1, False)], ids=["stage2", "stage2-overlap",
                                                                                     "stage1-rounds"])
def test_lossless_gift_equals_deepspeed_bit_for_bit_with_the_optimizer_on_the_host(stage, overlap):
    # 2 ranks: x/2 + y/2 == (x + y)/2 in fp32; ga=2: stage 2 accumulates the reduced micro-steps
    # in the host partition (DeepSpeed's own accumulation), stage 1 reduces in rounds at the boundary
    base = dict(stage=stage, steps=3, ga=2, bucket=12000, overlap=overlap, zero=OFFLOAD)
    native, lossless = run_ranks(train_many, 2, [base, dict(base, gift=LOSSLESS)])[0]
    assert lossless["losses"] == native["losses"] and lossless["digests"] == native["digests"]
    assert len(lossless["records"]) == 3 and all(r["bytes_per_elem"] > 4.0 for r in lossless["records"])
    assert all((r["rounds"] > 0) == (stage == 1) for r in lossless["records"])


def test_fp8_kfac_and_adam_geometry_train_offloaded_and_resume_exactly(tmp_path):
    # Adam's geometry reads the optimizer's second moment, which lives in the host partition here
    adam = dict(FP8_KFAC_EF, geometry={"kind": "adam_factored", "refresh_interval": 2})
    base = dict(stage=2, steps=6, bucket=30000, zero=OFFLOAD, gift=FP8_KFAC_EF)
    # the compressed parameter all-gather (gift.params) takes the replicas DeepSpeed copies back from the host
    params = dict(base, gift=dict(FP8_KFAC_EF, params={"format": "fp8_e4m3"}))
    full, _, same, scaled, gathered, gathered_on_device = resumed_as_uninterrupted(
        base, str(tmp_path / "ckpt"), 3, [dict(base, zero={}), dict(base, gift=adam), params, dict(params, zero={})])
    assert full["losses"][-1] < full["losses"][0] - 0.3, full["losses"]
    assert full["version"] >= 2 and full["active"]
    # telemetry: every step's reduction, FP8 with its block scales and headers
    assert len(full["records"]) == 6
    assert all(1.0 < (r["bytes_payload"] + r["bytes_header"]) / r["elements_sent"] < 1.1 for r in full["records"])
    # the same reduction whether the optimizer runs on the host or the device: the same bits
    assert full["losses"] == same["losses"] and full["digests"] == same["digests"]
    assert scaled["version"] >= 2 and scaled["kinds"] and set(scaled["kinds"].values()) == {"adam_factored"}
    assert scaled["losses"][-1] < scaled["losses"][0] - 0.3, scaled["losses"]
    assert all(1.0 < r["params_bytes_per_elem"] < 1.1 for r in gathered["records"])
    assert gathered["losses"] == gathered_on_device["losses"] and gathered["digests"] == gathered_on_device["digests"]
