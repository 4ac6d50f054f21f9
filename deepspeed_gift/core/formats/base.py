"""What every wire format shares: the header and byte layout, :class:`Payload`, the
:class:`Codec` base with its tiling, decode-and-sum and (de)serialization, the block-scaled
base, the registry and the public functions. The formats themselves, and the package's
reference of layouts, non-finite values, ranges and rounding: :mod:`deepspeed_gift.core.formats`.
"""

from __future__ import annotations

import enum
import math
import struct
from dataclasses import dataclass, field
from typing import Callable, ClassVar, Dict, Iterator, List, Optional, Sequence, Tuple, Type, Union

import torch
from torch import Tensor

from .. import kernels as fused_kernels
from ..devices import host_to_device
from ..rng import CounterRng

__all__ = [
    "FORMAT_NAMES",
    "format_class",
    "HEADER_BYTES",
    "Codec",
    "Payload",
    "get_format",
    "quantization_stats",
    "DEFAULT_TILE_ELEMENTS",
    "TensorSource",
    "SampleRecorder",
]

FORMAT_NAMES: Tuple[str, ...] = ("fp8_e4m3", "fp8_e5m2", "nvfp4", "int8", "int4", "bf16", "fp32")


class Rounding(str, enum.Enum):
    """How a codec rounds to its grid (``gift.rounding``)."""

    NEAREST = "nearest"
    STOCHASTIC = "stochastic"


ROUNDING_MODES: Tuple[str, ...] = tuple(r.value for r in Rounding)
SCALE_KINDS: Tuple[str, ...] = ("none", "fp32", "e8m0", "e4m3")

HEADER_BYTES = 16
_HEADER = struct.Struct("<BBBBIq")
_MAGIC = 0x47  # 'G'
_VERSION = 1
_FORMAT_IDS: Dict[str, int] = {name: i + 1 for i, name in enumerate(FORMAT_NAMES)}
_SCALE_IDS: Dict[str, int] = {kind: i for i, kind in enumerate(SCALE_KINDS)}
_MAX_BLOCK = 2**32 - 1

_SCALE_DTYPES = {"fp32": torch.float32, "e8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}

Shape = Union[torch.Size, Tuple[int, ...], int]


@dataclass
class Payload:
    """One encoded tensor. ``data``/``scales`` may be views into ``wire``.

    A batch of payloads of one shape and codec (the same section from every rank, laid out at
    one stride in a received buffer: see :meth:`Codec.bytes_to_payload`) is one payload whose
    ``data``, ``scales`` and ``global_scale`` carry a leading dimension, one row per payload;
    ``shape`` stays one payload's. Such a payload is for decoding only."""

    format: str
    shape: torch.Size
    data: Tensor
    scales: Optional[Tensor] = None
    global_scale: Optional[Tensor] = None  # nvfp4: 1-element fp32 tensor
    block_size: int = 0  # 0: one scale per tensor (or no scales)
    scale_kind: str = "none"
    wire: Optional[Tensor] = field(default=None, repr=False, compare=False)
    # an encode under way whose wire's header is still to be written: with the first rows' block
    # scales, which follow it in the wire, as one copy (``Codec._put_scales``)
    header_pending: bool = field(default=False, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def batch(self) -> Tuple[int, ...]:
        """The leading dimensions of a batch of payloads (``()`` for one payload)."""
        return tuple(self.data.shape[:-1])

    def as_batch(self) -> "Payload":
        """This payload as a batch of one (views)."""
        def row(t):
            return None if t is None else t.unsqueeze(0)
        return Payload(format=self.format, shape=self.shape, data=row(self.data), scales=row(self.scales),
                       global_scale=row(self.global_scale), block_size=self.block_size,
                       scale_kind=self.scale_kind, wire=self.wire)

    @property
    def nbytes(self) -> int:
        parts = (self.data, self.scales, self.global_scale)
        return HEADER_BYTES + sum(t.numel() * t.element_size() for t in parts if t is not None)


# ----------------------------------------------------------------------------- helpers

# Every element-wise step of encode and decode runs over a tile of whole blocks, so what a
# codec allocates besides its input and payload is bounded by the tile, not by the tensor.
# Measured per tile element (tests/test_tiles.py's LiveBytes, one tile over 4M elements):
# encode fp8/int8 4.1 B (10-11 with stochastic rounding), int4 5.5, bf16 stochastic 10, NVFP4 28
# (its three candidate scales); decode 0-4; quantization_stats 31 (on a sample of at most a
# tile). With the reducer's chunk it reads (4) and a sampled step's recorded sample (4), NVFP4
# peaks near 34 B per tile element: the default tile (``gift.tile_elements``) keeps that
# near 0.57 GB on an accelerator. A block larger than the tile is a tile of its own.
DEFAULT_TILE_ELEMENTS = 1 << 24
# On the CPU the tile is further cut to 4 MB of fp32, so temporaries stay in cache instead of
# being fresh multi-100 MB allocations (each one page-faulted in): faster, and never larger.
_CPU_TILE = 1 << 20


def check_tile_elements(tile_elements: int, key: str = "tile_elements") -> int:
    if isinstance(tile_elements, bool) or not isinstance(tile_elements, int) or tile_elements < 1:
        raise ValueError(f"{key} must be an int >= 1 (elements per tile), got {tile_elements!r}")
    return tile_elements


def _device_tile(tile_elements: int, device: torch.device) -> int:
    """The tile the element-wise work uses on ``device``: the configured one, cache-sized on CPU."""
    return min(tile_elements, _CPU_TILE) if device.type == "cpu" else tile_elements


def _as_size(shape: Shape) -> torch.Size:
    if isinstance(shape, int):
        return torch.Size((shape,))
    return torch.Size(shape)


def _flat_input(x: Tensor) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"encode expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point() or x.dtype.itemsize == 1:
        raise ValueError(f"encode expects a floating-point tensor (fp32/bf16/fp16), got {x.dtype}")
    return x.reshape(-1)


def _tile_rows(n_rows: int, row_len: int, tile: int) -> int:
    """Rows per tile: whole rows of at most ``tile`` elements (one row when a row is longer)."""
    step = max(1, tile // row_len)
    if step % 2 and row_len % 2 and step < n_rows:
        step += 1  # every tile but the last holds an even count (4-bit packing)
    return step


class TensorSource:
    """The values a codec encodes, read tile by tile: here a flat tensor (any float dtype).

    ``read(e0, e1, work)`` gives elements ``e0:e1`` as float32: a view of the input when it
    is float32, else converted into ``work`` (float32, at least ``e1 - e0`` long). Other
    sources (the reducer's sections, made tile by tile) implement the same three members."""

    def __init__(self, flat: Tensor) -> None:
        self.flat = flat
        self.numel = flat.numel()
        self.device = flat.device

    def read(self, e0: int, e1: int, work: Tensor) -> Tensor:
        part = self.flat[e0:e1]
        if part.dtype == torch.float32:
            return part
        return work[: e1 - e0].copy_(part)

    def native(self, e0: int, e1: int) -> Optional[Tensor]:
        """Elements ``e0:e1`` as they lie, in their own dtype (a view), for the compiled kernels,
        which widen them to fp32 as they load them (exact): no fp32 copy of a bf16 tile first. A
        source that cannot give a range as one view returns None (``read`` serves it)."""
        return self.flat[e0:e1]


def _native_rows(src, row_len: int, e0: int, e1: int) -> Optional[Tensor]:
    """Elements ``e0:e1`` of ``src``, whole rows of ``row_len``, as a (rows, row_len) view in
    their own dtype where the source gives one (``TensorSource.native``), else None."""
    values = None if (e1 - e0) % row_len else _native_flat(src, e0, e1)
    return None if values is None else values.view(-1, row_len)


def _native_flat(src, e0: int, e1: int) -> Optional[Tensor]:
    """Elements ``e0:e1`` of ``src`` as a flat view in their own dtype where the source gives one
    (``TensorSource.native``), else None."""
    native = getattr(src, "native", None)
    return None if native is None else native(e0, e1)


def _flat_values(src, e0: int, e1: int, work: Optional[Tensor], full_rows: int, row_len: int
                 ) -> Tuple[Tensor, Optional[Tensor]]:
    """Elements ``e0:e1`` of ``src``, flat, for a kernel that pads a short block inside: as they
    lie (:func:`_native_flat`), else read into the fp32 work tile (:func:`_work_tile`, of
    ``full_rows`` rows); and the work tile for the next reads."""
    values = _native_flat(src, e0, e1)
    if values is None:
        work = _work_tile(work, -(-(e1 - e0) // row_len), full_rows, row_len, src.device)
        values = src.read(e0, e1, work)
    return values, work


def pads_inside(device) -> bool:
    """Where a tile that ends in a short block is one compiled call that pads the block inside
    (a GPU: Triton's masked load of the padding is free, and NVFP4's kernel reads the tile's
    columns as a view, as it reads a whole tile's), rather than the whole blocks' call and then
    the short block's call, padded inside on its own (a CPU: inductor's C++ vectorizes a masked
    load poorly and NVFP4's kernel would read strided columns: one call took 2.4x the two at
    2^20 - 4 elements of fp8, 3.5x for int4, 3.8x for NVFP4, ``benchmarks/codec_speed.py --numel
    1048572``). The bytes are the same either way."""
    return torch.device(device).type != "cpu"


# The longest span a CPU encodes with others in one call (``Codec.encode_spans``): there the
# batched kernel's loads, gathered through its block table, do not vectorize, so past about this
# many elements its work costs more than the calls it saves (``benchmarks/codec_speed.py
# --sections``, fp8/int8/int4 per section: 4113 elements 194-198 us each against 18-23 batched,
# 65536 173-216 against 123-180, 262144 225-369 against 350-372).
SPANS_CPU_ELEMENTS = 1 << 16


def spans_batch_limit(device, tile: int) -> int:
    """The longest span that joins a batched encode on ``device``: a tile on a GPU (an encode
    call costs the host ~100 us there, a span's bytes microseconds of HBM, and Triton's gathered
    loads of a block's consecutive elements coalesce), :data:`SPANS_CPU_ELEMENTS` on a CPU."""
    # (and below 2^32: a span's random bits are drawn by offsets that one hash round serves)
    return min(tile, 1 << 32) if torch.device(device).type != "cpu" else min(tile, SPANS_CPU_ELEMENTS)


def _row_ranges(n_rows: int, step: int) -> Iterator[Tuple[int, int]]:
    """The encode's tiles as row ranges (r0, r1), ``step`` rows each."""
    for r0 in range(0, n_rows, step):
        yield r0, min(r0 + step, n_rows)


def _short_apart(r0: int, r1: int, apart: bool) -> List[Tuple[int, int]]:
    """A tile's rows r0:r1 as the ranges it is encoded in: with ``apart`` (its last row a short
    block that the compiled call of the whole tile does not serve) its whole rows, then that
    block alone, so that the compiled kernels, which take whole blocks, still serve the others:
    left in its tile, the block sent the whole tile (on a GPU 2^24 elements) down the eager
    chain."""
    return [(r0, r1 - 1), (r1 - 1, r1)] if apart and r1 - r0 > 1 else [(r0, r1)]


def _work_tile(work: Optional[Tensor], rows: int, full_rows: int, row_len: int, device) -> Tensor:
    """The fp32 tile a read of ``rows`` rows fills: ``work`` where it holds them, else a new one
    of a whole tile (``full_rows``), or of one row for the lone short last row (read last, so
    nothing larger is needed after it)."""
    if work is None or work.numel() < rows * row_len:
        work = torch.empty((full_rows if rows > 1 else 1) * row_len, dtype=torch.float32, device=device)
    return work


def _load_rows(src, row_len: int, r0: int, r1: int, work: Tensor) -> Tuple[Tensor, Tensor]:
    """Rows r0:r1 of ``src`` as (k, row_len) float32, zero padded, and a same-shaped work tile.

    Full rows read without a copy come back as a view (read only); otherwise they are
    copied (converted, padded) into the work tile and both results are that tile.
    """
    n = src.numel
    k = r1 - r0
    e0, e1 = r0 * row_len, min(r1 * row_len, n)
    tile = work[: k * row_len].view(k, row_len)
    flat_tile = tile.view(-1)
    values = src.read(e0, e1, flat_tile)
    if e1 - e0 == k * row_len and values.data_ptr() != flat_tile.data_ptr():
        return values.view(k, row_len), tile
    if values.data_ptr() != flat_tile.data_ptr():
        flat_tile[: e1 - e0].copy_(values)
    flat_tile[e1 - e0 :].zero_()
    return tile, tile


def _block_amax(blocks: Tensor) -> Tensor:
    """max |x| per row (float32); nan if the row holds a nan, inf if it holds an inf."""
    row = blocks.shape[1]
    if row >= 64 or row % 2:
        # two vectorized reductions; torch.aminmax(dim=1) is several times slower on CPU
        # abs: +0.0 for an all-zero row whichever zero maximum(0.0, -0.0) gives (as compiled)
        return torch.maximum(blocks.amax(dim=1), blocks.amin(dim=1).neg_()).abs_().float()
    # short rows reduce poorly: folding halves onto each other down to one column is about
    # twice as fast (max is exact, nan propagates: the same values)
    a = blocks.abs()
    while a.shape[1] > 1 and a.shape[1] % 2 == 0:
        half = a.shape[1] // 2
        a = torch.maximum(a[:, :half], a[:, half:])
    return (a[:, 0] if a.shape[1] == 1 else a.amax(dim=1)).float()


def _tile_amax(values: Tensor, row_len: int) -> Tensor:
    """_block_amax of flat ``values`` cut into rows of ``row_len`` (last row short), unpadded."""
    n = values.numel()
    full = n // row_len
    parts = [_block_amax(values[: full * row_len].view(full, row_len))] if full else []
    if n % row_len:
        parts.append(_block_amax(values[full * row_len :].view(1, -1)))
    return torch.cat(parts) if len(parts) > 1 else parts[0]


def _source_scale(src, row_len: int, tile: int, qmax: float, *, finite_blocks_only: bool = False,
                  fused: bool = False) -> Tensor:
    """A per-tensor scale over ``src`` read tile by tile: max |x| / ``qmax`` (``_fp32_scales``;
    nan/inf propagate, or with ``finite_blocks_only`` every row of ``row_len`` holding a nan/inf
    is left out). ``fused``: tiles of whole rows reduce in one compiled kernel each
    (:func:`.kernels.tensor_scale`: the same value)."""
    numel = src.numel
    n_rows = -(-numel // row_len)
    step = _tile_rows(n_rows, row_len, tile)
    work = None  # fp32 values of a tile that the source cannot give as they lie
    best = scale = None  # eager tiles' amax, compiled tiles' scale
    for r0, r1 in _row_ranges(n_rows, step):
        e0, e1 = r0 * row_len, min(r1 * row_len, numel)
        if fused and (e1 - e0) % row_len and row_len < tile:
            # a tile that ends in a short block (not a per-tensor scale's short last tile: its
            # row is a tile): one compiled call, padded inside, or (``pads_inside``) its whole
            # rows' call and the short block's
            if not pads_inside(src.device) and r1 - r0 > 1:
                rows = _native_rows(src, row_len, e0, (r1 - 1) * row_len)
                if rows is None:
                    work = _work_tile(work, r1 - r0 - 1, min(step, n_rows), row_len, src.device)
                    rows = src.read(e0, (r1 - 1) * row_len, work).view(-1, row_len)
                scale = fused_kernels.compiled(fused_kernels.tensor_scale, finite_blocks_only=finite_blocks_only,
                                               qmax=qmax)(rows, scale)
                e0 = (r1 - 1) * row_len
            values, work = _flat_values(src, e0, e1, work, min(step, n_rows), row_len)
            scale = fused_kernels.compiled(fused_kernels.ragged_tensor_scale, block=row_len,
                                           finite_blocks_only=finite_blocks_only, qmax=qmax)(values, scale)
            continue
        rows = _native_rows(src, row_len, e0, e1) if fused else None
        if rows is None:
            work = _work_tile(work, r1 - r0, min(step, n_rows), row_len, src.device)
            values = src.read(e0, e1, work)
        if fused and (rows is not None or (e1 - e0) % row_len == 0):
            rows = values.view(-1, row_len) if rows is None else rows
            scale = fused_kernels.compiled(fused_kernels.tensor_scale, finite_blocks_only=finite_blocks_only,
                                           qmax=qmax)(rows, scale)
            continue
        amax = _tile_amax(values, row_len)
        if finite_blocks_only:
            amax = torch.where(torch.isfinite(amax), amax, 0.0)
        top = amax.amax().reshape(1)
        best = top if best is None else torch.maximum(best, top)
    if best is None:
        return scale
    best = _fp32_scales(best, qmax)
    return best if scale is None else torch.maximum(best, scale)  # the same: fp32_scales is nondecreasing


def _div_scalar(a: Tensor, value: float) -> Tensor:
    # CUDA turns division by a Python scalar into a product with its rounded reciprocal;
    # a 0-d tensor divisor keeps the correctly rounded quotient, equal on every device
    return a / torch.full((), value, dtype=a.dtype, device=a.device)


# one definition each, shared with the compiled kernels
_fp32_scales = fused_kernels.fp32_scales
_safe_divisor = fused_kernels.safe_divisor
_e8m0_to_fp32 = fused_kernels.e8m0_to_fp32
_e4m3_at_least = fused_kernels.e4m3_at_least


def _mul_rows_(values: Tensor, row_scale: Tensor, row_len: int) -> None:
    """values (last dimension: rows of ``row_len``, the last row possibly short; any leading
    dimensions, a batch of payloads) *= row_scale (same leading dimensions, one per row)."""
    n = values.shape[-1]
    full = n // row_len
    if full:
        values[..., : full * row_len].unflatten(-1, (full, row_len)).mul_(row_scale[..., :full, None])
    if n % row_len:
        tail = row_scale[..., full]
        values[..., full * row_len :].mul_(tail if tail.dim() == 0 else tail[..., None])


# Stochastic rounding's eager chain works in chunks: its counter hash holds a few int64
# temporaries per element. On a CPU 2**18 elements (2 MB of int64) stay in cache; elsewhere
# 2**22 keep a GPU tile's (2**24) temporaries near 0.1 GB in four passes of ~20 launches each.
_RANDOM_CHUNK_CPU = 1 << 18
_RANDOM_CHUNK = 1 << 22


def _chunks(n: int, device: torch.device) -> Iterator[Tuple[int, int]]:
    step = _RANDOM_CHUNK_CPU if device.type == "cpu" else _RANDOM_CHUNK
    for c0 in range(0, n, step):
        yield c0, min(c0 + step, n)


def _stochastic_round_bits(y: Tensor, mant_bits: int, min_normal: float, key: Tensor, e0: int) -> Tensor:
    """Round flat fp32 ``y`` (the encode's elements e0..) in place to a float grid with
    ``mant_bits`` mantissa bits, stochastically (:func:`.kernels.stochastic_grid`, the
    compiled kernels' rule, with their counter's bits)."""
    for c0, c1 in _chunks(y.numel(), y.device):
        part = y[c0:c1]
        noise = fused_kernels.random_bits(key, e0 + c0, part, 23 - mant_bits)
        part.copy_(fused_kernels.stochastic_grid(part, noise, mant_bits=mant_bits, min_normal=min_normal))
    return y


def _pack_nibbles(codes: Tensor, out: Tensor) -> None:
    """Pack uint8 nibbles two per byte into ``out`` (element 2i in the low nibble)."""
    if codes.numel() % 2:
        codes = torch.cat([codes, codes.new_zeros(1)])
    pairs = codes.view(-1, 2)
    torch.bitwise_or(pairs[:, 0], pairs[:, 1].bitwise_left_shift(4), out=out)


def _nibble_table(values16) -> Tensor:
    """(256, 2) float32 table: byte b -> (value of its low nibble, value of its high nibble)."""
    lut = torch.tensor(values16, dtype=torch.float32)
    return torch.stack([lut.repeat(16), lut.repeat_interleave(16)], dim=1)


def _unpack_nibbles(data: Tensor, table: Tensor, out: Tensor) -> None:
    """Decode packed bytes into ``out`` (its last dimension at most twice ``data``'s; any leading
    dimensions, a batch) through ``table``."""
    n = out.shape[-1]
    pairs = n // 2
    if pairs:
        codes = data[..., :pairs].to(torch.int32).reshape(-1)
        dst = out[..., : 2 * pairs]
        if dst.is_contiguous():  # looked up straight into ``out``: no temporary
            torch.index_select(table, 0, codes, out=dst.view(-1, 2))
        else:
            dst.copy_(torch.index_select(table, 0, codes).view(dst.shape))
    if n % 2:
        out[..., -1:].copy_(table[data[..., pairs : pairs + 1].to(torch.int64), 0])


def _nibbles(data: Tensor, numel: int) -> Tensor:
    return torch.stack([data & 0x0F, data >> 4], dim=1).view(-1)[:numel]


def _view_dtype(buf: Tensor, dtype: torch.dtype) -> Tensor:
    """View a uint8 slice (1-D, or 2-D: one row per payload of a batch) as ``dtype``; copy first
    when an address is misaligned."""
    if dtype == torch.uint8:
        return buf
    size = dtype.itemsize
    if size > 1 and (buf.data_ptr() % size or buf.storage_offset() % size
                     or any(stride % size for stride in buf.stride()[:-1])):
        buf = buf.clone(memory_format=torch.contiguous_format)
    return buf.view(dtype)


_DEVICE_TABLES: Dict[Tuple[int, torch.device], Tensor] = {}


def _table_on(table: Tensor, device: torch.device) -> Tensor:
    if device.type == "cpu":
        return table
    key = (id(table), device)
    if key not in _DEVICE_TABLES:
        _DEVICE_TABLES[key] = host_to_device(table, device)
    return _DEVICE_TABLES[key]


_TABLES: List[Tensor] = []  # every family's lookup tables (``device_table``)


def device_table(table: Tensor) -> Tensor:
    """Registers a family's lookup table (host) for :func:`warm_device_tables`; returns it."""
    _TABLES.append(table)
    return table


def warm_device_tables(device) -> None:
    """Every lookup table of the codecs made on ``device`` now (at attach), not at a first
    decode inside a reduction."""
    device = torch.device(device)
    for table in _TABLES:
        _table_on(table, device)



# ----------------------------------------------------------------------------- codecs

_REGISTRY: Dict[str, Type["Codec"]] = {}


def _register(cls: Type["Codec"]) -> Type["Codec"]:
    _REGISTRY[cls.name] = cls
    return cls


class Codec:
    """Base class: header, byte layout and (de)serialization; subclasses do the math.

    Subclasses set the class attributes below and implement ``_check_options``,
    ``_encode_into``, ``_decode_range`` and ``_at_max``.
    """

    name: ClassVar[str] = ""
    default_block_size: ClassVar[int] = 0
    data_dtype: ClassVar[torch.dtype] = torch.uint8
    elements_per_byte: ClassVar[int] = 1  # 2 for packed 4-bit formats
    bytes_per_element: ClassVar[int] = 1
    has_global_scale: ClassVar[bool] = False
    _decode_temporaries: ClassVar[bool] = True  # decoding allocates per element (else: a cast)

    def __init__(
        self,
        *,
        block_size: Optional[int] = None,
        scale: str = "fp32",
        rounding: str = "nearest",
        seed: int = 0,
        tile_elements: int = DEFAULT_TILE_ELEMENTS,
        kernels: str = "by_device",
    ) -> None:
        if rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding must be one of {list(ROUNDING_MODES)}, got {rounding!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.rounding = rounding
        self.seed = seed
        self.tile_elements = check_tile_elements(tile_elements)
        self.kernels = fused_kernels.check_kernels(kernels)
        self.block_size, self.scale_kind = self._check_options(block_size, scale)
        self._rng = CounterRng(seed)  # stochastic rounding's keys when no generator is passed
        self._headers: Dict[Tuple[int, str], Tensor] = {}  # (numel, device) -> header bytes there

    # -- options ---------------------------------------------------------------

    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        raise NotImplementedError(f"{type(self).__name__} must implement _check_options")

    def _check_scale(self, scale: str, allowed: Tuple[str, ...]) -> None:
        if scale not in allowed:
            hint = " (scale='e8m0' is only for fp8_e4m3 / fp8_e5m2)" if scale == "e8m0" else ""
            raise ValueError(f"format {self.name!r} takes scale in {list(allowed)}, got {scale!r}{hint}")

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, block_size={self.block_size}, "
            f"scale={self.scale_kind!r}, rounding={self.rounding!r}, seed={self.seed}, kernels={self.kernels!r})"
        )

    def compiled_on(self, device) -> bool:
        """Whether this codec runs its fused (compiled) kernels on ``device`` (``kernels``)."""
        return fused_kernels.uses_compiled(self.kernels, device)

    # -- layout ----------------------------------------------------------------

    @property
    def scale_dtype(self) -> Optional[torch.dtype]:
        return _SCALE_DTYPES.get(self.scale_kind)

    def num_blocks(self, numel: int) -> int:
        """Number of block scales for ``numel`` elements (0 for an empty tensor)."""
        if self.scale_kind == "none" or numel == 0:
            return 0
        if self.block_size == 0:
            return 1
        return -(-numel // self.block_size)

    def _data_bytes(self, numel: int) -> int:
        if self.elements_per_byte == 2:
            return (numel + 1) // 2
        return numel * self.bytes_per_element

    def _offsets(self, numel: int) -> Tuple[int, int, int, int]:
        """Byte offsets: (global scale, block scales, data, end)."""
        g = HEADER_BYTES
        s = g + (4 if self.has_global_scale else 0)
        d = s + self.num_blocks(numel) * (self.scale_dtype.itemsize if self.scale_dtype else 0)
        return g, s, d, d + self._data_bytes(numel)

    def nbytes(self, numel: int) -> int:
        """Exact length in bytes of the wire buffer for ``numel`` elements."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return self._offsets(numel)[3]

    def scale_nbytes(self, numel: int) -> int:
        """Bytes of scales (block scales and any global scale) in ``nbytes(numel)``."""
        return self.nbytes(numel) - HEADER_BYTES - self._data_bytes(numel)

    def _header_tensor(self, numel: int) -> Tensor:
        raw = _HEADER.pack(
            _MAGIC, _VERSION, _FORMAT_IDS[self.name], _SCALE_IDS[self.scale_kind], self.block_size, numel
        )
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def header_on(self, numel: int, device) -> Tensor:
        """The header of a payload of ``numel`` elements, made on ``device`` once (a bucket's
        sections keep their sizes from step to step): no host-to-device copy per encode."""
        key = (numel, str(device))
        got = self._headers.get(key)
        if got is None:
            if len(self._headers) >= 4096:  # layouts of earlier selections
                self._headers.clear()
            got = self._headers[key] = host_to_device(self._header_tensor(numel), device)
        return got

    def _payload_on(self, numel: int, shape: Shape, device, *, header: bool = True) -> Payload:
        """A new payload of ``numel`` elements on ``device``: its wire's header written (or, not
        ``header``, left to the encode: :meth:`_put_scales`, then :meth:`_finish_header`), the
        rest to be filled."""
        buf = torch.empty(self.nbytes(numel), dtype=torch.uint8, device=device)
        if header:
            buf[:HEADER_BYTES].copy_(self.header_on(numel, buf.device))
        p = self._views(buf, numel, _as_size(shape))
        p.header_pending = not header
        return p

    def _put_scales(self, p: Payload, r0: int, scales: Tensor) -> None:
        """Scales of rows r0.. (``scales``, the payload's scale dtype; a per-tensor scale: row 0)
        into ``p``; the first rows of a payload whose header is pending with the header, where
        they follow it in the wire (no global scale between): :meth:`_with_header`."""
        if not (r0 == 0 and p.global_scale is None and self._with_header(p, scales)):
            p.scales[r0 : r0 + scales.numel()].copy_(scales)

    def _put_global(self, p: Payload, scale: Tensor) -> None:
        """The global scale (1 element, fp32) into ``p``, with the header where it is pending."""
        if not self._with_header(p, scale):
            p.global_scale.copy_(scale)

    def _with_header(self, p: Payload, *parts: Tensor) -> bool:
        """Write ``p``'s pending header and ``parts``, the bytes that follow it in the wire one
        after another, in one copy (a cat into the wire's first bytes): on a GPU a launch less
        per encode, which a one-tile section would otherwise spend on 16 bytes. False where
        nothing is pending (only :meth:`_payload_on` leaves a header pending, on a 1-D wire of
        its own)."""
        if not p.header_pending:
            return False
        end = HEADER_BYTES + sum(part.numel() * part.element_size() for part in parts)
        torch.cat([self.header_on(p.numel, p.device)] + [part.reshape(-1).view(torch.uint8) for part in parts],
                  out=p.wire[:end])
        p.header_pending = False
        return True

    def _finish_header(self, p: Payload) -> Payload:
        """The header of an encode that did not write it with its first scales."""
        if p.header_pending:
            p.wire[:HEADER_BYTES].copy_(self.header_on(p.numel, p.device))
            p.header_pending = False
        return p

    def _views(self, buf: Tensor, numel: int, shape: torch.Size) -> Payload:
        g, s, d, end = self._offsets(numel)
        glob = _view_dtype(buf[..., g:s], torch.float32) if self.has_global_scale else None
        scales = _view_dtype(buf[..., s:d], self.scale_dtype) if self.scale_dtype is not None else None
        return Payload(
            format=self.name,
            shape=shape,
            data=_view_dtype(buf[..., d:end], self.data_dtype),
            scales=scales,
            global_scale=glob,
            block_size=self.block_size,
            scale_kind=self.scale_kind,
            wire=buf,
        )

    # -- randomness --------------------------------------------------------------

    def _key_source(self, generator: Optional[CounterRng]) -> CounterRng:
        rng = self._rng if generator is None else generator
        if not isinstance(rng, CounterRng):
            raise TypeError(f"generator must be a deepspeed_gift CounterRng (counter-based: the same bits on every "
                            f"device and kernel mode), got {type(rng).__name__}")
        return rng

    def _random_key(self, device: torch.device, generator: Optional[CounterRng]) -> Tensor:
        """The next encode's stochastic rounding key, from ``generator`` or the codec's own."""
        return self._key_source(generator).key_on(device)

    def next_key(self, generator: Optional[CounterRng] = None) -> Optional[Tuple[int, int]]:
        """The key the next encode would take (from ``generator`` or the codec's own), drawn now
        as its two 32-bit words, for a span of :meth:`encode_spans`; None when rounding to nearest
        (an encode takes none)."""
        return self._key_source(generator).next_key() if self.rounding == Rounding.STOCHASTIC else None

    # -- public API --------------------------------------------------------------

    def _tile(self, device: torch.device, tile_elements: Optional[int]) -> int:
        tile = self.tile_elements if tile_elements is None else check_tile_elements(tile_elements)
        return _device_tile(tile, device)

    def encode(self, x: Tensor, *, generator: Optional[CounterRng] = None,
               tile_elements: Optional[int] = None) -> Payload:
        """Quantize ``x`` (any float dtype, any shape) into a payload backed by its wire bytes.

        Stochastic rounding takes one key per encode from ``generator`` if given, else from a
        :class:`CounterRng` owned by the codec and seeded with ``seed`` (same run -> same
        bytes), and draws element i's bits from (key, i): the same on every device and in
        either kernel mode. ``tile_elements`` (default: the codec's) bounds the work's
        temporaries; the bytes do not depend on it.
        """
        return self.encode_source(TensorSource(_flat_input(x)), x.shape, generator=generator,
                                  tile_elements=tile_elements)

    def encode_source(self, src, shape: Optional[Shape] = None, *, generator: Optional[CounterRng] = None,
                      tile_elements: Optional[int] = None) -> Payload:
        """:meth:`encode` of values read tile by tile from ``src`` (see :class:`TensorSource`),
        which is read in order, once or (per-tensor and NVFP4 global scales) twice."""
        numel = src.numel
        p = self._payload_on(numel, _as_size(numel if shape is None else shape), src.device, header=False)
        key = self._random_key(src.device, generator) if self.rounding == Rounding.STOCHASTIC and numel else None
        self._encode_into(src, p, key, self._tile(src.device, tile_elements))
        return self._finish_header(p)

    def decode(self, p: Payload, *, tile_elements: Optional[int] = None) -> Tensor:
        """Dequantize to a new float32 tensor of shape ``p.shape`` on ``p``'s device (a batch:
        ``p.batch + p.shape``)."""
        out = torch.empty((*p.batch, p.numel), dtype=torch.float32, device=p.device)
        self.decode_into(p, out, tile_elements=tile_elements)
        return out.view(*p.batch, *p.shape)

    def decode_into(self, p: Payload, out: Tensor, *, add: bool = False, tile_elements: Optional[int] = None) -> Tensor:
        """Dequantize ``p`` into the flat float32 ``out`` (``add``: added to it), tile by tile:
        the only temporaries are a tile's. A batch of payloads decodes into ``out`` of shape
        ``p.batch + (numel,)`` (rows of any stride) in one pass. Returns ``out``."""
        self._check_output(p, out)
        numel = p.numel
        if numel == 0:
            return out
        if not p.batch and self._fused_decode() is not None and self.compiled_on(p.device):
            return self.decode_sum(p.as_batch(), out, from_out=add, tile_elements=tile_elements)
        if add:
            for e0, e1, part in self.decode_tiles(p, tile_elements=tile_elements):
                out[..., e0:e1].add_(part)  # the same fp32 sum as adding a whole decoded tensor
            return out
        if not self._decode_temporaries:  # a cast straight into ``out``: nothing to bound
            self._decode_range(p, out, 0, numel, self._row_len(numel, numel))
            return out
        row_len, step = self._decode_tiling(p, tile_elements)
        for e0 in range(0, numel, step):
            e1 = min(e0 + step, numel)
            self._decode_range(p, out[..., e0:e1], e0, e1, row_len)
        return out

    def decode_tiles(self, p: Payload, *, tile_elements: Optional[int] = None,
                     begin: int = 0) -> Iterator[Tuple[int, int, Tensor]]:
        """Dequantize ``p`` a tile at a time: yields ``(e0, e1, values)``, ``values`` the float32
        elements ``e0:e1`` of ``p`` (of every payload of a batch: shape ``p.batch + (e1 - e0,)``),
        valid until the next tile. One buffer of about a tile's elements holds them (batch rows
        included), so a batch of W payloads decodes in as many passes as one payload does, each
        pass one set of operations for the whole batch. ``begin`` (a row start: a multiple of the
        block) skips the elements before it."""
        self._check_payload(p)
        numel = p.numel
        if numel <= begin:
            return
        if not self._decode_temporaries and p.data.dtype == torch.float32:
            yield begin, numel, p.data[..., begin:]  # already the values: nothing to decode
            return
        row_len, step = self._decode_tiling(p, tile_elements)
        work = torch.empty((*p.batch, min(step, numel - begin)), dtype=torch.float32, device=p.device)
        for e0 in range(begin, numel, step):
            e1 = min(e0 + step, numel)
            part = work[..., : e1 - e0]
            self._decode_range(p, part, e0, e1, row_len)
            yield e0, e1, part

    def _decode_tiling(self, p: Payload, tile_elements: Optional[int]) -> Tuple[int, int]:
        """(row length, elements per pass) of a decode: whole rows, at most about a tile of
        elements over all the payloads of a batch."""
        tile = max(1, self._tile(p.device, tile_elements) // math.prod(p.batch))
        row_len = self._row_len(p.numel, tile)
        return row_len, _tile_rows(-(-p.numel // row_len), row_len, tile) * row_len

    def decode_sum(self, p: Payload, out: Tensor, *, own: Optional[Tensor] = None, own_at: int = 0,
                   from_out: bool = False, tile_elements: Optional[int] = None) -> Tensor:
        """``out`` (flat fp32, ``p.numel``) = the fp32 sum of a batch of payloads (one a row: the
        same section from every sender) in row order, with ``own`` (fp32) at place ``own_at`` of
        that order when given, starting from ``out``'s values when ``from_out``: an owner's
        decode-and-sum. One add per term per element, in that order (no stock reduction keeps
        an order): the same sum on every rank, and native's at two ranks. Compiled
        (``kernels``), the whole-block part is one kernel reading each payload once; the eager
        path decodes a tile of all rows at a time and adds row by row. Returns ``out``."""
        self._check_payload(p)
        numel = p.numel
        if len(p.batch) != 1 or tuple(out.shape) != (numel,) or out.dtype != torch.float32:
            raise ValueError(f"decode_sum needs a batch of payloads (one a row) and a flat float32 output of "
                             f"{numel} elements, got a batch {p.batch} and {out.dtype} of shape {tuple(out.shape)}")
        done = 0
        fused = self._fused_decode()
        if numel and fused is not None and self.compiled_on(p.device):
            done = self._fused_whole(numel)
            if done:
                epb, block = self.elements_per_byte, self.block_size
                scales = p.scales[:, : done // block] if (p.scales is not None and block) else p.scales
                run = fused_kernels.compiled(fused_kernels.decode_sum, values=fused[0], row_scale=fused[1],
                                             block=block, own_at=own_at, from_out=from_out)
                run(p.data[:, : done // epb], scales, p.global_scale, out[:done],
                    own[:done] if own is not None else None)
        for e0, e1, part in self.decode_tiles(p, tile_elements=tile_elements, begin=done):
            acc, rows = out[e0:e1], list(part.unbind(0))  # one view per sender, made by one operation
            if own is not None:
                rows.insert(own_at, own[e0:e1])
            if not from_out:  # the first term is copied, every later one added
                acc.copy_(rows.pop(0))
            for term in rows:
                acc.add_(term)
        return out

    def _fused_decode(self) -> Optional[Tuple[Callable, Optional[Callable]]]:
        """This codec's payload values and block scales as :func:`fused_kernels.decoded_rows`
        takes them (functions of the family's module), or None: the eager decode only."""
        return None

    def _fused_block_codes(self) -> Optional[Tuple[Callable, tuple, bool]]:
        """This codec's compiled quantizer of a tile of whole blocks (a family function taking
        ``(x (rows, block), key, e0)`` and returning the rows' fp32 scales and their codes, whose
        float value times the scale is the decode), its constants as ``(name, value)`` pairs,
        and whether the codes are stored as nibbles; or None: it has none (per-tensor and E8M0
        scales, NVFP4, the passthroughs)."""
        return None

    def _fused_scaled_codes(self) -> Optional[Tuple[Callable, tuple, bool, float]]:
        """This codec's compiled quantizer under fp32 scales made outside it (a family function
        taking ``(x, divisor, key, e0)``, the divisor broadcast against ``x``, and returning the
        codes, whose float value times the scale is the decode), its constants as ``(name,
        value)`` pairs, whether the codes are stored as nibbles, and the format's largest
        magnitude (a scale is :func:`fp32_scales` of an amax over it); or None: it has none
        (E8M0 scales, NVFP4, the passthroughs). A per-tensor scale's encode takes it, and error
        feedback's step where the sent blocks are finer than the residual's."""
        return None

    def _fused_tensor_codes(self) -> Optional[Tuple[Callable, tuple, bool, float]]:
        """:meth:`_fused_scaled_codes` for a codec with one scale per tensor; None with block
        scales."""
        return None if self.block_size else self._fused_scaled_codes()

    def _fused_fed_codes(self) -> Optional[Tuple[Callable, tuple, float]]:
        """This codec's compiled tile encode of error feedback's sum, for a format whose global
        scale and block scales its own kernel chooses (NVFP4): a family function taking
        ``(values, res_data, res_scales, g, key, e0)`` (the sum made from the values and an int8
        residual, not stored) and returning the block scales' codes and the packed elements as
        its encode's tile kernel does; its constants as ``(name, value)`` pairs; and the largest
        magnitude the global scale is taken over (rows of its blocks holding inf/nan left out).
        None where the codec has none."""
        return None

    def _fused_whole(self, numel: int) -> int:
        """Elements of a payload's prefix of whole blocks (and whole bytes) the fused kernels take."""
        done = numel - numel % self.block_size if self.block_size else numel
        return done - done % self.elements_per_byte

    def _check_output(self, p: Payload, out: Tensor) -> None:
        self._check_payload(p)
        want = (*p.batch, p.numel)
        if tuple(out.shape) != want or out.dtype != torch.float32:
            raise ValueError(f"decode_into needs a float32 output of shape {want}, got {out.dtype} "
                             f"of shape {tuple(out.shape)}")

    def payload_to_bytes(self, p: Payload) -> Tensor:
        """The 1-D uint8 wire buffer (header + scales + data) of ``p`` (no copy after encode)."""
        self._check_payload(p)
        if p.wire is not None and p.wire.numel() == self.nbytes(p.numel):
            return p.wire
        parts = [self.header_on(p.numel, p.device)]
        for t in (p.global_scale, p.scales, p.data):
            if t is not None:
                parts.append(t.contiguous().reshape(-1).view(torch.uint8))
        return torch.cat(parts)

    def bytes_to_payload(self, buf: Tensor, shape: Shape, *, check_header: bool = True) -> Payload:
        """Payload viewing ``buf`` (1-D uint8, may be a slice of a bigger buffer), or a batch of
        payloads of ``shape`` viewing a 2-D ``buf``, one payload per row (rows at any stride:
        the same section in every rank's message of a received buffer).

        Scales/data are views of ``buf`` where alignment allows, copies otherwise. The
        header is validated against this codec and ``shape`` (ValueError naming each
        field that differs). On CUDA that reads 16 bytes to the host, i.e. a sync;
        ``check_header=False`` skips it when the caller has validated already.
        """
        shape = _as_size(shape)
        numel = math.prod(shape)
        if not isinstance(buf, Tensor) or buf.dtype != torch.uint8 or buf.dim() not in (1, 2) or buf.stride(-1) != 1:
            what = f"{buf.dtype} tensor of shape {tuple(buf.shape)}" if isinstance(buf, Tensor) else type(buf).__name__
            raise ValueError(f"bytes_to_payload expects a 1-D uint8 tensor (2-D: a batch, one payload a row, "
                             f"each contiguous), got {what}")
        expected = self.nbytes(numel)
        if buf.shape[-1] != expected:
            raise ValueError(
                f"{self.name} buffer for shape {tuple(shape)} must be {expected} bytes "
                f"(block_size {self.block_size}, scale {self.scale_kind!r}), got {buf.shape[-1]}"
            )
        if check_header:
            for row in buf[..., :HEADER_BYTES].reshape(-1, HEADER_BYTES).cpu():
                self.check_header_bytes(bytes(row.tolist()), numel)
        return self._views(buf, numel, shape)

    def splits_into(self, part_numel: int) -> bool:
        """Whether a payload of whole parts of ``part_numel`` elements cuts into the parts'
        payloads (:meth:`payload_to_rows`): the parts are whole blocks and whole bytes."""
        return (self.block_size == 0 or part_numel % self.block_size == 0) and (
            self.elements_per_byte == 1 or part_numel % 2 == 0)

    def payload_to_rows(self, p: Payload, rows: Tensor) -> Tensor:
        """Cut ``p`` into ``rows.shape[0]`` parts of equal size and write each part's wire bytes
        into its row of ``rows`` (uint8, a row of ``nbytes(part)`` each, rows at any stride: a
        run of messages of a send buffer). A part's payload carries its own header and blocks
        and ``p``'s per-tensor and global scales: it decodes to the part of ``p``'s values,
        which is all a receiver needs (the scale was chosen for the whole, not the part). A few
        copies for all the parts, not an encode each. Returns ``rows``."""
        self._check_payload(p)
        parts = rows.shape[0]
        n = p.numel // parts if parts else 0
        if parts * n != p.numel or not self.splits_into(n) or rows.shape[-1] != self.nbytes(n):
            raise ValueError(f"{self.name}: a payload of {p.numel} elements does not cut into {parts} parts "
                             f"of {rows.shape[-1]} bytes")
        g, s, d, end = self._offsets(n)
        rows[:, :HEADER_BYTES].copy_(self.header_on(n, rows.device).expand(parts, -1))
        if p.global_scale is not None:
            rows[:, g:s].copy_(p.global_scale.view(torch.uint8).expand(parts, -1))
        if p.scales is not None:
            scales = p.scales.view(torch.uint8)
            rows[:, s:d].copy_(scales.expand(parts, -1) if self.block_size == 0 else scales.view(parts, -1))
        rows[:, d:end].copy_(p.data.view(torch.uint8).view(parts, -1))
        return rows

    def encodes_spans(self, device) -> bool:
        """Whether :meth:`encode_spans` serves this codec on ``device``: compiled block scales
        (fp32; integers' nibbles an even block); else the caller encodes each span on its own."""
        return False

    def encode_spans(self, x: Tensor, spans: Sequence[Tuple[int, int]],
                     keys: Optional[Sequence[Tuple[int, int]]] = None) -> List[List[Tensor]]:
        """The wire bytes of each span ``(start, numel)`` of the flat ``x`` (as it lies: fp32 or
        the bucket's bf16) encoded on its own, as the uint8 parts that make it in order (header,
        scales, data), from one compiled call for all the spans (:func:`.kernels.spans_block_encode`);
        the caller joins each into its place in a send buffer (one ``cat``). Stochastic rounding
        takes a key per span (:meth:`next_key`, drawn where the span's own encode would have
        drawn it). The same bytes as ``encode_to_bytes(x[start:start + numel])`` span by span,
        under the same keys (``tests/test_kernels.py``). Only where :meth:`encodes_spans`."""
        raise NotImplementedError(f"{self.name}: no encode of several spans in one call; see encodes_spans")

    def encode_to_bytes(self, x: Tensor, *, generator: Optional[CounterRng] = None) -> Tensor:
        return self.payload_to_bytes(self.encode(x, generator=generator))

    def decode_from_bytes(self, buf: Tensor, shape: Shape, *, check_header: bool = True) -> Tensor:
        return self.decode(self.bytes_to_payload(buf, shape, check_header=check_header))

    # -- checks ------------------------------------------------------------------

    def check_header_bytes(self, raw: bytes, numel: int) -> None:
        """ValueError naming every field of the header ``raw`` that differs from this codec's."""
        magic, version, fmt_id, scale_id, block, hdr_numel = _HEADER.unpack(raw)
        if magic != _MAGIC or version != _VERSION:
            raise ValueError(
                f"not a deepspeed-gift payload: header magic/version is {magic:#04x}/{version}, "
                f"expected {_MAGIC:#04x}/{_VERSION}"
            )
        names = {v: k for k, v in _FORMAT_IDS.items()}
        kinds = {v: k for k, v in _SCALE_IDS.items()}
        problems = []
        if fmt_id != _FORMAT_IDS[self.name]:
            problems.append(f"format is {names.get(fmt_id, f'<unknown id {fmt_id}>')!r}, expected {self.name!r}")
        if scale_id != _SCALE_IDS[self.scale_kind]:
            got = kinds.get(scale_id, f"<unknown id {scale_id}>")
            problems.append(f"scale is {got!r}, expected {self.scale_kind!r}")
        if block != self.block_size:
            problems.append(f"block size is {block}, expected {self.block_size}")
        if hdr_numel != numel:
            problems.append(f"numel is {hdr_numel}, expected {numel}")
        if problems:
            raise ValueError(
                "payload header does not match this codec (do all ranks use the same gift format?): "
                + "; ".join(problems)
            )

    def _check_payload(self, p: Payload) -> None:
        if p.format != self.name or p.block_size != self.block_size or p.scale_kind != self.scale_kind:
            raise ValueError(
                f"payload is format {p.format!r} (block_size {p.block_size}, scale {p.scale_kind!r}), "
                f"codec is {self.name!r} (block_size {self.block_size}, scale {self.scale_kind!r})"
            )

    # -- subclass hooks ----------------------------------------------------------

    def _encode_into(self, src, p: Payload, key: Optional[Tensor], tile: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _encode_into")

    def _row_len(self, numel: int, tile: int) -> int:
        """Decode tiles are whole rows of this many elements (a block; 1 without blocks)."""
        return 1

    def _decode_range(self, p: Payload, out: Tensor, e0: int, e1: int, row_len: int) -> None:
        """Decode elements e0:e1 (e0 at a row start) into ``out`` (of a batch: every payload's,
        ``out`` with the batch's leading dimensions; subclasses index the last dimension)."""
        raise NotImplementedError(f"{type(self).__name__} must implement _decode_range")

    def _at_max(self, p: Payload) -> Tensor:
        """bool per element: its code has the format's largest magnitude."""
        raise NotImplementedError(f"{type(self).__name__} must implement _at_max")


def _check_block(name: str, block_size: Optional[int], default: int) -> int:
    if block_size is None:
        return default
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"block_size for format {name!r} must be an int, got {block_size!r}")
    if not 0 <= block_size <= _MAX_BLOCK:
        raise ValueError(
            f"block_size for format {name!r} must be in [0, {_MAX_BLOCK}] (0 = one scale per tensor), "
            f"got {block_size}"
        )
    return block_size


class _ScaledCodec(Codec):
    """Block-scaled formats: the input is cut into rows (one block each) processed in tiles.

    Subclasses implement ``_prepare`` (scales that need the whole tensor), ``_tile_divisor``
    (per-tile scales in block mode), ``_store`` (quantize a scaled tile into the payload),
    ``_row_scales`` and ``_fill`` (decode).
    """

    def _row_len(self, numel: int, tile: int) -> int:
        # one scale per tensor: rows are only a tiling unit, all share the one scale
        return self.block_size or min(numel, tile)

    def _encode_into(self, src, p: Payload, key: Optional[Tensor], tile: int) -> None:
        numel = src.numel
        if numel == 0:
            if p.global_scale is not None:
                p.global_scale.zero_()
            return
        row_len = self._row_len(numel, tile)
        n_rows = -(-numel // row_len)
        scale = self._prepare(src, row_len, tile)  # one scale per tensor, else None
        if scale is not None:
            self._put_scales(p, 0, scale)
        step = _tile_rows(n_rows, row_len, tile)
        work = None  # the fp32 tile, made where one is read (eager, or values the source cannot give as they lie)
        fused = self.compiled_on(src.device)
        ragged = self._fused_block_codes() if fused and scale is None and numel % row_len else None
        for r0, r1 in _row_ranges(n_rows, step):
            e0, e1 = r0 * row_len, min(r1 * row_len, numel)
            if (e1 - e0) % row_len and ragged is not None:
                # a tile that ends in a short block: the whole tile in one compiled call, or
                # (``pads_inside``) its whole rows' call and the short block's
                first = r0 if pads_inside(src.device) else r1 - 1
                if first > r0:
                    work = self._encode_rows(src, p, row_len, r0, first, scale, key, fused, work, min(step, n_rows))
                values, work = _flat_values(src, first * row_len, e1, work, min(step, n_rows), row_len)
                self._fused_ragged(values, p, first, e1, key, ragged)
                continue
            # its whole blocks compiled, the short one (an E8M0 scale's, an odd int4 block's) by
            # the eager chain
            for a, b in _short_apart(r0, r1, bool((e1 - e0) % row_len) and fused and scale is None):
                work = self._encode_rows(src, p, row_len, a, b, scale, key, fused, work, min(step, n_rows))

    def _encode_rows(self, src, p: Payload, row_len: int, r0: int, r1: int, scale: Optional[Tensor],
                     key: Optional[Tensor], fused: bool, work: Optional[Tensor], full_rows: int) -> Optional[Tensor]:
        """Rows r0:r1 of ``src`` into ``p``: by the compiled kernels where they serve (whole
        blocks, or a per-tensor ``scale``'s cast, its divisor inline), else by the eager chain.
        Returns the fp32 work tile (of ``full_rows`` rows), made where one is read, for the next
        rows."""
        e0, e1 = r0 * row_len, min(r1 * row_len, src.numel)
        native = _native_rows(src, row_len, e0, e1) if fused else None
        if native is not None and self._fused_tile(native, p, r0, r1, e1, scale, key):
            return work
        work = _work_tile(work, r1 - r0, full_rows, row_len, src.device)
        x, y = _load_rows(src, row_len, r0, r1, work)
        if fused and self._fused_tile(x, p, r0, r1, e1, scale, key):
            return work
        div = self._tile_divisor(x, p, r0, r1) if scale is None else _safe_divisor(scale).expand(r1 - r0)
        torch.div(x, div[:, None], out=y)
        self._store(y.view(-1)[: e1 - e0], p, e0, e1, key)
        return work

    def encodes_spans(self, device) -> bool:
        return self.block_size > 0 and self.compiled_on(device) and self._fused_block_codes() is not None

    def encode_spans(self, x: Tensor, spans: Sequence[Tuple[int, int]],
                     keys: Optional[Sequence[Tuple[int, int]]] = None) -> List[List[Tensor]]:
        if not self.encodes_spans(x.device) or x.dim() != 1:
            raise ValueError(f"{self!r} cannot encode spans of a {x.dim()}-D tensor on {x.device} in one call")
        spans = tuple((int(a), int(n)) for a, n in spans)
        if any(n <= 0 or a < 0 or a + n > x.numel() for a, n in spans):
            raise ValueError(f"spans {spans[:4]} do not lie inside a tensor of {x.numel()} elements, each non-empty")
        stochastic = self.rounding == Rounding.STOCHASTIC
        if stochastic != (keys is not None) or (keys is not None and len(keys) != len(spans)):
            raise ValueError(f"{self.name} rounded {self.rounding}: encode_spans takes "
                             f"{'a key per span (next_key)' if stochastic else 'no keys'}")
        codes_fn, codes_kw, packed = self._fused_block_codes()
        # the spans' table, one small copy a call: start, length, first block, key (two words)
        blocks = [self.num_blocks(n) for _, n in spans]
        firsts = [0]
        for count in blocks[:-1]:
            firsts.append(firsts[-1] + count)
        table = host_to_device(torch.tensor([(a, n, f, *(key or (0, 0))) for (a, n), f, key in
                                             zip(spans, firsts, keys or [None] * len(spans))], dtype=torch.int64),
                               x.device)
        span_of = torch.repeat_interleave(torch.arange(len(spans), device=x.device), table[:, 1].add(
            self.block_size - 1).div_(self.block_size, rounding_mode="floor"), output_size=firsts[-1] + blocks[-1])
        run = fused_kernels.compiled(fused_kernels.spans_block_encode, block=self.block_size, codes_fn=codes_fn,
                                     codes_kw=codes_kw, packed=packed)
        scales, codes = run(x, span_of, table, stochastic)
        scale_bytes, code_bytes = scales.view(torch.uint8), codes.view(torch.uint8).reshape(-1)
        row_bytes, parts, b0 = self.block_size // self.elements_per_byte, [], 0
        for _, numel in spans:
            blocks = self.num_blocks(numel)
            parts.append([self.header_on(numel, x.device), scale_bytes[4 * b0 : 4 * (b0 + blocks)],
                          code_bytes[b0 * row_bytes : b0 * row_bytes + self._data_bytes(numel)]])
            b0 += blocks
        return parts

    def _fused_ragged(self, values: Tensor, p: Payload, r0: int, e1: int, key: Optional[Tensor],
                      codes: Tuple[Callable, tuple, bool]) -> None:
        """Encode rows r0.. of a tile that ends in a short block (``values``: its elements up to
        ``e1``, flat, as they lie or in fp32) by :func:`.kernels.ragged_block_encode` over the
        format's ``codes`` (:meth:`_fused_block_codes`): one compiled call for the whole tile, then
        its scales and the short block's bytes copied into ``p``."""
        codes_fn, codes_kw, packed = codes
        row_len, epb = self.block_size, self.elements_per_byte
        e0, width = r0 * row_len, row_len // epb
        whole = (e1 - e0) // row_len
        run = fused_kernels.compiled(fused_kernels.ragged_block_encode, block=row_len, codes_fn=codes_fn,
                                     codes_kw=codes_kw, packed=packed)
        b0, b1 = e0 // epb + whole * width, -(-e1 // epb)  # the short block's bytes
        scales, short = run(values, p.data.view(torch.uint8)[e0 // epb : b0].view(whole, width), key, e0)
        self._put_scales(p, r0, scales)
        p.data.view(torch.uint8)[b0:b1].copy_(short.view(torch.uint8)[: b1 - b0])

    def _decode_range(self, p: Payload, out: Tensor, e0: int, e1: int, row_len: int) -> None:
        r0, r1 = e0 // row_len, -(-e1 // row_len)
        self._fill(out, p, e0, e1)
        _mul_rows_(out, self._row_scales(p, r0, r1), row_len)

    def _tensor_scale(self, src, row_len: int, tile: int) -> Tensor:
        """A per-tensor scale over ``src`` (:func:`_source_scale`), compiled where this codec is."""
        return _source_scale(src, row_len, tile, self._tensor_qmax, fused=self.compiled_on(src.device))

    def _prepare(self, src, row_len: int, tile: int) -> Optional[Tensor]:
        """A per-tensor scale over ``src`` (:meth:`_tensor_scale`); None for block scales."""
        raise NotImplementedError(f"{type(self).__name__} must implement _prepare")

    def _fused_tile(self, x: Tensor, p: Payload, r0: int, r1: int, e1: int, scale: Optional[Tensor],
                    key: Optional[Tensor]) -> bool:
        """Encode rows r0:r1 (``x``, padded to whole rows; elements up to ``e1``) with the compiled
        kernels (stochastic under ``key``; ``scale``: one per tensor, already in ``p``); False
        where they do not serve the tile (the eager path does)."""
        return False

    def _tile_divisor(self, x: Tensor, p: Payload, r0: int, r1: int) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement _tile_divisor")

    def _store(self, y: Tensor, p: Payload, e0: int, e1: int, key: Optional[Tensor]) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _store")

    def _row_scales(self, p: Payload, r0: int, r1: int) -> Tensor:
        """The fp32 scale of rows r0:r1."""
        raise NotImplementedError(f"{type(self).__name__} must implement _row_scales")

    def _fill(self, out: Tensor, p: Payload, e0: int, e1: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _fill")


# ----------------------------------------------------------------------------- public functions


def format_class(name: str) -> Type["Codec"]:
    """The codec class of ``name`` (its ``default_block_size`` and options), without building one."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown format {name!r}; valid names are {list(FORMAT_NAMES)}")
    return cls


def get_format(
    name: str,
    *,
    block_size: Optional[int] = None,
    scale: str = "fp32",
    rounding: str = "nearest",
    seed: int = 0,
    tile_elements: int = DEFAULT_TILE_ELEMENTS,
    kernels: str = "by_device",
) -> Codec:
    """Codec for ``name`` (one of FORMAT_NAMES); ValueError for invalid options."""
    return format_class(name)(block_size=block_size, scale=scale, rounding=rounding, seed=seed,
                              tile_elements=tile_elements, kernels=kernels)


def sample_rows(codec: Codec, numel: int, limit: int) -> Tuple[int, Optional[Tensor]]:
    """An evenly strided sample of whole rows of at most ``limit`` elements in all: (row length,
    row indices), or (row length, None) when the tensor is small enough to take whole.

    A row is whole blocks (whole bytes of 4-bit data), at least 256 elements, so every sampled
    element is encoded exactly as in the whole tensor and decoded from its own block's scale."""
    block = max(codec.block_size, 1)
    unit = block * max(1, 256 // block)
    if codec.elements_per_byte == 2 and unit % 2:
        unit *= 2
    rows = numel // unit
    keep = max(1, limit // unit)
    if rows <= keep:
        return unit, None
    stride = -(-rows // keep)
    return unit, torch.arange(0, rows, stride)


def payload_rows(codec: Codec, p: Payload, rows: Tensor, unit: int) -> Payload:
    """The payload of rows ``rows`` (of ``unit`` elements, whole blocks) of ``p``: what encoding
    only those elements would give (the global and per-tensor scales stay the whole tensor's)."""
    def pick(t: Tensor, per_row: int) -> Tensor:
        index = rows.to(t.device)
        return t.reshape(-1)[: (p.numel // unit) * per_row].view(-1, per_row)[index].reshape(-1)

    data = pick(p.data, unit // codec.elements_per_byte)
    scales = p.scales
    if scales is not None and codec.block_size:
        scales = pick(scales, unit // codec.block_size)
    return Payload(format=p.format, shape=torch.Size((rows.numel() * unit,)), data=data, scales=scales,
                   global_scale=p.global_scale, block_size=p.block_size, scale_kind=p.scale_kind)


class SampleRecorder:
    """A source that passes ``src`` through to an encode and keeps the values of the rows
    :func:`sample_rows` picks as they are read (all of them when the source is small), so the
    quantization can be measured on a sample without reading the source again (a reducer's
    section is made tile by tile)."""

    def __init__(self, src, codec: Codec, limit: int) -> None:
        self.src, self.numel, self.device = src, src.numel, src.device
        self.unit, self.rows = sample_rows(codec, src.numel, limit)
        count = self.rows.numel() if self.rows is not None else 0
        self.stride = int(self.rows[1] - self.rows[0]) * self.unit if count > 1 else self.unit
        size = count * self.unit if self.rows is not None else src.numel
        self.values = torch.empty(size, dtype=torch.float32, device=src.device)

    def read(self, e0: int, e1: int, work: Tensor) -> Tensor:
        values = self.src.read(e0, e1, work)
        if self.rows is None:
            self.values[e0:e1].copy_(values)
            return values
        unit, stride, count = self.unit, self.stride, self.rows.numel()
        kept = self.values.view(count, unit)
        i = max(0, -(-(e0 - unit + 1) // stride))  # the first sampled row ending after e0
        last = min(count, -(-e1 // stride))  # past the last one starting before e1
        while i < last:
            start = i * stride
            if start >= e0 and start + unit <= e1:  # whole rows from i on, one strided copy
                n = min(last - i, (e1 - unit - start) // stride + 1)
                kept[i : i + n].copy_(values[start - e0 :].as_strided((n, unit), (stride, 1)))
                i += n
                continue
            lo, hi = max(start, e0), min(start + unit, e1)  # a row cut by the read's edge
            kept[i, lo - start : hi - start].copy_(values[lo - e0 : hi - e0])
            i += 1
        return values

    def stats(self, payload: Payload, codec: Codec) -> Dict[str, float]:
        """:func:`quantization_stats` of what was recorded."""
        if self.rows is not None:
            payload = payload_rows(codec, payload, self.rows, self.unit)
        return quantization_stats(self.values, payload, codec)


def quantization_stats(x: Tensor, payload: Payload, codec: Codec, *, limit: Optional[int] = None) -> Dict[str, float]:
    """Telemetry for one encode (not computed by ``encode``; costs a decode).

    Keys: ``numel`` (the elements measured); ``nonfinite`` (inputs that are inf/nan);
    ``underflow`` (finite nonzero inputs that decode to 0); ``saturated`` (elements whose code
    has the format's largest magnitude: with per-block amax scales every nonzero block has at
    least one; for bf16/fp32 the elements that are inf); ``nonfinite_out`` (decoded inf/nan,
    including finite neighbours in a non-finite block); ``rel_l2_error`` (over positions where
    input and output are finite).

    ``limit``: measured on an evenly strided sample of whole blocks of at most about
    ``limit`` elements (:func:`sample_rows`), so its temporaries (a decode, masks, a float64
    square: ~30 B per element) stay bounded; counts are the sample's.
    """
    if limit is not None:
        unit, rows = sample_rows(codec, payload.numel, limit)
        if rows is not None:
            flat = x.reshape(-1)
            x = flat[: (flat.numel() // unit) * unit].view(-1, unit)[rows.to(flat.device)].reshape(-1)
            payload = payload_rows(codec, payload, rows, unit)
    y = codec.decode(payload).reshape(-1)
    xf = x.reshape(-1).float()
    finite_in = torch.isfinite(xf)
    finite_out = torch.isfinite(y)
    both = finite_in & finite_out
    diff = torch.where(both, y - xf, 0.0)
    ref = torch.where(both, xf, 0.0)
    counts = torch.stack(
        [
            (~finite_in).sum(),
            (finite_in & (xf != 0) & (y == 0)).sum(),
            codec._at_max(payload).sum(),
            (~finite_out).sum(),
        ]
    ).tolist()
    err = torch.stack([diff.double().square().sum(), ref.double().square().sum()]).tolist()
    return {
        "numel": xf.numel(),
        "nonfinite": int(counts[0]),
        "underflow": int(counts[1]),
        "saturated": int(counts[2]),
        "nonfinite_out": int(counts[3]),
        "rel_l2_error": math.sqrt(err[0] / err[1]) if err[1] > 0 else 0.0,
    }
