"""Fused tile kernels of the codecs (``gift.kernels``): each a small pure function over one tile
that ``torch.compile`` turns into one or two kernels, beside the eager chains in
:mod:`.formats`, which stay the reference and the fallback.

Why: an eager encode is a chain of 10-40 ATen ops, each a pass over the tile; on a GPU every one
is a kernel launch and a trip through HBM. Written as one function, inductor fuses the block
amax, the scale, the divide, the cast or rounding and the nibble packing into a reduction and a
store (Triton on CUDA, C++ here), and the owner's decode of W - 1 senders and their fp32 sum
into one kernel that reads each payload once and writes the sum once.

Every function here computes exactly what the eager chain computes, operation by operation in
the same order (the same roundings: ``tests/test_kernels.py`` compares bytes), so the modes
give the same bits. Stochastic rounding draws from a counter (:mod:`.rng`: a hash of the
encode's key and the element's offset), so both modes, on any device, draw the same bits.
What they leave to the eager path: E8M0 scales' encode, rows that are not whole blocks (a
section's last, short block) and odd rows of 4-bit data.

Pure tensor math: no ``torch.distributed``.
"""

from __future__ import annotations

import functools
import math
import types
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .rng import counter_bits, offsets_of

__all__ = ["KERNEL_MODES", "check_kernels", "uses_compiled", "compiled", "sum_pairwise", "row_sum_pairwise", "fp32_scales",
           "safe_divisor", "e8m0_to_fp32", "e4m3_at_least", "rows_amax_scale",
           "fp8_block_encode", "scaled_cast", "int_block_encode", "int_scaled_round",
           "nvfp4_tile_encode", "fp4_signed_codes", "e2m1_nearest", "e2m1_of_codes", "decode_sum", "random_bits",
           "stochastic_grid", "stochastic_int", "bf16_stochastic_cast"]

KERNEL_MODES: Tuple[str, ...] = ("by_device", "eager", "compiled")

# Inductor's defaults round fp32 division on CUDA approximately (Triton's div.full) and flush
# subnormals; the codecs' scales need the correctly rounded quotient eager computes. Its fusion
# stops at 64 nodes by default: NVFP4's tile (three candidates over 16 columns) is a few hundred,
# which that cap cut into five kernels, each reading the tile again.
_COMPILE_OPTIONS = {"eager_numerics.division_rounding": True, "eager_numerics.disable_ftz": True,
                    "max_fusion_size": 4096}


def check_kernels(mode: str, key: str = "kernels") -> str:
    if mode not in KERNEL_MODES:
        raise ValueError(f"{key} must be one of {list(KERNEL_MODES)}, got {mode!r}")
    return mode


def uses_compiled(mode: str, device: torch.device) -> bool:
    """Whether ``mode`` runs the compiled kernels on ``device``: ``compiled`` always; ``by_device``
    on CUDA only. On a CPU the first use of a compiled codec costs 5-40 s of C++ compilation per
    format and process (inductor's disk cache shortens later ones), more than an eager codec
    costs a short CPU job, so ``by_device`` stays eager there (``benchmarks/codec_speed.py``
    prints both modes' speed)."""
    return mode == "compiled" or (mode == "by_device" and torch.device(device).type == "cuda")


_COPIES = 0


@functools.lru_cache(maxsize=None)
def compiled(fn: Callable, **constants) -> Callable:
    """``fn`` with its keyword-only arguments fixed to ``constants``, compiled once per process
    and set of constants (then once more with the sizes that vary made symbolic: those serve
    every tile and section size; inductor's on-disk cache serves later processes)."""
    # a copy of ``fn`` with a code object of its own and the constants as its keyword defaults:
    # dynamo counts recompiles per code object (8 at most), so each set of constants is a
    # compile of its own rather than a recompile of one shared function
    # (a name of its own too: dynamo remembers which sizes changed per file, line and name, and a
    # size that varied in one format's kernel would otherwise start another's as symbolic)
    global _COPIES
    _COPIES += 1
    code = fn.__code__.replace(co_name=f"{fn.__name__}_{_COPIES}")
    own = types.FunctionType(code, fn.__globals__, code.co_name, fn.__defaults__, fn.__closure__)
    own.__kwdefaults__ = {**(fn.__kwdefaults__ or {}), **constants}
    # dynamic=None: the first call compiles for its shapes, and a dimension that changes later
    # (a tile's rows, a section's length) becomes symbolic in one recompile; a block's width
    # never changes and stays a constant the C++/Triton code vectorizes over
    return torch.compile(own, dynamic=None, fullgraph=True, options=_COMPILE_OPTIONS)


# ----------------------------------------------------------------------------- shared pieces


def sum_pairwise(cols: Sequence[Tensor]) -> Tensor:
    """The sum of a power-of-two count of like tensors by halving: one fixed order of fp32 adds,
    the same in eager and compiled code (a stock reduction's order is the kernel's own)."""
    cols = list(cols)
    while len(cols) > 1:
        half = len(cols) // 2
        cols = [cols[i] + cols[i + half] for i in range(half)]
    return cols[0]


def row_sum_pairwise(a: Tensor) -> Tensor:
    """Sum over the last dimension (a power of two) in :func:`sum_pairwise`'s order."""
    # column by column (each a (rows,) vector): in compiled code every add is then one pointwise
    # over the rows that fuses with the rest, where halving the tensor would make buffers
    return sum_pairwise(a.unbind(-1))


def _rows_amax(x: Tensor) -> Tensor:
    """max |x| per row; nan if the row holds a nan (maximum propagates it). The abs makes an
    all-zero row's +0.0 whichever zero maximum(0.0, -0.0) picks (compiled code may ignore
    the sign of zero)."""
    return torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg()).abs()


# The scale helpers below serve the eager codecs too (formats imports them), so both paths run
# the same operations.


def fp32_scales(amax: Tensor, qmax: float) -> Tensor:
    """amax / qmax, nudged up one ulp where needed so that fl(amax / scale) <= qmax.

    Only matters when amax / qmax is subnormal (rounded with few bits) or lands on a
    rounding edge; it guarantees that no finite element is scaled past the format max. The
    divisor is a 0-d tensor: CUDA turns division by a Python scalar into a product with its
    rounded reciprocal, a tensor keeps the correctly rounded quotient on every device.
    """
    scale = amax / torch.full((), qmax, dtype=amax.dtype, device=amax.device)
    over = amax / scale > qmax  # false for nan, inf and 0/0
    return torch.where(over, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)


def safe_divisor(scale: Tensor) -> Tensor:
    """An all-zero block has scale 0; dividing by 1 keeps its zeros (0/0 would be nan)."""
    return torch.where(scale == 0, torch.ones_like(scale), scale)


def e8m0_to_fp32(codes: Tensor) -> Tensor:
    """2**(code - 127); code 0 -> 2**-127 (an fp32 subnormal), code 255 -> nan."""
    c = codes.to(torch.int32)
    edge = ((c == 0) | (c == 255)).to(torch.int32)
    return (c.bitwise_left_shift(23) | edge.bitwise_left_shift(22)).view(torch.float32)


def e4m3_at_least(target: Tensor) -> Tensor:
    """uint8 code of the smallest E4M3 value >= ``target`` (>= 0, <= 448; nan stays nan)."""
    s8 = target.to(torch.float8_e4m3fn)
    codes = s8.view(torch.uint8)
    return codes + ((s8.to(torch.float32) < target) & (codes < 0x7E)).to(torch.uint8)


# ----------------------------------------------------------------------------- stochastic rounding


def random_bits(key: Tensor, e0: int, like: Tensor, bits: int) -> Tensor:
    """``bits`` (<= 24) random bits (int32) per element of ``like``, whose flat element i is the
    encode's element e0 + i: the top bits of :func:`.rng.counter_bits`."""
    offsets = offsets_of(e0, like.numel(), like.device).view(like.shape)
    return (counter_bits(key, offsets, wide=e0 + like.numel() > 2**32) >> (32 - bits)).to(torch.int32)


def stochastic_grid(y: Tensor, noise: Tensor, *, mant_bits: int, min_normal: float) -> Tensor:
    """fp32 ``y`` rounded to a float grid of ``mant_bits`` mantissa bits, up with probability
    equal to its distance from the value below: ``noise`` (uniform on 0 .. 2**(23 - mant_bits)
    - 1) is added to the bits that are dropped, which are then cleared.

    Values below ``min_normal`` are first shifted by it into the first normal binade, whose
    spacing is the subnormal spacing, so one rule covers both ranges. Requires |y| <= the
    grid's largest value (no carry past the format max); nan stays nan."""
    drop = 23 - mant_bits
    sign = y.view(torch.int32) & -(2**31)
    a = y.abs()
    small = a < min_normal
    a = torch.where(small, a + min_normal, a)
    a = ((a.view(torch.int32) + noise) & ~((1 << drop) - 1)).view(torch.float32)
    a = torch.where(small, a - min_normal, a)
    return (a.view(torch.int32) | sign).view(torch.float32)


def stochastic_int(y: Tensor, draw: Tensor) -> Tensor:
    """``y`` rounded to an integer (fp32), up with probability ceil(f * 2**24) / 2**24 for its
    fractional part f (exact on the 2**-24 grid): ``draw`` is uniform on 0 .. 2**24 - 1."""
    lower = torch.floor(y)
    return lower + (draw < (y - lower) * 2.0**24).to(torch.float32)


def bf16_stochastic_cast(x: Tensor, key: Tensor, e0: int, data: Tensor) -> None:
    """``data`` (bf16) = ``x`` stochastically rounded to bfloat16 (16 random bits added to the
    dropped ones). inf (low bits 0) truncates to itself; nan keeps an all-ones exponent; the
    largest finite values may carry into inf, as round-to-nearest can."""
    bits = (x.view(torch.int32) + random_bits(key, e0, x, 16)) & ~0xFFFF
    data.copy_(bits.view(torch.float32).to(torch.bfloat16))  # exact: the low 16 bits are zero


# ----------------------------------------------------------------------------- encode


def rows_amax_scale(x: Tensor, best: Optional[Tensor], *, finite_blocks_only: bool,
                    qmax: float) -> Tuple[Tensor, Tensor, Tensor]:
    """A per-tensor scale's first pass, one tile: max |x| over the rows ``x`` (1 element) and
    over ``best`` (the earlier tiles') when given, ``finite_blocks_only``: rows holding inf/nan
    left out; with the scale amax / ``qmax`` so far and its divisor (1 for a zero scale), which
    the last tile's call gives for the whole tensor in the same kernel."""
    amax = _rows_amax(x)
    if finite_blocks_only:
        amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    top = amax.amax().reshape(1)
    top = top if best is None else torch.maximum(best, top)
    scale = fp32_scales(top, qmax)
    return top, scale, safe_divisor(scale)


# Element outputs come as the wire buffer's uint8 bytes and are viewed in their dtype here; fp32
# block scales are returned (a graph input that is a 4-byte view of the uint8 buffer cannot be
# written under dynamic shapes): the caller copies them, 1/32 of the element bytes at block 128.


def _fp8_rounded(y: Tensor, key: Optional[Tensor], e0: int, mant_bits: int, min_normal: float) -> Tensor:
    """Scaled values ready for the fp8 cast: as they are (the cast rounds to nearest), or on the
    grid by stochastic rounding when a ``key`` is given (the cast is then exact)."""
    if key is None:
        return y
    return stochastic_grid(y, random_bits(key, e0, y, 23 - mant_bits), mant_bits=mant_bits, min_normal=min_normal)


def fp8_block_encode(x: Tensor, data: Tensor, key: Optional[Tensor] = None, e0: int = 0, *, fmax: float,
                     dtype: torch.dtype, mant_bits: int = 0, min_normal: float = 0.0) -> Tensor:
    """One tile of whole blocks: ``x`` (rows, block) fp32, the encode's elements e0.. -> ``data``
    (the bytes of (rows, block) elements of the fp8 ``dtype``), round to nearest, or stochastic
    under ``key`` (``mant_bits``, ``min_normal``: the format's); returns the rows' fp32 scales."""
    scale = fp32_scales(_rows_amax(x), fmax)
    y = _fp8_rounded(x / safe_divisor(scale)[:, None], key, e0, mant_bits, min_normal)
    data.view(dtype).copy_(y.to(dtype))
    return scale


def scaled_cast(x: Tensor, divisor: Tensor, data: Tensor, key: Optional[Tensor] = None, e0: int = 0, *,
                dtype: torch.dtype, mant_bits: int = 0, min_normal: float = 0.0) -> None:
    """One tile under a per-tensor scale: ``data`` (bytes) = cast(x / divisor), round to nearest or
    stochastic under ``key``."""
    data.view(dtype).copy_(_fp8_rounded(x / divisor, key, e0, mant_bits, min_normal).to(dtype))


def _int_codes(y: Tensor, key: Optional[Tensor] = None, e0: int = 0) -> Tensor:
    if key is None:
        return torch.round(y).to(torch.int8)  # half to even, as eager's round_
    return stochastic_int(y, random_bits(key, e0, y, 24)).to(torch.int8)


def _pack_int4(codes: Tensor) -> Tensor:
    nib = codes.view(torch.uint8) & 0x0F
    pairs = nib.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def int_block_encode(x: Tensor, data: Tensor, key: Optional[Tensor] = None, e0: int = 0, *, qmax: int,
                     packed: bool) -> Tensor:
    """One tile of whole blocks of a symmetric integer format: ``data`` the bytes of (rows, block)
    int8, or (rows, block / 2) nibbles (element 2i low) when ``packed``, round half to even or
    stochastic under ``key``; returns the fp32 scales."""
    scale = fp32_scales(_rows_amax(x), float(qmax))
    codes = _int_codes(x / safe_divisor(scale)[:, None], key, e0)
    data.copy_(_pack_int4(codes) if packed else codes.view(torch.uint8))
    return scale


def int_scaled_round(x: Tensor, divisor: Tensor, data: Tensor, key: Optional[Tensor] = None, e0: int = 0, *,
                     packed: bool) -> None:
    """One tile under a per-tensor scale (flat ``x``; ``packed``: an even count)."""
    codes = _int_codes(x / divisor, key, e0)
    data.copy_(_pack_int4(codes) if packed else codes.view(torch.uint8))


# E2M1: magnitudes by code 0..7 and the midpoints between neighbours (a tie goes to the even code)
_FP4_MAX = 6.0
_E4M3_MAX = 448.0


# E2M1 codes are carried as fp32 values 0..15 (exact): comparisons, selects and floors of floats
# vectorize in C++ and Triton alike, where shifts and small-integer arithmetic fall back to
# scalar code on a CPU.


def _fp4_magnitude_codes(a: Tensor) -> Tensor:
    """formats._fp4_magnitude_codes as one expression: the count of midpoints below ``a`` (as
    fp32; nan counts none)."""
    c = (a > 0.25).to(torch.float32)
    for midpoint, tie_up in ((0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)):
        c = c + (a >= midpoint if tie_up else a > midpoint).to(torch.float32)
    return c


def fp4_signed_codes(y: Tensor) -> Tensor:
    """The signed E2M1 code (fp32 0..15) of fp32 ``y``, nearest with ties to even, saturating
    at +-6 (nan: magnitude 0): what :func:`formats._fp4_keys` and its tables give."""
    negative = (y.view(torch.int32) < 0).to(torch.float32)  # the sign bit (-0.0 included)
    return _fp4_magnitude_codes(y.abs()) + negative * 8.0


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
    return torch.where(negative, -mag, mag)


def _fp4_nibbles(data: Tensor) -> Tensor:
    """The nibbles (fp32 0..15) of packed bytes, element 2i the low one."""
    shifts = torch.tensor([0, 4], dtype=torch.int32, device=data.device)
    return ((data.to(torch.int32).unsqueeze(-1) >> shifts) & 0x0F).flatten(-2).to(torch.float32)


def _e4m3_scale(codes: Tensor, g: Tensor) -> Tensor:
    return codes.view(torch.float8_e4m3fn).to(torch.float32) * g


def nvfp4_tile_encode(xt: Tensor, g: Tensor, key: Optional[Tensor] = None, e0: int = 0, *,
                      candidates: Sequence[str]) -> Tuple[Tensor, Tensor]:
    """One tile of whole 16-blocks (``xt``: (16, rows) fp32, the blocks as columns: the tile's
    transpose, a view of it or a copy; the encode's elements e0..; ``g``:
    the 1-element global scale): per block the candidate E4M3 scale whose nearest-rounded block
    errs least (the first wins a tie), and the block's E2M1 codes, nearest or stochastic under
    ``key``, packed two a byte; returns the scales' uint8 codes (0x7F for a non-finite block)
    and each block's 8 bytes as one int64 (little-endian). ``NvFp4Codec._encode_into``."""
    # Written over the block's 16 columns, each a (rows,) vector: every step, the block amax and
    # each candidate's summed error included, is then a pointwise expression over the rows, so
    # the whole tile is one kernel that reads each block once and writes its 8 bytes (one int64)
    # and its scale (a reduction over the block would be a kernel of its own, and the byte
    # packing, over (rows, 8), a third, each reading the tile again). The bytes are returned, not
    # written into the payload: its data sit at any byte offset, where no int64 view lies.
    # (A copy, contiguous, on a CPU: C++ vectorizes across rows only where a column's elements
    # are adjacent; a GPU thread takes its row's 16 strided loads from cache.)
    cols = xt.unbind(0)
    amax = functools.reduce(torch.maximum, [c.abs() for c in cols])  # max is exact: _rows_amax's value
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
            offsets = offsets_of(0, y.numel(), y.device) * 16 + (e0 + j)
            noise = (counter_bits(key, offsets, wide=e0 + 16 * y.numel() > 2**32) >> 10).to(torch.int32)
            y = stochastic_grid(y.clamp(-_FP4_MAX, _FP4_MAX), noise, mant_bits=1, min_normal=1.0)
        codes.append(fp4_signed_codes(y))
    scale_codes = torch.where(torch.isfinite(amax), best_codes, torch.full_like(best_codes, 0x7F))
    return scale_codes, _bytes_as_int64([codes[2 * k] + codes[2 * k + 1] * 16.0 for k in range(8)])


def _bytes_as_int64(byte_values: Sequence[Tensor]) -> Tensor:
    """Eight byte values (fp32 0..255, each a (rows,) vector) as one int64 per row whose
    little-endian bytes they are: the row's 8 bytes in one pointwise store. The top byte enters
    as its signed value times 2**56, so no product or sum leaves the int64 range."""
    top = byte_values[7].to(torch.int64)
    total = torch.where(top >= 128, top - 256, top) * (1 << 56)
    for k in range(7):
        total = total + byte_values[k].to(torch.int64) * (1 << (8 * k))
    return total


# ----------------------------------------------------------------------------- decode and sum


def _fp8_values(data: Tensor) -> Tensor:
    return data.to(torch.float32)


# Nibbles unpacked by broadcasting each byte against two factors (element 2i the low nibble):
# one pointwise expression, where a stack of the two halves would be a buffer of its own.


def _int4_values(data: Tensor) -> Tensor:
    n = _fp4_nibbles(data)  # two's complement nibbles
    return torch.where(n >= 8.0, n - 16.0, n)


def _nvfp4_values(data: Tensor) -> Tensor:
    return e2m1_of_codes(_fp4_nibbles(data))


def decoded_rows(kind: str, data: Tensor, scales: Optional[Tensor], glob: Optional[Tensor], block: int) -> Tensor:
    """(senders, n) fp32 values of a batch of payloads of whole blocks (``kind``: ``fp8``,
    ``int8``, ``int4``, ``nvfp4``, ``e8m0`` (fp8 elements), ``cast`` (bf16/fp32)), each
    element its code's value times its block's scale, as one product (what the eager fill and
    row scaling give: the eager fp8 path's power-of-two detours are exact)."""
    if kind == "cast":
        return data.to(torch.float32)
    values = {"fp8": _fp8_values, "e8m0": _fp8_values, "int8": _fp8_values,
              "int4": _int4_values, "nvfp4": _nvfp4_values}[kind](data)
    if kind == "nvfp4":
        row_scale = scales.view(torch.float8_e4m3fn).to(torch.float32) * glob
    elif kind == "e8m0":
        row_scale = e8m0_to_fp32(scales)
    else:
        row_scale = scales
    s = values.shape[0]
    if block == 0:
        return values * row_scale.view(s, 1)
    rows = row_scale.shape[-1]
    torch._check(values.shape[-1] == rows * block)  # whole blocks: tells the symbolic shapes so
    return (values.view(s, rows, block) * row_scale.view(s, rows, 1)).view(s, -1)


def decode_sum(data: Tensor, scales: Optional[Tensor], glob: Optional[Tensor], out: Tensor,
               own: Optional[Tensor], *, kind: str, block: int, own_at: int, from_out: bool) -> None:
    """``out`` = the fp32 sum, in rank order, of every sender's decoded payload (rows of
    ``data``/``scales``/``glob``) with ``own`` at place ``own_at`` of that order when given,
    starting from ``out``'s own values when ``from_out``: the owner's decode-and-sum as one
    pass (``GiftReducer.sum_sources`` adds the same terms in the same order)."""
    rows = decoded_rows(kind, data, scales, glob, block)
    terms = [rows[i] for i in range(rows.shape[0])]
    if own is not None:
        terms.insert(own_at, own)
    total = out if from_out else terms.pop(0)
    for term in terms:
        total = total + term
    out.copy_(total)
