"""Tiles (``gift.tile_elements``): the reduction's element-wise work runs in tiles, and that
changes no bit of the result, and bounds what it allocates.

Real gloo ranks and real codecs, transforms and reducers; the memory is measured with the
torch profiler's allocation events (validated here on allocations of known size)."""

import torch

from deepspeed_gift.core import formats
from deepspeed_gift.core.rng import CounterRng
from deepspeed_gift.core import geometry as geo
from deepspeed_gift.exchange.plan import GEO, HIGH, MAIN, ParamSlice, Piece, SectionSource, transform_pieces
from deepspeed_gift.exchange.reducer import GiftReducer
from launch.spawn import run_ranks

HUGE_TILE = 1 << 30  # one tile covers every section of these tests: the untiled reduction
SMALL_TILE = 64  # smaller than a block of 128, than a row of 48: every boundary is crossed


def _layout(world):
    """Two whitened matrices, a plain vector, a bf16 vector and a matrix every rank of a copy set
    receives whole (a shared section); owners cut through rows."""
    shapes = [(24, 48), (40, 32), (300,), (100,), (8, 16)]
    modes = [GEO, GEO, MAIN, HIGH, GEO]
    total = sum(torch.Size(s).numel() for s in shapes)
    bounds = [round(total * j / world) for j in range(world + 1)]
    slices, offset = [], 0
    for key, (shape, mode) in enumerate(zip(shapes, modes)):
        numel = torch.Size(shape).numel()
        copy = (0, 1) if key == 4 else ()
        for dst in range(world):
            lo, hi = max(bounds[dst], offset), min(bounds[dst + 1], offset + numel)
            if hi > lo:
                slices.append(ParamSlice(dst, lo, hi - lo, lo - offset, key, shape[-1] if mode == GEO else 0, mode,
                                         copy))
        offset += numel
    return slices, total


def _whiteners(kind="hadamard"):
    """Hadamard rotations compute every row alike however many rows a call holds; the fitted
    (structured) whitener's matrix products do not: the CPU's BLAS rounds a row differently
    by the number of rows in the call (measured: 1-3 or 5-7 rows differ from 4 or 8 in the last
    bit), so a tile that cuts a piece's rows elsewhere moves some transformed values by an ulp."""
    out = {}
    for key, dim in ((0, 48), (1, 32), (4, 16)):
        if kind == "hadamard":
            out[key] = geo.make_whitener("hadamard", dim, seed=key)
            continue
        g = torch.Generator().manual_seed(key)
        X = torch.randn(300, dim, generator=g) * torch.linspace(0.1, 3.0, dim)
        out[key] = geo.fit_whitener(X.T @ X / 300, rank=4, damping=1e-3)
    return out


def _tiled_body(rank, world, fmt, options, route, rounding, kind="hadamard"):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm

    dist.init_process_group("gloo")
    slices, total = _layout(world)
    comm = TorchComm()
    grad = torch.randn(total, generator=torch.Generator().manual_seed(100 + rank))
    grad[::7] *= 1e3  # blocks of very different scales
    results = []
    for tile in (HUGE_TILE, SMALL_TILE):
        codec = formats.get_format(fmt, rounding=rounding, seed=5, **options)
        reducer = GiftReducer(comm, codec, formats.get_format("bf16"), route=route, tile_elements=tile,
                              generator=CounterRng(rank + 1))
        bucket = grad.clone()
        outputs = [torch.zeros(s.numel) if s.dst == rank or rank in s.copy_ranks else None for s in slices]
        for step in range(2):  # the second step with the first one's plan from the cache
            bucket = grad.clone()
            outputs = [o.zero_() if o is not None else None for o in outputs]
            stats = reducer.reduce(bucket, slices, _whiteners(kind), divisor=world, step=step, outputs=outputs,
                                   sample=True)
        kept = [(s, bucket[s.bucket_offset:s.bucket_offset + s.numel].clone(), o)
                for s, o in zip(slices, outputs) if o is not None]
        results.append((kept, stats.quantized, stats.relay_buckets))
    return results


def _check_tiles_change_no_bit(fmt, options, route, rounding="nearest", world=3):
    for (big, _, relays), (small, quantized, _) in run_ranks(_tiled_body, world, fmt, options, route, rounding):
        assert relays == (route == "relay")
        assert 0 < quantized  # sampled steps measured the quantization (on a sample)
        assert len(big) == len(small) > 0
        for (s, got_big, out_big), (_, got_small, out_small) in zip(big, small):
            assert torch.equal(got_big, got_small), (fmt, route, s)
            assert torch.equal(out_big, out_small), (fmt, route, s)


def test_a_small_tile_reduces_bit_for_bit_as_the_untiled_fp8():
    _check_tiles_change_no_bit("fp8_e4m3", {}, "direct")


def test_a_small_tile_reduces_bit_for_bit_as_the_untiled_nvfp4_relayed():
    # NVFP4: a global scale read in a first pass over the section's tiles; the relay route
    # encodes chunks of sections and decodes into the sums
    _check_tiles_change_no_bit("nvfp4", {}, "relay")


def test_a_small_tile_reduces_bit_for_bit_as_the_untiled_per_tensor_int4_stochastic():
    # one scale per tensor (another first pass), odd tails of 4-bit data, stochastic rounding
    # (its bits come from a counter over the element offset, whatever the tile or device)
    _check_tiles_change_no_bit("int4", {"block_size": 0}, "direct", "stochastic")


def test_transforms_in_tiles_equal_whole_pieces():
    w = _whiteners("hadamard")[0]
    g = torch.randn(24 * 48 + 100, generator=torch.Generator().manual_seed(3))
    pieces = [Piece(0, 100, 9, 0), Piece(100, 24 * 48, 0, 24, param_start=0)]
    whole = torch.cat([g[:100], w.apply_run(g[100:], 0)])
    src = SectionSource(g, pieces, {0: w}, tile=50)  # one row per chunk
    assert torch.equal(src.gather(), whole)
    work = torch.empty(200)
    assert torch.equal(torch.cat([src.read(e0, min(e0 + 200, src.numel), work).clone()
                                  for e0 in range(0, src.numel, 200)]), whole)
    assert torch.equal(src.read(30, 90, work), whole[30:90])  # read behind: made again
    back = transform_pieces(whole.clone(), pieces, {0: w}, inverse=True, tile=50)
    assert torch.equal(back, transform_pieces(whole.clone(), pieces, {0: w}, inverse=True, tile=HUGE_TILE))


def test_tile_elements_is_validated():
    import pytest

    from deepspeed_gift.config import DEFAULT_TILE_ELEMENTS, get_gift_config

    assert get_gift_config({"gift": {}}).tile_elements == DEFAULT_TILE_ELEMENTS
    assert get_gift_config({"gift": {"tile_elements": 4096}}).tile_elements == 4096
    for bad in (0, -5, 1.5, True, "auto"):
        with pytest.raises(ValueError, match="gift.tile_elements: got"):
            get_gift_config({"gift": {"tile_elements": bad}})
    with pytest.raises(ValueError, match="tile_elements must be an int >= 1"):
        formats.get_format("fp8_e4m3", tile_elements=0)


def test_a_small_tile_moves_a_fitted_whitener_by_its_blas_rounding_only():
    # the structured whitener's products round by the rows per call (see _whiteners): a small
    # tile may move a transformed value by an ulp and so, rarely, an element across a rounding
    # edge of fp8 (one step: 2^-3 relative at most); everything else stays equal
    for (big, _, _), (small, _, _) in run_ranks(_tiled_body, 3, "fp8_e4m3", {}, "direct", "nearest", "structured"):
        got_big = torch.cat([g for _, g, _ in big])
        got_small = torch.cat([g for _, g, _ in small])
        # measured ~8e-8 (an fp32 ulp through the inverse); a crossed fp8 rounding edge would
        # add ~1e-4 per element moved: the bound allows a few, far below fp8's own ~3e-2
        rel = float((got_big - got_small).norm() / got_big.norm())
        assert 0 <= rel < 1e-3


# ---- memory ----------------------------------------------------------------------------
class LiveBytes:
    """Counts the bytes of tensor storage that torch ops allocate while it is active, and the
    peak of what is alive at once: every op's outputs whose storage is none of its inputs' are
    new allocations; a storage is freed when the last tensor made on it inside is gone. What
    existed before (inputs, the model) is not counted; a kernel's internal scratch is not seen."""

    def __init__(self) -> None:
        self.current = self.peak = 0
        self.refs = {}  # storage address -> [bytes, live tensors on it]

    def __enter__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                counter.saw(out, args, kwargs)
                return out

        self.mode = Mode()
        self.mode.__enter__()
        return self

    def __exit__(self, *exc):
        self.mode.__exit__(*exc)

    def saw(self, out, args, kwargs) -> None:
        import weakref

        from torch.utils._pytree import tree_flatten

        def tensors(x):
            return [t for t in tree_flatten(x)[0] if isinstance(t, torch.Tensor)]

        inputs = {t.untyped_storage().data_ptr() for t in tensors((args, kwargs or {}))}
        for t in tensors(out):
            storage = t.untyped_storage()
            key, size = storage.data_ptr(), storage.nbytes()
            if key in self.refs:
                self.refs[key][1] += 1
            elif key in inputs or size == 0:
                continue
            else:
                self.refs[key] = [size, 1]
                self.current += size
                self.peak = max(self.peak, self.current)
            weakref.finalize(t, self._release, key)

    def _release(self, key) -> None:
        entry = self.refs.get(key)
        if entry is None:
            return
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.refs[key]


def test_live_bytes_counts_known_allocations():
    x = torch.randn(1000)
    with LiveBytes() as live:
        a = torch.empty(250_000)  # 1 MB
        b = a[10:20] * 2  # 40 B
        view = a[:5]
        del a  # its storage lives on in ``view``
        c = torch.empty(100_000)  # 400 kB
        del view, c
        y = x.add(1)  # 4000 B
        del b, y
    assert live.peak == 1_000_000 + 40 + 400_000
    assert live.current == 0


def _memory_body(rank, world, fmt, tile, sample):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm

    dist.init_process_group("gloo")
    rows, dim = 4096, 1024  # one 4M-element matrix, whitened; each rank owns half (2M elements)
    half = rows * dim // 2
    slices = [ParamSlice(dst, dst * half, half, dst * half, 0, dim, GEO) for dst in range(2)]
    reducer = GiftReducer(TorchComm(), formats.get_format(fmt), tile_elements=tile)
    whiteners = {0: geo.make_whitener("hadamard", dim, seed=1)}
    bucket = torch.randn(rows * dim, generator=torch.Generator().manual_seed(rank))
    reducer.reduce(bucket.clone(), slices, whiteners, divisor=2.0, sample=sample)  # plan, headers, caches
    with LiveBytes() as live:
        reducer.reduce(bucket, slices, whiteners, divisor=2.0, sample=sample)
    return live.peak, half, reducer.encoder.main_codec.nbytes(half)


def test_a_reduction_allocates_a_few_tiles_beyond_its_payloads_and_its_result():
    """A 2M-element section each way: the untiled reduction allocates tens of bytes per element of
    it (NVFP4's candidates, staging, the transform, the decode); with a 16K-element tile what it
    allocates beyond the payloads (sent, their send buffer, received) and the owner's fp32 result
    and own contribution is a few tiles."""
    tile = 1 << 14
    for fmt in ("nvfp4", "fp8_e4m3"):
        for sample in (False, True):
            tiled = run_ranks(_memory_body, 2, fmt, tile, sample)
            untiled = run_ranks(_memory_body, 2, fmt, HUGE_TILE, sample)
            for (peak, section, wire), (peak_whole, _, _) in zip(tiled, untiled):
                floor = 3 * wire + 2 * 4 * section  # payload buffers, the sum and my contribution
                # the sampled fidelity check: 64K fp32 positions, values and exact sums per owner
                floor += (4 * 65536 * 8) if sample else 0
                bound = floor + 48 * 4 * tile
                print(fmt, sample, "peak", peak, "floor", floor, "extra", peak - floor, "untiled", peak_whole)
                assert peak <= bound, (fmt, sample, peak, bound)
                assert peak_whole > bound + 4 * section, (fmt, sample, peak_whole, bound)


def test_sampled_stats_are_those_of_whole_blocks_of_the_encoded_tensor():
    """What a sampled step measures: rows of whole blocks picked at an even stride, recorded as
    the encode reads them (tiles that cut the rows included), decoded from their own scales."""
    x = torch.randn(100_003, generator=torch.Generator().manual_seed(1))
    x[::5] *= 1e-30  # underflows for the 4-bit formats
    limit = 4096
    for name, kw in (("fp8_e4m3", {}), ("nvfp4", {}), ("int4", {"block_size": 0})):
        codec = formats.get_format(name, **kw)
        recorder = formats.SampleRecorder(formats.TensorSource(x), codec, limit)
        payload = codec.encode_source(recorder, tile_elements=300)
        assert torch.equal(payload.wire, codec.encode(x).wire)  # recording changes nothing
        unit, rows = formats.sample_rows(codec, x.numel(), limit)
        assert rows.numel() * unit <= limit and rows[1] - rows[0] > 1
        at = (rows[:, None] * unit + torch.arange(unit)).reshape(-1)
        assert torch.equal(recorder.values, x[at])
        sub = formats.payload_rows(codec, payload, rows, unit)
        assert torch.equal(codec.decode(sub), codec.decode(payload)[at])
        got = recorder.stats(payload, codec)
        assert got == formats.quantization_stats(x, payload, codec, limit=limit)
        assert got == formats.quantization_stats(x[at], sub, codec)
        assert got["numel"] == at.numel() and (name == "fp8_e4m3" or got["underflow"] > 0)


def _tiles_of_engine(rank, world, spec):
    from tests.harness import build_engine

    engine = build_engine(spec)
    reducer = engine.gift.reducer
    return getattr(reducer, "tile_elements", None), getattr(getattr(reducer, "inner", None), "tile_elements", None)


def test_gift_tile_elements_reaches_the_engines_reducers():
    from launch.spawn import run_ranks

    gift = {"format": "fp8_e4m3", "tile_elements": 4096}
    flat = run_ranks(_tiles_of_engine, 2, dict(stage=2, gift=gift))
    assert [t for t, _ in flat] == [4096, 4096]
    two = run_ranks(_tiles_of_engine, 2, dict(stage=2, gift={**gift, "hierarchy": "two_level", "ranks_per_node": 1}))
    assert [inner for _, inner in two] == [4096, 4096]
