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
