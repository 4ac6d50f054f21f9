"""NVFP4: E2M1 elements, an E4M3 scale per 16 chosen per block among three candidates, and an
fp32 global scale per encoded tensor: the eager codec, its tables and its fused kernels."""

from __future__ import annotations

import threading
from typing import ClassVar, List, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .. import kernels as fused_kernels
from ..kernels import columns_amax, e4m3_at_least, random_bits, safe_divisor, stochastic_grid, sum_pairwise
from .base import (Payload, Rounding, _load_rows, _native_flat, _native_rows, _nibble_table, _nibbles, _register,
                   _row_ranges, _ScaledCodec, _source_scale, _stochastic_round_bits, _table_on, _tile_amax,
                   _tile_rows, _unpack_nibbles, _work_tile, device_table, pads_inside)
from .integer import _fed

_FP4_MAX = 6.0
_E4M3_MAX = 448.0


# E2M1 magnitudes by code 0..7; bit 3 is the sign
_FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
_FP4_TABLE = device_table(_nibble_table(_FP4_VALUES + [-v for v in _FP4_VALUES]))
# midpoints between neighbours; at a tie the even code wins: ">=" where it is the upper one
_FP4_MIDPOINTS = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)]


def _fp4_magnitude_codes(a: Tensor) -> Tensor:
    """E2M1 magnitude codes (uint8 0..7) of ``a`` >= 0: nearest, ties to even.

    The code is the number of midpoints below ``a``; above 6 saturates to 7, nan gives 0.
    """
    codes = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    for midpoint, tie_up in _FP4_MIDPOINTS:
        codes.add_(a >= midpoint if tie_up else a > midpoint)
    return codes


def _fp4_key_tables() -> Tuple[Tensor, Tensor]:
    """Signed E2M1 code (low / high nibble) for every key of ``_fp4_keys``.

    A key is the top 12 bits of an fp32 pattern (sign, exponent, 3 mantissa bits) and
    a flag "lower 20 bits nonzero". Every midpoint has at most 3 mantissa bits, so all
    values sharing a key round to the same code; the table is built from one
    representative per key (the exact value, or one strictly inside the interval).
    """
    key = torch.arange(8192, dtype=torch.int64)
    bits = ((key >> 1) << 20) | ((key & 1) << 19)
    bits = torch.where(bits >= 2**31, bits - 2**32, bits).to(torch.int32)
    values = bits.view(torch.float32)
    codes = _fp4_magnitude_codes(values.abs()) | (torch.signbit(values).to(torch.uint8) << 3)
    return codes, codes << 4


_FP4_KEY_LO, _FP4_KEY_HI = map(device_table, _fp4_key_tables())
# the signed E2M1 value of every key, for measuring a candidate scale's error
_FP4_KEY_VALUES = device_table(torch.tensor(_FP4_VALUES + [-v for v in _FP4_VALUES])[_FP4_KEY_LO.long()])


def _fp4_keys(y: Tensor) -> Tensor:
    """int32 key per fp32 element: (top 12 bits) * 2 + (lower 20 bits != 0)."""
    bits = y.view(torch.int32)
    key = (bits >> 20).bitwise_and_(0xFFF).bitwise_left_shift_(1)
    return key.add_((bits & 0xFFFFF).clamp_(max=1))


_FP4_VALUES_T = torch.tensor(_FP4_VALUES)


def _e2m1_of_keys(key: Tensor) -> Tensor:
    """The E2M1 value (fp32) of every :func:`_fp4_keys` key, same shape: one lookup each."""
    return torch.index_select(_table_on(_FP4_KEY_VALUES, key.device), 0, key.reshape(-1)).view(key.shape)


def _e2m1_nearest(y: Tensor) -> Tensor:
    """``y`` (fp32) rounded to the nearest E2M1 value (ties to even), saturating at +-6, by the
    fp32-bit keys the encoder uses."""
    return _e2m1_of_keys(_fp4_keys(y.contiguous()))


# ----------------------------------------------------------------------------- fused kernels




# E2M1 codes are carried as fp32 values 0..15 (exact): comparisons, selects and floors of floats
# vectorize in C++ and Triton alike, where shifts and small-integer arithmetic fall back to
# scalar code on a CPU.


def _fp4_magnitude_codes_f32(a: Tensor) -> Tensor:
    """:func:`_fp4_magnitude_codes` as one expression: the count of midpoints below ``a`` (as
    fp32; nan counts none)."""
    c = (a > 0.25).to(torch.float32)
    for midpoint, tie_up in ((0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)):
        c = c + (a >= midpoint if tie_up else a > midpoint).to(torch.float32)
    return c


def fp4_signed_codes(y: Tensor) -> Tensor:
    """The signed E2M1 code (fp32 0..15) of fp32 ``y``, nearest with ties to even, saturating
    at +-6 (nan: magnitude 0): what :func:`_fp4_keys` and its tables give."""
    negative = (y.view(torch.int32) < 0).to(torch.float32)  # the sign bit (-0.0 included)
    return _fp4_magnitude_codes_f32(y.abs()) + negative * 8.0


def e2m1_nearest(y: Tensor) -> Tensor:
    """fp32 ``y`` rounded to the nearest E2M1 value, ties to the even code, saturating at +-6 (the
    value of :func:`fp4_signed_codes`' code for finite ``y``; nan stays nan): E2M1's steps are
    0.5 below 2, 1 below 4, 2 above, and round-half-even of the value over its step is the
    even code at a tie (fewer operations than finding the code and decoding it)."""
    a = y.abs()
    mag = torch.where(a < 2.0, torch.round(a * 2.0) * 0.5,
                      torch.where(a < 4.0, torch.round(a), torch.clamp(torch.round(a * 0.5) * 2.0, max=_FP4_MAX)))
    return torch.copysign(mag, y)


def e2m1_of_codes(codes: Tensor) -> Tensor:
    """The fp32 value of signed E2M1 codes (0..15, as fp32; -0.0 for code 8): magnitude code
    m >= 2 is 2**(floor(m / 2) - 1) * (1 + (m mod 2) / 2), m < 2 is m / 2."""
    negative = codes >= 8.0
    m = codes - negative.to(torch.float32) * 8.0
    e = torch.floor(m * 0.5)
    mag = torch.where(m < 2.0, m * 0.5, (1.0 + (m - 2.0 * e) * 0.5)
                      * torch.where(e < 2.0, 1.0, torch.where(e < 3.0, 2.0, 4.0)))
    # the sign by copysign, not -mag: Triton computes -x as 0 - x, which makes code 8 (-0.0) +0.0
    # (the H200 run's batched decode differed from the fused one by the sign of such zeros)
    return torch.copysign(mag, torch.where(negative, -1.0, 1.0))


def _e4m3_scale(codes: Tensor, g: Tensor) -> Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float32) * g


def nvfp4_tile_encode(xt: Tensor, g: Tensor, key: Optional[Tensor] = None, e0: int = 0, *,
                      candidates: Sequence[str]) -> Tuple[Tensor, Tensor]:
    """One tile of whole 16-blocks (``xt``: (16, rows) fp32, the blocks as columns: the tile's
    transpose, a view of it or a copy; the encode's elements e0..; ``g``:
    the 1-element global scale): per block the candidate E4M3 scale whose nearest-rounded block
    errs least (the first wins a tie), and the block's E2M1 codes, nearest or stochastic under
    ``key``, packed two a byte. Returns the scales' uint8 codes (0x7F for a non-finite block)
    and each block's 8 bytes as one int64 (little-endian). ``NvFp4Codec._encode_into``."""
    # Written over the block's 16 columns, each a (rows,) vector: every step, the block amax and
    # each candidate's summed error included, is then a pointwise expression over the rows, so
    # the whole tile is one kernel that reads each block once and writes its 8 bytes (one int64)
    # and its scale (a reduction over the block would be a kernel of its own, and the byte
    # packing, over (rows, 8), a third, each reading the tile again). The bytes are returned, not
    # written into the payload: its data sit at any byte offset, where no int64 view lies; the
    # scales are returned too, so that a one-tile section's header, global scale, scales and
    # data reach the wire in one copy (NvFp4Codec._encode_into).
    # (A copy, contiguous, on a CPU: C++ vectorizes across rows only where a column's elements
    # are adjacent; a GPU thread takes its row's 16 strided loads from cache.)
    cols = xt.float().unbind(0)  # a source's bf16/fp16 values as they lie widened here, exactly
    amax = columns_amax(cols)  # max is exact: _rows_amax's value
    target = amax / (safe_divisor(g) * _FP4_MAX)
    up = e4m3_at_least(target)
    options = {"up": up, "down": torch.where(up > 0, up - 1, up),
               "4/6": e4m3_at_least((target * 1.5).clamp(max=_E4M3_MAX))}
    best_codes = best_err = None
    for name in candidates:  # per candidate only its error per block is kept
        cand = options[name]
        scale = _e4m3_scale(cand, g)
        divisor = safe_divisor(scale)
        err = sum_pairwise([torch.square(e2m1_nearest(c / divisor) * scale - c) for c in cols])
        if best_err is None:
            best_codes, best_err = cand, err
            continue
        better = err < best_err
        best_codes = torch.where(better, cand, best_codes)
        best_err = torch.where(better, err, best_err)
    # the winner's element codes made again from its scale (the same operations as when it was
    # tried), so no candidate's codes are ever stored
    divisor = safe_divisor(_e4m3_scale(best_codes, g))
    codes = []
    for j, c in enumerate(cols):
        y = c / divisor
        if key is not None:  # onto the E2M1 grid (1 mantissa bit, smallest normal 1) by chance
            noise = random_bits(key, e0 + j, y, 22, stride=16)  # element (row, j) is e0 + 16 row + j
            y = stochastic_grid(y.clamp(-_FP4_MAX, _FP4_MAX), noise, mant_bits=1, min_normal=1.0)
        codes.append(fp4_signed_codes(y))
    scales = torch.where(torch.isfinite(amax), best_codes, torch.full_like(best_codes, 0x7F))
    return scales, _bytes_as_int64([codes[2 * k] + codes[2 * k + 1] * 16.0 for k in range(8)])


def nvfp4_ragged_encode(x: Tensor, g: Tensor, key: Optional[Tensor] = None, e0: int = 0, *,
                        candidates: Sequence[str]) -> Tuple[Tensor, Tensor]:
    """:func:`nvfp4_tile_encode` of a tile that ends in a short block: ``x`` (n,) as it lies,
    padded inside with zeros to whole 16-blocks (as the eager chain pads it: they change neither
    the block's amax nor its candidates' errors, and the padding's codes are dropped by the
    caller), its blocks read as strided columns (a view: the GPU's layout)."""
    return nvfp4_tile_encode(fused_kernels.padded_blocks(x, 16).t(), g, key, e0, candidates=candidates)


def nvfp4_feedback_tile(values: Tensor, res_data: Tensor, res_scales: Tensor, g: Tensor, key: Optional[Tensor] = None,
                        e0: int = 0, *, candidates: Sequence[str], width: int) -> Tuple[Tensor, Tensor]:
    """:func:`nvfp4_tile_encode` of error feedback's sum: ``values`` (n,) plus last step's int8
    residual (codes ``res_data``, a scale per ``width``), made here and not stored, its blocks
    read as strided columns (a view: the GPU's layout)."""
    fed = _fed(values, res_data, res_scales, width)
    return nvfp4_tile_encode(fed.view(-1, 16).t(), g, key, e0, candidates=candidates)


def _bytes_as_int64(byte_values: Sequence[Tensor]) -> Tensor:
    """Eight byte values (fp32 0..255, each a (rows,) vector) as one int64 per row whose
    little-endian bytes they are: the row's 8 bytes in one pointwise store. The top byte enters
    as its signed value times 2**56, so no product or sum leaves the int64 range."""
    top = byte_values[7].to(torch.int64)
    total = torch.where(top >= 128, top - 256, top) * (1 << 56)
    for k in range(7):
        total = total + byte_values[k].to(torch.int64) * (1 << (8 * k))
    return total


def _nvfp4_values(data: Tensor) -> Tensor:
    return e2m1_of_codes(fused_kernels.fp4_nibbles(data))


def _nvfp4_row_scale(scales: Tensor, glob: Tensor) -> Tensor:
    return scales.view(torch.float8_e4m3fn).to(torch.float32) * glob


# ----------------------------------------------------------------------------- codecs


def _blocks_as_columns(x: Tensor) -> Tensor:
    """A tile of 16-blocks (rows, 16) as the (16, rows) columns NVFP4's kernel reads: a copy on
    a CPU, where C++ vectorizes across rows only over adjacent elements (on strided columns the
    kernel took 10x as long); a view elsewhere (a GPU thread takes its block's 16 strided loads
    from cache: no extra pass).

    The CPU's copy is inductor's tiled transpose into a buffer this thread keeps (as large as
    its largest tile: 64 MB at 2^24 elements; ranks run as threads of one process, so a buffer
    each). ``x.t().contiguous()`` took 55 ms of a 2^24-element encode's 82 on a 2-core x86, half
    of it the first-touch page faults of a fresh 64 MB tensor, half torch's strided copy; this
    takes 12 (``benchmarks/codec_speed.py``'s nvfp4+c row)."""
    if x.device.type != "cpu":
        return x.t()
    buf = getattr(_COLUMNS, "buf", None)
    if buf is None or buf.numel() < x.numel():
        buf = _COLUMNS.buf = torch.empty(x.numel(), dtype=torch.float32)
    out = buf[: x.numel()].view(16, x.shape[0])
    fused_kernels.compiled(_transpose_into)(x, out)
    return out


_COLUMNS = threading.local()


def _transpose_into(x: Tensor, out: Tensor) -> None:
    out.copy_(x.t())


@_register
class NvFp4Codec(_ScaledCodec):
    """E2M1 elements, E4M3 scale per 16, fp32 global scale per encoded tensor."""

    name = "nvfp4"
    default_block_size = 16
    data_dtype = torch.uint8
    elements_per_byte = 2
    has_global_scale = True
    SCALE_CANDIDATES: ClassVar[Tuple[str, ...]] = ("up", "down", "4/6")  # tried per block, in tie-break order

    def __init__(self, *, scale_candidates: Tuple[str, ...] = SCALE_CANDIDATES, **options) -> None:
        """``scale_candidates``: the block scales tried per block (see ``_prepare``); ``("up",)``
        alone is the single rule the per-block choice is measured against."""
        if not scale_candidates or any(c not in self.SCALE_CANDIDATES for c in scale_candidates):
            raise ValueError(f"nvfp4 scale_candidates must be a non-empty subset of {self.SCALE_CANDIDATES}, "
                             f"got {scale_candidates!r}")
        super().__init__(**options)
        # stochastic rounding stays unbiased only with scales that clip nothing: "down" is left out
        self.scale_candidates = tuple(c for c in scale_candidates if self.rounding == Rounding.NEAREST or c != "down")
        if not self.scale_candidates:
            raise ValueError(f"nvfp4 scale_candidates {tuple(scale_candidates)!r} with rounding 'stochastic': "
                             "'down' may clip, which stochastic rounding cannot keep unbiased; add 'up' or '4/6'")

    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        self._check_scale(scale, ("fp32",))
        if block_size not in (None, 16):
            raise ValueError(f"nvfp4 needs block_size 16, got {block_size}")
        return 16, "e4m3"

    def _row_scales(self, p: Payload, r0: int, r1: int) -> Tensor:
        return p.scales[..., r0:r1].float().mul_(p.global_scale)  # a batch: one global scale a row

    def _candidate_codes(self, amax: Tensor, g: Tensor) -> List[Tensor]:
        """The E4M3 block scale codes tried per block, in tie-break order: "up", the smallest
        E4M3 value >= amax / (6 g) (no element clips); "down", the E4M3 value below it (the
        largest elements may saturate at 6); "4/6", the smallest E4M3 value >= amax / (4 g)
        (the block's amax lands on 4, where E2M1 steps are finer relative to the amax).
        Stochastic rounding keeps to the two that never clip, so it stays unbiased."""
        target = amax / (safe_divisor(g) * _FP4_MAX)  # g == 0: all-zero tensor, target 0
        up = e4m3_at_least(target)
        options = {"up": up, "down": torch.where(up > 0, up - 1, up),
                   "4/6": e4m3_at_least((target * 1.5).clamp_(max=_E4M3_MAX))}
        return [options[k] for k in self.scale_candidates]

    def _encode_into(self, src, p: Payload, key: Optional[Tensor], tile: int) -> None:
        # Two passes over the tiles: the first finds the global scale (the finite blocks' amax);
        # the second, per tile, its blocks' amax and candidate scales: every candidate divides
        # the tile and rounds it to E2M1 (by the fp32-bit keys), each block keeps the candidate
        # whose decoded block errs least (the first wins a tie), and the winner's keys (nearest)
        # or scaled values (stochastic, rounded here) are stored: no tile is divided or looked
        # up again for the store, and nothing but the scales outlives a tile.
        numel = src.numel
        if numel == 0:
            p.global_scale.zero_()
            return
        row_len = self.block_size
        n_rows = -(-numel // row_len)
        compiled = self.compiled_on(src.device)
        step = _tile_rows(n_rows, row_len, tile)
        fused = fused_kernels.compiled(nvfp4_tile_encode, candidates=self.scale_candidates) \
            if compiled else None
        work = None  # the fp32 tile, made where one is read (eager, or values the source cannot give as they lie)

        def rows(r0: int, r1: int) -> Tensor:
            """Rows r0:r1 as the compiled kernels take them (in the source's dtype where it gives
            them as they lie), else as ``_load_rows`` reads them into the fp32 tile."""
            nonlocal work
            e0, e1 = r0 * row_len, min(r1 * row_len, numel)
            native = _native_rows(src, row_len, e0, e1) if fused is not None else None
            if native is not None:
                return native
            work = _work_tile(work, r1 - r0, min(step, n_rows), row_len, src.device)
            return _load_rows(src, row_len, r0, r1, work)[0]

        qmax = _FP4_MAX * _E4M3_MAX
        if (fused is not None and p.header_pending and n_rows <= step
                and (numel % row_len == 0 or pads_inside(src.device))):
            # one tile, compiled, the header pending: the global scale's pass, the tile kernel,
            # and the header, the global scale, the scales and the data, which follow one another
            # in the wire, written by one copy. A short last block is padded inside both kernels
            # where the source gives its values as they lie, else by the fp32 tile's read. (On a
            # CPU whole blocks' columns are a copy, which the pass then reads contiguously where
            # it read the rows' columns strided.)
            values = _native_flat(src, 0, numel) if numel % row_len else None
            if values is not None:
                g = fused_kernels.compiled(fused_kernels.ragged_tensor_scale, block=row_len, finite_blocks_only=True,
                                           qmax=qmax)(values, None)
                codes, packed = fused_kernels.compiled(nvfp4_ragged_encode, candidates=self.scale_candidates)(
                    values, g, key, 0)
            else:
                xt = _blocks_as_columns(rows(0, n_rows))
                g = fused_kernels.compiled(fused_kernels.tensor_scale, finite_blocks_only=True, qmax=qmax)(xt.t(), None)
                codes, packed = fused(xt, g, key, 0)
            self._with_header(p, g, codes, packed.view(torch.uint8).reshape(-1)[: (numel + 1) // 2])
            return
        g = _source_scale(src, row_len, tile, qmax, finite_blocks_only=True, fused=compiled)
        self._put_global(p, g)

        def store(r0: int, e0: int, e1: int, codes: Tensor, packed: Tensor) -> None:
            p.scales.view(torch.uint8)[r0 : r0 + codes.numel()].copy_(codes)
            nbytes = (e1 - e0 + 1) // 2  # an odd count's last high nibble: a padding zero's code
            p.data[e0 // 2 : e0 // 2 + nbytes].copy_(packed.view(torch.uint8).reshape(-1)[:nbytes])

        for t0, t1 in _row_ranges(n_rows, step):
            e0, e1 = t0 * row_len, min(t1 * row_len, numel)
            ragged = (e1 - e0) % row_len != 0
            if fused is not None and ragged:
                # a tile that ends in a short block, padded with zeros (as the eager chain pads it:
                # they change neither its amax nor its candidates' errors), in one call, or
                # (``pads_inside``) its whole rows' call and the short block's: padded inside the
                # kernel where the source gives its values as they lie, else the fp32 tile the
                # read pads
                first = t0 if pads_inside(src.device) else t1 - 1
                if first > t0:
                    self._encode_rows(src, p, rows, t0, first, g, key, fused, store)
                e0 = first * row_len
                values = _native_flat(src, e0, e1)
                if values is not None:
                    store(first, e0, e1, *fused_kernels.compiled(nvfp4_ragged_encode,
                                                                 candidates=self.scale_candidates)(values, g, key, e0))
                else:
                    store(first, e0, e1, *fused(_blocks_as_columns(rows(first, t1)), g, key, e0))
                continue
            self._encode_rows(src, p, rows, t0, t1, g, key, fused, store)

    def _encode_rows(self, src, p: Payload, rows, r0: int, r1: int, g: Tensor, key: Optional[Tensor], fused,
                     store) -> None:
        """Rows r0:r1: compiled where ``fused`` serves them (whole blocks), else the eager chain."""
        row_len, numel = self.block_size, src.numel
        e0, e1 = r0 * row_len, min(r1 * row_len, numel)
        x = rows(r0, r1)
        if fused is not None and e1 - e0 == x.numel():
            store(r0, e0, e1, *fused(_blocks_as_columns(x), g, key, e0))
            return
        amax = _tile_amax(x.view(-1)[: e1 - e0], row_len)
        candidates = self._candidate_codes(amax, g)
        codes = candidates[0].clone()
        best = best_err = None
        for cand in candidates:
            scale = cand.view(torch.float8_e4m3fn).float().mul_(g)
            y = torch.div(x, safe_divisor(scale)[:, None])
            keys = _fp4_keys(y)
            # summed in a fixed order, the compiled kernel's (fused_kernels.row_sum_pairwise)
            err = fused_kernels.row_sum_pairwise(_e2m1_of_keys(keys).mul_(scale[:, None]).sub_(x).square_())
            keep = y if key is not None else keys
            if best is None:
                best, best_err = keep, err
                continue
            better = err < best_err  # nan (non-finite block) never wins: its scale is set apart
            codes = torch.where(better, cand, codes)
            best_err = torch.where(better, err, best_err)
            torch.where(better[:, None], keep, best, out=best)
        best = best.view(-1)[: e1 - e0]
        if key is not None:
            best.clamp_(-_FP4_MAX, _FP4_MAX)
            best = _fp4_keys(_stochastic_round_bits(best, 1, 1.0, key, e0))
        self._pack_keys(best, p, e0, e1)
        codes.masked_fill_(~torch.isfinite(amax), 0x7F)  # nan scale marks a non-finite block
        p.scales.view(torch.uint8)[r0:r1].copy_(codes)

    @staticmethod
    def _pack_keys(key: Tensor, p: Payload, e0: int, e1: int) -> None:
        """Signed E2M1 codes of elements e0:e1 from their keys, two per byte (codes by table
        lookup, no search); nan/inf only occur in blocks whose scale is nan, where any code
        decodes to nan."""
        if key.numel() % 2:
            key = torch.cat([key, key.new_zeros(1)])
        pairs = key.view(-1, 2)
        lo = torch.index_select(_table_on(_FP4_KEY_LO, key.device), 0, pairs[:, 0])
        hi = torch.index_select(_table_on(_FP4_KEY_HI, key.device), 0, pairs[:, 1])
        torch.bitwise_or(lo, hi, out=p.data[e0 // 2 : (e1 + 1) // 2])

    def _fused_decode(self):
        return _nvfp4_values, _nvfp4_row_scale

    def _fused_fed_codes(self):
        return nvfp4_feedback_tile, (("candidates", self.scale_candidates),), _FP4_MAX * _E4M3_MAX

    def _fill(self, out: Tensor, p: Payload, e0: int, e1: int) -> None:
        _unpack_nibbles(p.data[..., e0 // 2 : (e1 + 1) // 2], _table_on(_FP4_TABLE, p.device), out)

    def _at_max(self, p: Payload) -> Tensor:
        return (_nibbles(p.data, p.numel) & 7) == 7
