"""The compiled codec kernels (``gift.kernels: compiled``) against the eager codecs, their
reference: the same bytes and the same sums.

Bit for bit wherever a value is finite. In a block holding inf or nan the payload's element
bits are free (the scale carries the block's non-finiteness; an fp32 nan cast to an integer has
no defined value): there both paths must decode every element non-finite, nan or inf alike.
Each kernel variant compiles once per process (5-40 s on 2 cores, less from inductor's disk
cache), so the cases are few and each covers a family: a block format, a per-tensor one, the
packed nibbles, NVFP4's scale choice, and the sum of each kind of payload.
"""

import functools

import pytest
import torch

from deepspeed_gift.config import get_gift_config
from deepspeed_gift.core import kernels
from deepspeed_gift.core.formats import NvFp4Codec, get_format, integer
from deepspeed_gift.core.formats.fp8 import fp8_block_encode
from deepspeed_gift.core.rng import CounterRng, counter_bits
from tests.kernel_calls import compiled_calls

N = 20000 + 37  # a short last block for every block size here
SMALL_TILE = 4096  # several tiles, the last one short


def _input(n=N, seed=0):
    gen = torch.Generator().manual_seed(seed)
    spread = torch.logspace(-30, 30, n // 64 + 1, base=2.0)[torch.randperm(n // 64 + 1, generator=gen)]
    x = torch.randn(n, generator=gen) * spread.repeat_interleave(64)[:n]
    x[64 * 3: 64 * 4] = 0.0  # an all-zero block
    x[64 * 5 + 7] = float("nan")
    x[64 * 9 + 1] = float("inf")
    x[64 * 11 + 2] = float("-inf")
    x[64 * 13: 64 * 14] *= 2.0**-140  # fp32 subnormal amax: the scale is nudged
    return x


def _nonfinite_blocks(x, block):
    """bool per element: its block (of ``block``; the whole tensor when 0) holds inf/nan."""
    bad = ~torch.isfinite(x)
    if block == 0:
        return torch.full_like(bad, bool(bad.any()))
    n = x.numel()
    padded = torch.nn.functional.pad(bad, (0, -n % block)).view(-1, block).any(1)
    return padded.repeat_interleave(block)[:n]


def _same_values(a, b, free):
    """Equal bits where ``free`` is false; non-finite in both where it is true."""
    assert torch.equal(a[~free].view(torch.int32), b[~free].view(torch.int32))
    assert not torch.isfinite(a[free]).any() and not torch.isfinite(b[free]).any()


def _element_bytes(codec, wire, n):
    """The element data of a wire buffer, without header and scales."""
    return wire[codec._offsets(n)[2]:]


ENCODE_CASES = [
    ("fp8_e4m3", {}),  # fp32 scale per 128: fp8_block_encode
    ("fp8_e5m2", {"block_size": 0}),  # one scale per tensor: scaled_cast over tiles
    ("int8", {"block_size": 32}),  # the relay's second hop: int_block_encode
    ("int4", {}),  # packed nibbles
    ("nvfp4", {}),  # the per-block scale choice among three candidates
]


def _same_payloads(eager, pe, pf, x):
    """Encodes of ``x`` by two codecs of one format: the same bytes where blocks are finite."""
    we, wf = eager.payload_to_bytes(pe), eager.payload_to_bytes(pf)
    if eager.scale_kind == "none":  # element by element: every bit alike, nan and inf included
        assert torch.equal(we, wf)
        return
    n = x.numel()
    offsets = eager._offsets(n)
    assert torch.equal(we[: offsets[1]], wf[: offsets[1]])  # header, NVFP4's global scale
    se, sf = pe.scales.float(), pf.scales.float()  # block scales: equal bits, a nan's aside
    assert torch.equal(se.isnan(), sf.isnan())
    assert torch.equal(pe.scales[~se.isnan()].view(torch.uint8), pf.scales[~sf.isnan()].view(torch.uint8))
    free = _nonfinite_blocks(x, eager.block_size)
    if eager.elements_per_byte == 1:
        keep = ~free
        assert torch.equal(_element_bytes(eager, we, n)[keep], _element_bytes(eager, wf, n)[keep])
    else:  # a byte holds two elements: compare the bytes whose elements are both finite-blocked
        pair_free = torch.nn.functional.pad(free, (0, n % 2)).view(-1, 2).any(1)
        assert torch.equal(_element_bytes(eager, we, n)[~pair_free], _element_bytes(eager, wf, n)[~pair_free])
    _same_values(eager.decode(pe), eager.decode(pf), free)


@pytest.mark.parametrize("tile,n", [(None, N), (SMALL_TILE, N), (None, 160 * 128)],
                         ids=["tile", "small_tile", "one_tile_whole_blocks"])
@pytest.mark.parametrize("name,options", ENCODE_CASES, ids=[f"{n}-{o}" for n, o in ENCODE_CASES])
def test_compiled_encode_equals_eager(name, options, tile, n):
    """Every tile of whole blocks compiled, a short last block eager; a section of one tile of
    whole blocks (NVFP4 then writes its header, global scale, scales and data in one copy)."""
    x = _input(n)
    eager = get_format(name, kernels="eager", **options)
    fused = get_format(name, kernels="compiled", **options)
    _same_payloads(eager, eager.encode(x, tile_elements=tile), fused.encode(x, tile_elements=tile), x)


@pytest.mark.parametrize("name,options", [("fp8_e4m3", {}), ("fp8_e5m2", {"block_size": 0}),
                                          ("int8", {"block_size": 32}), ("nvfp4", {})],
                         ids=["fp8_block", "fp8_tensor", "int8_32", "nvfp4"])
def test_compiled_encode_reads_bf16_values_as_they_lie(name, options, monkeypatch):
    """A bf16 tensor (a bf16 bucket's gradients) reaches the compiled kernels as it lies, widened
    to fp32 inside them (exact), not first copied into an fp32 tile: the same bytes as eager's,
    which reads every tile into fp32; only a tile of a short last block is still read so. Also
    through a reducer's section whose tiles straddle its pieces (those are read, the rest not)."""
    from deepspeed_gift.core.formats import TensorSource
    from deepspeed_gift.exchange.plan import Piece, SectionSource

    reads = []
    real_read = TensorSource.read
    monkeypatch.setattr(TensorSource, "read", lambda self, e0, e1, work: reads.append(e1 - e0)
                        or real_read(self, e0, e1, work))
    x = _input().to(torch.bfloat16)
    eager = get_format(name, kernels="eager", **options)
    fused = get_format(name, kernels="compiled", **options)
    pe = eager.encode(x, tile_elements=SMALL_TILE)
    eager_reads, reads[:] = len(reads), []
    pf = fused.encode(x, tile_elements=SMALL_TILE)
    assert eager_reads >= 5 and len(reads) <= 2, (eager_reads, reads)  # the last tile (each pass)
    _same_payloads(eager, pe, pf, x.float())
    bucket = torch.cat([x, -x[:5000]])
    pieces = [Piece(0, 7000, -1), Piece(7000, 9000, -1), Piece(16000, 9037, -1)]
    ref, got = (codec.encode_source(SectionSource(bucket, pieces, None, tile=SMALL_TILE), 25037,
                                    tile_elements=SMALL_TILE) for codec in (eager, fused))
    _same_payloads(eager, ref, got, bucket[:25037].float())
    # pieces at odd elements of the bucket (a two-level node stage's runs: 301, 77, ...): views
    # of bf16 at every byte alignment reach the kernels
    odd = [Piece(3, 7001, -1), Piece(7005, 8999, -1), Piece(16009, 9027, -1)]
    values = torch.cat([bucket[p.bucket_offset:p.bucket_offset + p.numel] for p in odd])
    ref, got = (codec.encode_source(SectionSource(bucket, odd, None, tile=SMALL_TILE), values.numel(),
                                    tile_elements=SMALL_TILE) for codec in (eager, fused))
    _same_payloads(eager, ref, got, values.float())


@pytest.mark.parametrize("inside", [True, False], ids=["one_call", "whole_rows_then_short"])
@pytest.mark.parametrize("name,options", [("fp8_e4m3", {}), ("int8", {"block_size": 32}), ("int4", {}),
                                          ("nvfp4", {})], ids=["fp8_block", "int8_32", "int4", "nvfp4"])
def test_a_tile_ending_in_a_short_block_is_compiled_as_it_lies(name, options, inside, monkeypatch):
    """A section shorter than a tile whose length is not a multiple of the block (most of them:
    on a GPU a tile is 2^24 elements): read as it lies (the bf16 values, no fp32 read at all) by
    the compiled kernels, never the eager chain, NVFP4's global scale pass included; the same
    bytes as eager. Where the kernel pads inside (``base.pads_inside``: a GPU) the whole tile is
    one call; elsewhere its whole rows are one call and the short block, padded inside, another.
    Until the short block was split off, the whole tile went eager; until it was compiled, it
    went eager alone; until it was padded inside, it was read into fp32 and padded by a copy."""
    from deepspeed_gift.core.formats import TensorSource, base, nvfp4

    monkeypatch.setattr(base, "pads_inside", lambda device: inside)
    monkeypatch.setattr(nvfp4, "pads_inside", lambda device: inside)
    reads = []
    real_read = TensorSource.read
    monkeypatch.setattr(TensorSource, "read", lambda self, e0, e1, work: reads.append((e0, e1))
                        or real_read(self, e0, e1, work))
    eager = get_format(name, kernels="eager", **options)
    fused = get_format(name, kernels="compiled", **options)
    x = _input(3 * 1024 + 7).to(torch.bfloat16)  # one tile, a short block of 7 at its end
    pe = eager.encode(x, tile_elements=SMALL_TILE)
    reads.clear()

    def eager_chain(*args):
        raise AssertionError("the eager chain ran in the compiled mode")

    monkeypatch.setattr(type(fused), "_candidate_codes" if name == "nvfp4" else "_tile_divisor", eager_chain)
    ranges = []
    real_rows = type(fused)._encode_rows
    monkeypatch.setattr(type(fused), "_encode_rows", lambda self, src, p, rows_or_len, r0, r1, *a:
                        ranges.append((r0, r1)) or real_rows(self, src, p, rows_or_len, r0, r1, *a))
    pf = fused.encode(x, tile_elements=SMALL_TILE)
    assert not reads, reads  # the tile, as it lies
    whole = x.numel() // eager.block_size
    assert ranges == ([] if inside else [(0, whole)]), ranges
    _same_payloads(eager, pe, pf, x.float())


@pytest.mark.parametrize("name,options", [("fp8_e4m3", {}), ("int4", {}), ("int8", {"block_size": 32})],
                         ids=["fp8_block", "int4", "int8_32"])
def test_the_ragged_tile_kernel_is_right_at_its_first_static_compile(name, options):
    """The kernel of a tile that ends in a short block, compiled afresh: its first call compiles
    for that call's shapes (static), its next ones with the length symbolic. Both give eager's
    bytes. Stored as one flat slice of the padded rows, the static kernel (torch 2.13's C++)
    dropped the short block's codes: 1000 elements of fp8 came back with bytes 896.. wrong."""
    codec = get_format(name, kernels="eager", **options)
    codes_fn, codes_kw, packed = codec._fused_block_codes()
    fresh = kernels.compiled.__wrapped__(kernels.ragged_block_encode, block=codec.block_size, codes_fn=codes_fn,
                                         codes_kw=codes_kw, packed=packed)
    lengths = (1000, 4099, 1000, 900, 100, 1)  # the last: a tile of the short block alone
    for n in lengths:
        x = _input(max(n, 1024), seed=n)[:n].nan_to_num(nan=0.0, posinf=1.0, neginf=-1.0)  # finite: all bytes compared
        ref = codec.encode(x)
        data = torch.full((codec._data_bytes(n),), 0xAA, dtype=torch.uint8)  # unwritten bytes show
        whole, width = n // codec.block_size, codec.block_size // codec.elements_per_byte
        scales, short = fresh(x, data[: whole * width].view(whole, width), None, 0)
        data[whole * width:].copy_(short.view(torch.uint8)[: data.numel() - whole * width])
        assert torch.equal(data, ref.data.view(torch.uint8).view(-1)), n
        assert torch.equal(scales.view(torch.int32), ref.scales.view(-1).view(torch.int32)), n
    # a copy per class of the whole rows' count and the length (0, 1, more: dynamo compiles them apart)
    assert len(fresh.graphs) == len({(min(n // codec.block_size, 2), min(n, 2)) for n in lengths})


SPAN_CASES = [("fp8_e4m3", {}), ("int8", {"block_size": 32}), ("int4", {}), ("fp8_e5m2", {}),
              ("fp8_e4m3", {"rounding": "stochastic"}), ("int4", {"rounding": "stochastic"})]


@pytest.mark.parametrize("name,options", SPAN_CASES, ids=[f"{n}-{o}" for n, o in SPAN_CASES])
def test_spans_encoded_in_one_call_give_each_span_its_own_bytes(name, options):
    """``Codec.encode_spans``: spans of one tensor (as it lies, fp32 and bf16) of whole blocks,
    short ones, one element, apart and adjacent, encoded by one compiled call, each cut into its
    wire: every byte the compiled encode of that span alone gives (non-finite blocks included),
    and eager's bytes where blocks are finite; stochastic rounding under each span's own key
    (drawn in the spans' order, as their own encodes draw them), so a second call differs. The
    eager mode, E8M0 scales and odd int4 blocks do not take this path."""
    eager = get_format(name, kernels="eager", seed=7, **options)
    fused = get_format(name, kernels="compiled", seed=7, **options)
    stochastic = options.get("rounding") == "stochastic"
    x = _input()
    spans = [(0, 300), (300, 4133), (4433, 128), (6000, 1), (7001, 2000), (12000, 257), (12257, N - 12257)]
    calls = []
    for src in (x, x.bfloat16()):
        rng = CounterRng(3)
        keys = [fused.next_key(rng) for _ in spans] if stochastic else None
        with compiled_calls() as made:
            parts = fused.encode_spans(src, spans, keys=keys)
        calls += made
        rng, first = CounterRng(3), None
        for (a, n), ps in zip(spans, parts):
            wire = torch.cat(ps)
            first = wire if first is None else first
            state = rng.get_state()
            assert torch.equal(wire, fused.encode_to_bytes(src[a:a + n], generator=rng)), (a, n)
            rng.set_state(state)
            seg = src[a:a + n]
            _same_payloads(eager, eager.encode(seg, generator=rng), eager.bytes_to_payload(wire, (n,)), seg.float())
    assert calls == ["spans_block_encode"] * 2  # one compiled call for all the spans
    if stochastic:  # the next keys: other bits
        again = fused.encode_spans(x, spans, keys=[fused.next_key(rng) for _ in spans])
        assert not torch.equal(torch.cat(again[0]), torch.cat(fused.encode_spans(x, spans, keys=keys)[0]))
        with pytest.raises(ValueError, match="a key per span"):
            fused.encode_spans(x, spans)
    assert not eager.encodes_spans(x.device)
    assert not get_format("fp8_e4m3", kernels="compiled", scale="e8m0").encodes_spans(x.device)
    assert not get_format("int4", kernels="compiled", block_size=33).encodes_spans(x.device)
    with pytest.raises(ValueError, match="do not lie inside"):
        fused.encode_spans(x, [(N - 10, 11)], keys=[(1, 2)] if stochastic else None)


STOCHASTIC_CASES = [
    ("fp8_e4m3", {}),  # fp8_block_encode's stochastic variant
    ("fp8_e5m2", {"block_size": 0}),  # scaled_cast's
    ("int4", {}),  # int_block_encode's, packed
    ("nvfp4", {}),  # the two candidates that never clip, then the winner rounded by chance
    ("bf16", {}),  # the passthrough's cast
]


@pytest.mark.parametrize("name,options", STOCHASTIC_CASES, ids=[f"{n}-{o}" for n, o in STOCHASTIC_CASES])
def test_compiled_stochastic_encode_equals_eager_at_any_tile(name, options):
    """Counter-based random bits: the compiled kernel over whole tiles and the eager chain over
    small ones draw the same bits for each element, so they give the same bytes; a second encode
    takes the next key and differs."""
    eager = get_format(name, kernels="eager", rounding="stochastic", seed=11, **options)
    fused = get_format(name, kernels="compiled", rounding="stochastic", seed=11, **options)
    x = _input()
    _same_payloads(eager, eager.encode(x, tile_elements=SMALL_TILE), fused.encode(x), x)
    finite = torch.nan_to_num(x, nan=1.0, posinf=2.0, neginf=-3.0)  # (a per-tensor scale of inf hides all)
    pe = eager.encode(finite, tile_elements=SMALL_TILE)
    _same_payloads(eager, pe, fused.encode(finite), finite)
    again = eager.encode(finite, tile_elements=SMALL_TILE)
    assert not torch.equal(again.wire, pe.wire)
    _same_payloads(eager, again, fused.encode(finite), finite)


def test_an_elements_random_bits_follow_its_offset_alone_across_2_to_the_32():
    """An offset below 2**32 draws the same bits in a call whose range reaches past 2**32
    (``wide``) as in one that does not, and an offset past it draws by its high word too; so
    NVFP4's columns (element (row, j) at e0 + 16 row + j, drawn at a stride of 16) draw what
    the flat eager range draws, for a tile that ends at 2**32 and for one that crosses it, and
    a short block padded past 2**32 draws what it draws unpadded. Until the commit after
    ``ceb486c`` a wide call gave every offset the second round: columns 1..15 of a tile ending
    at 2**32 drew other bits than the flat range (and a padded short block than an unpadded
    one)."""
    key = torch.tensor(CounterRng(9).next_key())
    below = torch.arange(2**32 - 64, 2**32, dtype=torch.int64)
    past = below + 64
    assert torch.equal(counter_bits(key, below), counter_bits(key, below, wide=True))
    both = counter_bits(key, torch.cat([below, past]), wide=True)
    assert torch.equal(both[:64], counter_bits(key, below))
    assert not torch.equal(both[64:], counter_bits(key, past - 2**32))  # the high word counts
    for e0 in (2**32 - 64, 2**32 - 32):  # a tile ending at 2**32, one crossing it
        flat = kernels.random_bits(key, e0, torch.empty(64), 22).view(4, 16)
        for j in range(16):
            assert torch.equal(kernels.random_bits(key, e0 + j, torch.empty(4), 22, stride=16), flat[:, j]), (e0, j)
    short = kernels.random_bits(key, 2**32 - 16, torch.empty(11), 22)  # a short block ending before 2**32
    assert torch.equal(kernels.random_bits(key, 2**32 - 16, torch.empty(16), 22)[:11], short)  # padded past it


def test_counter_bits_are_uniform_and_keyed():
    """The hash's bits against a uniform law, by arithmetic: over 2**20 consecutive offsets the
    top and the bottom 8 bits fall in 256 bins with chi-square below its mean + 6 sd (255 + 6 *
    sqrt(510)); an identity or a weak mix fails by orders of magnitude (consecutive counters
    share their top bits). Another key draws other bits; neighbours are uncorrelated."""
    offsets = torch.arange(1 << 20, dtype=torch.int64)
    a = counter_bits(torch.tensor(CounterRng(5).next_key()), offsets)
    b = counter_bits(torch.tensor(CounterRng(6).next_key()), offsets)
    assert int(a.min()) >= 0 and int(a.max()) < 2**32
    bound = 255 + 6 * 510 ** 0.5
    expected = offsets.numel() / 256
    for bits in (a >> 24, a & 0xFF, b >> 24, (a >> 12) & 0xFF):
        chi2 = float(((torch.bincount(bits, minlength=256) - expected) ** 2 / expected).sum())
        assert chi2 < bound, chi2
    assert float((a == b).float().mean()) < 1e-3
    u = a.double() / 2**32 - 0.5
    corr = float((u[1:] * u[:-1]).mean() / u.var())
    assert abs(corr) < 6 / (1 << 10), corr  # 6 sd of a correlation over 2**20 pairs


def test_counter_rng_state_round_trips():
    rng = CounterRng(2**63 + 12345)
    rng.next_key()
    state = rng.get_state()
    expected = rng.next_key()
    other = CounterRng(0)
    other.set_state(state)
    assert other.next_key() == expected
    with pytest.raises(ValueError, match="counter-based"):
        other.set_state(torch.ByteTensor(5056))  # a torch generator's state


def test_compiled_mode_runs_the_compiled_kernels():
    """Not the eager fallback: every whole tile goes through a compiled kernel, and the short
    last block too, padded; ``by_device`` on this CPU and ``eager`` compile nothing."""
    x = _input()[: 4 * SMALL_TILE + 100]
    with compiled_calls() as used:
        for mode in ("eager", "by_device"):
            get_format("fp8_e4m3", kernels=mode).encode(x, tile_elements=SMALL_TILE)
    assert used == []
    with compiled_calls() as used:
        get_format("fp8_e4m3", kernels="compiled").encode(x, tile_elements=SMALL_TILE)
    assert used == ["fp8_block_encode"] * 4 + ["ragged_block_encode"]  # four whole tiles, then the 100 left over


def test_a_compiled_kernel_stays_within_dynamos_recompile_limit_whatever_it_meets():
    """The tiles a real run meets, one kernel (fp8_e4m3's stochastic block encode) under a
    recompile limit of 3 where dynamo's is 8: sections of several lengths, one of a single row,
    each at the start of its buffer (storage offset 0) and after another, in one tile (e0 = 0)
    and in several (e0 > 0). Dynamo specializes each 0 or 1 apart; one compiled object collected
    an entry per mix and, past the limit, ``fullgraph`` stops the run. A copy per specialization
    class holds at most 3 here: its first shapes, then the rows symbolic, then e0 too."""
    kernels.compiled.cache_clear()  # copies with no entries yet
    eager = get_format("fp8_e4m3", kernels="eager", rounding="stochastic", seed=3)
    fused = get_format("fp8_e4m3", kernels="compiled", rounding="stochastic", seed=3)
    buffer = _input(3 * SMALL_TILE + 128 * 41, seed=4)
    sections = [(0, 128 * 40), (128 * 40, 128 * 41), (0, 128), (128 * 7, 128 * 8), (0, 3 * SMALL_TILE),
                (128, 128 + 2 * SMALL_TILE + 128 * 5), (128 * 3, 128 * 3 + SMALL_TILE + 128)]
    with torch._dynamo.config.patch(recompile_limit=3):
        for a, b in sections:
            x = buffer[a:b]
            _same_payloads(eager, eager.encode(x, tile_elements=SMALL_TILE),
                           fused.encode(x, tile_elements=SMALL_TILE), x)
    run = kernels.compiled(fp8_block_encode, fmax=fused.fmax, dtype=fused.data_dtype, mant_bits=fused.mant_bits,
                           min_normal=fused.min_normal)  # the one object the encodes called
    assert len(run.graphs) >= 4, list(run.graphs)  # the mixes above are classes of their own


@pytest.mark.parametrize("qmax", [448.0, 57344.0, 127.0, 7.0, 6.0 * 448.0])
def test_a_per_tensor_scale_is_the_largest_of_its_elements_scales(qmax):
    """kernels.tensor_scale reduces the elements' scales where the eager path scales their
    amax: the same value because fp32_scales is nondecreasing. Checked over magnitudes that
    meet its edges: every binade from subnormal to the largest, the neighbours of each multiple
    of qmax's ulp (where the nudge acts), 0, inf and nan."""
    gen = torch.Generator().manual_seed(7)
    binades = torch.ldexp(1.0 + torch.rand(4000, generator=gen), torch.randint(-149, 127, (4000,), generator=gen))
    edges = (torch.arange(1, 2000, dtype=torch.float32) * qmax * 2.0**-130)  # subnormal quotients
    near = torch.cat([torch.nextafter(edges, torch.tensor(0.0)), edges, torch.nextafter(edges, torch.tensor(1.0))])
    a = torch.cat([binades, near, torch.tensor([0.0, torch.finfo(torch.float32).max])]).sort().values
    s = kernels.fp32_scales(a, qmax)
    assert bool((s[1:] >= s[:-1]).all())  # nondecreasing, so the largest scale is the amax's
    for extra in ([], [float("inf")], [float("nan")], [float("inf"), float("nan")]):
        x = torch.cat([a[torch.randperm(a.numel(), generator=gen)[:3000]], torch.tensor(extra)])
        got = kernels.tensor_scale(x.view(1, -1), None, finite_blocks_only=False, qmax=qmax)
        want = kernels.fp32_scales(x.abs().amax().reshape(1), qmax)
        assert torch.equal(got.view(torch.int32), want.view(torch.int32)) or (got.isnan() & want.isnan()).all()


DECODE_CASES = [
    ("fp8_e4m3", {}, 1, False),
    ("fp8_e4m3", {}, 0, True),  # the sum starts from the output's values, my term first
    ("int4", {}, 2, False),
    ("nvfp4", {}, 1, False),
    ("fp32", {}, 1, False),  # lossless: the decode is the values themselves
]


@pytest.mark.parametrize("name,options,own_at,from_out", DECODE_CASES,
                         ids=[f"{c[0]}-own{c[2]}-{'from_out' if c[3] else 'fresh'}" for c in DECODE_CASES])
def test_compiled_decode_sum_equals_eager(name, options, own_at, from_out):
    eager = get_format(name, kernels="eager", **options)
    fused = get_format(name, kernels="compiled", **options)
    xs = [_input(seed=s) * (1 + s / 4) for s in range(3)]
    size = eager.nbytes(N)
    stride = size + 3  # rows at a misaligned stride, as the sections of a received buffer lie
    buf = torch.zeros(3 * stride, dtype=torch.uint8)
    rows = buf.as_strided((3, size), (stride, 1))
    for i, x in enumerate(xs):
        rows[i].copy_(eager.encode(x).wire)
    payload = eager.bytes_to_payload(rows, (N,))
    own = _input(seed=7)
    start = torch.randn(N)
    out_e, out_f = start.clone(), start.clone()
    eager.decode_sum(payload, out_e, own=own, own_at=own_at, from_out=from_out, tile_elements=SMALL_TILE)
    fused.decode_sum(payload, out_f, own=own, own_at=own_at, from_out=from_out, tile_elements=SMALL_TILE)
    free = ~torch.isfinite(out_e) | ~torch.isfinite(out_f)
    for x in xs:  # a scaled block shares its non-finiteness; an unscaled element keeps its own
        free |= _nonfinite_blocks(x, eager.block_size if eager.scale_kind != "none" else 1)
    free |= ~torch.isfinite(own)
    _same_values(out_e, out_f, free)
    assert torch.isfinite(out_e[~free]).all() and (~free).sum() > N // 2
    # the eager sum is each payload decoded alone, added in order (the reducer's contract)
    terms = [eager.decode(eager.bytes_to_payload(rows[i].contiguous(), (N,))) for i in range(3)]
    terms.insert(own_at, own)
    expected = start.clone() if from_out else terms.pop(0).clone()
    for t in terms:
        expected += t
    _same_values(expected, out_e, free)


def test_kernels_key_is_validated_and_never_auto():
    assert get_gift_config({"gift": {}}).kernels == "by_device"
    assert get_gift_config({"gift": {"kernels": "compiled"}}).kernels == "compiled"
    for bad in ("auto", "fused", 1):
        with pytest.raises(ValueError, match="kernels"):
            get_gift_config({"gift": {"kernels": bad}})
    with pytest.raises(ValueError, match="kernels must be one of"):
        get_format("fp8_e4m3", kernels="auto")
    assert not kernels.uses_compiled("by_device", torch.device("cpu"))
    assert kernels.uses_compiled("by_device", torch.device("cuda"))
    assert kernels.uses_compiled("compiled", torch.device("cpu"))


def test_compiled_kernels_keep_eagers_roundings_on_triton():
    """The options every compiled codec kernel is built with turn off what makes Triton's code
    round otherwise than eager: fp contraction (a multiply-add as one rounding: on an H200 it
    moved error feedback's residual and fp32 payload bytes), approximate division and flushed
    subnormals. Read off inductor's own Triton meta, which this CPU build generates too."""
    from torch._inductor import config
    from torch._inductor.codegen.triton import TritonKernel

    options = kernels.known_options(kernels._COMPILE_OPTIONS)
    assert options == kernels._COMPILE_OPTIONS  # this torch knows them all
    assert TritonKernel.triton_meta_common()["enable_fp_fusion"] is True  # inductor's default: contraction on
    with config.patch(options):
        meta = TritonKernel.triton_meta_common()
    assert meta["enable_fp_fusion"] is False and meta["disable_ftz"] is True
    assert kernels.known_options({"no_such_option": 1, "max_fusion_size": 8}) == {"max_fusion_size": 8}


def test_e2m1_nearest_is_the_encoders_rounding():
    """NVFP4's candidate error rounds by E2M1's steps (round half even of value / step); the
    encoder rounds by codes and tables. The same value for every finite input: each midpoint
    (a tie) and its fp32 neighbours, values up to far past saturation, signed zeros."""
    from deepspeed_gift.core.formats.nvfp4 import _e2m1_nearest, e2m1_nearest
    grid = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])
    mids = (grid[1:] + grid[:-1]) / 2
    edges = torch.cat([grid, mids, torch.tensor([6.5, 7.0, 8.0, 1e30, 3.4e38, 1e-40])])
    near = torch.cat([edges, torch.nextafter(edges, torch.full_like(edges, float("inf"))),
                      torch.nextafter(edges, torch.full_like(edges, -1.0))])
    y = torch.cat([near, -near, torch.rand(100000, generator=torch.Generator().manual_seed(0)) * 16 - 8])
    got, want = e2m1_nearest(y), _e2m1_nearest(y)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    assert torch.isnan(e2m1_nearest(torch.tensor([float("nan")]))).all()


RESIDUAL_CASES = [
    ("fp8_e4m3", {}),  # blocks of 128, as the residual's
    ("nvfp4", {}),  # blocks of 16, a global scale, nibbles
    ("int4", {"block_size": 0}),  # one scale per tensor, nibbles
]


@pytest.mark.parametrize("name,options", RESIDUAL_CASES, ids=[f"{n}-{o}" for n, o in RESIDUAL_CASES])
def test_compiled_residual_equals_eager(name, options):
    """Error feedback's residual of a sent payload in one compiled pass (values minus the
    payload's decode, encoded int8 per 128) gives the eager bytes: the int8 encode of the
    difference. Over several tiles and a short tail; a residual block that holds inf/nan gets
    scale 0 in both modes, so it decodes to zeros (its codes are left as they are: no pass over
    them), and every other block is what it would be without them."""
    from deepspeed_gift.exchange import feedback

    sent_eager = get_format(name, kernels="eager", **options)
    sent_fused = get_format(name, kernels="compiled", **options)
    store_eager = get_format("int8", block_size=128, kernels="eager")
    store_fused = get_format("int8", block_size=128, kernels="compiled")
    finite = torch.nan_to_num(_input(), nan=1.0, posinf=2.0, neginf=-3.0)
    p = sent_eager.encode(finite)
    want = store_eager.encode(finite - sent_eager.decode(p))
    got_eager = store_eager.encode_difference(finite.clone(), sent_eager, p, tile_elements=SMALL_TILE)
    got_fused = store_fused.encode_difference(finite.clone(), sent_fused, p, tile_elements=SMALL_TILE)
    assert torch.equal(got_eager.wire, want.wire)
    assert torch.equal(got_fused.wire, want.wire)
    store = feedback.residual_codec("compiled")  # what ErrorFeedback(kernels="compiled") keeps residuals with
    assert store.compiled_on(torch.device("cpu")) and feedback.ErrorFeedback("compiled").codec is store
    kept = feedback.StoredResidual.of_sent(finite.clone(), sent_fused, p, store)
    assert torch.equal(kept.wire, want.wire)
    x = _input()  # inf and nan in a few blocks: those residual blocks kept as zeros
    p = sent_eager.encode(x)
    diff = x - sent_eager.decode(p)
    whole = -(-N // 128) * 128
    bad = ~torch.isfinite(torch.nn.functional.pad(diff, (0, whole - N))).view(-1, 128).all(1)
    assert 0 < bad.sum() < bad.numel() or name == "int4"  # (a scale per tensor: every block shares the inf)
    ref = store_eager.encode(diff)  # its blocks that hold inf/nan have nan scales
    header = feedback.StoredResidual.encode(torch.zeros(N)).wire[:16]
    for kept in (feedback.StoredResidual.of_sent(x.clone(), sent_fused, p, store),
                 feedback.StoredResidual.of_sent(x.clone(), sent_eager, p, feedback.residual_codec("eager"))):
        q = kept._payload()
        assert torch.equal(kept.wire[:16], header)
        assert torch.equal(q.scales[bad].view(torch.int32), torch.zeros(int(bad.sum()), dtype=torch.int32))  # +0.0
        assert torch.equal(q.scales[~bad].view(torch.int32), ref.scales[~bad].view(torch.int32))
        good = (~bad).repeat_interleave(128)[:N]
        assert torch.equal(q.data[good], ref.data[good])
        values = torch.randn(N)
        added = kept.add_to(values.clone())
        assert torch.equal(added[~good], values[~good])  # adds nothing there
        assert torch.isfinite(kept.decode()).all() and not kept.decode()[~good].any()


FEEDBACK_CASES = [
    ("fp8_e4m3", {}, "nearest"),  # blocks of 128, as the residual's
    ("fp8_e4m3", {}, "stochastic"),
    ("int4", {}, "stochastic"),  # nibbles
    ("int8", {"block_size": 32}, "nearest"),  # the relay's second hop: four blocks a residual block
    ("int4", {"block_size": 32}, "stochastic"),  # ... stochastic, in nibbles
    ("fp8_e5m2", {"block_size": 0}, "stochastic"),  # one scale per tensor: a first pass for the amax
    ("int4", {"block_size": 0}, "nearest"),  # ... and nibbles
    # a global scale's first pass, then two kernels a tile (one candidate scale: the same path
    # at a third of the three candidates' compile, which the encode cases above cover)
    ("nvfp4", {"scale_candidates": ("up",)}, "stochastic"),
]


@pytest.mark.parametrize("name,options,rounding", FEEDBACK_CASES, ids=[f"{n}-{o}-{r}" for n, o, r in FEEDBACK_CASES])
def test_compiled_feedback_step_equals_the_three_eager_steps(name, options, rounding, monkeypatch):
    """Error feedback's whole step for a payload a rank sends in one compiled kernel a tile
    (last residual added, encoded, the new residual; with one scale per tensor after a first
    pass over the tiles for the sum's amax; sent blocks finer than the residual's, every
    reduction over the residual's rows, as a GPU takes it) gives the bytes of its three eager steps:
    the residual's decode added, the encode, the int8 encode of the difference. Several tiles;
    stochastic rounding draws the same bits (one key, the elements' offsets). A section that is
    not whole blocks takes the three steps, the same bytes."""

    # whole blocks of every codec here, over two small tiles: the first (e0 = 0) and a later one
    # (each a compile of its own; a third tile would compile the later ones' e0 symbolic)
    n = 2 * SMALL_TILE
    x = torch.nan_to_num(_input(n), nan=1.0, posinf=2.0, neginf=-3.0)
    old_values = torch.randn(n, generator=torch.Generator().manual_seed(1)) * x.abs().clamp(max=1e30) * 0.01
    monkeypatch.setattr(integer, "finer_blocks_fused", lambda device: True)  # a GPU's path on this CPU
    store = {m: get_format("int8", block_size=128, kernels=m) for m in ("eager", "compiled")}
    old = store["eager"].encode(old_values)
    def sent(mode):  # a fresh codec: stochastic rounding's first key
        codec = NvFp4Codec if name == "nvfp4" else functools.partial(get_format, name)  # (candidates: a codec option)
        return codec(kernels=mode, rounding=rounding, seed=5, **options)

    values = x.clone()
    store["eager"].decode_into(old, values, add=True)
    eager = sent("eager")
    want = eager.encode(values)
    want_residual = store["eager"].encode(values - eager.decode(want))
    with compiled_calls() as calls:
        got = {m: store[m].encode_with_residual(x.clone(), old, sent(m), tile_elements=SMALL_TILE) for m in store}
        if name == "nvfp4":  # one tile too (a small tile's length: no compile of its own): its header,
            # global scale, scales and data in one copy
            one = store["compiled"].encode_with_residual(x[:SMALL_TILE].clone(), store["eager"].encode(
                old_values[:SMALL_TILE]), sent("compiled"), tile_elements=SMALL_TILE)
    if name == "nvfp4":
        values = x[:SMALL_TILE].clone()
        store["eager"].decode_into(store["eager"].encode(old_values[:SMALL_TILE]), values, add=True)
        p1 = sent("eager").encode(values)
        assert torch.equal(one[0].wire, p1.wire)
        assert torch.equal(one[1].wire, store["eager"].encode(values - sent("eager").decode(p1)).wire)
    # the fused kernels served the compiled mode (one scale per tensor: its first pass, then one kernel a tile)
    # (sent blocks finer than the residual's: every reduction over the residual's rows, one kernel)
    fused = {"nvfp4": "nvfp4_feedback_tile"}.get(name, {0: "feedback_tensor_encode", 32: "feedback_sub_encode"}.get(
        options.get("block_size"), "feedback_encode"))
    assert fused in calls, calls
    for m, (p, q) in got.items():
        assert torch.equal(p.wire, want.wire), m
        assert torch.equal(q.wire, want_residual.wire), m
    # not whole blocks (a short last block): compiled, the whole units in the fused kernel and the
    # tail by the eager steps where rounded to nearest (else the eager steps throughout), the
    # same bytes as eager's
    tail = x[: n - 37].clone()
    a = store["eager"].encode_with_residual(tail.clone(), store["eager"].encode(old_values[: n - 37]), sent("eager"))
    with compiled_calls() as calls:
        b = store["compiled"].encode_with_residual(tail.clone(), store["eager"].encode(old_values[: n - 37]),
                                                   sent("compiled"))
    assert torch.equal(a[0].wire, b[0].wire) and torch.equal(a[1].wire, b[1].wire)
    if fused in ("feedback_encode", "feedback_sub_encode") and rounding == "nearest":
        assert fused in calls, calls
    if fused == "feedback_sub_encode" and rounding == "nearest":  # a CPU's path: the sent blocks' rows
        monkeypatch.undo()
        with compiled_calls() as calls:
            c = store["compiled"].encode_with_residual(x.clone(), old, sent("compiled"), tile_elements=SMALL_TILE)
        assert "feedback_encode" in calls and "feedback_sub_encode" not in calls, calls
        assert torch.equal(c[0].wire, want.wire) and torch.equal(c[1].wire, want_residual.wire)


def test_feedback_send_keeps_a_nonfinite_block_of_the_residual_as_zeros():
    """``ErrorFeedback.send``: a block of what a rank sends that holds inf/nan keeps that block
    of the new residual as zeros, fused or not, and the other blocks as they come (the same
    bytes in both modes); ``drop_all`` (a step DeepSpeed skipped) leaves nothing to add."""
    from types import SimpleNamespace

    from deepspeed_gift.exchange import feedback

    x = _input(128 * 40)
    bad = ~torch.isfinite(x).view(-1, 128).all(1)
    assert 0 < bad.sum() < bad.numel()
    plan, sec = SimpleNamespace(layout_key=("k",)), SimpleNamespace(key=0, pieces=[])
    finite = torch.nan_to_num(x, nan=0.0, posinf=1.0, neginf=-1.0)
    wires = {}
    for mode in ("eager", "compiled"):
        fb = feedback.ErrorFeedback(mode)
        sent = get_format("fp8_e4m3", kernels=mode)
        fb.send(plan, sec, finite.clone(), sent, {})  # a residual to add: the step after takes the fused path
        wires[mode] = fb.send(plan, sec, x.clone(), sent, {})
        kept = fb.sent[(("k",), 0)][0]
        decoded = kept.decode().view(-1, 128)
        assert torch.isfinite(decoded).all() and not decoded[bad].any(), mode
        assert decoded[~bad].abs().amax(1).gt(0).sum() > 0.9 * (~bad).sum(), mode  # the rest kept
        scales = kept._payload().scales
        assert torch.equal(scales[bad].view(torch.int32), torch.zeros(int(bad.sum()), dtype=torch.int32)), mode
        wires[mode + " scales"] = scales.clone()
        values = torch.randn(x.numel())
        fb.drop_all()
        assert torch.equal(fb.add(plan, sec, values.clone(), {}), values) and fb.nbytes() == 0, mode
    codec = get_format("fp8_e4m3", kernels="eager")
    sent = {m: codec.decode_from_bytes(wires[m], (x.numel(),)).view(-1, 128) for m in ("eager", "compiled")}
    assert torch.equal(sent["eager"][~bad], sent["compiled"][~bad])  # a non-finite block's codes are free
    assert not torch.isfinite(sent["eager"][bad]).any() and not torch.isfinite(sent["compiled"][bad]).any()
    assert torch.equal(wires["eager scales"].view(torch.int32), wires["compiled scales"].view(torch.int32))


def test_bf16_stochastic_rounding_keeps_every_nan_a_nan():
    """Sixteen random bits added to a nan's pattern could carry it past the int32 range into a
    finite value (0xFFFFFFFF + 1 is +0.0): every nan pattern stays nan, inf stays inf, in both modes."""
    patterns = torch.tensor([-1, 0x7FFFFFFF, -4194304, 0x7FC00000, 0x7FFF0001, -65535], dtype=torch.int64)
    nans = torch.where(patterns >= 2**31, patterns - 2**32, patterns).to(torch.int32).view(torch.float32)
    x = torch.cat([nans.repeat(1000), torch.tensor([float("inf"), float("-inf"), 3.3895e38, -1.5])])
    assert torch.isnan(x[: nans.numel() * 1000]).all()
    for mode in ("eager", "compiled"):
        y = get_format("bf16", rounding="stochastic", seed=3, kernels=mode).encode(x).data.float()
        assert torch.isnan(y[: nans.numel() * 1000]).all(), mode
        assert y[-4] == float("inf") and y[-3] == float("-inf") and y[-1] == -1.5, (mode, y[-4:])
