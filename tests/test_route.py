"""``gift.route``: a bucket that reaches few owners (buckets smaller than a partition) is relayed
through every rank in two balanced all-to-alls instead of funnelling into its owners' links.
Bytes measured on real engines against native DeepSpeed; exactness, error feedback, stochastic
rounding and resume under the relay."""

import pytest
import torch

from benchmarks.exchange_bytes import busiest_per_step
from deepspeed_gift.core import formats
from deepspeed_gift.exchange.comm import run_local
from deepspeed_gift.exchange.plan import GEO, HIGH, MAIN, ParamSlice
from deepspeed_gift.exchange.reducer import GiftReducer
from launch.spawn import run_ranks
from tests.harness import train_many
from tests.kernel_calls import compiled_calls
from tests.spread import assert_within_native_spread, native_perturbed

N = 40_000
LAYOUTS = {"one owner": [ParamSlice(0, 0, N, 0, 0)],
           "two owners": [ParamSlice(1, 0, N // 2, 0, 0), ParamSlice(2, N // 2, N // 2, 0, 1)],
           "balanced": [ParamSlice(d, d * N // 4, N // 4, 0, d) for d in range(4)]}


def _reduce(comm, route, fmt, slices, grads, steps=1, **kw):
    reducer = GiftReducer(comm, formats.get_format(fmt, **kw.pop("codec", {})), route=route, **kw)
    for step in range(steps):
        bucket = grads[step][comm.rank].clone()
        stats = reducer.reduce(bucket, slices, {}, divisor=comm.world_size, step=step)
    return bucket, stats


def _owned_err(out, slices, exact):
    errs = []
    for s in slices:
        got = out[s.dst][0].narrow(0, s.bucket_offset, s.numel)
        want = exact.narrow(0, s.bucket_offset, s.numel)
        errs.append(float((got - want).norm() / want.norm()))
    return max(errs)


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_relay_reduces_every_layout_and_by_layout_takes_the_lighter_route(layout):
    slices, world = LAYOUTS[layout], 4
    grads = torch.randn(1, world, N, generator=torch.Generator().manual_seed(0))
    exact = grads[0].mean(0)
    got = {route: run_local(world, _reduce, route, fp, slices, grads)
           for route in ("direct", "relay", "by_layout") for fp in ("fp32",)}
    fp8 = {route: run_local(world, _reduce, route, "fp8_e4m3", slices, grads) for route in ("direct", "relay")}
    # fp32 wire: the relay sums the same values in another order (ulps)
    assert _owned_err(got["relay"], slices, exact) < 1e-6
    direct, relay = got["direct"][0][1], got["relay"][0][1]
    assert relay.relay_buckets == 1 and direct.relay_buckets == 0
    picked = got["by_layout"][0][1]
    lighter = "relay" if relay.recv_max < direct.recv_max else "direct"
    assert picked.relay_buckets == (lighter == "relay") and picked.recv_max == min(relay.recv_max, direct.recv_max)
    if layout == "one owner":  # the owner receives 3 parts directly; relayed, every rank ~1/4 twice
        assert relay.recv_max < 0.51 * direct.recv_max
    if layout == "balanced":
        assert lighter == "direct"
    # fp8 e4m3: the relayed sum is quantized once more; measured 0.031 against 0.022 direct
    err_direct, err_relay = (_owned_err(fp8[r], slices, exact) for r in ("direct", "relay"))
    assert err_direct < err_relay < 1.6 * err_direct and err_relay < 0.0625, (err_direct, err_relay)


def test_an_int8_second_hop_keeps_the_relay_near_the_direct_error_at_the_same_bytes():
    # 8 ranks, one owner, gradients that share most of their signal (as the large per-rank batches
    # of pretraining do): the relayed sum carries the shared part at 8x, so quantizing it in
    # fp8 adds an error that does not average over the ranks; int8 (fp32 scale per 128) at the
    # same bytes per element rounds a Gaussian block to ~0.6% of its spread (2.6 sigma / 127 / sqrt 12),
    # ~1/4 of fp8 e4m3's ~2.3%. Direct's error of the mean is ~2.3% x sqrt(7) / 8 x 1.28 = 1.0% of the
    # shared signal, so the relay's is sqrt(1 + 0.6^2) = 1.17x direct's with int8 (measured 1.15x),
    # 2.5x with fp8 (measured 2.56x)
    world, n = 8, 1 << 15
    gen = torch.Generator().manual_seed(1)
    rows = torch.rand(n // 256, 1, generator=gen).mul(3).exp().expand(-1, 256).reshape(-1)  # row scales
    shared = torch.randn(n, generator=gen) * rows
    grads = (shared + 0.8 * torch.randn(1, world, n, generator=gen) * rows)
    exact = grads[0].mean(0)
    slices = [ParamSlice(0, 0, n, 0, 0)]
    int8 = formats.get_format("int8", block_size=128)
    runs = {name: run_local(world, lambda comm, route=route, hop=hop: _reduce(comm, route, "fp8_e4m3", slices, grads,
                                                                              relay_codec=hop))
            for name, route, hop in (("direct", "direct", None), ("relay fp8", "relay", None),
                                     ("relay int8", "relay", int8))}
    err = {k: _owned_err(v, slices, exact) for k, v in runs.items()}
    print({k: round(v / err["direct"], 3) for k, v in err.items()})
    assert err["relay fp8"] > 2.0 * err["direct"]
    assert err["relay int8"] < 1.3 * err["direct"]
    assert runs["relay int8"][0][1].recv_max == runs["relay fp8"][0][1].recv_max  # the same bytes
    assert runs["relay int8"][0][1].relay_buckets == 1


def test_relay_error_feedback_cancels_both_quantizations():
    # the same gradient every step, round to nearest: without feedback the error of each step
    # repeats, so the running sum drifts; with it (the rank's and the relay's own) it stays bounded
    world, steps = 4, 8
    slices = LAYOUTS["one owner"]
    g = torch.randn(world, N, generator=torch.Generator().manual_seed(1))
    grads = g.expand(steps, world, N)
    exact = g.mean(0)

    def drift(feedback):
        def body(comm):
            reducer = GiftReducer(comm, formats.get_format("int4"), route="relay", error_feedback=feedback)
            total = torch.zeros(N)
            for step in range(steps):
                bucket = grads[step][comm.rank].clone()
                reducer.reduce(bucket, slices, {}, divisor=world, step=step)
                total += bucket
            return float((total - steps * exact).norm() / (steps * exact).norm()), reducer.residual_nbytes()
        return run_local(world, body)[0]

    (plain, mem_plain), (fed, mem_fed) = drift(False), drift(True)
    assert mem_plain == 0 and mem_fed > 0
    assert fed < plain / 4, (fed, plain)


@pytest.mark.parametrize("route", ["direct", "relay"])
def test_error_feedback_reduces_the_same_bits_with_compiled_and_eager_kernels(route):
    """Error feedback through the reducer, stochastic rounding on, 4 ranks, 3 steps: with the
    codecs compiled, a section a rank sends directly takes one fused kernel a tile for its whole
    step (``Int8Codec.encode_with_residual``; the relay's second hop too), and every rank's results
    equal the eager path's bit for bit, step after step (the residuals carry each step's error
    into the next, so a stored byte that differed would show)."""

    world, steps, n = 4, 3, 128 * 320  # sections of whole blocks (the fused kernel's), and one that is not
    slices = ([ParamSlice(0, 0, n, 0, 0)] if route == "relay" else
              [ParamSlice(d, d * n // 4, n // 4 - 3 * (d == 1), 0, d) for d in range(4)])
    grads = torch.randn(steps, world, n, generator=torch.Generator().manual_seed(3))

    def run(mode):
        def body(comm):
            codec = formats.get_format("fp8_e4m3", kernels=mode, rounding="stochastic", seed=11)
            relay = formats.get_format("int8", block_size=32, kernels=mode, rounding="stochastic", seed=12)
            reducer = GiftReducer(comm, codec, route=route, error_feedback=True, relay_codec=relay)
            out = []
            for step in range(steps):
                bucket = grads[step][comm.rank].clone()
                reducer.reduce(bucket, slices, {}, divisor=world, step=step)
                out.append(bucket)
            return torch.stack(out)
        return run_local(world, body)

    with compiled_calls(block=True) as calls:
        fused = run("compiled")
    # direct: the sends; relayed: the relay's int8-per-32 hop (the chunks a rank sends to the
    # relays keep their three steps: a residual per section, payloads per run of chunks)
    assert ("feedback_encode", 32 if route == "relay" else 128) in calls, sorted(set(calls))
    for rank, (a, b) in enumerate(zip(run("eager"), fused)):
        assert torch.equal(a, b), rank


@pytest.mark.parametrize("fmt,options", [("fp8_e4m3", {}), ("int4", {}), ("int8", {"block_size": 32}),
                                         ("fp8_e4m3", {"rounding": "stochastic", "seed": 4}),
                                         ("int8", {"rounding": "stochastic", "seed": 4})])
def test_a_ranks_plain_sections_are_encoded_in_one_call_with_the_same_bits(fmt, options):
    """The direct route, 4 ranks, a bf16 bucket of uneven owners' sections (short last blocks),
    codecs compiled, two steps: the sections a rank sends as plain spans of the bucket are
    encoded by one call for all (``Codec.encode_spans``), none by an encode of its own, and
    every rank's result equals the eager path's bit for bit (stochastic rounding: each section
    under the key its own encode draws, step after step), and telemetry counts the same bytes."""

    world, n = 4, 128 * 160
    sizes = [n // 4 - 37, n // 4 + 61, n // 4 - 5, n // 4 - 19]
    slices = [ParamSlice(d, sum(sizes[:d]), sizes[d], 0, d) for d in range(4)]
    grads = torch.randn(world, sum(sizes), generator=torch.Generator().manual_seed(5)).bfloat16()

    def run(mode):
        def body(comm):
            reducer = GiftReducer(comm, formats.get_format(fmt, kernels=mode, **options), route="direct")
            out = []
            for step in range(2):
                bucket = grads[comm.rank].clone()
                stats = reducer.reduce(bucket, slices, {}, divisor=world, step=step)
                out.append((bucket, (stats.bytes_main, stats.bytes_scales, stats.elements_sent, stats.elements)))
            return out
        return run_local(world, body)

    with compiled_calls() as calls:
        fused = run("compiled")
    # per rank and step one encode of its three sections; the owner's sums are decode_sum's
    assert calls.count("spans_block_encode") == 2 * world, calls
    assert not {"ragged_block_encode", "fp8_block_encode", "int_block_encode"} & set(calls), calls
    for rank, (eager, compiled) in enumerate(zip(run("eager"), fused)):
        for step, ((a, sa), (b, sb)) in enumerate(zip(eager, compiled)):
            assert torch.equal(a, b), (rank, step)
            assert sa == sb, (rank, step)
    if options.get("rounding") == "stochastic":  # the second step drew other keys
        assert not torch.equal(fused[0][0][0], fused[0][1][0])


@pytest.mark.parametrize("rounding", ["nearest", "stochastic"])
def test_a_relays_sums_are_encoded_in_one_call_with_the_same_bits(rounding):
    """The relay route, 4 ranks, a bucket of two owners' uneven sections, codecs compiled, two
    steps: a relay's sums of its chunks, one buffer, are encoded for their owners in one call
    (the relay's int8-per-32 hop; a high section's in its own codec, another call), and every
    rank's result equals the eager path's bit for bit (stochastic rounding: each sum under the
    key its own encode draws, a high one's from its codec's own generator)."""

    from deepspeed_gift.core.rng import CounterRng

    world, n = 4, 128 * 90
    slices = [ParamSlice(1, 0, n // 2 - 13, 0, 1), ParamSlice(2, n // 2 - 13, n // 2 - 200, 0, 2),
              ParamSlice(2, n - 213, 213, 0, 3, 0, HIGH)]  # and a high one, in its codec
    grads = torch.randn(2, world, n, generator=torch.Generator().manual_seed(8))

    def run(mode):
        def body(comm):
            codec = formats.get_format("fp8_e4m3", kernels=mode, rounding=rounding, seed=11)
            high = formats.get_format("int8", kernels=mode, rounding=rounding, seed=13)
            relay = formats.get_format("int8", block_size=32, kernels=mode, rounding=rounding, seed=12)
            reducer = GiftReducer(comm, codec, high, route="relay", relay_codec=relay, generator=CounterRng(comm.rank))
            out = []
            for step in range(2):
                bucket = grads[step][comm.rank].clone()
                reducer.reduce(bucket, slices, {}, divisor=world, step=step)
                out.append(bucket)
            return out
        return run_local(world, body)

    with compiled_calls(block=True) as calls:
        fused = run("compiled")
    # each rank relays sums for the owners (two, or one for an owner), one call a step; the high
    # section's chunks (two blocks: two relays, one of them its owner) another
    assert calls.count(("spans_block_encode", 32)) == 2 * world, calls
    assert calls.count(("spans_block_encode", 128)) == 2, calls
    for rank, (a, b) in enumerate(zip(run("eager"), fused)):
        assert all(torch.equal(x, y) for x, y in zip(a, b)), rank


def test_plain_sections_of_two_codecs_are_two_calls_whatever_their_order():
    """Each owner gets a main section and a high one (``others`` in int8 here), interleaved in
    the plan: a rank encodes all its main sections in one call and all its high ones in
    another, not a call each time the codec changes, with the eager path's bits (stochastic
    rounding: the main sections under the reducer's generator, the high ones their codec's own)."""
    from deepspeed_gift.core.rng import CounterRng

    world, n = 4, 3000
    slices = [ParamSlice(d, (2 * d + h) * n, n - 7 * h, 0, 2 * d + h, 0, HIGH if h else MAIN)
              for d in range(world) for h in (0, 1)]
    grads = torch.randn(world, 2 * world * n, generator=torch.Generator().manual_seed(6))

    def run(mode):
        def body(comm):
            reducer = GiftReducer(comm, formats.get_format("fp8_e4m3", kernels=mode, rounding="stochastic"),
                                  formats.get_format("int8", kernels=mode, rounding="stochastic", seed=9),
                                  route="direct", generator=CounterRng(comm.rank))
            bucket = grads[comm.rank].clone()
            reducer.reduce(bucket, slices, {}, divisor=world)
            return bucket
        return run_local(world, body)

    with compiled_calls() as calls:
        fused = run("compiled")
    assert calls.count("spans_block_encode") == 2 * world, calls
    for rank, (a, b) in enumerate(zip(run("eager"), fused)):
        assert torch.equal(a, b), rank


BASE = dict(stage=2, steps=2, bucket=20000, dtype="bf16", count_recv=True)
FP8 = {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 8, "refresh_interval": 100},
       "telemetry": {"every": 0}}


@pytest.mark.parametrize("stage", [1, 2])
def test_the_busiest_link_carries_half_of_native_bf16_with_buckets_smaller_than_a_partition(stage):
    # 4 ranks, tiny Llama (119k parameters, partitions of ~30k): a 20k-element bucket reaches one
    # or two owners; a 2M one reaches all four (by_layout must then stay direct: no regression)
    # (stage 1: DeepSpeed's buckets, with the balanced rounds turned off; they have a test of their own)
    fp8 = dict(FP8, stage1_rounds=False)
    small, large = dict(BASE, stage=stage), dict(BASE, stage=stage, bucket=2_000_000)
    specs = [small, dict(small, gift=dict(fp8, route="direct")), dict(small, gift=dict(fp8, route="by_layout")),
             large, dict(large, gift=dict(fp8, route="by_layout"))]
    per_rank = run_ranks(train_many, 4, specs)
    busiest = [busiest_per_step([r[i]["grad_receives"] for r in per_rank], 2) for i in range(len(specs))]
    native, direct, auto, native_large, auto_large = busiest
    print(f"stage {stage}: direct {direct / native:.2f}x, by_layout {auto / native:.2f}x, "
          f"one bucket {auto_large / native_large:.2f}x of native bf16")
    assert direct / native > 0.85  # the funnel: FP8's saving is gone
    assert auto / native <= 0.55
    assert auto_large / native_large < 0.3
    for i, expect_relay in ((2, True), (4, False)):  # telemetry's own count is what the wire carried
        records = per_rank[0][i]["records"]
        assert records[-1]["bytes_recv_max"] == busiest_per_step([r[i]["grad_receives"] for r in per_rank], 2,
                                                                 last=True)
        assert (records[-1]["relay_buckets"] > 0) == expect_relay


@pytest.mark.parametrize("stage", [1, 2])
def test_two_level_nics_carry_a_fifth_of_native_bf16_with_buckets_smaller_than_a_partition(stage):
    # 2 x 2 (ranks 0-1, 2-3 as nodes), 20k-element buckets of one or two owners: what arrives from
    # the other node, native's ring against GIFT FP8 two-level by route (measured 0.30x owner_slot,
    # 0.17x balanced); the node stage and the forwards stay inside a node (all bytes at stage 2: 0.87x, 0.75x)
    two = {"hierarchy": "two_level", "ranks_per_node": 2}
    base = dict(BASE, stage=stage, count_recv=2)
    fp8 = dict(FP8, stage1_rounds=False)
    specs = [base, dict(base, gift=dict(fp8, route="direct", **two)), dict(base, gift=dict(fp8, route="by_layout", **two))]
    per_rank = run_ranks(train_many, 4, specs)
    nic = [busiest_per_step([r[i]["grad_receives"] for r in per_rank], 2, internode=True) for i in range(3)]
    native, direct, auto = nic
    print(f"stage {stage}: two-level from other nodes, direct {direct / native:.2f}x, by_layout {auto / native:.2f}x")
    assert auto / native <= 0.25 and auto < 0.7 * direct
    for i in (1, 2):  # telemetry's own figures are what the wire carried on the last step
        runs = [r[i]["grad_receives"] for r in per_rank]
        record = per_rank[0][i]["records"][-1]
        assert record["bytes_recv_max_internode"] == busiest_per_step(runs, 2, internode=True, last=True)
        assert record["bytes_recv_max"] == busiest_per_step(runs, 2, last=True)
        assert (record["balanced_buckets"] > 0) == (i == 2)


LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1},
            "route": "relay"}


@pytest.mark.parametrize("stage", [1, pytest.param(2, marks=pytest.mark.isa)])
def test_lossless_config_relayed_matches_deepspeed(stage):
    # 4 ranks, buckets smaller than a partition, gradient accumulation; fp32 sums in rank order
    # (a chunk's, then the owner's) are another order of native's sum: within native's own spread
    base = dict(stage=stage, steps=3, ga=2, bucket=12000)
    gift = dict(LOSSLESS, stage1_rounds=False)  # stage 1 through DeepSpeed's buckets, relayed
    results = run_ranks(train_many, 4, [base, native_perturbed(base, 4), dict(base, gift=gift)])
    for native, perturbed, gift in results:
        assert_within_native_spread(native, perturbed, gift)
        assert all(r["relay_buckets"] > 0 and r["fidelity_rel_err"] < 1e-6 for r in gift["records"])


@pytest.mark.isa
@pytest.mark.parametrize("stage,route,counter", [(2, "relay", "relay_buckets"), (1, "by_layout", "rounds")],
                         ids=["relay", "zero1 rounds"])
def test_relay_and_rounds_under_muon_keep_shared_matrices_whole(stage, route, counter):
    # Muon matrices cut by a partition travel whole to their copy ranks (direct), the rest relayed;
    # or, ZeRO-1's balanced rounds, each shared matrix whole in one round
    base = dict(stage=stage, steps=3, bucket=20000, optimizer="muon", lr=2e-2, muon_ns_fp32=True)
    results = run_ranks(train_many, 3, [base, native_perturbed(base, 3), dict(base, gift=dict(LOSSLESS, route=route))])
    for native, perturbed, gift in results:
        assert gift["split_muon"]
        assert_within_native_spread(native, perturbed, gift)
        assert all(r[counter] > 0 for r in gift["records"])
    assert len({r[2]["digests"][-1] for r in results}) == 1  # every replica identical


@pytest.mark.parametrize("stage,route,counter", [(2, "relay", "relay_buckets"), (1, "by_layout", "rounds")],
                         ids=["relay", "zero1 rounds"])
def test_relay_and_rounds_with_stochastic_rounding_and_error_feedback_resume_exactly(tmp_path, stage, route, counter):
    # the relay's residuals (both hops), and ZeRO-1's balanced rounds (their layout, and with it the
    # residuals' keys, the same every step)
    gift = {"format": "int4", "rounding": "stochastic", "error_feedback": True, "layers": "all", "route": route,
            "geometry": {"rank": 8, "refresh_interval": 2, "collect_interval": 1}, "telemetry": {"every": 1}}
    save_dir = str(tmp_path / "ckpt")
    base = dict(stage=stage, steps=5, bucket=20000, gift=gift)
    full, first = run_ranks(train_many, 3, [base, dict(base, steps=3, save_at=3, save_dir=save_dir)])[0]
    (resumed,) = run_ranks(train_many, 3, [dict(base, resume=save_dir)])[0]
    assert all(r[counter] > 0 for r in full["records"])
    assert first["losses"] == full["losses"][:3]
    assert resumed["losses"] == full["losses"][3:]  # residuals saved right after a refresh: moved, read at step 3
    assert full["losses"][-1] < full["losses"][0]


@pytest.mark.parametrize("stage,route,counter", [(2, "relay", "relay_buckets"), (1, "by_layout", "rounds")],
                         ids=["relay", "zero1 rounds"])
def test_compiled_codecs_train_real_engines_to_the_eager_bits(stage, route, counter):
    # DeepSpeed engines, 3 ranks, the README's Euclidean FP8 with stochastic rounding: compiled,
    # a rank's plain sections (ZeRO-1's rounds) and a relay's sums (ZeRO-2's small buckets) are
    # encoded a batch at a time (Codec.encode_spans); every step's loss and every replica equal
    # the eager codecs' run bit for bit
    gift = {"format": "fp8_e4m3", "rounding": "stochastic", "geometry": {"kind": "identity"}, "route": route,
            "telemetry": {"every": 0}}
    base = dict(stage=stage, steps=3, bucket=20000)
    results = run_ranks(train_many, 3, [dict(base, gift=dict(gift, kernels=mode)) for mode in ("eager", "compiled")])
    for eager, compiled in results:
        assert len(compiled["records"]) == 3 and all(r[counter] > 0 for r in compiled["records"])
        assert eager["losses"] == compiled["losses"]
        assert eager["digests"] == compiled["digests"]


def test_the_layout_model_lays_out_buckets_as_deepspeed_does():
    # benchmarks/layout_model.py builds buckets and partitions by DeepSpeed's rules; here its
    # layout of the tiny Llama is checked against what real engines hand GIFT, bucket by bucket
    from benchmarks import layout_model
    from launch.pretrain import PRESETS

    spec = dict(stage=2, steps=1, bucket=20000, gift=dict(FP8, route="direct"), record_buckets=True)
    per_rank = run_ranks(train_many, 4, [spec, dict(spec, bucket=7000)])
    sizes, arrival = layout_model.parameter_layout(PRESETS["tiny"])
    for i, bucket in enumerate((20000, 7000)):
        assert per_rank[0][i]["bucket_owners"] == layout_model.buckets_of(sizes, arrival, 4, bucket)


def test_the_layout_model_finds_the_funnel_and_the_relay_removes_it():
    from benchmarks import layout_model

    rows = layout_model.rows_with_nics(layout_model.main([]))
    one_nic = {(r["model"], r["world"]): r for r in rows if r["per_node"] == 1}
    # 5e8-element buckets reach one or two owners of a 7B model at 8 GPUs: direct is slower than bf16
    assert one_nic[("7B", 8)]["owners_max"] <= 2 and one_nic[("7B", 8)]["direct_vs_bf16"] > 1.5
    assert one_nic[("13B", 64)]["direct_vs_bf16"] > 5
    assert all(r["by_layout_vs_bf16"] <= 0.55 for r in one_nic.values())  # one NIC per GPU: every row
    # 8 GPUs per node: today's two-level funnels into the owners' slots (7B and 13B at 64 GPUs);
    # the balanced split keeps every row's busiest NIC under 0.55x of DeepSpeed's bf16
    eight = {(r["model"], r["world"]): r for r in rows if r["per_node"] == 8}
    assert eight[("13B", 64)]["two_level_owner_slot_vs_bf16"] > 1.2
    assert all(r["two_level_by_layout_vs_bf16"] <= 0.55 for r in eight.values())
    assert all(r["two_level_by_layout_vs_bf16"] <= r["two_level_owner_slot_vs_bf16"] for r in eight.values())
    # ZeRO-1's balanced rounds (gift.stage1_rounds): a quarter of bf16 on every layout, as one
    # bucket over every owner would be (flat with a NIC per GPU; two-level with 8 per node)
    assert all(r["rounds_vs_bf16"] <= 0.30 for r in one_nic.values())
    assert all(r["two_level_rounds_vs_bf16"] <= 0.30 for r in eight.values())


def test_a_nan_in_a_relayed_bucket_reaches_deepspeed_as_natively():
    # 3 ranks, every bucket relayed: the nan travels through a relay's fp32 sum and its second
    # encoding, and DeepSpeed skips the step exactly as natively; telemetry counts it
    poison = {"step": 1, "rank": 1, "param": "model.layers.1.mlp.down_proj.weight"}
    base = dict(stage=2, steps=3, bucket=20000, poison=poison)
    gift = {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 8, "refresh_interval": 2},
            "error_feedback": True, "telemetry": {"every": 1}, "route": "relay"}
    results = run_ranks(train_many, 3, [base, dict(base, gift=gift)])
    for native, lowp in results:
        assert native["skipped"] == 1 and lowp["skipped"] == 1
        assert lowp["losses"] == pytest.approx(native["losses"], rel=1e-3)
        assert all(r["relay_buckets"] > 0 for r in lowp["records"])
    poisoned = [r for res in results for r in res[1]["records"] if r["step"] == 1]
    assert sum(r["nonfinite"] for r in poisoned) > 0
    assert any(r["fidelity_rel_err"] != r["fidelity_rel_err"] for r in poisoned)  # nan, not a finite lie


# ---- two-level: a bucket with few owners is spread over every rank of the node ----------
def _few_owner_bucket(world):
    """Five parameters of one bucket, owned by rank 1 and the last rank only (buckets smaller than
    a partition): matrices cut mid-row by the owners, a Muon matrix shared by both, a vector in
    ``others`` (bf16; left out of the comparisons below)."""
    last = world - 1
    shapes = {0: (6, 16), 1: (5, 32), 2: (40,), 3: (24, 16), 4: (300,)}
    cuts = {0: [(1, 96)], 1: [(1, 80), (last, 80)], 2: [(1, 40)], 3: [(1, 200), (last, 184)], 4: [(last, 300)]}
    slices, offset = [], 0
    for key, shape in shapes.items():
        at = 0
        for dst, n in cuts[key]:
            mode = GEO if len(shape) == 2 else (HIGH if key == 2 else MAIN)
            slices.append(ParamSlice(dst, offset + at, n, at, key, shape[-1] if mode == GEO else 0, mode,
                                     (1, last) if key == 1 else ()))
            at += n
        offset += at
    return slices, offset


def _two_level_routes_body(rank, world, per_node):
    import torch.distributed as dist

    from deepspeed_gift.core import geometry as geo
    from deepspeed_gift.exchange.comm import TorchComm, split_by_node
    from deepspeed_gift.exchange.two_level import TwoLevelReducer

    dist.init_process_group("gloo")
    slices, total = _few_owner_bucket(world)
    whiteners = {}
    for key, dim in ((0, 16), (1, 32), (3, 16)):
        x = torch.randn(200, dim, generator=torch.Generator().manual_seed(key)) * torch.linspace(0.1, 3.0, dim)
        whiteners[key] = geo.fit_whitener(x.T @ x / 200, rank=4, damping=1e-3)
    node_comm, slot_comm = split_by_node(TorchComm(), per_node)
    grads = [torch.randn(total, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    out = {}
    for fmt in ("fp32", "fp8_e4m3"):
        for route in ("direct", "relay", "by_layout"):
            inner = GiftReducer(slot_comm, formats.get_format(fmt), formats.get_format("bf16"), route=route)
            two = TwoLevelReducer(node_comm, inner, per_node)
            bucket = grads[rank].clone()
            outputs = [torch.zeros(s.numel) if s.dst == rank else None for s in slices]
            stats = two.reduce(bucket, slices, whiteners, divisor=world, outputs=outputs)
            owned = [(s.bucket_offset, bucket.narrow(0, s.bucket_offset, s.numel).clone(), o)
                     for s, o in zip(slices, outputs) if s.dst == rank and s.mode != HIGH]
            shared = bucket.narrow(0, 96, 160).clone() if rank in (1, world - 1) else None
            out[fmt, route] = (owned, stats.balanced_buckets, stats.recv_max_internode, stats.recv_max, shared)
    return out, torch.stack(grads).mean(0)


@pytest.mark.parametrize("world,per_node", [(4, 2), (6, 2), (6, 3)])
def test_two_level_spreads_a_bucket_with_few_owners_over_every_rank_of_the_node(world, per_node):
    per_rank = run_ranks(_two_level_routes_body, world, per_node)
    exact = per_rank[0][1]
    results = [r[0] for r in per_rank]
    for fmt in ("fp32", "fp8_e4m3"):
        for route in ("direct", "relay", "by_layout"):
            split, nic, busiest = results[0][fmt, route][1:4]
            assert all(r[fmt, route][1:4] == (split, nic, busiest) for r in results)  # every rank plans the same
            assert split == (route != "direct"), (route, split)  # by_layout: the balanced split is lighter
            got = torch.cat([v for r in results for _, v, _ in r[fmt, route][0]])
            want = torch.cat([exact.narrow(0, at, v.numel()) for r in results for at, v, _ in r[fmt, route][0]])
            rel = float((got - want).norm() / want.norm())
            for r in results:
                for _, v, o in r[fmt, route][0]:
                    torch.testing.assert_close(o, v)  # the compact output has the same result, forwarded or not
            copies = [r[fmt, route][4] for r in results if r[fmt, route][4] is not None]
            assert len(copies) == 2 and torch.equal(copies[0], copies[1])  # the Muon matrix whole at both owners
            shared_rel = float((copies[0] - exact.narrow(0, 96, 160)).norm() / exact.narrow(0, 96, 160).norm())
            if fmt == "fp32":
                assert rel < 1e-5 and shared_rel < 1e-5, (route, rel, shared_rel)
            else:
                assert 0 < rel < 0.08 and 0 < shared_rel < 0.08, (route, rel, shared_rel)
        # among the nodes the busiest rank receives about its share, not the owners' slots' load
        # (measured: by_layout 0.54x / 0.54x / 0.39x of direct as 2x2 / 3x2 / 2x3 nodes x ranks, both formats)
        nic = {route: results[0][fmt, route][2] for route in ("direct", "relay", "by_layout")}
        assert nic["by_layout"] <= 0.6 * nic["direct"] and nic["relay"] < nic["direct"], nic


# Uneven sections, a HIGH one, and owners with several: each owner's relays fall into runs of
# different layouts (chunks of q + 1 blocks, of q blocks, the short last one, none).
UNEVEN = [ParamSlice(1, 0, 1003, 0, 0), ParamSlice(1, 1003, 517, 0, 1, mode=HIGH),
          ParamSlice(2, 1520, 4099, 0, 2), ParamSlice(0, 5619, 70, 0, 3), ParamSlice(4, 5689, 2600, 0, 4)]


def test_relay_chunks_come_in_a_few_runs_of_one_layout_whatever_the_world():
    # chunk_bounds: q or q + 1 whole blocks, the longer ones from the owner on (its own chunk
    # never travels), so a section's relays fall in at most a few runs of one size; the owner
    # decodes each run as one batch. The busiest relay holds ceil(blocks / world) blocks.
    from deepspeed_gift.exchange.plan import BucketPlan, chunk_bounds, plan_route
    from deepspeed_gift.exchange.relay import relay_runs

    for numel, world, align, first in [(1003, 5, 128, 1), (4099, 64, 16, 63), (70, 8, 128, 0), (2600, 7, 1, 4)]:
        chunks = chunk_bounds(numel, world, align, first)
        assert [s for s, _ in chunks] == [sum(n for _, n in chunks[:j]) for j in range(world)]
        assert sum(n for _, n in chunks) == numel and all(s % align == 0 for s, n in chunks if n)
        longest = -(-(-(-numel // align)) // world) * align  # ceil(blocks / world) blocks
        assert max(n for _, n in chunks) <= longest
        assert chunks[first][1] == min(longest, numel - chunks[first][0])  # the owner's is a longer one
    codec = formats.get_format("fp8_e4m3")
    for world in (6, 16, 64):
        slices = [ParamSlice(s.dst, s.bucket_offset, s.numel, 0, s.param_key, mode=s.mode) for s in UNEVEN]
        plan = BucketPlan(slices, world, {})
        plan_route(plan, "relay", lambda sec: codec, codec.block_size)
        for owner in (0, 1, 2, 4):
            runs = relay_runs(plan, owner)
            owned = [i for i in plan.to_rank[owner] if not plan.sections[i].shared]
            relays = [j for run, _ in runs for j in run]
            assert relays == [j for j in range(world) if plan.forward_sizes[j][owner]]
            assert len(runs) <= 2 + 2 * len(owned), (world, owner, [(r[0], r[-1]) for r, _ in runs])


def _reduce_relay_codec(comm, route, fmt, slices, grads):
    return _reduce(comm, route, fmt, slices, grads, relay_codec=formats.get_format(fmt),
                   high_codec=formats.get_format("fp32"))


@pytest.mark.parametrize("fmt", ["fp32", "fp8_e4m3"])
def test_relay_of_uneven_sections_equals_the_direct_route(fmt):
    # the owner's batched assembly places every relay's chunk: fp32 equals the direct route up
    # to the order of the sum (ulps); fp8 within the second quantization of the relayed sums
    world = 6
    grads = torch.randn(1, world, 8289, generator=torch.Generator().manual_seed(3))
    exact = grads[0].mean(0)
    out = {route: run_local(world, _reduce_relay_codec, route, fmt, UNEVEN, grads) for route in ("direct", "relay")}
    assert out["relay"][0][1].relay_buckets == 1
    err = {route: _owned_err(out[route], UNEVEN, exact) for route in out}
    if fmt == "fp32":
        assert err["relay"] < 1e-6 and err["direct"] < 1e-6, err
    else:  # measured 0.033 against 0.025 direct
        assert err["direct"] < err["relay"] < 1.6 * err["direct"], err


class _CountingTransform:
    """A whitener that counts how many elements it was applied to."""

    def __init__(self, inner) -> None:
        self.inner, self.applied = inner, 0

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def apply_run(self, values, start):
        self.applied += values.numel()
        return self.inner.apply_run(values, start)


def _relay_whitened(comm, fmt):
    from deepspeed_gift.core import geometry as geo

    rows, dim = 64, 32
    x = torch.randn(400, dim, generator=torch.Generator().manual_seed(0))
    whitener = _CountingTransform(geo.fit_whitener(x.T @ x / 400, rank=4, damping=1e-3))
    slices = [ParamSlice(0, 0, rows * dim, 0, 0, dim, GEO)]  # one owner: relayed
    reducer = GiftReducer(comm, formats.get_format(fmt), route="relay")
    bucket = torch.randn(rows * dim, generator=torch.Generator().manual_seed(1 + comm.rank))
    stats = reducer.reduce(bucket, slices, {0: whitener}, divisor=comm.world_size)
    return whitener.applied, stats.relay_buckets


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "nvfp4"])
def test_a_relayed_section_is_whitened_once_not_once_per_chunk(fmt):
    # the relay's chunks are windows of one source read in order: the whitener runs over the
    # section once (nvfp4 reads each chunk twice, for its global scale: at most twice). A fresh
    # source per chunk ran it over the whole tile (here the whole section) for every chunk: 8x.
    for applied, relayed in run_local(8, _relay_whitened, fmt):
        assert relayed == 1 and 64 * 32 <= applied <= 2 * 64 * 32, applied
