"""Adam's geometry (``geometry.kind: "adam_factored"``): the pure scaling, its use on ZeRO
slices that cut rows, and what it buys in the error of Adam's update."""

import pytest
import torch

from deepspeed_gift.core import formats
from deepspeed_gift.core import geometry as geo
from deepspeed_gift.core import metrics
from deepspeed_gift.exchange.plan import GEO, ParamSlice, split_slice_rows
from deepspeed_gift.exchange.reducer import GiftReducer
from launch.spawn import run_ranks

F32_EPS = torch.finfo(torch.float32).eps
# invert(apply(x)) multiplies by a_i, b_j, then by their reciprocals: four roundings.
ROUNDTRIP_RTOL = 4 * F32_EPS


def _second_moment(out_dim, width, seed=0):
    """A second moment with the structure Adam's has: rows and columns of very different scale."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.logspace(-3, 1, out_dim)[torch.randperm(out_dim, generator=g)]
    cols = torch.logspace(-2, 2, width)[torch.randperm(width, generator=g)]
    noise = torch.rand(out_dim, width, generator=g) * 0.5 + 0.75
    return torch.outer(rows, cols) * noise


def test_row_col_sums_of_slices_add_up_to_the_whole_matrix():
    v = _second_moment(7, 5)
    rows, cols = geo.row_col_sums(v.reshape(-1), 0, v.shape)
    torch.testing.assert_close(rows, v.double().sum(1))
    torch.testing.assert_close(cols, v.double().sum(0))
    # ZeRO-style cuts through rows: partial first row, whole rows, partial last row
    r_sum, c_sum = torch.zeros_like(rows), torch.zeros_like(cols)
    for lo, hi in ((0, 3), (3, 17), (17, 19), (19, 35)):
        r, c = geo.row_col_sums(v.reshape(-1)[lo:hi], lo, v.shape)
        r_sum += r
        c_sum += c
    torch.testing.assert_close(r_sum, rows, rtol=1e-12, atol=0)
    torch.testing.assert_close(c_sum, cols, rtol=1e-12, atol=0)
    with pytest.raises(ValueError, match="outside a 7 x 5 matrix"):
        geo.row_col_sums(v.reshape(-1)[:10], 30, v.shape)


def test_factored_scaling_is_adafactors_factorization_of_v():
    v = _second_moment(12, 9).double()
    rows, cols = geo.row_col_sums(v.reshape(-1), 0, v.shape)
    scaling = geo.factored_scaling_from_sums(rows, cols)
    mu = v.mean()
    v_hat = torch.outer(v.mean(1), v.mean(0)) / mu  # Adafactor: r c^T / mean(v)
    expected = (mu / v_hat).sqrt()
    G = torch.randn(12, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(scaling.apply(G.float()).double(), G * expected, rtol=1e-6, atol=0)
    # Coordinates keep the gradient's overall scale when E[G^2] = v. Taken in expectation,
    # not on one draw: v spans eight decades, so one sample's norm is set by a few entries.
    energy_ratio = float(((v * expected**2).sum() / v.sum()).sqrt())
    assert energy_ratio == pytest.approx(1.0, rel=0.05)


def test_runs_transform_like_the_whole_weight_and_invert_within_ulps():
    v = _second_moment(6, 10)
    scaling = geo.factored_scaling_from_sums(*geo.row_col_sums(v.reshape(-1), 0, v.shape))
    G = torch.randn(6, 10)
    whole = scaling.apply(G).reshape(-1)
    runs = [(0, 4), (4, 30), (30, 33), (33, 60)]
    parts = torch.cat([scaling.apply_run(G.reshape(-1)[lo:hi], lo) for lo, hi in runs])
    assert torch.equal(parts, whole)  # a slice is scaled bit for bit as in the whole weight
    back = torch.cat([scaling.invert_run(whole[lo:hi], lo) for lo, hi in runs])
    torch.testing.assert_close(back, G.reshape(-1), rtol=ROUNDTRIP_RTOL, atol=0)
    assert scaling.run_unit == 1 and scaling.metadata_nbytes() == (6 + 10) * 4
    with pytest.raises(ValueError, match="outside the 6 x 10 weight"):
        scaling.apply_run(G.reshape(-1)[:5], 58)


def test_no_state_means_no_scaling_and_bad_sums_are_refused():
    assert geo.factored_scaling_from_sums(torch.zeros(4), torch.zeros(3)) is None
    with pytest.raises(ValueError, match="not finite"):
        geo.factored_scaling_from_sums(torch.tensor([1.0, float("nan")]), torch.ones(3))
    with pytest.raises(ValueError, match="negative"):
        geo.factored_scaling_from_sums(torch.tensor([1.0, -1.0]), torch.ones(3))
    # a dead row is floored, not infinite
    s = geo.factored_scaling_from_sums(torch.tensor([0.0, 2.0, 2.0]), torch.ones(2) * 2)
    assert bool(torch.isfinite(s.row).all()) and float(s.row[0]) == pytest.approx(1e4, rel=1e-3)


def _adam_rule(v, seed=1):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(v.shape, generator=g) * v.sqrt() * 0.3
    return metrics.AdamRule(exp_avg=m, exp_avg_sq=v, step=50, betas=(0.9, 0.95))


@pytest.mark.parametrize("fmt,at_most", [("int4", 0.4), ("nvfp4", 0.6)])
def test_adam_update_error_falls_at_four_bits(fmt, at_most):
    # A gradient whose scale follows its second moment, as Adam's does: Euclidean blocks mix
    # large and small coordinates, and Adam divides the small ones' error by a small sqrt(v).
    v = _second_moment(64, 256)
    g = torch.Generator().manual_seed(2)
    G = torch.randn(64, 256, generator=g) * v.sqrt()
    scaling = geo.factored_scaling_from_sums(*geo.row_col_sums(v.reshape(-1), 0, v.shape))
    euclid, adam = metrics.judge_geometry(G, formats.get_format(fmt), scaling, rule=_adam_rule(v))
    assert adam["rule_kind"] == "adam"
    assert adam["optimizer"] <= at_most * euclid["optimizer"], (euclid, adam)


SHAPE = (25, 37)  # 2 or 3 equal partitions cut through rows


def _slices(world, shape):
    numel = shape[0] * shape[1]
    bounds = [round(numel * j / world) for j in range(world + 1)]
    return [ParamSlice(d, bounds[d], bounds[d + 1] - bounds[d], bounds[d], 0, 1, GEO) for d in range(world)]


def _reduce_body(rank, world, fmt, scaled):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm

    dist.init_process_group("gloo")
    shape = SHAPE
    v = _second_moment(*shape)
    slices = _slices(world, shape)
    transforms = {0: geo.factored_scaling_from_sums(*geo.row_col_sums(v.reshape(-1), 0, shape))} if scaled else {}
    grads = [(torch.randn(shape, generator=torch.Generator().manual_seed(10 + r)) * v.sqrt()).reshape(-1)
             for r in range(world)]
    bucket = grads[rank].clone()
    reducer = GiftReducer(TorchComm(), formats.get_format(fmt))
    if scaled:
        reducer.reduce(bucket, slices, transforms, divisor=world, step=1)
    else:
        plain = [ParamSlice(s.dst, s.bucket_offset, s.numel, s.param_offset, 0) for s in slices]
        reducer.reduce(bucket, plain, {}, divisor=world, step=1)
    exact = torch.stack(grads).sum(0) / world
    s = slices[rank]
    return (s.param_offset, bucket[s.bucket_offset:s.bucket_offset + s.numel].clone(),
            exact[s.bucket_offset:s.bucket_offset + s.numel], v.reshape(-1)[s.bucket_offset:s.bucket_offset + s.numel])


def test_slices_that_cut_rows_are_scaled_whole_and_reduce_exactly_in_fp32():
    for s in _slices(3, SHAPE)[1:]:
        assert s.param_offset % SHAPE[1]  # the cuts go through rows
        assert split_slice_rows(s) == [(0, s.numel, s.numel)]  # one transformed run, partial rows included
    for world in (2, 3):
        for start, got, exact, _ in run_ranks(_reduce_body, world, "fp32", True):
            # a few ulps of the summands (a cancelling sum has a larger relative error per element)
            assert float((got - exact).norm() / exact.norm()) < ROUNDTRIP_RTOL


def test_reduced_slices_err_less_in_adams_metric_at_int4():
    def adam_err(per_rank):
        got = torch.cat([g for _, g, _, _ in per_rank])
        exact = torch.cat([e for _, _, e, _ in per_rank])
        v = torch.cat([v for _, _, _, v in per_rank])
        return float(((got - exact) / v.sqrt()).norm() / (exact / v.sqrt()).norm())

    scaled = adam_err(run_ranks(_reduce_body, 3, "int4", True))
    plain = adam_err(run_ranks(_reduce_body, 3, "int4", False))
    assert scaled < 0.5 * plain, (scaled, plain)


def test_a_slice_rule_is_judged_on_its_rows_alone_with_the_same_update_error():
    """A layer whose Adam state this rank holds for a ZeRO slice is judged on the rows that slice
    covers (``selection.rows_of_slice``): the update error is the one judging the whole layer
    gives (the codec's blocks and every transform act on whole rows alike), from ~1/W of it."""
    from deepspeed_gift.selection import rows_of_slice

    out_dim, width = 64, 256
    v = _second_moment(out_dim, width)
    g = torch.Generator().manual_seed(5)
    G = torch.randn(out_dim, width, generator=g) * v.sqrt()
    start, numel = 9 * width + 40, 20 * width  # a slice starting and ending inside rows
    whole_rule = _adam_rule(v.reshape(-1)[start:start + numel].clone())
    whole_rule = metrics.AdamRule(exp_avg=whole_rule.exp_avg, exp_avg_sq=whole_rule.exp_avg_sq, step=50,
                                  betas=(0.9, 0.95), start=start)
    basis = torch.linalg.qr(torch.randn(width, 4, generator=g)).Q
    kfac = geo.whitener_from_low_rank(geo.LowRankDiag(U=basis, lam=torch.tensor([9.0, 5.0, 3.0, 2.0]),
                                                      d=torch.rand(width, generator=g) + 0.5), "structured")
    scaling = geo.factored_scaling_from_sums(*geo.row_col_sums(v.reshape(-1), 0, v.shape))
    transforms = {"kfac_input": kfac, "adam_factored": scaling}
    codec = formats.get_format("fp8_e4m3", block_size=128)
    rows, rule, blocks = rows_of_slice(G, whole_rule, transforms)
    assert rows.shape == (21, width) and rule.start == 40  # rows 9..29, the slice 40 elements into row 9
    whole = metrics.judge_geometries(G, codec, transforms, rule=whole_rule)
    cut = metrics.judge_geometries(rows, codec, blocks, rule=rule)
    for kind in transforms:
        for side in (0, 1):  # Euclidean, then the geometry
            # the same elements through the same arithmetic; a whitener's BLAS blocking may differ
            # with the row count (a few fp32 ulps of the update, whose error is ~1e-2)
            assert cut[kind][side]["optimizer"] == pytest.approx(whole[kind][side]["optimizer"], rel=1e-4)
    # Muon's rule (the whole matrix) and no rule leave the layer whole
    assert rows_of_slice(G, None, transforms)[0] is G


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "int4"])
def test_a_layer_judged_a_tile_of_rows_at_a_time_gets_the_whole_layers_errors(fmt):
    """Judged in blocks of rows (``tile_rows``; Adam's rule cut to each block's part of its
    slice, transforms placed by row), every error is the whole layer's: the squared sums add up
    over the blocks (block scales lie within rows)."""
    from deepspeed_gift.selection import rows_of_slice

    out_dim, width = 64, 256
    v = _second_moment(out_dim, width)
    g = torch.Generator().manual_seed(7)
    G = torch.randn(out_dim, width, generator=g) * v.sqrt()
    start, numel = 5 * width + 40, 30 * width
    base = _adam_rule(v.reshape(-1)[start:start + numel].clone())
    rule = metrics.AdamRule(exp_avg=base.exp_avg, exp_avg_sq=base.exp_avg_sq, step=50, betas=(0.9, 0.95), start=start)
    basis = torch.linalg.qr(torch.randn(width, 4, generator=g)).Q
    kfac = geo.whitener_from_low_rank(geo.LowRankDiag(U=basis, lam=torch.tensor([9.0, 5.0, 3.0, 2.0]),
                                                      d=torch.rand(width, generator=g) + 0.5), "structured")
    scaling = geo.factored_scaling_from_sums(*geo.row_col_sums(v.reshape(-1), 0, v.shape))
    transforms = {"kfac_input": kfac, "adam_factored": scaling}
    codec = formats.get_format(fmt, block_size=128)
    for judged_rule in (rule, None):
        whole = metrics.judge_geometries(G, codec, transforms, rule=judged_rule)
        tiled = metrics.judge_geometries(G, codec, transforms, rule=judged_rule, tile_rows=7)
        for kind in transforms:
            for side in (0, 1):
                # float64 sums in another order: equal to 1e-9, except that a fitted whitener's
                # products round a row's last bit by the row count of the call (BLAS blocking),
                # which flips elements that sit on a rounding boundary of the format (measured
                # 0.12% of the Adam-metric error with blocks of 7 rows, 0 with 8)
                rel = WHITENER_ROWS_REL if kind == "kfac_input" else 1e-9
                for m in metrics.METRICS:
                    assert tiled[kind][side][m] == pytest.approx(whole[kind][side][m], rel=rel), (kind, side, m)
    # and after the cut to the slice's rows, as the plugin judges it
    rows, cut_rule, blocks = rows_of_slice(G, rule, transforms)
    cut = metrics.judge_geometries(rows, codec, blocks, rule=cut_rule, tile_rows=4)
    whole = metrics.judge_geometries(G, codec, transforms, rule=rule)
    for kind in transforms:
        rel = WHITENER_ROWS_REL if kind == "kfac_input" else 1e-9
        assert cut[kind][1]["optimizer"] == pytest.approx(whole[kind][1]["optimizer"], rel=rel)


WHITENER_ROWS_REL = 1e-2


JUDGE_UNDER_TF32_SCRIPT = """
from types import SimpleNamespace

import torch
from deepspeed_gift.core import formats
from deepspeed_gift.selection import Selection

torch.backends.fp32_precision = "tf32"  # what transformers 5 sets for tf32=True
seen = set()


class Probe:
    version, run_unit = 0, 1

    def apply(self, G):
        seen.add((torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision))
        return G.clone()

    invert = apply


sel = Selection(SimpleNamespace(tile_elements=1 << 24), ("kfac_input",), ["l"], None, formats.get_format("fp8_e4m3"))
sel.judge_captured("l", torch.randn(8, 16), None, {"kfac_input": Probe()})
print(sorted(seen), torch.backends.cuda.matmul.fp32_precision, "l" in sel.judged_rows)
"""


def test_a_layer_is_judged_in_full_fp32_under_the_new_tf32_api():
    import os
    import subprocess
    import sys

    proc = subprocess.run([sys.executable, "-c", JUDGE_UNDER_TF32_SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[('ieee', 'ieee')] tf32 True"  # full fp32 inside, restored
