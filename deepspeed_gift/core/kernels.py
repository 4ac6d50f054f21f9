"""Fused tile kernels of the codecs (``gift.kernels``): how they are compiled, and the pieces the
format families share (scales, stochastic rounding's rules, a per-tensor scale's first pass,
nibbles, the owner's decode-and-sum). Each family's own kernels live beside its eager codec in
:mod:`.formats` (``fp8``, ``integer``, ``nvfp4``, ``passthrough``); the eager chains stay the
reference and the fallback.

Why: an eager encode is a chain of 10-40 ATen ops, each a pass over the tile; on a GPU every one
is a kernel launch and a trip through HBM. Written as one function, inductor fuses the block
amax, the scale, the divide, the cast or rounding and the nibble packing into a reduction and a
store (Triton on CUDA, C++ here), and the owner's decode of W - 1 senders and their fp32 sum
into one kernel that reads each payload once and writes the sum once.

Every function here computes exactly what the eager chain computes, operation by operation in
the same order (the same roundings: ``tests/test_kernels.py`` compares bytes), so the modes
give the same bits. Stochastic rounding draws from a counter (:mod:`.rng`: a hash of the
encode's key and the element's offset), so both modes, on any device, draw the same bits.
What they leave to the eager path: E8M0 scales' encode and odd rows of 4-bit data.

Pure tensor math: no ``torch.distributed``.
"""

from __future__ import annotations

import functools
import math
import threading
import types
from typing import Callable, Optional, Sequence, Tuple

import torch
from torch import Tensor

from .rng import counter_bits, offsets_of

__all__ = ["KERNEL_MODES", "check_kernels", "uses_compiled", "compiled", "sum_pairwise", "row_sum_pairwise",
           "fp32_scales", "finite_or_zero", "safe_divisor", "e8m0_to_fp32", "e4m3_at_least", "random_bits",
           "stochastic_grid", "stochastic_int", "rows_amax", "columns_amax", "tensor_scale", "ragged_tensor_scale",
           "padded_blocks", "int4_bytes",
           "ragged_block_encode", "spans_block_encode", "fp4_nibbles",
           "decoded_rows", "decode_sum"]

KERNEL_MODES: Tuple[str, ...] = ("by_device", "eager", "compiled")

# Inductor's defaults round fp32 division on CUDA approximately (Triton's div.full) and flush
# subnormals; the codecs' scales need the correctly rounded quotient eager computes. Its fusion
# stops at 64 nodes by default: NVFP4's tile (three candidates over 16 columns) is a few hundred,
# which that cap cut into five kernels, each reading the tile again.
# Triton also contracts a product and a sum into one fused multiply-add (one rounding where eager
# rounds twice): error feedback's ``x + q * s`` and the owner's ``sum + q * s`` then move last
# bits (seen on an H200, 2026-12-04: every format's feedback step but bf16's differed from the
# CPU's; a CPU build with -ffp-contract=fast shows the same formats differ). Inductor turns
# Triton's fp fusion off under ``emulate_precision_casts``, which also keeps eager's bf16 roundings
# between fused operations; its C++ builds keep -ffp-contract=off by default.
_COMPILE_OPTIONS = {"eager_numerics.division_rounding": True, "eager_numerics.disable_ftz": True,
                    "emulate_precision_casts": True, "max_fusion_size": 4096}


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
    """``fn`` with its keyword-only arguments fixed to ``constants``, compiled once per process,
    set of constants and specialization class of its arguments (:func:`specialization_class`),
    then once more with the sizes that vary made symbolic: those serve every tile and section
    size; inductor's on-disk cache serves later processes. A function's ``compile_options``
    attribute adds inductor options of its own.

    Why a copy per class: dynamo specializes a size, storage offset or int of 0 or 1 apart from
    the others, so one compiled object that meets a one-row tile, a section's first tile (e0 =
    0), a tile at the bucket's start (offset 0) and every other tile collects a cache entry for
    each mix; past 8 (dynamo's limit per code object) ``fullgraph=True`` stops the run with
    "recompile limit exceeded". A copy per class holds one entry, plus one for each time
    another of its sizes or ints is first seen to change (rows, then e0: 3 for a tile kernel),
    whatever mix the run meets."""
    options = known_options({**_COMPILE_OPTIONS, **getattr(fn, "compile_options", {})})
    graphs: dict = {}

    @functools.wraps(fn)
    def run(*args):
        # one call at a time: dynamo's compiles and guard checks are not safe against threads, and
        # ranks run as threads of one process (``comm.run_local``) raced it into "runtime guards
        # failed" recompiles past its limit of 8 (seen in a CI run, tests/test_route.py's relay
        # case); a rank of its own process calls from one thread and never waits here
        with _CALL_LOCK:
            cls = specialization_class(args)
            graph = graphs.get(cls)
            if graph is None:
                graph = graphs[cls] = _compile_copy(fn, constants, options)
            return graph(*args)
    run.graphs = graphs  # per class: what tests and benchmarks count
    return run


def specialization_class(args: Sequence) -> tuple:
    """What dynamo compiles apart for ``args``: per tensor its dtype, device, rank, contiguity,
    autograd flag and which sizes and storage offset are 0, 1 or more; per int, bool or None its
    value class the same way; a float by value (dynamo guards floats' values)."""
    def small(v: int) -> int:
        return v if v < 2 else 2

    cls = []
    for a in args:
        if isinstance(a, Tensor):
            cls.append((a.dtype, a.device.type, a.requires_grad, a.is_contiguous(),
                        tuple(small(s) for s in a.shape), small(a.storage_offset())))
        elif isinstance(a, bool) or a is None:
            cls.append(a)
        elif isinstance(a, int):
            cls.append(("int", small(a)))
        else:
            cls.append((type(a).__name__, a))
    return tuple(cls)


def _compile_copy(fn: Callable, constants: dict, options: dict) -> Callable:
    # a copy of ``fn`` with a code object of its own and the constants as its keyword defaults:
    # dynamo counts recompiles per code object, so each set of constants and each class is a
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
    return torch.compile(own, dynamic=None, fullgraph=True, options=options)


_CALL_LOCK = threading.RLock()


def known_options(options: dict) -> dict:
    """The inductor options this torch knows (an unknown one fails the compile); the others are
    logged once, by name: the numerics options came in torch 2.11 (2.10 named one otherwise),
    and without them a compiled codec may round its scales otherwise than eager
    (``benchmarks/gpu_check.py``'s parity rows tell)."""
    import torch._inductor.config as config

    def has(name: str) -> bool:
        obj = config
        for part in name.split("."):
            if not hasattr(obj, part):
                return False
            obj = getattr(obj, part)
        return True

    missing = sorted(k for k in options if not has(k))
    if missing and not _MISSING_LOGGED:
        _MISSING_LOGGED.append(missing)
        import logging

        logging.getLogger(__name__).warning("this torch's inductor lacks the options %s: compiled codecs run "
                                            "without them", missing)
    return {k: v for k, v in options.items() if k not in missing}


_MISSING_LOGGED: list = []


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


def rows_amax(x: Tensor) -> Tensor:
    """max |x| per row; nan if the row holds a nan (maximum propagates it). The abs makes an
    all-zero row's +0.0 whichever zero maximum(0.0, -0.0) picks (compiled code may ignore
    the sign of zero)."""
    return torch.maximum(x.amax(dim=-1), x.amin(dim=-1).neg()).abs()


def columns_amax(cols: Sequence[Tensor]) -> Tensor:
    """max |x| per row of a tile given as its columns (each a (rows,) vector): pointwise, so the
    kernel that takes it needs no reduction of its own (NVFP4's 16-blocks); nan if the row holds
    a nan (maximum propagates it), +0.0 for an all-zero row (each |x| is)."""
    return functools.reduce(torch.maximum, [c.abs() for c in cols])


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


def finite_or_zero(scale: Tensor) -> Tensor:
    """A residual's block scales as error feedback keeps them: a block that held inf/nan gets
    scale 0, so it decodes to zeros (its codes times 0; a negative code's -0 adds nothing
    either). Per block, in the kernel that makes the scales: no pass of its own."""
    return torch.where(torch.isfinite(scale), scale, torch.zeros_like(scale))


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


def random_bits(key: Tensor, e0, like: Tensor, bits: int, stride: int = 1) -> Tensor:
    """``bits`` (<= 24) random bits (int32) per element of ``like``, whose flat element i is the
    encode's element e0 + i * ``stride`` (a column of blocks: the block's length): the top bits
    of :func:`.rng.counter_bits`. Spans (:func:`spans_block_encode`): ``e0`` a tensor, a row's
    first offset in its own encode per row of ``like`` (rows, block), and ``key`` (rows, 2), the
    row's encode's key: each element draws what the encode of its span alone draws for it (an
    offset below 2**32: a span is at most a tile)."""
    if isinstance(e0, Tensor):
        offsets = e0[:, None] + torch.arange(like.shape[-1], dtype=torch.int64, device=like.device)
        return (counter_bits(key.t().unsqueeze(-1), offsets) >> (32 - bits)).to(torch.int32)
    n = like.numel()
    offsets = offsets_of(0, n, like.device) * stride + e0 if stride != 1 else offsets_of(e0, n, like.device)
    wide = e0 + stride * (n - 1) >= 2**32  # the last offset: a second round only reaches offsets past 2**32
    return (counter_bits(key, offsets.view(like.shape), wide=wide) >> (32 - bits)).to(torch.int32)


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


# ----------------------------------------------------------------------------- encode


def tensor_scale(x: Tensor, best: Optional[Tensor], *, finite_blocks_only: bool, qmax: float) -> Tensor:
    """A per-tensor scale's first pass, one tile: the scale of max |x| over the rows ``x`` and
    over ``best`` (the earlier tiles' scale) when given (:func:`fp32_scales`, 1 element);
    ``finite_blocks_only``: rows holding inf/nan left out. The encode kernels take its divisor
    (:func:`safe_divisor`) inline.

    Taken as the largest scale of the elements' magnitudes, not as the scale of their largest
    magnitude: the same value, since fp32_scales is nondecreasing in its amax (a correctly
    rounded quotient is; where two amaxes share a quotient, the larger is nudged whenever the
    smaller is) and nan stays nan through both. So the pass is one reduction: the scale as a
    step of its own after the reduction was a kernel of its own, on a single element. ``x`` may be
    bf16/fp16 (a source's values as they lie): widened first, exactly."""
    x = x.float()
    if finite_blocks_only:  # a row's amax first, to leave out the rows that are not finite
        # over the row's columns, each a (rows,) vector: the row amax is then pointwise and the
        # whole pass one reduction, where a reduction per row and one over the rows were two
        # kernels (and on this CPU 1.6x the time)
        amax = columns_amax(x.t().unbind(0))
        amax = torch.where(torch.isfinite(amax), amax, torch.zeros_like(amax))
    else:
        amax = x.reshape(-1).abs()
    top = fp32_scales(amax, qmax).amax().reshape(1)
    return top if best is None else torch.maximum(best, top)


def padded_blocks(x: Tensor, block: int) -> Tensor:
    """Flat ``x`` (n,) as (ceil(n / block), block) rows, the last padded with zeros, inside a
    kernel: the padding is a masked load, not a pass of its own (what the eager chain's padded
    work tile holds)."""
    rows = (x.shape[0] + block - 1) // block
    return torch.nn.functional.pad(x, (0, rows * block - x.shape[0])).view(rows, block)


def ragged_tensor_scale(x: Tensor, best: Optional[Tensor], *, block: int, finite_blocks_only: bool,
                        qmax: float) -> Tensor:
    """:func:`tensor_scale` of a tile that ends in a short block (``x`` (n,), padded inside to
    whole rows of ``block``: zeros change neither a row's amax nor whether it holds an inf or a
    nan): one call where the short block was a padded copy and a call of its own."""
    return tensor_scale(padded_blocks(x, block), best, finite_blocks_only=finite_blocks_only, qmax=qmax)


# Element outputs come as the wire buffer's uint8 bytes and are viewed in their dtype here; fp32
# scales are returned and the caller copies them (1/32 of the element bytes at block 128, but a
# launch a tile; the first tile's with the payload's header, ``Codec._put_scales``): a graph input that is a 4-byte view of the uint8 buffer cannot be written
# under dynamic shapes (torch 2.13: "nbytes % dtype_size == 0" as the compiler regenerates the
# view from its base; tried again 2026-12-06, tests/test_kernels.py). One-byte scales (NVFP4's
# E4M3 codes) are written by the kernel that chooses them (nvfp4_tile_encode).


def int4_bytes(codes: Tensor) -> Tensor:
    """int8 codes in [-8, 7] (an even count per row) packed two to a byte, element 2i the low nibble."""
    nib = codes.view(torch.uint8) & 0x0F
    pairs = nib.unflatten(-1, (-1, 2))
    return pairs[..., 0] | (pairs[..., 1] << 4)


def ragged_block_encode(x: Tensor, data: Tensor, key: Optional[Tensor] = None, e0: int = 0, *, block: int,
                        codes_fn: Callable, codes_kw: tuple, packed: bool) -> Tuple[Tensor, Tensor]:
    """A tile that ends in a short block, in one call: ``x`` (n,), the encode's elements e0..,
    n = rows * block plus the short block's 1 .. block - 1, padded inside with zeros to whole
    blocks (as the eager chain pads the short block: the zeros change neither its amax nor the
    codes kept, and the padding's random bits are drawn and dropped), quantized by the format
    family's ``codes_fn`` (a ``Codec._fused_block_codes``, ``codes_kw`` its constants). The
    whole blocks' codes go into ``data``, the bytes of their (rows, block) codes, or (rows,
    block / 2) nibbles when ``packed``. Returns the blocks' fp32 scales and the short block's
    codes (or bytes), padded to a whole block, whose first bytes the caller copies into the
    payload (an odd count of nibbles ends in a padding zero's code, 0, as eager packs it).
    Where the short block was a call of its own, padded and copied around it, a tile took 9
    launches; this is 4 (``benchmarks/codec_traffic.py --ops "encode short"``), at the cost of
    the codes written to a buffer of inductor's and copied from it (2 B an element more: a
    second store of them, returned or into an input, cut the kernel or the same).

    Stored as one flat slice of the padded codes, inductor's C++ (torch 2.13, shapes static)
    wrote the whole rows and dropped the short one (``tests/test_kernels.py`` compares bytes at
    a first, static compile). The whole rows' count is ``data``'s, an input's size, so a tile of
    the short block alone is a specialization class of its own (:func:`compiled`), not a
    symbolic 0 (which failed to lower)."""
    rows = data.shape[0]
    scale, codes = codes_fn(padded_blocks(x, block), key, e0, **dict(codes_kw))
    if packed:
        codes = int4_bytes(codes)
    data.view(codes.dtype).copy_(codes[:rows])  # the bytes viewed as the codes' dtype: fp8 codes viewed as bytes failed to lower
    return scale, codes[rows]


def spans_block_encode(x: Tensor, span_of: Tensor, table: Tensor, stochastic: bool = False, *, block: int,
                       codes_fn: Callable, codes_kw: tuple, packed: bool) -> Tuple[Tensor, Tensor]:
    """Several spans of one flat tensor, each quantized as an encode of its own, in one call:
    ``x`` (the bucket, as it lies), ``span_of`` (int64, per block of every span in order, its
    span) and ``table`` (int64 (spans, 5): each span's start in ``x``, length, first block and
    stochastic rounding key's two words). A block past its span's end is padded inside with
    zeros, as :func:`ragged_block_encode` pads a short block, so every span gets the bytes an
    encode of it alone gives; ``stochastic``: each element draws, under its span's key, the bits
    of its offset in its span (:func:`random_bits`), as the span's own encode draws them. Returns
    the blocks' fp32 scales and codes, (blocks, block) or (blocks, block / 2) bytes when
    ``packed``; the caller cuts them into the spans' payloads. Why: a piece of a two-level or
    ZeRO-1 exchange sends a section to each of up to W/G - 1 or W - 1 owners, and on a GPU every
    encode call costs the host ~100 us (dynamo's guards, the payload's views): one call for them
    all is what the layout model's host charge asks for. The blocks' places are made here from the
    spans' (no table per block on the host, none kept)."""
    rows = table[span_of]
    inner = (torch.arange(span_of.shape[0], device=x.device) - rows[:, 2]) * block  # the block's offset in its span
    j = torch.arange(block, device=x.device)
    inside = j < (rows[:, 1] - inner)[:, None]
    values = x[torch.where(inside, (rows[:, 0] + inner)[:, None] + j, 0)].float()
    keys = rows[:, 3:5] if stochastic else None
    scale, codes = codes_fn(torch.where(inside, values, 0.0), keys, inner if stochastic else 0, **dict(codes_kw))
    return scale, int4_bytes(codes) if packed else codes


def fp4_nibbles(data: Tensor) -> Tensor:
    """The nibbles (fp32 0..15) of packed bytes, element 2i the low one."""
    shifts = torch.tensor([0, 4], dtype=torch.int32, device=data.device)
    return ((data.to(torch.int32).unsqueeze(-1) >> shifts) & 0x0F).flatten(-2).to(torch.float32)


# ----------------------------------------------------------------------------- decode and sum


def decoded_rows(data: Tensor, scales: Optional[Tensor], glob: Optional[Tensor], *, values: Callable,
                 row_scale: Optional[Callable], block: int) -> Tensor:
    """(senders, n) fp32 values of a batch of payloads of whole blocks: ``values(data)`` each
    code's value, times its block's scale ``row_scale(scales, glob)`` (None: no scale, a cast),
    as one product (what the eager fill and row scaling give: the eager fp8 path's power-of-two
    detours are exact). The two functions are the format family's (:meth:`Codec._fused_decode`)."""
    v = values(data)
    if row_scale is None:
        return v
    scale = row_scale(scales, glob)
    s = v.shape[0]
    if block == 0:
        return v * scale.view(s, 1)
    rows = scale.shape[-1]
    torch._check(v.shape[-1] == rows * block)  # whole blocks: tells the symbolic shapes so
    return (v.view(s, rows, block) * scale.view(s, rows, 1)).view(s, -1)


def decode_sum(data: Tensor, scales: Optional[Tensor], glob: Optional[Tensor], out: Tensor,
               own: Optional[Tensor], *, values: Callable, row_scale: Optional[Callable], block: int,
               own_at: int, from_out: bool) -> None:
    """``out`` = the fp32 sum, in rank order, of every sender's decoded payload (rows of
    ``data``/``scales``/``glob``; :func:`decoded_rows`) with ``own`` at place ``own_at`` of
    that order when given, starting from ``out``'s own values when ``from_out``: the owner's
    decode-and-sum as one pass (``GiftReducer.sum_sources`` adds the same terms in the same
    order)."""
    rows = decoded_rows(data, scales, glob, values=values, row_scale=row_scale, block=block)
    terms = [rows[i] for i in range(rows.shape[0])]
    if own is not None:
        terms.insert(own_at, own)
    total = out if from_out else terms.pop(0)
    for term in terms:
        total = total + term
    out.copy_(total)


def fp32_row_scale(scales: Tensor, glob: Optional[Tensor]) -> Tensor:
    """Block scales carried as fp32: as they are (:func:`decoded_rows`' ``row_scale`` of the
    fp8 and integer families)."""
    return scales
