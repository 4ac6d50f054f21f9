"""Two-level's node stage in a wire format of its own (``gift.node_format``): each rank encodes
the part of the bucket it sends each other rank of its node, the receiver decodes and sums in
fp32 with its own part exact. Real gloo ranks, one machine posing as 2 nodes of 2; the exchange
among the nodes in fp32, so what differs from the bucket-dtype node stage is the node format's
alone."""

import math

import pytest
import torch

from deepspeed_gift.config import GiftConfig, get_gift_config
from deepspeed_gift.core import formats
from deepspeed_gift.exchange.plan import MAIN, ParamSlice
from launch.spawn import run_ranks

# (owner, elements) runs of one bucket: lengths off the node format's 32-element blocks, so the
# blocks a sender cuts span the runs it sends one rank
RUNS = [(0, 301), (1, 77), (2, 500), (3, 123), (1, 260), (0, 45), (3, 390), (2, 31)]
NODE_BLOCK = 32


def _bucket():
    slices, offset = [], 0
    for key, (dst, n) in enumerate(RUNS):
        slices.append(ParamSlice(dst, offset, n, 0, key, 0, MAIN, ()))
        offset += n
    return slices, offset


def _grad(rank: int, step: int, total: int, dtype, representable: bool) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * step + rank)
    if representable:  # +-127 * 2^-5 everywhere: every block's amax is 127 of its scale, every value exact
        signs = torch.randint(0, 2, (total,), generator=gen) * 2 - 1
        return (signs * 127.0 * 2.0 ** -5).to(dtype)
    return (torch.randn(total, generator=gen) * torch.linspace(0.01, 4.0, total)).to(dtype)


def _body(rank, world, per_node):
    import torch.distributed as dist

    from deepspeed_gift.core.rng import CounterRng
    from deepspeed_gift.exchange.comm import TorchComm, split_by_node
    from deepspeed_gift.exchange.reducer import GiftReducer
    from deepspeed_gift.exchange.two_level import TwoLevelReducer

    dist.init_process_group("gloo")
    slices, total = _bucket()
    node_comm, slot_comm = split_by_node(TorchComm(), per_node)

    def run(node_format, dtype, pieces, overlap, representable, route="direct"):
        inner = GiftReducer(slot_comm, formats.get_format("fp32"), generator=CounterRng(3 + rank), route=route)
        codec = None if node_format is None else formats.get_format(node_format, block_size=NODE_BLOCK)
        two = TwoLevelReducer(node_comm, inner, per_node, pieces=pieces, piece_min_elements=300, overlap=overlap,
                              node_codec=codec)
        got = []
        for step in range(2):
            grad = _grad(rank, step, total, dtype, representable)
            stats = two.reduce(grad, slices, {}, divisor=world, step=step)
            mine = torch.cat([grad.narrow(0, s.bucket_offset, s.numel) for s in slices if s.dst == rank])
            got.append((mine.clone(), stats.bytes_node, stats.pieces))
        return got

    out = {}
    for overlap in (False, True):
        for pieces in (1, 3):
            out["int8", pieces, overlap] = run("int8", torch.float32, pieces, overlap, False)
    out["none", 1] = run(None, torch.float32, 1, True, False)
    for route in ("direct", "by_layout"):
        out["bf16 exact", route] = run("int8", torch.bfloat16, 3, True, True, route)
        out["bf16 none", route] = run(None, torch.bfloat16, 3, True, True, route)
    return out


@pytest.fixture(scope="module")
def ranks():
    return run_ranks(_body, 4, 2)


def _exact_sums(step: int, rank: int, dtype, representable: bool) -> torch.Tensor:
    slices, total = _bucket()
    exact = sum(_grad(r, step, total, dtype, representable).double() for r in range(4))
    return torch.cat([exact.narrow(0, s.bucket_offset, s.numel) for s in slices if s.dst == rank])


def test_a_quantized_node_stage_errs_within_the_node_formats_half_step(ranks):
    """Each owner's result is the fp64 sum of the 4 ranks' gradients over 4, but for one term a
    node quantized in int8 per 32 (the other local rank's, the receiver's own is exact): at most
    half a scale of each, a scale at most that rank's largest |g| over 127, plus fp32's sums."""
    for rank, got in enumerate(ranks):
        for pieces in (1, 3):
            for step in range(2):
                result = got["int8", pieces, True][step][0].double()
                exact = _exact_sums(step, rank, torch.float32, False) / 4
                amax = max(_grad(r, step, _bucket()[1], torch.float32, False).abs().max().item() for r in range(4))
                # 2 nodes, one quantized term each: 2 half-steps; 4 fp32 terms summed: 3 roundings
                bound = (2 * amax / 127 / 2 * (1 + 2 ** -20) + 3 * 4 * amax * 2 ** -24) / 4
                err = (result - exact).abs()
                assert err.max().item() <= bound, (rank, pieces, step, err.max().item(), bound)
                # and quantized it is: the bucket-dtype stage at one piece errs by fp32 sums alone
                assert err.max().item() > 100 * 4 * amax * 2 ** -24 / 4, (rank, pieces, step)
        none = got["none", 1][0][0].double()
        amax = max(_grad(r, 0, _bucket()[1], torch.float32, False).abs().max().item() for r in range(4))
        assert (none - _exact_sums(0, rank, torch.float32, False) / 4).abs().max().item() <= 3 * 4 * amax * 2 ** -24 / 4


def _one_piece_reference(step: int, rank: int) -> torch.Tensor:
    """What owner ``rank`` holds after the int8 node stage in one piece on the direct route (the
    owner_slot split), made here from the codec itself: on each node, its slot's runs of the bucket
    (every slice whose owner is on that slot, in bucket order) from the other local rank encoded
    as one payload and decoded, plus the slot's own runs exact; the two nodes' partials summed in
    fp32 by the fp32 exchange among them and divided by 4 (sums of two terms and a power of two:
    no order to choose)."""
    slices, total = _bucket()
    codec = formats.get_format("int8", block_size=NODE_BLOCK)
    slot = rank % 2
    runs = [s for s in slices if s.dst % 2 == slot]

    def gather(r: int) -> torch.Tensor:
        g = _grad(r, step, total, torch.float32, False)
        return torch.cat([g.narrow(0, s.bucket_offset, s.numel) for s in runs])

    partials = [gather(2 * node + slot) + codec.decode(codec.encode(gather(2 * node + 1 - slot)))
                for node in (0, 1)]
    reduced = (partials[0] + partials[1]) / 4
    mine, at = [], 0
    for s in runs:
        if s.dst == rank:
            mine.append(reduced[at:at + s.numel])
        at += s.numel
    return torch.cat(mine)


def test_a_quantized_node_stage_is_the_codecs_round_trip_of_the_other_ranks_runs(ranks):
    """Bit for bit, the reference above: each block's own scale (not a bound from the largest
    gradient), the payload's blocks cut across the runs a rank sends one slot, the receiver's own
    part exact."""
    for rank, got in enumerate(ranks):
        for step in range(2):
            assert torch.equal(got["int8", 1, True][step][0], _one_piece_reference(step, rank)), (rank, step)


def test_the_overlap_never_changes_a_quantized_node_stage_bits(ranks):
    for got in ranks:
        for pieces in (1, 3):
            for step in range(2):
                assert torch.equal(got["int8", pieces, False][step][0], got["int8", pieces, True][step][0])
            assert got["int8", pieces, True][0][2] == pieces


def test_values_the_node_format_holds_exactly_reduce_to_the_bucket_dtype_stages_bits(ranks):
    """+-127 * 2^-5 in every element: int8 per 32 holds each exactly (a scale of 2^-5), so a
    quantized node stage that sends every part to its slot and sums it in local rank order gives
    the bucket-dtype stage's bits, owner_slot and balanced (forwards) splits alike."""
    for got in ranks:
        for route in ("direct", "by_layout"):
            for step in range(2):
                assert torch.equal(got["bf16 exact", route][step][0], got["bf16 none", route][step][0]), (route, step)


def test_a_quantized_node_stage_sends_its_payloads_bytes(ranks):
    """fp32 bucket, one piece, owner_slot: the bucket-dtype stage sends 16 + 4 n bytes to the other
    local rank, the int8 one 16 + the payload's 16 + 4 ceil(n / 32) + n."""
    codec = formats.get_format("int8", block_size=NODE_BLOCK)
    for got in ranks:
        plain = got["none", 1][0][1]
        n = (plain - 16) // 4
        assert plain == 16 + 4 * n
        assert got["int8", 1, True][0][1] == 16 + codec.nbytes(n) == 32 + 4 * math.ceil(n / NODE_BLOCK) + n
        assert got["int8", 1, True][0][1] < 0.3 * plain


def test_node_format_is_checked_and_resolved_at_config():
    cfg = GiftConfig(node_format="int8", node_block_size=32)
    assert cfg.node_codec_options() == dict(rounding="nearest", seed=0, kernels="by_device", block_size=32,
                                            name="int8")
    assert GiftConfig(node_format="fp8_e4m3").node_codec_options()["block_size"] == 128
    assert GiftConfig(node_format="bf16").node_codec_options() == dict(rounding="nearest", seed=0,
                                                                     kernels="by_device", name="bf16")
    assert GiftConfig().node_codec_options() is None
    for bad, key in (({"node_block_size": 32}, "gift.node_block_size"),
                     ({"node_format": "int8", "hierarchy": "flat"}, "gift.node_format"),
                     ({"node_format": "nvfp4", "node_block_size": 32}, "gift.node_block_size"),
                     ({"node_format": "bf16", "node_block_size": 8}, "gift.node_block_size"),
                     ({"node_format": "auto"}, "gift.node_format"),
                     ({"node_format": "fp9"}, "gift.node_format")):
        with pytest.raises(ValueError, match=key):
            get_gift_config({"gift": bad})


def test_node_format_with_muon_is_refused_at_initialize():
    # Muon's matrices cut by the partitions reach every owner of a slice whole, and the copies must
    # agree bit for bit: a quantized node stage rounds each slot's copy on its own block
    # boundaries (and adds the slot's own part exact), so the pair is refused, naming the key
    from launch.spawn import run_ranks
    from tests.harness import initialize_error

    gift = {"format": "fp8_e4m3", "hierarchy": "two_level", "ranks_per_node": 2, "node_format": "int8"}
    per_rank = run_ranks(initialize_error, 2, dict(stage=2, optimizer="muon", gift=gift))
    assert all("gift.node_format: got 'int8' with DeepSpeed's Muon" in m for m in per_rank), per_rank
    per_rank = run_ranks(initialize_error, 2, dict(stage=2, optimizer="muon", gift={**gift, "node_format": None}))
    assert per_rank == ["", ""], per_rank
