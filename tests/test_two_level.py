"""``gift.hierarchy: "two_level"`` inside real DeepSpeed ZeRO-1/2 engines on real gloo ranks,
one machine posing as nodes of 2 ranks: the node-local reduce-scatter, then the exchange among
same-slot ranks of the nodes, compared with DeepSpeed's own reduction."""

import pytest

from deepspeed_gift.exchange.comm import ranks_per_node_from
from tests.harness import initialize_error, train_many
from tests.spread import assert_within_native_spread, native_perturbed
from launch.spawn import run_ranks

LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1},
            "hierarchy": "two_level", "ranks_per_node": 2}


# fp32 model, fp32 wire: the node stage sums two ranks in fp32, the node exchange sums the nodes
# in fp32 and divides once; DeepSpeed divides each rank's gradient, then gloo sums. Another order
# of the same sum (and at 6 ranks another rounding of the division): within native DeepSpeed's own
# spread under a change of that size, measured in the same processes (tests/spread.py).
@pytest.mark.parametrize("world,stage,optimizer", [(4, 1, "adam"), (4, 2, "adam"),
                                                   pytest.param(4, 1, "muon", marks=pytest.mark.isa),
                                                   pytest.param(6, 1, "adam", marks=pytest.mark.isa), (6, 2, "muon")])
def test_two_level_lossless_config_matches_deepspeed(world, stage, optimizer):
    base = dict(stage=stage, steps=10, ga=2, bucket=12000)
    if optimizer == "muon":  # matrices cut by partitions reach every owner whole, across slots and nodes
        # fp32 Newton-Schulz: in DeepSpeed's half-precision default the ulps of another summation
        # order grow to ~1e-4 within a step, for native alike (see test_zero's Muon test)
        base.update(optimizer="muon", lr=2e-2, bucket=20000, muon_ns_fp32=True)
    results = run_ranks(train_many, world, [base, native_perturbed(base, world), dict(base, gift=LOSSLESS)])
    for native, perturbed, gift in results:
        assert_within_native_spread(native, perturbed, gift)
        assert len(gift["records"]) == 10
        if optimizer == "muon":
            assert gift["split_muon"], "the layout no longer splits a Muon matrix"
        for record in gift["records"]:
            assert record["hierarchy"] == "two_level"
            assert record["bytes_node"] > 0 and record["fidelity_rel_err"] < 1e-6
        # buckets smaller than a partition: by_layout spreads some over the node's ranks, and
        # their owners get results reduced in other slots, handed on inside the node
        assert all(r["balanced_buckets"] > 0 for r in gift["records"]), [r["balanced_buckets"] for r in gift["records"]]


def test_fp8_kfac_trains_two_level_and_the_network_carries_a_third_of_flat():
    base = dict(stage=2, steps=8, bucket=20000)
    # route direct on both: this compares hierarchies at one route (flat's by_layout would relay its
    # small buckets, a second quantization: tests/test_route.py measures that)
    gift = {"format": "fp8_e4m3", "layers": "all", "rounding": "stochastic", "error_feedback": True,
            "geometry": {"rank": 8, "refresh_interval": 3, "collect_interval": 1}, "telemetry": {"every": 1},
            "route": "direct"}
    two = dict(base, gift=dict(gift, hierarchy="by_topology"), env={"LOCAL_WORLD_SIZE": "2"})  # detected: 2 x 2
    flat = dict(base, gift=dict(gift, hierarchy="flat"))
    # by_layout two-level: these buckets reach one or two owners, so the node splits them evenly
    even = dict(base, gift=dict(gift, hierarchy="two_level", ranks_per_node=2, route="by_layout"))
    results = run_ranks(train_many, 4, [two, flat, even])
    fidelity = {"even": [], "two": []}
    for t, f, e in results:
        assert t["losses"][-1] < t["losses"][0] - 0.3, t["losses"]
        assert abs(t["losses"][-1] - f["losses"][-1]) < 0.05, (t["losses"], f["losses"])
        assert t["version"] >= 2 and len(t["active"]) > 0  # whitened, refreshed
        assert {r["hierarchy"] for r in t["records"]} == {"two_level"}
        assert {r["hierarchy"] for r in f["records"]} == {"flat"}
        # error feedback carries each step's residual into the next, so single steps reach ~0.15 on
        # either path; on average two-level (one quantization per node partial) is no worse than flat
        mean = {name: sum(r["fidelity_rel_err"] for r in x["records"]) / len(x["records"])
                for name, x in (("two", t), ("flat", f))}
        assert 0 < mean["two"] < 1.25 * mean["flat"] and mean["flat"] < 0.1, mean
        # spread over the node's ranks, each node partial is still quantized once (2 nodes: direct)
        assert all(r["balanced_buckets"] > 0 and r["relay_buckets"] == 0 for r in e["records"])
        assert e["losses"][-1] < e["losses"][0] - 0.3 and abs(e["losses"][-1] - t["losses"][-1]) < 0.05
        # each rank samples what it receives, which differs between the splits: compare over all ranks
        fidelity["even"].append(sum(r["fidelity_rel_err"] for r in e["records"]) / len(e["records"]))
        fidelity["two"].append(mean["two"])
    # measured: 0.048 and 0.048 (ranks 0.043 / 0.061 / 0.039 / 0.048 against 0.054 / 0.045 / 0.053 / 0.041)
    assert 0 < sum(fidelity["even"]) < 1.25 * sum(fidelity["two"]), fidelity
    # Every gradient element leaves 1 of 2 nodes (two-level, either split) instead of 3 of 4 ranks (flat)
    sent = {name: sum(res[i]["records"][-1]["elements_sent"] for res in results)
            for i, name in enumerate(("two", "flat", "even"))}
    assert sent["flat"] == 3 * sent["two"] and sent["even"] == sent["two"], sent
    assert results[0][0]["whitener_digest"] == results[3][0]["whitener_digest"]


def test_ranks_per_node_from_what_ranks_report():
    assert ranks_per_node_from(["a"] * 4, ["2"] * 4, True) == (2, "")  # LOCAL_WORLD_SIZE wins
    assert ranks_per_node_from(["a", "a", "b", "b", "c", "c"], [""] * 6, True) == (2, "")
    assert ranks_per_node_from(["a", "a", "b", "b"], ["2"] * 4, False) == (2, "")  # a sub-group: hosts
    per_node, why = ranks_per_node_from(["a", "b", "a", "b"], [""] * 4, True)
    assert per_node is None and "not contiguous" in why
    per_node, why = ranks_per_node_from(["a", "a", "a", "b"], [""] * 4, True)
    assert per_node is None and "different numbers" in why
    per_node, why = ranks_per_node_from(["a"] * 4, ["3"] * 4, True)
    assert per_node is None and "LOCAL_WORLD_SIZE 3 does not divide" in why


def test_a_ranks_per_node_that_does_not_divide_the_group_fails_at_initialize():
    spec = dict(stage=2, gift=dict(LOSSLESS, ranks_per_node=3))
    for message in run_ranks(initialize_error, 4, spec):
        assert "gift.ranks_per_node: got 3; the data-parallel group has 4 ranks" in message


def test_a_copy_slice_is_carried_by_its_owners_slot_in_the_balanced_split():
    # a COPY slice (a parameter with copies in other data-parallel groups) must be kept by its owner,
    # never handed over inside the node in the bucket's dtype: whether a result is handed over
    # depends on the bucket's layout, which differs between the groups holding the copies
    from deepspeed_gift.exchange.plan import COPY, MAIN, ParamSlice
    from deepspeed_gift.exchange.two_level import carried_balanced

    # two nodes of 2; owner 1 holds a COPY slice, then a big main slice, owner 3 a main slice (an
    # even cut of owner 1's 1300 elements would give slot 0 the COPY slice)
    slices = [ParamSlice(1, 0, 300, 0, 1, 0, COPY), ParamSlice(1, 300, 1000, 0, 0, 0, MAIN),
              ParamSlice(3, 1300, 800, 0, 2, 0, MAIN)]
    carried = carried_balanced(slices, 2)
    assert (0, 0, 300) in carried[1] and all(run[0] != 0 for run in carried[0])
    for i in (1, 2):  # the main slices are still cut over both slots, with the COPY slice counted
        assert sum(n for runs in carried for j, _, n in runs if j == i) == slices[i].numel
        assert all(any(j == i for j, _, _ in runs) for runs in carried)
