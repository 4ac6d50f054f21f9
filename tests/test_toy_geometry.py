"""A worked example of adding a geometry: a toy transform that keeps ``core.geometry.Transform``
goes through the exchange as it is (direct and relay routes), with no change outside the class.
Registering it for configs is one entry in ``core.geometry`` (``GeometryKind`` and, for a
data-independent kind, ``FIXED_KINDS``); the config's vocabulary is built from the enum."""

import torch

from deepspeed_gift.core import formats
from deepspeed_gift.core.geometry import FIXED_KINDS, GeometryKind, Transform
from deepspeed_gift.config import get_gift_config
from deepspeed_gift.exchange.comm import run_local
from deepspeed_gift.exchange.plan import GEO, MAIN, ParamSlice
from deepspeed_gift.exchange.reducer import GiftReducer

DIM, ROWS, WORLD = 16, 12, 4


class ColumnScaling:
    """Toy geometry: ``Z = G * s`` with a fixed positive factor per input column."""

    version = 0

    def __init__(self, dim: int, seed: int) -> None:
        self.s = torch.rand(dim, generator=torch.Generator().manual_seed(seed)) * 3 + 0.25

    @property
    def run_unit(self) -> int:
        return self.s.numel()  # whole rows, as a whitener

    def apply(self, G):
        return G.float() * self.s

    def invert(self, Z):
        return Z / self.s

    def apply_run(self, values, start):
        return self.apply(values.view(-1, self.s.numel())).reshape(-1)

    def invert_run(self, values, start):
        return self.invert(values.view(-1, self.s.numel())).reshape(-1)

    def to_tensors(self):
        return [self.s]


def _body(comm, fmt, route, grads, toy):
    # one matrix of 12 rows cut by the owners at row boundaries and mid-row
    cuts = [0, 40, 96, 150, ROWS * DIM]
    mode = GEO if toy is not None else MAIN  # without it: the same bucket in Euclidean coordinates
    slices = [ParamSlice(d, cuts[d], cuts[d + 1] - cuts[d], cuts[d], 0, DIM, mode) for d in range(WORLD)]
    reducer = GiftReducer(comm, formats.get_format(fmt), route=route)
    bucket = grads[comm.rank].clone()
    reducer.reduce(bucket, slices, {0: toy} if toy is not None else {}, divisor=WORLD)
    s = slices[comm.rank]
    return bucket.narrow(0, s.bucket_offset, s.numel)


def test_a_toy_geometry_goes_through_the_exchange_unchanged():
    toy = ColumnScaling(DIM, seed=1)
    assert isinstance(toy, Transform)
    columns = torch.linspace(0.01, 5, DIM).repeat(ROWS)  # columns of very different sizes
    grads = torch.randn(WORLD, ROWS * DIM, generator=torch.Generator().manual_seed(0)) * columns
    exact = grads.mean(0)
    for route in ("direct", "relay"):
        got = torch.cat(run_local(WORLD, _body, "fp32", route, grads, toy))
        torch.testing.assert_close(got, exact, rtol=1e-6, atol=1e-6)
        toy_fp8 = torch.cat(run_local(WORLD, _body, "fp8_e4m3", route, grads, toy))
        plain_fp8 = torch.cat(run_local(WORLD, _body, "fp8_e4m3", route, grads, None))
        assert 0 < float((toy_fp8 - exact).norm() / exact.norm()) < 0.06
        assert not torch.equal(toy_fp8, plain_fp8)  # the toy's coordinates are what got quantized


def test_the_geometry_vocabulary_is_the_enum():
    # every GeometryKind is a valid gift.geometry.kind; the fixed kinds build from a width and a seed
    for kind in GeometryKind:
        assert get_gift_config({"gift": {"geometry": {"kind": kind.value}}}).geometry.kind == kind.value
    for kind, build in FIXED_KINDS.items():
        t = build(DIM, 3)
        assert isinstance(t, Transform) and t.run_unit == DIM, kind
