"""No host conversion inside a bucket's reduction on ordinary steps (no telemetry sample, no
geometry refresh, no statistics collection): on a GPU each would stall DeepSpeed's reduction
stream. Counted on real engines by ``benchmarks/host_syncs.py``'s counter; the other steps may
sync, and do (the counter sees them, so it is not blind)."""

import pytest

from benchmarks.host_syncs import (FP8_KFAC_EF, FP8_PARAMS, FP8_RELAY, NVFP4, ZERO_CHUNKED, copies_of, per_bucket,
                                   split_entries)
from launch.spawn import run_ranks
from tests.harness import train_many


def _specs(configs):
    return [dict(stage=2, steps=4, bucket=20000, gift=gift, count_syncs=True) for gift in configs]


@pytest.mark.parametrize("world", [2, 4])
def test_ordinary_steps_make_no_host_conversion_in_a_bucket(world):
    # 4 ranks: two-level as 2 x 2 and the relay beside flat; every config refreshes, collects and
    # samples at steps 0 and 3 (interval 3); a bucket's first reduction under a new plan (step 0,
    # and step 1 where the refresh changed its whiteners) agrees on the plan, a host read: step 2
    # and step 1's other buckets are ordinary. Pageable host-to-device copies are counted with them.
    configs = [FP8_KFAC_EF, NVFP4]
    if world == 4:
        configs += [dict(FP8_KFAC_EF, hierarchy="two_level", ranks_per_node=2),
                    dict(NVFP4, hierarchy="two_level", ranks_per_node=2), FP8_RELAY]
    specs = _specs(configs)
    if world == 4:  # under overlap_comm two-level's pipeline is carried from bucket to bucket
        configs.append(dict(FP8_KFAC_EF, hierarchy="two_level", ranks_per_node=2))
        specs.append(dict(_specs(configs[-1:])[0], overlap=True))
    results = run_ranks(train_many, world, specs)
    for per_config in results:
        for gift, r in zip(configs, per_config):
            buckets = r["host_syncs"]
            per_step = len(buckets) // 4
            ordinary = [b for b in buckets if b["ordinary"]]
            assert [b["planned"] for b in buckets if b["step"] == 0] == [True] * per_step
            assert {b["step"] for b in buckets if b["planned"]} <= {0, 1}
            assert [b["step"] for b in ordinary].count(2) == per_step
            assert any(b["planned"] for b in buckets if b["step"] == 1)  # the refresh made new plans
            assert per_bucket(buckets, True) == 0.0, [b["counts"] for b in ordinary if b["counts"]]
            assert per_bucket(buckets, False) > 0, gift  # sampled/refresh steps read values back
            assert per_bucket(buckets, False, copies_of) > 0, gift  # and make host data: seen too
            assert r["losses"][-1] < r["losses"][0]
        if world == 4:  # the last config's buckets were carried (telemetry's steps 0 and 3)
            carried = per_config[-1]["records"]
            assert carried and all(rec["carried_buckets"] > 0 for rec in carried), carried


@pytest.mark.parametrize("world", [2, 4])
def test_ordinary_steps_make_no_host_conversion_in_zero1_rounds(world):
    # ZeRO-1's balanced rounds (gift.stage1_rounds, 20k-element buckets: several rounds a step),
    # counted whole per step, flat and (4 ranks) two-level as 2 x 2
    configs = [FP8_KFAC_EF] + ([dict(NVFP4, hierarchy="two_level", ranks_per_node=2)] if world == 4 else [])
    specs = [dict(spec, stage=1) for spec in _specs(configs)]
    for per_config in run_ranks(train_many, world, specs):
        for r in per_config:
            rounds = [e for e in r["host_syncs"] if e.get("where") == "rounds"]
            assert [e["step"] for e in rounds] == [0, 1, 2, 3]
            assert all(sum(e["counts"].values()) == 0 for e in rounds if e["ordinary"]), rounds
            assert any(sum(e["counts"].values()) > 0 for e in rounds if not e["ordinary"])  # not blind
            assert r["losses"][-1] < r["losses"][0]


@pytest.mark.parametrize("world, hierarchy", [(2, "flat"), (4, "two_level")])
def test_ordinary_steps_make_no_host_read_in_the_parameter_all_gather(world, hierarchy):
    # gift.params with fp8 deltas, the partitions cut into several all-gathers (ZERO_CHUNKED): the
    # codec headers are compared on the device and read with the reduction's at the next step; only
    # telemetry's sampled steps (0 and 3) read, the gap and the headers with it
    gift = dict(FP8_PARAMS, hierarchy=hierarchy, **({"ranks_per_node": 2} if hierarchy == "two_level" else {}))
    spec = dict(stage=2, steps=4, bucket=20000, gift=gift, count_syncs=True, zero=ZERO_CHUNKED)
    for (r,) in run_ranks(train_many, world, [spec]):
        buckets, gathers = split_entries(r["host_syncs"])
        assert [g["step"] for g in gathers] == [0, 1, 2, 3]
        assert [g["ordinary"] for g in gathers] == [False, True, True, False]
        assert per_bucket(gathers, True) == 0.0, [g["counts"] for g in gathers]
        assert per_bucket(gathers, False) > 0  # the counter sees the gather's reads where it makes them
        assert per_bucket(buckets, True) == 0.0
        assert all(rec["params_bytes_per_elem"] > 1 for rec in r["records"])  # the compressed gather ran
        assert r["losses"][-1] < r["losses"][0]


def _mismatch_body(rank, world):
    import torch

    from benchmarks.host_syncs import HostSyncCounter
    from deepspeed_gift.core import formats
    from deepspeed_gift.exchange.comm import TorchComm
    from deepspeed_gift.exchange.reducer import GiftReducer
    from deepspeed_gift.exchange.plan import ParamSlice
    import torch.distributed as dist

    dist.init_process_group("gloo")
    reducer = GiftReducer(TorchComm(), formats.get_format("fp8_e4m3"), defer_checks=True)
    slices = [ParamSlice(d, d * 512, 512, d * 512, 0) for d in range(world)]
    reducer.plan_for(slices, {})  # a new plan is agreed (a host read) when made, before its first exchange
    with HostSyncCounter() as counter:  # deferred: the reduction itself reads nothing back
        reducer.reduce(torch.randn(512 * world), slices, {}, divisor=world, step=5 + (rank == world - 1))
    try:
        reducer.verify_checks()
    except RuntimeError as exc:
        return counter.total, str(exc)
    return counter.total, ""


@pytest.mark.parametrize("world", [2, 3])
def test_a_header_mismatch_is_found_when_the_step_ends_and_named(world):
    # the last rank believes it is at another step: its messages carry that step in their
    # header. An owner checks all its senders' headers as one batch, and names the one that
    # differs (at 3 ranks, rank 2 and not rank 1 to rank 0; rank 0, the first that differs, to rank 2)
    last = world - 1
    for rank, (syncs, message) in enumerate(run_ranks(_mismatch_body, world)):
        assert syncs == 0
        other = 0 if rank == last else last
        assert f"rank {other} sent a bucket for plan" in message and f"at step {5 + (other == last)}" in message
        assert "this rank expects plan" in message and f"at step {5 + (rank == last)}" in message
