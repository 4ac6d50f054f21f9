"""How far GIFT's lossless path may land from native DeepSpeed: within native DeepSpeed's own
spread, measured in the same run.

With fp32 gradients on an fp32 wire, GIFT's owner sums the ranks' gradients in rank order
(two-level: the ranks of a node, then the nodes; relay: a chunk's sum, then the owner's) and
divides once; DeepSpeed divides each rank's gradient and gloo sums them in its algorithm's
order. Every order rounds the sum to within (W - 1) ulps of sum_i |g_i| (fp32: u = 2^-24), and
dividing by a world that is not a power of two rounds once more per term (x/3 + y/3 + z/3
against (x + y + z)/3). So one reduction differs from native by a few ulps. What the tests
compare are parameters after 3-10 optimizer steps, and there no closed form bounds the
difference: Adam divides by sqrt(v) ~ |g|, so an element whose sum cancels takes a relative
error of order 1 into a step of size lr, and Muon's Newton-Schulz mixes whole matrices. How
much a model, an optimizer and a number of steps amplify a reordering is a property of the run,
and it changes with the machine: another SIMD width (AVX2 against AVX512) rounds the forward,
the backward and Newton-Schulz differently, which moves every trajectory.

So the tests measure it, in the same processes, on the same machine: native DeepSpeed runs
twice, with its default collective (one all-reduce of each bucket: ``use_multi_rank_bucket_
allreduce`` true) and with its other one (each owner's slices reduced to it: false). Both are
DeepSpeed's own reduction of the same gradients in fp32; gloo's all-reduce and reduce sum them
in different orders. The distance between the two native runs is the spread of a reordering of
the sum; GIFT's order is one more reordering, so GIFT must lie within ``SPREAD_FACTOR`` spreads
of native.

``SPREAD_FACTOR``: three runs that each carry an independent reordering are pairwise about
equally far apart; measured (``benchmarks/native_spread.py``, every case below, AVX512 and AVX2
kernels of one machine), GIFT-vs-native over native-vs-native was 0.4-2.1 for the parameters.
The factor leaves room for that ratio's spread without admitting a real fault: a wrong owner,
a missed division or a lost bucket moves parameters by ~lr per step (1e-3 and more), 100x
above the largest spread measured (~1e-5).

At two ranks there is nothing to measure: x/2 + y/2 and (x + y)/2 are the same fp32 number and
both collectives add two terms, so native's two runs agree bit for bit and so must GIFT.
"""

from __future__ import annotations

import math

SPREAD_FACTOR = 4.0
# A loss is one fp32 number near 5: when native's two runs print the same loss, GIFT's may still
# round its last bit the other way for a parameter change too small to show in native's pair.
LOSS_FLOOR_ULPS = 2.0


def native_reordered(spec: dict) -> dict:
    """``spec`` with DeepSpeed's other reduction collective: the same sums, in gloo's other order."""
    return dict(spec, zero=dict(spec.get("zero", {}), use_multi_rank_bucket_allreduce=False))


def max_param_diff(a: dict, b: dict) -> float:
    return max((a["params"][k] - b["params"][k]).abs().max().item() for k in a["params"])


def max_loss_diff(a: dict, b: dict) -> float:
    return max(abs(x - y) for x, y in zip(a["losses"], b["losses"]))


def spread_bounds(native: dict, reordered: dict) -> dict:
    """The parameter and loss bounds ``native_reordered`` measured."""
    loss_ulp = max(math.ulp(x) for x in native["losses"]) * 2 ** 29  # fp32's ulp from fp64's
    return {"params": SPREAD_FACTOR * max_param_diff(native, reordered),
            "losses": SPREAD_FACTOR * max(max_loss_diff(native, reordered), LOSS_FLOOR_ULPS * loss_ulp)}


def assert_within_native_spread(native: dict, reordered: dict, gift: dict) -> None:
    """GIFT's run lies within ``SPREAD_FACTOR`` of native's own spread (see the module docstring)."""
    bound = spread_bounds(native, reordered)
    spread = max_param_diff(native, reordered)
    if spread == 0.0:  # two ranks, or the collectives happened to agree: GIFT must too
        assert gift["losses"] == native["losses"] and max_param_diff(native, gift) == 0.0, \
            (max_param_diff(native, gift), "native's two collectives agree bit for bit")
        return
    diff = max_param_diff(native, gift)
    assert diff <= bound["params"], f"GIFT vs native {diff:.3e} > {SPREAD_FACTOR:g} x native's spread {spread:.3e}"
    loss = max_loss_diff(native, gift)
    assert loss <= bound["losses"], f"loss: GIFT vs native {loss:.3e} > bound {bound['losses']:.3e}"
