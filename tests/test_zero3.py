"""ZeRO stage 3 with GIFT: DeepSpeed partitions every parameter (rank r owns elements
[r c, (r + 1) c) of each, c = ceil(numel / W)) and reduce-scatters each bucket of full gradients
(``__avg_scatter_grads``: ``reduce_scatter_coalesced``); GIFT replaces that call, each owner's chunk
of every parameter encoded once by every sender, summed in fp32 and divided once. Real engines
(HF Llama, stage 3 partitioning its parameters) on gloo ranks, real text."""

import pytest

from launch.spawn import run_ranks
from tests.harness import FP8_KFAC_EF, initialize_error, resumed_as_uninterrupted, train_many
from tests.spread import assert_within_native_spread, native_perturbed

LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1}}
# SGD for the comparison at 3 ranks: Adam turns the rounding of a cancelling sum into a step of
# order lr on that element (tests/spread.py)
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True}


@pytest.mark.parametrize("dtype,ga,overlap,tile,scatter", [("fp32", 1, False, None, True), ("fp32", 2, True, None, True),
                                                           ("bf16", 2, False, 512, True), ("bf16", 2, False, None, False)],
                         ids=["fp32", "fp32-ga2-overlap", "bf16-ga2-pieces", "bf16-ga2-allreduce"])
def test_lossless_gift_equals_deepspeed_bit_for_bit_under_stage3(dtype, ga, overlap, tile, scatter):
    # 2 ranks: x/2 + y/2 (DeepSpeed divides before its reduce-scatter) == (x + y)/2, one rounding
    # either way, in fp32 and in bf16; ga=2: stage 3 accumulates the reduced partitions; tile 512:
    # a bucket goes in pieces of at most 4 tiles (2048 elements: most parameters alone);
    # reduce_scatter false: DeepSpeed all-reduces the bucket's contiguous buffer and keeps its
    # chunks, padded to the partition's length (__avg_scatter_contiguous_grads)
    base = dict(stage=3, steps=3, ga=ga, bucket=12000, overlap=overlap, dtype=dtype,
                zero={} if scatter else {"reduce_scatter": False})
    gift = LOSSLESS if tile is None else dict(LOSSLESS, tile_elements=tile)
    native, lossless = run_ranks(train_many, 2, [base, dict(base, gift=gift)])[0]
    assert lossless["losses"] == native["losses"] and lossless["digests"] == native["digests"]
    assert len(lossless["records"]) == 3
    assert all(r["bytes_per_elem"] > 4.0 and r["fidelity_rel_err"] == 0.0 for r in lossless["records"])
    # every micro-step's bucket through GIFT, on either of DeepSpeed's paths: rank 0 sends rank 1's
    # chunk (numel - ceil(numel / 2)) of every parameter
    sent = ga * sum(p.numel() - -(-p.numel() // 2) for p in lossless["params"].values())
    assert [r["elements_sent"] for r in lossless["records"]] == [sent] * 3


def test_layers_the_optimizer_is_not_handed_are_left_alone_under_stage3():
    # DeepSpeed's own unit test of empty parameter groups hands the optimizer a part of the model:
    # the other layers' gradients are not reduced by stage 3, and GIFT takes no geometry for them
    base = dict(stage=3, steps=3, bucket=12000, optimize_only=["model.layers.0.*", "lm_head.*"])
    native, lossless = run_ranks(train_many, 2, [base, dict(base, gift=LOSSLESS)])[0]
    assert lossless["losses"] == native["losses"] and lossless["digests"] == native["digests"]
    assert native["losses"][0] != native["losses"][-1]


@pytest.mark.parametrize("scatter", [True, False], ids=["reduce-scatter", "all-reduce"])
def test_lossless_gift_is_within_native_spread_at_three_ranks(scatter):
    # W = 3: chunks of ceil(numel / 3), the last one shorter (padded on DeepSpeed's all-reduce
    # path); GIFT sums 3 ranks in rank order
    base = dict(stage=3, steps=3, bucket=12000, extra=SGD, zero={} if scatter else {"reduce_scatter": False})
    for native, lossless, perturbed in run_ranks(train_many, 3, [base, dict(base, gift=LOSSLESS),
                                                                  native_perturbed(base, 3)]):
        assert_within_native_spread(native, perturbed, lossless)
        assert len(lossless["records"]) == 3


def test_zeropp_hierarchical_partitions_beside_gift_lossless_within_native_spread():
    # ZeRO++'s hpZ (zero_hpz_partition_size 2 of 4): a secondary copy of the parameters
    # partitioned within groups of 2 for the gathers; the gradients still reduce over all 4
    base = dict(stage=3, steps=3, bucket=12000, extra=SGD, zero={"zero_hpz_partition_size": 2})
    for native, lossless, perturbed in run_ranks(train_many, 4, [base, dict(base, gift=LOSSLESS),
                                                                  native_perturbed(base, 4)]):
        assert_within_native_spread(native, perturbed, lossless)
        assert len(lossless["records"]) == 3


def test_fp8_kfac_trains_under_stage3_and_resumes_exactly(tmp_path):
    base = dict(stage=3, steps=6, bucket=30000, gift=FP8_KFAC_EF)
    adam = dict(base, gift=dict(FP8_KFAC_EF, format="nvfp4", geometry={"kind": "adam_factored", "refresh_interval": 2}))
    full, _, scaled = resumed_as_uninterrupted(base, str(tmp_path / "ckpt"), 3, [adam])
    assert full["losses"][-1] < full["losses"][0] - 0.3, full["losses"]
    assert full["version"] >= 2 and full["active"]  # whitened (chunks cut rows: whole rows whitened), refreshed
    # NVFP4 in Adam's geometry: every layer scaled from the partitioned second moment
    assert scaled["version"] >= 2 and len(scaled["kinds"]) == 15 and set(scaled["kinds"].values()) == {"adam_factored"}
    assert scaled["losses"][-1] < scaled["losses"][0] - 0.3, scaled["losses"]
    assert len(full["records"]) == 6
    assert all(1.0 < (r["bytes_payload"] + r["bytes_header"]) / r["elements_sent"] < 1.1 for r in full["records"])


OFFLOAD = {"offload_optimizer": {"device": "cpu"}}


@pytest.mark.parametrize("zero", [OFFLOAD, dict(OFFLOAD, offload_param={"device": "cpu"})],
                         ids=["optimizer", "optimizer-and-params"])
def test_lossless_gift_equals_deepspeed_bit_for_bit_offloaded_under_stage3(zero):
    # the chunks GIFT returns go where DeepSpeed's reduce-scatter's go: its host partition
    # (accumulated there over the 2 micro-steps), the parameters' partitions on the host
    base = dict(stage=3, steps=3, ga=2, bucket=12000, zero=zero)
    native, lossless = run_ranks(train_many, 2, [base, dict(base, gift=LOSSLESS)])[0]
    assert lossless["losses"] == native["losses"] and lossless["digests"] == native["digests"]
    assert len(lossless["records"]) == 3


@pytest.mark.slow
def test_lossless_gift_equals_deepspeed_bit_for_bit_with_a_partial_offload_under_stage3():
    # ZeRO-Offload++ (offload_optimizer.ratio 0.5): half the sub-groups stepped on the host by
    # DeepSpeedCPUAdam (its C++ op builds on first use, ~100 s: slow), the rest by a second
    # optimizer on the device. A Euclidean block reads neither's state and is served; GIFT's
    # geometry reads Adam's and is refused (test_stage3_offloads_gift_does_not_read_are_refused_...)
    # sub-groups of 20000 elements: several, the first half stepped by the accelerator's optimizer
    zero = {"offload_optimizer": {"device": "cpu", "ratio": 0.5}, "sub_group_size": 20000}
    base = dict(stage=3, steps=3, ga=2, bucket=12000, zero=zero, extra={"optimizer": {"type": "Adam",
                                                                                   "params": {"lr": 3e-3}}})
    native, lossless = run_ranks(train_many, 2, [base, dict(base, gift=LOSSLESS)], timeout=900)[0]
    assert lossless["losses"] == native["losses"] and lossless["digests"] == native["digests"]
    assert len(lossless["records"]) == 3


def test_fp8_kfac_and_adam_geometry_offloaded_under_stage3_resume_exactly(tmp_path):
    # Adam's geometry reads the second moment from the host partition
    base = dict(stage=3, steps=6, bucket=30000, zero=OFFLOAD, gift=FP8_KFAC_EF)
    adam = dict(base, gift=dict(FP8_KFAC_EF, geometry={"kind": "adam_factored", "refresh_interval": 2}))
    full, _, on_device, scaled = resumed_as_uninterrupted(base, str(tmp_path / "ckpt"), 3,
                                                          [dict(base, zero={}), adam])
    assert full["losses"][-1] < full["losses"][0] - 0.3, full["losses"]
    assert full["version"] >= 2 and full["active"]
    # the same reduction whether the optimizer runs on the host or beside the model: the same bits
    assert full["losses"] == on_device["losses"] and full["digests"] == on_device["digests"]
    assert len(scaled["kinds"]) == 15 and set(scaled["kinds"].values()) == {"adam_factored"}
    assert scaled["losses"][-1] < scaled["losses"][0] - 0.3, scaled["losses"]


# Adam's geometry scales every element by a_i b_j and back by the reciprocals: a few fp32 ulps
# per element on top of the lossless Euclidean path (tests/test_zero.py's bound)
ADAM_SCALING_RTOL = 1e-6
ADAM = dict(LOSSLESS, geometry={"kind": "adam_factored", "refresh_interval": 2})


def _rel_param_diff(a, b):
    diff = sum(float((a["params"][k] - b["params"][k]).double().square().sum()) for k in a["params"])
    return (diff / sum(float(a["params"][k].double().square().sum()) for k in a["params"])) ** 0.5


def test_lossless_config_with_adam_geometry_matches_deepspeed_under_stage3():
    # each rank sums the rows and columns of its chunk of every layer's exp_avg_sq (chunks cut
    # rows); one all-reduce of (out + in + 1) fp32 numbers per weight at each refresh
    base = dict(stage=3, steps=5, ga=2, bucket=12000)
    native, adam = run_ranks(train_many, 2, [base, dict(base, gift=ADAM)])[0]
    assert [r["geometry_layers"] for r in adam["records"]] == [15] * 5
    numbers = sum(p.shape[0] + p.shape[1] + 1 for n, p in adam["params"].items() if p.dim() == 2 and "embed" not in n)
    sums = numbers * 4  # what one of 2 ranks sends in a ring all-reduce
    assert [r["bytes_geometry"] for r in adam["records"]] == [sums, 0, sums, 0, sums]
    assert _rel_param_diff(native, adam) <= ADAM_SCALING_RTOL
    assert adam["losses"] == pytest.approx(native["losses"], rel=1e-6)


def _partitioned_state_body(rank, world, spec):
    """After two steps, GIFT's view of stage 3's partitioned Adam state against the whole state
    DeepSpeed gathers itself (``safe_get_full_optimizer_state``): the row and column sums over all
    ranks, and each rank's slice of the moments in the optimizer's metric."""
    import torch

    from deepspeed.utils import safe_get_full_optimizer_state
    from deepspeed_gift.core.geometry import row_col_sums
    from tests.harness import batches, build_engine

    engine = build_engine(spec)
    for tokens in batches(rank, 2, 2, 32):
        out = engine(input_ids=tokens, labels=tokens)
        engine.backward(out.loss)
        engine.step()
    state = engine.gift.optimizer_state
    worst_sums, worst_slice, covered = 0.0, 0.0, {}
    for name, module in sorted(state.modules.items()):
        full_v = safe_get_full_optimizer_state(module.weight, "exp_avg_sq").double()
        full_m = safe_get_full_optimizer_state(module.weight, "exp_avg").double()
        rows, cols = row_col_sums(full_v.reshape(-1), 0, full_v.shape)
        got_rows, got_cols, numel = state.second_moment_sums(name)
        total = torch.cat([got_rows, got_cols, torch.tensor([float(numel)], dtype=torch.float64)])
        torch.distributed.all_reduce(total)
        covered[name] = int(total[-1]) == full_v.numel()
        expected = torch.cat([rows, cols])
        worst_sums = max(worst_sums, float((total[:-1] - expected).abs().max() / expected.abs().max()))
        rule = state.update_rule(name)
        flat_v, flat_m = full_v.reshape(-1), full_m.reshape(-1)
        part = slice(rule.start, rule.start + rule.exp_avg_sq.numel())
        assert rule.start == rank * -(-full_v.numel() // world)
        worst_slice = max(worst_slice, float((rule.exp_avg_sq.double() - flat_v[part]).abs().max()),
                          float((rule.exp_avg.double() - flat_m[part]).abs().max()))
    return worst_sums, worst_slice, covered


def test_stage3_partitioned_adam_state_is_read_where_deepspeed_keeps_it():
    # 3 ranks: chunks of ceil(numel / 3) at their offsets in each sub-group's fp32 partition
    spec = dict(stage=3, bucket=12000, gift=dict(LOSSLESS, geometry={"kind": "identity"}))
    for worst_sums, worst_slice, covered in run_ranks(_partitioned_state_body, 3, spec):
        assert len(covered) == 15 and all(covered.values()), covered
        assert worst_slice == 0.0  # the very elements DeepSpeed holds
        # float64 sums of the same fp32 values in another order: ~1e-16 relative
        assert worst_sums < 1e-12, worst_sums


def test_what_stage3_with_gift_does_not_serve_fails_at_initialize_naming_the_key():
    fp8 = {"format": "fp8_e4m3"}
    cases = [
        (dict(gift=fp8, zero={"zero_quantized_gradients": True}), "zero_optimization.zero_quantized_gradients"),
        (dict(gift=dict(fp8, params={})), "gift.params: under ZeRO stage 3"),
    ]
    for spec, expected in cases:
        per_rank = run_ranks(initialize_error, 2, dict(stage=3, **spec))
        assert all(expected in message for message in per_rank), (expected, per_rank)


def test_a_stage3_engine_without_an_optimizer_is_refused_at_initialize():
    # stage 3 then builds only its parameter partitioner (DeepSpeedZeRoOffload; stage 1/2 refuse
    # to run without an optimizer themselves): no gradient reduction for GIFT to replace, which it
    # says rather than leave the gift block without effect
    per_rank = run_ranks(initialize_error, 2, dict(stage=3, optimizer="none", gift={"format": "fp8_e4m3"}))
    assert all("gift.enabled: this engine has no optimizer (DeepSpeed built DeepSpeedZeRoOffload)" in message
               for message in per_rank), per_rank


@pytest.mark.parametrize("zero,expected", [
    ({"offload_optimizer": {"device": "nvme", "nvme_path": "nvme"}}, "zero_optimization.offload_optimizer.device: 'nvme'"),
    ({"offload_param": {"device": "nvme", "nvme_path": "nvme"}}, "zero_optimization.offload_param.device: 'nvme'"),
    ({"offload_optimizer": {"device": "cpu", "ratio": 0.5}}, "zero_optimization.offload_optimizer.ratio: 0.5"),
    ({"offload_optimizer": {"device": "cpu", "super_offload": True}}, "offload_optimizer.super_offload: true"),
], ids=["nvme-optimizer", "nvme-params", "partial", "super-offload"])
def test_stage3_offloads_gift_does_not_read_are_refused_naming_the_key(zero, expected):
    """Offloads that keep Adam's state where GIFT does not read it, checked on DeepSpeed's own parsed
    ``zero_optimization`` (an engine with them needs the aio op, or DeepSpeedCPUAdam's C++ build);
    the host offload passes the same check (and runs: the tests above)."""
    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig

    from deepspeed_gift.zero import _check_stage3_offload

    class Engine:  # the two accessors DeepSpeed's engine gives, over its parsed config
        def __init__(self, block):
            self.config = DeepSpeedZeroConfig(stage=3, **block)

        def zero_offload_optimizer(self):
            return self.config.offload_optimizer

        def zero_offload_param(self):
            return self.config.offload_param

    with pytest.raises(ValueError, match=expected.replace(".", r"\.")):
        _check_stage3_offload(Engine(zero))
    _check_stage3_offload(Engine({"offload_optimizer": {"device": "cpu"}, "offload_param": {"device": "cpu"}}))
    if "ratio" in str(zero):  # a Euclidean block reads no optimizer state: a partial offload serves it
        _check_stage3_offload(Engine(zero), reads_optimizer_state=False)
