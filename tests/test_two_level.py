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
    # the node stage quantized too (gift.node_format): int8 per 32 in place of the fp32 bucket's 4 B
    node = dict(base, gift=dict(gift, hierarchy="two_level", ranks_per_node=2, node_format="int8",
                                node_block_size=32))
    results = run_ranks(train_many, 4, [two, flat, even, node])
    fidelity = {"even": [], "two": []}
    for t, f, e, q in results:
        assert q["losses"][-1] < q["losses"][0] - 0.3 and abs(q["losses"][-1] - t["losses"][-1]) < 0.05
        assert [r["elements_sent"] for r in q["records"]] == [r["elements_sent"] for r in t["records"]]
        # the same messages inside the node, each part an int8/32 payload of 1.125 B an element (plus
        # its 16-byte header and a block's padding) where the fp32 bucket sends 4
        for rq, rt in zip(q["records"], t["records"]):
            assert 0.28 * rt["bytes_node"] < rq["bytes_node"] < 0.3 * rt["bytes_node"], (rq["bytes_node"],
                                                                                      rt["bytes_node"])
        mean_q = sum(r["fidelity_rel_err"] for r in q["records"]) / len(q["records"])
        mean_t = sum(r["fidelity_rel_err"] for r in t["records"]) / len(t["records"])
        assert 0 < mean_q < 1.25 * mean_t, (mean_q, mean_t)
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


def test_each_slot_carries_its_own_owners_elements_first_in_the_balanced_split():
    # one node of 4 (and a second with nothing): owners 0, 1, 2 hold 300, 300 and 200 elements,
    # a share of 200 a slot. Cut in bucket order over the slots, slot 1 would carry 100 of owner
    # 0's and slot 2 owner 1's, and owners 1 and 2 would receive 200 each from other slots; with
    # each slot's own owner first, every owner receives only what exceeds its slot's share
    from deepspeed_gift.exchange.plan import GEO, MAIN, ParamSlice
    from deepspeed_gift.exchange.two_level import NodePlan, carried_balanced

    slices = [ParamSlice(0, 0, 300, 0, 0, 10, GEO), ParamSlice(1, 300, 300, 0, 1, 0, MAIN),
              ParamSlice(2, 600, 200, 0, 2, 0, MAIN)]
    carried = carried_balanced(slices, 4)
    assert carried == [[(0, 0, 200)], [(1, 0, 200)], [(2, 0, 200)], [(0, 200, 100), (1, 200, 100)]]
    plan = NodePlan(slices, 4, 0, carried, "balanced")
    assert [[plan.forward_numel[j][d] for j in range(4)] for d in range(4)] == [
        [0, 0, 0, 100], [0, 0, 0, 100], [0, 0, 0, 0], [0, 0, 0, 0]]
    # a share that ends inside a whitened row moves to the nearest row boundary (rows of 10 from
    # the parameter's element 0; the slice starts at its element 5: the share's 200 is element 205)
    carried = carried_balanced([ParamSlice(0, 0, 305, 5, 0, 10, GEO), ParamSlice(1, 305, 95, 0, 1, 0, MAIN)], 2)
    assert carried == [[(0, 0, 205)], [(0, 205, 100), (1, 0, 95)]]
    # an excess of at most 1/64 of the share stays on the owner's slot (share 200: 3 elements),
    # not a run of its own on another slot: nothing is forwarded
    carried = carried_balanced([ParamSlice(0, 0, 203, 0, 0, 0, MAIN), ParamSlice(1, 203, 197, 0, 1, 0, MAIN)], 2)
    assert carried == [[(0, 0, 203)], [(1, 0, 197)]]
    carried = carried_balanced([ParamSlice(0, 0, 204, 0, 0, 0, MAIN), ParamSlice(1, 204, 196, 0, 1, 0, MAIN)], 2)
    assert carried == [[(0, 0, 200)], [(0, 200, 4), (1, 0, 196)]]


def test_the_layout_models_forwards_are_the_balanced_splits():
    # benchmarks/layout_model.py counts the balanced split's forwards by a formula; here it meets
    # carried_balanced on buckets of 7B's layout at W = 64 in nodes of 8 (rows not counted: MAIN
    # slices), the busiest owner's receive and the busiest slot's hand-on, element for element
    from benchmarks import layout_model
    from deepspeed_gift.exchange.plan import MAIN, ParamSlice
    from deepspeed_gift.exchange.two_level import NodePlan, carried_balanced

    sizes, arrival = layout_model.parameter_layout(layout_model.MODELS["7B"])
    buckets = layout_model.bucket_runs_of(sizes, arrival, 64, 500_000_000)
    checked = 0
    for runs in buckets[:6]:
        slices, at = [], 0
        for key, (owner, n) in enumerate(runs):
            slices.append(ParamSlice(owner, at, n, 0, key, 0, MAIN))
            at += n
        carried = carried_balanced(slices, 8)
        owners = layout_model.owners_of(runs)
        handed_in, handed_out = layout_model.balanced_forwards(owners, 8)
        received, handed = {}, [0] * 8
        for node in {d // 8 for d in owners}:
            plan = NodePlan(slices, 8, node * 8, carried, "balanced")
            for j in range(8):
                handed[j] = max(handed[j], sum(plan.forward_numel[j]))
                for local, n in enumerate(plan.forward_numel[j]):
                    received[node * 8 + local] = received.get(node * 8 + local, 0) + n
        assert max(received.values()) == pytest.approx(handed_in, abs=8)  # shares rounded to elements
        assert max(handed) == pytest.approx(handed_out, abs=8)
        checked += handed_in > 0
    assert checked >= 3  # buckets whose owners hold more than a share


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
