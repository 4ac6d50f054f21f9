"""GIFT's input statistics: the shared hook class (token subsample, shared inputs) and its
presence on the model only on collect steps, in a real DeepSpeed engine."""

import torch
from torch import nn

from deepspeed_gift.statistics import InputMoments, subsample_tokens
from launch.spawn import run_ranks


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.o = nn.Linear(6, 4), nn.Linear(6, 4), nn.Linear(4, 3)

    def forward(self, x):
        return self.o(self.q(x) * self.k(x))


def test_moments_of_a_strided_token_subsample_with_shared_inputs():
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(3, 4, 6)  # 12 tokens
    for limit, stride in ((None, 1), (5, 3), (12, 1), (1, 12)):
        moments = InputMoments({"q": block.q, "k": block.k, "o": block.o}, limit)
        moments.attach()
        block(x)
        got = moments.take()
        assert moments.key_of == {"q": "q", "k": "q", "o": "o"}  # q and k read one tensor: one statistic
        rows = x.reshape(-1, 6)[::stride]
        torch.testing.assert_close(got["q"], rows.T @ rows / rows.shape[0])
        with torch.no_grad():  # (the hooks skip forwards without gradients: evaluation)
            hidden = (block.q(x) * block.k(x)).reshape(-1, 4)[::stride]
        assert moments.take() == {}
        torch.testing.assert_close(got["o"], hidden.T @ hidden / hidden.shape[0])
        moments.detach()
        block(x)
        assert moments.take() == {} and not block.q._forward_pre_hooks
    assert subsample_tokens(x.reshape(-1, 6), 4).shape[0] == 4  # ceil(12 / 4) = 3: rows 0, 3, 6, 9
    assert subsample_tokens(x.reshape(-1, 6), 5).shape[0] == 4  # stride ceil(12 / 5) = 3 never exceeds the cap


def test_activation_recomputation_counts_each_module_once_per_forward():
    # torch.utils.checkpoint runs the block's forward again in the backward: non-reentrant with
    # gradients on both times, reentrant with the first under no_grad; either way each module's
    # statistic must be what one forward without recomputation gives (before: twice the tokens
    # under non-reentrant checkpointing)
    from torch.utils.checkpoint import checkpoint

    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(3, 4, 6, requires_grad=True)

    def statistics(run, pipelined=False):
        moments = InputMoments({"q": block.q, "k": block.k, "o": block.o})
        moments.attach()
        losses = []
        for _ in range(2):  # two micro-batches of one step
            moments.new_forward()  # what the model's forward pre-hook does (GiftState.on_forward)
            losses.append(run().sum())
            if not pipelined:
                losses.pop().backward()
        for loss in losses:  # a pipeline's cool-down: backwards one after the other, no forward between
            loss.backward()
        counts = dict(moments.counts)
        moments.detach()
        return counts, moments.take()

    plain = statistics(lambda: block(x))
    assert plain[0] == {"q": 24, "o": 24}
    for reentrant in (False, True):
        for pipelined in (False, True):
            got = statistics(lambda: checkpoint(block, x, use_reentrant=reentrant), pipelined)
            assert got[0] == plain[0], (reentrant, pipelined, got[0])
            for key in plain[1]:
                torch.testing.assert_close(got[1][key], plain[1][key], rtol=0, atol=0)
    twice = statistics(lambda: block(x) + block(x))  # a module called twice in a forward counts twice
    assert twice[0] == {"q": 48, "o": 48}


# an fp32 x^T x over 256 tokens: each entry a sum of 256 products, whose rounding stays within
# 256 u of the sum of |products| at worst and ~log2(256) u in BLAS's blocked order; the largest
# entry is a sum of squares, so 2^-18 = 64 u of it is a bound of fp32's sums (measured 2.3e-7,
# ~4 u), far below the 2^-9 or so of bf16 autocast, which the hook computed in before
FP32_MOMENT_RTOL = 2.0**-18


def test_moments_are_fp32_under_bf16_autocast():
    torch.manual_seed(0)
    layer = nn.Linear(64, 8)
    x = torch.randn(256, 64)
    moments = InputMoments({"l": layer})
    moments.attach()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        layer(x.clone().requires_grad_())
    got = moments.take()["l"]
    exact = (x.double().T @ x.double() / x.shape[0])
    assert got.dtype == torch.float32
    err = float((got.double() - exact).abs().max() / exact.abs().max())
    assert err < FP32_MOMENT_RTOL, err


def _hooks_per_step(rank, world, spec):
    from tests.harness import batches, build_engine

    engine = build_engine(spec)
    gift = engine.gift
    name = gift.geometry.names[0]
    module = gift.geometry.modules[name]
    seen = []
    module.register_forward_hook(lambda m, i, o: seen.append(len(m._forward_pre_hooks)))
    for tokens in batches(rank, 7, 2, 16):
        out = engine(input_ids=tokens, labels=tokens)
        engine.backward(out.loss)
        engine.step()
    return seen


def test_statistics_hooks_are_on_the_model_only_on_collect_steps():
    gift = {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 4, "collect_interval": 3,
                                                                 "refresh_interval": 6}}
    (seen,) = run_ranks(_hooks_per_step, 1, dict(stage=2, gift=gift))
    hooked = [k for k, hooks in enumerate(seen) if hooks]
    assert hooked == [0, 3, 6], seen


# ---- the sketched statistics (what a rank holds of a wide layer's input) ----------------------

def _planted_inputs(dim: int, tokens: int, *, seed: int, signal=(30.0, 20.0, 12.0, 8.0, 5.0, 3.0)):
    """Tokens whose covariance is a planted decaying spectrum on a random subspace plus
    isotropic noise (the shape of a layer input's spectrum, with known eigenvalues)."""
    g = torch.Generator().manual_seed(seed)
    basis = torch.linalg.qr(torch.randn(dim, len(signal), generator=g, dtype=torch.float64)).Q.float()
    coeff = torch.randn(tokens, len(signal), generator=g) * torch.tensor(signal).sqrt()
    return coeff @ basis.T + 0.3 * torch.randn(tokens, dim, generator=g)


def _geometry_config(**over):
    from deepspeed_gift.config import GeometryConfig

    return GeometryConfig(**{"rank": 4, "stats_decay": 0.5, **over})


def test_a_wide_statistic_is_held_as_its_sketch_and_exact_diagonal():
    """The hook sums x^T (x Omega) and sum x^2 (O(in w) bytes), which are A @ Omega and diag(A) of
    the tokens it saw; a narrow layer (in <= w + 1) keeps its whole x^T x."""
    from deepspeed_gift.statistics import SketchedMoment

    torch.manual_seed(0)
    wide, narrow = nn.Linear(64, 8), nn.Linear(8, 3)
    omega = torch.linalg.qr(torch.randn(64, 12)).Q
    moments = InputMoments({"wide": wide, "narrow": narrow}, None,
                           test_matrix=lambda key, rows: omega if rows.shape[1] == 64 else None)
    moments.attach()
    x = torch.randn(5, 7, 64)
    narrow(wide(x)[..., :8].contiguous())
    got = moments.take()
    rows = x.reshape(-1, 64).double()
    A = rows.T @ rows / rows.shape[0]
    assert isinstance(got["wide"], SketchedMoment)
    assert got["wide"].Y.shape == (64, 12) and got["wide"].diag.shape == (64,)
    # fp32 sums over 35 tokens against float64: a few ulps of the largest entry
    torch.testing.assert_close(got["wide"].Y.double(), A @ omega.double(), rtol=0, atol=2e-6 * float(A.abs().max()))
    torch.testing.assert_close(got["wide"].diag.double(), torch.diagonal(A), rtol=1e-5, atol=0)
    assert isinstance(got["narrow"], torch.Tensor) and got["narrow"].shape == (8, 8)


def test_rebasing_a_sketch_is_exact_for_what_the_sketch_saw():
    """A refresh moves each EMA onto the next test matrix through the Nystrom approximation of
    what it holds: exact when A's range lies in what the old test matrix saw (rank(A) <= w)."""
    from deepspeed_gift.refresh import SketchEMA

    g = torch.Generator().manual_seed(1)
    dim, w = 96, 12
    B = torch.randn(dim, 7, generator=g, dtype=torch.float64)
    A = B @ B.T  # rank 7 < w
    old = torch.linalg.qr(torch.randn(dim, w, generator=g, dtype=torch.float64)).Q
    new = torch.linalg.qr(torch.randn(dim, w, generator=g, dtype=torch.float64)).Q
    ema = SketchEMA(dim, old.float(), decay=0.9)
    ema.Y, ema.diag = (A @ old).float(), torch.diagonal(A).float()
    ema.rebase(new.float())
    # fp32 inputs (rounding ~6e-8 relative) through a w x w core solve of condition ~1e2
    torch.testing.assert_close(ema.Y.double(), A @ new, rtol=0, atol=1e-4 * float(A.abs().max()))
    assert ema.omega is not None and torch.equal(ema.omega, new.float())


def _cold_fit(comm, dim, tokens_per_rank):
    from deepspeed_gift.refresh import KfacRefresh

    cfg = _geometry_config(rank=4)
    kfac = KfacRefresh(cfg, 0, comm, ["l"], {})
    layer = nn.Linear(dim, 2)
    moments = InputMoments({"l": layer}, None, test_matrix=kfac.test_matrix)
    moments.attach()
    x = _planted_inputs(dim, tokens_per_rank, seed=10 + comm.rank)
    layer(x.requires_grad_())
    kfac.fold(moments.take())
    fitted = kfac.refit(0)["l"]
    return fitted, kfac.nbytes()


def test_the_first_fit_is_accurate_from_the_sketch_with_its_power_step():
    """A statistic's first test matrix is random, which one Nystrom pass sees poorly; the hook's
    power step (all-reduced over the ranks on first sight) makes the first fit's eigenvalues
    match the exact ones of the rank-averaged A, while no rank ever held an in x in matrix."""
    from deepspeed_gift.core import geometry
    from deepspeed_gift.exchange.comm import run_local
    from deepspeed_gift.refresh import SKETCH_OVERSAMPLE

    dim, tokens, world = 160, 512, 2
    results = run_local(world, _cold_fit, dim, tokens)
    xs = torch.cat([_planted_inputs(dim, tokens, seed=10 + r) for r in range(world)]).double()
    A = xs.T @ xs / xs.shape[0]
    exact = geometry.fit_low_rank_diag(A.float(), rank=4, damping=1e-3, method="eigh")
    for lrd, held in results:
        # the statistics travel in bf16 (2^-8 relative), so the eigenvalues agree to ~1%
        torch.testing.assert_close(lrd.lam, exact.lam, rtol=0.02, atol=0.0)
        assert torch.linalg.svdvals(lrd.U.double().T @ exact.U.double()).min() > 0.98
        w = 4 + SKETCH_OVERSAMPLE
        # Y, diag, Omega and the factors: O(in w), never in^2 (160^2 floats would be 102 kB)
        assert held == 4 * (dim * w + dim + dim * w + dim * 4 + 4 + dim), held
    assert torch.equal(results[0][0].U, results[1][0].U)  # every rank holds the same bits
    # without the power step a random test matrix underestimates these eigenvalues
    g = torch.Generator().manual_seed(0)
    omega = torch.linalg.qr(torch.randn(dim, 4 + SKETCH_OVERSAMPLE, generator=g, dtype=torch.float64)).Q
    cold = geometry.nystrom_low_rank_diag(omega.float(), (A @ omega).float(), torch.diagonal(A).float(), rank=4,
                                          damping=1e-3)
    assert (cold.lam < 0.9 * exact.lam).any(), (cold.lam, exact.lam)


def test_a_checkpoint_of_whole_averages_loads_as_the_sketch_the_next_refit_would_take():
    """Checkpoints written before the statistics were sketched hold each rank's in x in EMA: it
    loads as A @ Omega and diag(A) against the test matrix the next refit would have built."""
    from deepspeed_gift.core.geometry import CovarianceEMA, fit_low_rank_diag
    from deepspeed_gift.exchange.comm import LocalComm
    import threading
    from deepspeed_gift.refresh import KfacRefresh

    dim = 64
    x = _planted_inputs(dim, 300, seed=4)
    ema = CovarianceEMA(dim, decay=0.5)
    ema.update(x)
    prev = fit_low_rank_diag(ema.value(), rank=4, damping=1e-3, method="eigh")
    state = {"stats": {"l": ema.state_dict()}, "lowrank": {"l": (prev.U, prev.lam, prev.d)}}
    comm = LocalComm(0, 1, [None], threading.Barrier(1))
    kfac = KfacRefresh(_geometry_config(), 0, comm, ["l"], {})
    kfac.load_state_dict(state, torch.device("cpu"), version=3)
    omega = kfac._omega("l", dim, 3, torch.device("cpu"))
    assert torch.equal(kfac.omegas["l"], omega)
    torch.testing.assert_close(kfac.stats["l"].Y, ema.value() @ omega)
    torch.testing.assert_close(kfac.stats["l"].diag, torch.diagonal(ema.value()))
    # the warm start: the previous eigenvectors span the test matrix's first columns
    assert torch.linalg.svdvals(prev.U.double().T @ omega.double()).min() > 1 - 1e-5
