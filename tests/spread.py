"""How far GIFT's lossless path may land from native DeepSpeed: within the spread of native
DeepSpeed itself under a change of the size fp32 rounding makes, measured in the same run.

With fp32 gradients on an fp32 wire, GIFT's owner sums the W ranks' gradients in rank order
(two-level: the ranks of a node, then the nodes; relay: a chunk's sum, then the owner's) and
divides once; DeepSpeed divides each rank's gradient and gloo sums them in its algorithm's
order. Either way the reduced gradient is the exact mean to within W - 1 roundings of the
additions and one of the division: |error| <= W u sum_i |g_i| / W per element (u = 2^-24),
and the two results differ by at most twice that. At two ranks there is no difference at all
(x/2 + y/2 == (x + y)/2, one addition in either order): those tests ask for the same bits.

The tests compare parameters after 3-10 optimizer steps, and there no closed form bounds the
difference: Adam divides by sqrt(v) ~ |g|, so an element whose sum cancels takes a relative
error of order 1 into a step of size lr, and Muon's Newton-Schulz mixes whole matrices. How far
a run carries a rounding-sized change is a property of the run (model, optimizer, steps) and of
the machine: another SIMD width (AVX2 against AVX512) rounds the forward, the backward and
Newton-Schulz differently and moves every trajectory by more than any of these comparisons
(``benchmarks/native_spread.py``: 1.4e-6 to 2.4e-5 of the parameters between native runs on the
two widths of one machine, against GIFT's 0 to 3.4e-6 from native on either).

So each test measures it: native DeepSpeed runs a second time with every rank's gradient
element moved by ``REORDER_ULPS(W)`` = W units u of its magnitude, with a fixed random sign
(``tests.harness.perturb_gradients``): the size of the reordering and division error above, on
every element and every micro step. That run's distance from native is this run's spread under
rounding-sized changes, on this machine; GIFT's run carries one such change and must lie within
``SPREAD_FACTOR`` spreads of native.

Distances are L2 norms over all parameters. The largest element is the worse statistic: one
element's luck decides it, and ``benchmarks/native_spread.py`` measured GIFT over the perturbed
spread from 0.04 to 4.6 by it over the 12 cases of these tests with AVX512 and AVX2 kernels
(4.6: the relayed Muon run, 3 steps). In the L2 norm the same runs gave 0.07-0.87: under Adam
0.07-0.62, under Muon 0.57-0.87 (Newton-Schulz mixes a whole matrix, so two changes of one size
part less evenly). ``SPREAD_FACTOR`` 2 is above all of them with room for that ratio's own
spread. A real fault (a wrong owner, a missed division, a lost bucket) moves the parameters of
whole tensors by ~lr per step: a bucket of 12000 elements off by lr = 3e-3 is an L2 distance of
0.3, where these bounds are 7e-6 to 1e-4.

The case an AVX2 machine failed before these bounds (two-level, 4 ranks, ZeRO-1, Muon: 3.43e-6
largest element against a fixed 2e-6 set on an AVX512 machine) is in that table.
"""

from __future__ import annotations

import math

SPREAD_FACTOR = 2.0
# A loss is one fp32 number near 5: its last bit may round either way for a parameter change
# too small to show in native's pair.
LOSS_FLOOR_ULPS = 2.0


def REORDER_ULPS(world: int) -> float:
    """The reordered sum's and the division's roundings: W - 1 additions and one division."""
    return float(world)


def native_perturbed(spec: dict, world: int) -> dict:
    """``spec`` with every gradient element moved by ``REORDER_ULPS(world)`` u, fixed random signs."""
    return dict(spec, perturb_ulps=REORDER_ULPS(world))


def max_param_diff(a: dict, b: dict) -> float:
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


def norm_param_diff(a: dict, b: dict) -> float:
    """The L2 norm of the difference of all parameters: a sum over every element, so a far steadier
    measure of chaotic growth than the largest element (which one element's luck decides)."""
    return sum(float((a["params"][k] - b["params"][k]).double().square().sum()) for k in a["params"]) ** 0.5


def max_loss_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


def spread_bounds(native: dict, perturbed: dict) -> dict:
    """The parameter (L2) and loss bounds that the perturbed native run measured."""
    loss_ulp = max(math.ulp(x) for x in native["losses"]) * 2 ** 29  # fp32's ulp from fp64's
    return {"params": SPREAD_FACTOR * norm_param_diff(native, perturbed),
            "losses": SPREAD_FACTOR * max(max_loss_diff(native, perturbed), LOSS_FLOOR_ULPS * loss_ulp)}


def assert_within_native_spread(native: dict, perturbed: dict, gift: dict) -> None:
    """GIFT's run lies within ``SPREAD_FACTOR`` of native's own spread (see the module docstring)."""
    bound = spread_bounds(native, perturbed)
    spread = norm_param_diff(native, perturbed)
    assert spread > 0.0, "the perturbed native run did not move: the yardstick measures nothing"
    diff = norm_param_diff(native, gift)
    assert diff <= bound["params"], (f"GIFT vs native {diff:.3e} (L2; largest element {max_param_diff(native, gift):.3e}) "
                                     f"> {SPREAD_FACTOR:g} x native's spread {spread:.3e}")
    loss = max_loss_diff(native, gift)
    assert loss <= bound["losses"], f"loss: GIFT vs native {loss:.3e} > bound {bound['losses']:.3e}"
