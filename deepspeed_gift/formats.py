"""Low-precision wire formats: tensor -> payload -> uint8 bytes and back.

Pure tensor math (no ``torch.distributed``); every function works on the input's
device. A :class:`Codec` turns a float tensor into a :class:`Payload` (quantized data
plus scales) and a payload into the exact uint8 buffer that travels between ranks.

Wire layout of one encoded tensor (all integers little-endian)::

    [0:16)   header: 'G', version, format id, scale kind, block size (uint32),
             numel (int64)
    [16:..)  nvfp4 only: fp32 global scale (4 bytes)
    [..:..)  block scales: fp32 (4 B each, 4-byte aligned because the header is
             16 B), E8M0 or E4M3 (1 B each)
    [..:end) element data: fp8/int8 1 B, int4/nvfp4 two per byte (element 2i in
             the low nibble), bf16 2 B, fp32 4 B

``Codec.nbytes(numel)`` is the exact length of that buffer. Blocks are consecutive
runs of ``block_size`` elements of the flattened tensor; the last block is padded
with zeros internally (padding never travels and never changes a scale).

Non-finite inputs (never silently made finite, DeepSpeed's overflow check needs them):

- fp8 / int8 / int4 with fp32 scales: a block holding inf or nan gets an inf/nan
  scale and decodes to nan in all its elements; other blocks are unaffected.
- fp8 with E8M0 scales: the block's scale byte is 0xFF (nan); the block decodes nan.
- nvfp4: the block's E4M3 scale is nan and the block decodes nan; the fp32 global
  scale is computed from the finite blocks only, so other blocks are unaffected.
- bf16: inf/nan stay inf/nan (sign kept); finite values above bf16's largest finite
  value round to inf, as a bf16 cast does.
- fp32: bit-identical passthrough (inf, nan payloads, -0.0 included).

Range limits (the fp32 scales cover fp32's range; what remains):

- fp8/int with fp32 scales: scale = amax / format_max. Blocks with amax below
  ~format_max * 2**-126 (about 5e-36 for e4m3) get a subnormal scale and lose
  relative precision; no finite value ever decodes to a non-finite one.
- fp8 with E8M0 scales: exponents are clamped to [-127, 127]; blocks with amax
  below about 2**-127 * format_max lose precision.
- nvfp4: block scale = E4M3 (smallest value >= block_amax / (6 * g)), global
  g = tensor_amax / (6 * 448). A block whose amax is below ~2**-9 / 448 (2.2e-6) of
  the tensor's amax still gets the smallest E4M3 scale, so its elements mostly
  underflow to 0; below ~2**-6 / 448 (3.5e-5) of the amax the E4M3 scale is
  subnormal and coarse. ``quantization_stats`` reports the underflow count.

Stochastic rounding picks one of the two neighbouring representable values with
probability proportional to the distance. For fp8/nvfp4/bf16 the choice is made by
adding a uniform random integer to the fp32 bits below the target precision and
truncating (exactly unbiased for values in the normal range of the target format; in
the subnormal range the value is first shifted by the smallest normal, which rounds
away fp32 bits more than 2**-21 of a step below the grid). For int8/int4 it compares a
uniform draw with the fractional part (bias below 2**-24 of a step).
"""

from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from typing import ClassVar, Dict, Optional, Tuple, Type, Union

import torch
from torch import Tensor

__all__ = [
    "FORMAT_NAMES",
    "HEADER_BYTES",
    "Codec",
    "Payload",
    "get_format",
    "quantization_stats",
]

FORMAT_NAMES: Tuple[str, ...] = ("fp8_e4m3", "fp8_e5m2", "nvfp4", "int8", "int4", "bf16", "fp32")
ROUNDING_MODES: Tuple[str, ...] = ("nearest", "stochastic")
SCALE_KINDS: Tuple[str, ...] = ("none", "fp32", "e8m0", "e4m3")

HEADER_BYTES = 16
_HEADER = struct.Struct("<BBBBIq")
_MAGIC = 0x47  # 'G'
_VERSION = 1
_FORMAT_IDS: Dict[str, int] = {name: i + 1 for i, name in enumerate(FORMAT_NAMES)}
_SCALE_IDS: Dict[str, int] = {kind: i for i, kind in enumerate(SCALE_KINDS)}
_MAX_BLOCK = 2**32 - 1

_SCALE_DTYPES = {"fp32": torch.float32, "e8m0": torch.uint8, "e4m3": torch.float8_e4m3fn}
_FP4_MAX = 6.0
_E4M3_MAX = 448.0

Shape = Union[torch.Size, Tuple[int, ...], int]


@dataclass
class Payload:
    """One encoded tensor. ``data``/``scales`` may be views into ``wire``."""

    format: str
    shape: torch.Size
    data: Tensor
    scales: Optional[Tensor] = None
    global_scale: Optional[Tensor] = None  # nvfp4: 1-element fp32 tensor
    block_size: int = 0  # 0: one scale per tensor (or no scales)
    scale_kind: str = "none"
    wire: Optional[Tensor] = field(default=None, repr=False, compare=False)

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def device(self) -> torch.device:
        return self.data.device

    @property
    def nbytes(self) -> int:
        parts = (self.data, self.scales, self.global_scale)
        return HEADER_BYTES + sum(t.numel() * t.element_size() for t in parts if t is not None)


# ----------------------------------------------------------------------------- helpers


def _as_size(shape: Shape) -> torch.Size:
    if isinstance(shape, int):
        return torch.Size((shape,))
    return torch.Size(shape)


def _flat_input(x: Tensor) -> Tensor:
    if not isinstance(x, Tensor):
        raise ValueError(f"encode expects a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise ValueError(f"encode expects a floating-point tensor (fp32/bf16/fp16), got {x.dtype}")
    return x.reshape(-1)


def _padded_blocks(flat: Tensor, block: int) -> Tuple[Tensor, bool]:
    """(n_blocks, block) float32 view of ``flat``, zero padded; flag: buffer is a fresh copy."""
    n = flat.numel()
    n_blocks = -(-n // block)
    if n_blocks * block == n and flat.dtype == torch.float32:
        return flat.view(n_blocks, block), False
    out = torch.empty(n_blocks * block, dtype=torch.float32, device=flat.device)
    out[:n].copy_(flat)
    out[n:].zero_()
    return out.view(n_blocks, block), True


def _block_amax(blocks: Tensor) -> Tensor:
    """max |x| per row; nan if the row holds a nan, inf if it holds an inf."""
    lo, hi = torch.aminmax(blocks, dim=1)
    return torch.maximum(hi, lo.neg_())


def _fp32_scales(amax: Tensor, qmax: float) -> Tensor:
    """amax / qmax, nudged up one ulp where needed so that fl(amax / scale) <= qmax.

    Only matters when amax / qmax is subnormal (rounded with few bits) or lands on a
    rounding edge; it guarantees that no finite element is scaled past the format max.
    """
    scale = amax / qmax
    over = amax / scale > qmax  # false for nan, inf and 0/0
    return torch.where(over, torch.nextafter(scale, torch.full_like(scale, math.inf)), scale)


def _safe_divisor(scale: Tensor) -> Tensor:
    # an all-zero block has scale 0; dividing by 1 keeps its zeros (0/0 would be nan)
    return scale.masked_fill(scale == 0, 1.0)


def _stochastic_round_bits(y: Tensor, mant_bits: int, min_normal: float, gen: torch.Generator) -> Tensor:
    """Round fp32 ``y`` in place to a float grid with ``mant_bits`` mantissa bits.

    Values below ``min_normal`` are shifted by it into the first normal binade, whose
    spacing equals the subnormal spacing, so one bit-level rule covers both ranges.
    Adding r ~ U{0..2^k-1} to the k dropped bits and truncating rounds up with
    probability (dropped bits) / 2^k, i.e. exactly the distance to the lower neighbour.
    Requires |y| <= the grid's largest value (no carry past the format max); nan stays nan.
    """
    drop = 23 - mant_bits
    bits = y.view(torch.int32)
    sign_bits = bits & -(2**31)
    y.abs_()
    small = y < min_normal
    y.add_(small, alpha=min_normal)
    noise = torch.randint(0, 1 << drop, y.shape, dtype=torch.int32, device=y.device, generator=gen)
    bits.add_(noise).bitwise_and_(~((1 << drop) - 1))
    del noise
    y.add_(small, alpha=-min_normal)
    bits.bitwise_or_(sign_bits)
    return y


def _pack_nibbles(codes: Tensor, n: int, out: Tensor) -> None:
    """Pack uint8 nibbles ``codes[:n]`` two per byte into ``out`` (element 2i low)."""
    pairs = (n + 1) // 2
    if codes.numel() < 2 * pairs:
        codes = torch.cat([codes, codes.new_zeros(2 * pairs - codes.numel())])
    codes = codes[: 2 * pairs].view(pairs, 2)
    hi = codes[:, 1].bitwise_left_shift(4)
    torch.bitwise_or(codes[:, 0], hi, out=out)


def _unpack_nibbles(data: Tensor, lut16: Tensor, out: Tensor) -> None:
    """Decode bytes into ``out`` (2 * len(data) floats) through a 16-entry value table."""
    lo = lut16.repeat(16)  # value of the low nibble of byte b: lut16[b & 15]
    hi = lut16.repeat_interleave(16)  # value of the high nibble: lut16[b >> 4]
    lut256 = torch.stack([lo, hi], dim=1)
    torch.index_select(lut256, 0, data.to(torch.int32), out=out.view(-1, 2))


def _e8m0_to_fp32(codes: Tensor) -> Tensor:
    """2**(code - 127); code 0 -> 2**-127 (an fp32 subnormal), code 255 -> nan."""
    c = codes.to(torch.int32)
    edge = ((c == 0) | (c == 255)).to(torch.int32)
    return (c.bitwise_left_shift(23) | edge.bitwise_left_shift(22)).view(torch.float32)


def _view_dtype(buf: Tensor, dtype: torch.dtype) -> Tensor:
    """View a uint8 slice as ``dtype``; copy first when the address is misaligned."""
    if dtype == torch.uint8:
        return buf
    size = torch.empty((), dtype=dtype).element_size()
    if size > 1 and (buf.data_ptr() % size or buf.storage_offset() % size):
        buf = buf.clone()
    return buf.view(dtype)


# ----------------------------------------------------------------------------- codecs

_REGISTRY: Dict[str, Type["Codec"]] = {}


def _register(cls: Type["Codec"]) -> Type["Codec"]:
    _REGISTRY[cls.name] = cls
    return cls


class Codec:
    """Base class: header, byte layout and (de)serialization; subclasses do the math.

    Subclasses set the class attributes below and implement ``_encode_into`` and
    ``_decode_flat``.
    """

    name: ClassVar[str] = ""
    default_block_size: ClassVar[int] = 0
    data_dtype: ClassVar[torch.dtype] = torch.uint8
    elements_per_byte: ClassVar[int] = 1  # 2 for packed 4-bit formats
    bytes_per_element: ClassVar[int] = 1
    has_global_scale: ClassVar[bool] = False

    def __init__(
        self,
        *,
        block_size: Optional[int] = None,
        scale: str = "fp32",
        rounding: str = "nearest",
        seed: int = 0,
    ) -> None:
        if rounding not in ROUNDING_MODES:
            raise ValueError(f"rounding must be one of {list(ROUNDING_MODES)}, got {rounding!r}")
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.rounding = rounding
        self.seed = seed
        self.block_size, self.scale_kind = self._check_options(block_size, scale)
        self._generators: Dict[torch.device, torch.Generator] = {}

    # -- options ---------------------------------------------------------------

    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        raise NotImplementedError(f"{type(self).__name__} must implement _check_options")

    def _check_scale(self, scale: str, allowed: Tuple[str, ...]) -> None:
        if scale not in allowed:
            raise ValueError(
                f"format {self.name!r} takes scale in {list(allowed)}, got {scale!r}"
                + (" (scale='e8m0' is only for fp8_e4m3 / fp8_e5m2)" if scale == "e8m0" else "")
            )

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(name={self.name!r}, block_size={self.block_size}, "
            f"scale={self.scale_kind!r}, rounding={self.rounding!r}, seed={self.seed})"
        )

    # -- layout ----------------------------------------------------------------

    @property
    def scale_dtype(self) -> Optional[torch.dtype]:
        return _SCALE_DTYPES.get(self.scale_kind)

    def num_blocks(self, numel: int) -> int:
        """Number of scales for ``numel`` elements (0 for an empty tensor)."""
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
        """Byte offsets: (global scale, scales, data, end)."""
        g = HEADER_BYTES
        s = g + (4 if self.has_global_scale else 0)
        n_scales = self.num_blocks(numel)
        d = s + (n_scales * _SCALE_DTYPES[self.scale_kind].itemsize if n_scales else 0)
        return g, s, d, d + self._data_bytes(numel)

    def nbytes(self, numel: int) -> int:
        """Exact length in bytes of the wire buffer for ``numel`` elements."""
        if numel < 0:
            raise ValueError(f"numel must be >= 0, got {numel}")
        return self._offsets(numel)[3]

    def _header_tensor(self, numel: int) -> Tensor:
        raw = _HEADER.pack(
            _MAGIC, _VERSION, _FORMAT_IDS[self.name], _SCALE_IDS[self.scale_kind], self.block_size, numel
        )
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)

    def _views(self, buf: Tensor, numel: int, shape: torch.Size) -> Payload:
        g, s, d, end = self._offsets(numel)
        n_scales = self.num_blocks(numel)
        glob = _view_dtype(buf[g:s], torch.float32) if self.has_global_scale else None
        scales = _view_dtype(buf[s:d], self.scale_dtype) if n_scales else None
        if self.scale_kind != "none" and scales is None:
            scales = torch.empty(0, dtype=self.scale_dtype, device=buf.device)
        data = _view_dtype(buf[d:end], self.data_dtype)
        return Payload(
            format=self.name,
            shape=shape,
            data=data,
            scales=scales,
            global_scale=glob,
            block_size=self.block_size,
            scale_kind=self.scale_kind,
            wire=buf,
        )

    # -- randomness --------------------------------------------------------------

    def _generator(self, device: torch.device, generator: Optional[torch.Generator]) -> torch.Generator:
        if generator is not None:
            return generator
        if device.type == "cuda" and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(self.seed)
            self._generators[device] = gen
        return gen

    # -- public API --------------------------------------------------------------

    def encode(self, x: Tensor, *, generator: Optional[torch.Generator] = None) -> Payload:
        """Quantize ``x`` (any float dtype, any shape) into a payload backed by its wire bytes."""
        flat = _flat_input(x)
        numel = flat.numel()
        buf = torch.empty(self.nbytes(numel), dtype=torch.uint8, device=x.device)
        buf[:HEADER_BYTES].copy_(self._header_tensor(numel))
        p = self._views(buf, numel, x.shape)
        gen = self._generator(x.device, generator) if self.rounding == "stochastic" and numel else None
        self._encode_into(flat, p, gen)
        return p

    def decode(self, p: Payload) -> Tensor:
        """Dequantize to a new float32 tensor of shape ``p.shape`` on ``p``'s device."""
        self._check_payload(p)
        numel = p.numel
        if numel == 0:
            return torch.zeros(p.shape, dtype=torch.float32, device=p.device)
        return self._decode_flat(p, numel).view(p.shape)

    def payload_to_bytes(self, p: Payload) -> Tensor:
        """The 1-D uint8 wire buffer (header + scales + data) of ``p``."""
        self._check_payload(p)
        if p.wire is not None and p.wire.numel() == self.nbytes(p.numel):
            return p.wire
        parts = [self._header_tensor(p.numel).to(p.device)]
        for t in (p.global_scale, p.scales, p.data):
            if t is not None:
                parts.append(t.contiguous().reshape(-1).view(torch.uint8))
        return torch.cat(parts)

    def bytes_to_payload(self, buf: Tensor, shape: Shape, *, check_header: bool = True) -> Payload:
        """Payload viewing ``buf`` (1-D uint8, may be a slice of a bigger buffer).

        The header is validated against this codec and ``shape`` (ValueError naming the
        field that differs). On CUDA that reads 16 bytes to the host, i.e. a sync;
        ``check_header=False`` skips it when the caller has validated already.
        """
        shape = _as_size(shape)
        numel = math.prod(shape)
        if not isinstance(buf, Tensor) or buf.dtype != torch.uint8 or buf.dim() != 1:
            what = f"{buf.dtype} tensor of shape {tuple(buf.shape)}" if isinstance(buf, Tensor) else type(buf).__name__
            raise ValueError(f"bytes_to_payload expects a 1-D uint8 tensor, got {what}")
        expected = self.nbytes(numel)
        if buf.numel() != expected:
            raise ValueError(
                f"{self.name} buffer for shape {tuple(shape)} must be {expected} bytes "
                f"(block_size {self.block_size}, scale {self.scale_kind!r}), got {buf.numel()}"
            )
        if check_header:
            self._check_header(bytes(buf[:HEADER_BYTES].cpu().tolist()), numel)
        return self._views(buf, numel, shape)

    def encode_to_bytes(self, x: Tensor, *, generator: Optional[torch.Generator] = None) -> Tensor:
        return self.payload_to_bytes(self.encode(x, generator=generator))

    def decode_from_bytes(self, buf: Tensor, shape: Shape, *, check_header: bool = True) -> Tensor:
        return self.decode(self.bytes_to_payload(buf, shape, check_header=check_header))

    # -- checks ------------------------------------------------------------------

    def _check_header(self, raw: bytes, numel: int) -> None:
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
            problems.append(
                f"scale is {kinds.get(scale_id, f'<unknown id {scale_id}>')!r}, expected {self.scale_kind!r}"
            )
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

    def _block_view(self, flat: Tensor) -> Tuple[Tensor, bool]:
        block = self.block_size or flat.numel()
        return _padded_blocks(flat, block)

    def _encode_into(self, flat: Tensor, p: Payload, gen: Optional[torch.Generator]) -> None:
        raise NotImplementedError(f"{type(self).__name__} must implement _encode_into")

    def _decode_flat(self, p: Payload, numel: int) -> Tensor:
        raise NotImplementedError(f"{type(self).__name__} must implement _decode_flat")

    def _at_max(self, p: Payload) -> Tensor:
        """bool per element: the element's code has the format's largest magnitude."""
        raise NotImplementedError(f"{type(self).__name__} must implement _at_max")

    def _scaled_decode(self, p: Payload, numel: int, fill, scale: Tensor) -> Tensor:
        """Shared tail: write unscaled values with ``fill(out)``, zero the padding, scale per block."""
        block = self.block_size or numel
        n_blocks = scale.numel()
        length = n_blocks * block
        if self.elements_per_byte == 2:
            length = max(length, 2 * p.data.numel())  # an odd block size leaves half a byte over
        out = torch.empty(length, dtype=torch.float32, device=p.device)
        fill(out)
        out[numel : n_blocks * block].zero_()
        out[: n_blocks * block].view(n_blocks, block).mul_(scale[:, None])
        return out[:numel]


def _check_block(name: str, block_size: Optional[int], default: int, allow_zero: bool) -> int:
    if block_size is None:
        return default
    if isinstance(block_size, bool) or not isinstance(block_size, int):
        raise ValueError(f"block_size for format {name!r} must be an int, got {block_size!r}")
    low = 0 if allow_zero else 1
    if not low <= block_size <= _MAX_BLOCK:
        raise ValueError(
            f"block_size for format {name!r} must be in [{low}, {_MAX_BLOCK}]"
            + (" (0 = one scale per tensor)" if allow_zero else "")
            + f", got {block_size}"
        )
    return block_size


class _Fp8Codec(Codec):
    """FP8 elements, one fp32 scale per block (or per tensor), or E8M0 scales per 32."""

    fmax: ClassVar[float]
    mant_bits: ClassVar[int]
    min_normal: ClassVar[float]
    max_code: ClassVar[int]  # uint8 code of +fmax

    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        self._check_scale(scale, ("fp32", "e8m0"))
        if scale == "e8m0":
            if block_size not in (None, 32):
                raise ValueError(f"{self.name} with scale='e8m0' needs block_size 32, got {block_size}")
            return 32, "e8m0"
        return _check_block(self.name, block_size, self.default_block_size, allow_zero=True), "fp32"

    def _e8m0_codes(self, amax: Tensor) -> Tensor:
        """Smallest power-of-two scale with amax / scale <= fmax, as E8M0 bytes (bias 127)."""
        t = amax / self.fmax
        mant, exp = torch.frexp(t)
        e = exp - (mant == 0.5).to(exp.dtype)  # ceil(log2 t): exact powers of two keep their exponent
        e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp_(-127, 127)
        over = amax / torch.ldexp(torch.ones_like(amax), e) > self.fmax
        e = (e + over.to(e.dtype)).clamp_(max=127)
        codes = (e + 127).to(torch.uint8)
        return codes.masked_fill_(~torch.isfinite(amax), 255)

    def _encode_into(self, flat: Tensor, p: Payload, gen: Optional[torch.Generator]) -> None:
        numel = flat.numel()
        if numel == 0:
            return
        blocks, owned = self._block_view(flat)
        amax = _block_amax(blocks)
        if self.scale_kind == "e8m0":
            codes = self._e8m0_codes(amax)
            p.scales.copy_(codes)
            divisor = _e8m0_to_fp32(codes)
        else:
            scale = _fp32_scales(amax, self.fmax)
            p.scales.copy_(scale)
            divisor = _safe_divisor(scale)
        y = torch.div(blocks, divisor[:, None], out=blocks if owned else None)
        y = y.view(-1)
        if gen is not None:
            _stochastic_round_bits(y, self.mant_bits, self.min_normal, gen)
        # |y| <= fmax by construction of the scale, so the cast never overflows
        p.data.copy_(y[:numel])

    def _decode_flat(self, p: Payload, numel: int) -> Tensor:
        if self.scale_kind == "e8m0":
            scale = _e8m0_to_fp32(p.scales)
        else:
            scale = p.scales
        return self._scaled_decode(p, numel, lambda out: out[:numel].copy_(p.data), scale)

    def _at_max(self, p: Payload) -> Tensor:
        return (p.data.view(torch.uint8) & 0x7F) == self.max_code


@_register
class Fp8E4M3Codec(_Fp8Codec):
    """torch.float8_e4m3fn elements (max 448, no inf: non-finite blocks ride on the scale)."""

    name = "fp8_e4m3"
    default_block_size = 128
    data_dtype = torch.float8_e4m3fn
    fmax = 448.0
    mant_bits = 3
    min_normal = 2.0**-6
    max_code = 0x7E


@_register
class Fp8E5M2Codec(_Fp8Codec):
    """torch.float8_e5m2 elements (max 57344)."""

    name = "fp8_e5m2"
    default_block_size = 128
    data_dtype = torch.float8_e5m2
    fmax = 57344.0
    mant_bits = 2
    min_normal = 2.0**-14
    max_code = 0x7B


class _IntCodec(Codec):
    """Symmetric integers in [-qmax, qmax], one fp32 scale per block (or per tensor)."""

    qmax: ClassVar[int]

    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        self._check_scale(scale, ("fp32",))
        return _check_block(self.name, block_size, self.default_block_size, allow_zero=True), "fp32"

    def _quantize(self, flat: Tensor, p: Payload, gen: Optional[torch.Generator]) -> Tensor:
        """Scaled, rounded values (float32, integral, padded to whole blocks)."""
        blocks, owned = self._block_view(flat)
        scale = _fp32_scales(_block_amax(blocks), float(self.qmax))
        p.scales.copy_(scale)
        y = torch.div(blocks, _safe_divisor(scale)[:, None], out=blocks if owned else None).view(-1)
        if gen is None:
            return y.round_()  # round half to even
        lower = torch.floor(y)
        y.sub_(lower)  # fractional part in [0, 1), exact
        up = torch.rand(y.shape, dtype=torch.float32, device=y.device, generator=gen) < y
        return lower.add_(up)

@_register
class Int8Codec(_IntCodec):
    name = "int8"
    default_block_size = 128
    data_dtype = torch.int8
    qmax = 127

    def _encode_into(self, flat: Tensor, p: Payload, gen: Optional[torch.Generator]) -> None:
        numel = flat.numel()
        if numel:
            p.data.copy_(self._quantize(flat, p, gen)[:numel])

    def _decode_flat(self, p: Payload, numel: int) -> Tensor:
        return self._scaled_decode(p, numel, lambda out: out[:numel].copy_(p.data), p.scales)

    def _at_max(self, p: Payload) -> Tensor:
        return p.data.abs() == self.qmax


_INT4_LUT = [float(v) for v in range(8)] + [float(v) for v in range(-8, 0)]


@_register
class Int4Codec(_IntCodec):
    """Two's-complement nibbles in [-7, 7], two per byte."""

    name = "int4"
    default_block_size = 128
    data_dtype = torch.uint8
    elements_per_byte = 2
    qmax = 7

    def _encode_into(self, flat: Tensor, p: Payload, gen: Optional[torch.Generator]) -> None:
        numel = flat.numel()
        if numel:
            q = self._quantize(flat, p, gen)
            codes = q.to(torch.int8).view(torch.uint8).bitwise_and_(0x0F)
            _pack_nibbles(codes, numel, p.data)

    def _decode_flat(self, p: Payload, numel: int) -> Tensor:
        lut = torch.tensor(_INT4_LUT, dtype=torch.float32, device=p.device)
        fill = lambda out: _unpack_nibbles(p.data, lut, out[: 2 * p.data.numel()])  # noqa: E731
        return self._scaled_decode(p, numel, fill, p.scales)

    def _at_max(self, p: Payload) -> Tensor:
        nib = torch.stack([p.data & 0x0F, p.data >> 4], dim=1).view(-1)[: p.numel]
        return (nib == 7) | (nib == 9)  # +7, -7


# E2M1 magnitudes by code 0..7; bit 3 is the sign
_FP4_VALUES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
# midpoints between neighbours and whether a tie goes up (to the even code) or down
_FP4_THRESHOLDS = [(0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False)]


def _fp4_codes(a: Tensor) -> Tensor:
    """E2M1 magnitude code (uint8 0..7) of |v| = ``a``, nearest with ties to even.

    Counting the midpoints below ``a`` is the code; at a midpoint the comparison is
    ``>=`` where the upper neighbour has the even code, ``>`` where the lower one has.
    Values above 6 saturate to code 7; nan gives 0 (nan blocks are flagged by the scale).
    """
    codes = torch.zeros(a.shape, dtype=torch.uint8, device=a.device)
    mask = torch.empty(a.shape, dtype=torch.bool, device=a.device)
    for threshold, tie_up in _FP4_THRESHOLDS:
        (torch.ge if tie_up else torch.gt)(a, threshold, out=mask)
        codes.add_(mask)
    return codes


@_register
class NvFp4Codec(Codec):
    """E2M1 elements, E4M3 scale per 16, fp32 global scale per encoded tensor."""

    name = "nvfp4"
    default_block_size = 16
    data_dtype = torch.uint8
    elements_per_byte = 2
    has_global_scale = True

    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        self._check_scale(scale, ("fp32",))
        if block_size not in (None, 16):
            raise ValueError(f"nvfp4 needs block_size 16, got {block_size}")
        return 16, "e4m3"

    def _decode_scales(self, p: Payload) -> Tensor:
        return p.scales.float().mul_(p.global_scale)

    def _encode_into(self, flat: Tensor, p: Payload, gen: Optional[torch.Generator]) -> None:
        numel = flat.numel()
        if numel == 0:
            p.global_scale.zero_()
            return
        blocks, owned = self._block_view(flat)
        amax = _block_amax(blocks)
        finite = torch.isfinite(amax)
        tensor_amax = torch.where(finite, amax, 0.0).amax().reshape(1)
        g = _fp32_scales(tensor_amax, _FP4_MAX * _E4M3_MAX)
        p.global_scale.copy_(g)
        # block scale: smallest E4M3 value >= amax / (6 g), so no finite element clips
        target = amax / (g * _FP4_MAX)
        s8 = target.to(torch.float8_e4m3fn)
        codes = s8.view(torch.uint8)
        codes.add_((s8.float() < target) & (codes < 0x7E))
        codes.masked_fill_(~finite, 0x7F)  # nan scale marks a non-finite block
        p.scales.view(torch.uint8).copy_(codes)
        d = self._decode_scales(p)
        v = torch.div(blocks, d[:, None], out=blocks if owned else None).view(-1)
        sign = torch.signbit(v)
        v.abs_()
        if gen is not None:
            v.clamp_(max=_FP4_MAX)
            _stochastic_round_bits(v, 1, 1.0, gen)
        codes = _fp4_codes(v)
        del v
        codes.bitwise_or_(sign.to(torch.uint8).bitwise_left_shift_(3))
        _pack_nibbles(codes, numel, p.data)

    def _decode_flat(self, p: Payload, numel: int) -> Tensor:
        lut = torch.tensor(_FP4_VALUES + [-v for v in _FP4_VALUES], dtype=torch.float32, device=p.device)
        fill = lambda out: _unpack_nibbles(p.data, lut, out[: 2 * p.data.numel()])  # noqa: E731
        return self._scaled_decode(p, numel, fill, self._decode_scales(p))

    def _at_max(self, p: Payload) -> Tensor:
        nib = torch.stack([p.data & 0x0F, p.data >> 4], dim=1).view(-1)[: p.numel]
        return (nib & 7) == 7


class _PassthroughCodec(Codec):
    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        self._check_scale(scale, ("fp32",))
        if block_size not in (None, 0):
            raise ValueError(f"format {self.name!r} has no blocks: block_size must be None or 0, got {block_size}")
        return 0, "none"

    def _encode_into(self, flat: Tensor, p: Payload, gen: Optional[torch.Generator]) -> None:
        p.data.copy_(flat)

    def _decode_flat(self, p: Payload, numel: int) -> Tensor:
        return p.data.to(torch.float32, copy=True)

    def _at_max(self, p: Payload) -> Tensor:
        return torch.isinf(p.data)


@_register
class Bf16Codec(_PassthroughCodec):
    """bfloat16 elements: torch's round-to-nearest-even cast, or stochastic rounding."""

    name = "bf16"
    data_dtype = torch.bfloat16
    bytes_per_element = 2

    def _encode_into(self, flat: Tensor, p: Payload, gen: Optional[torch.Generator]) -> None:
        if gen is None:
            p.data.copy_(flat)
            return
        y = flat.to(torch.float32, copy=True)
        bits = y.view(torch.int32)
        # nan/inf keep an all-ones exponent: inf stays inf, nan stays nan or becomes inf
        finite = torch.isfinite(y)
        noise = torch.randint(0, 1 << 16, y.shape, dtype=torch.int32, device=y.device, generator=gen)
        bits.add_(noise.mul_(finite)).bitwise_and_(~0xFFFF)
        p.data.copy_(y)  # exact: the low 16 bits are zero


@_register
class Fp32Codec(_PassthroughCodec):
    """float32 elements, bit-identical passthrough."""

    name = "fp32"
    data_dtype = torch.float32
    bytes_per_element = 4

    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        if self.rounding != "nearest":
            raise ValueError(f"fp32 is exact: rounding must be 'nearest', got {self.rounding!r}")
        return super()._check_options(block_size, scale)


# ----------------------------------------------------------------------------- public functions


def get_format(
    name: str,
    *,
    block_size: Optional[int] = None,
    scale: str = "fp32",
    rounding: str = "nearest",
    seed: int = 0,
) -> Codec:
    """Codec for ``name`` (one of FORMAT_NAMES); ValueError for invalid options."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown format {name!r}; valid names are {list(FORMAT_NAMES)}")
    return cls(block_size=block_size, scale=scale, rounding=rounding, seed=seed)


def quantization_stats(x: Tensor, payload: Payload, codec: Codec) -> Dict[str, float]:
    """Telemetry for one encode (not computed by ``encode``; costs a decode).

    Keys: ``numel``; ``nonfinite`` (inputs that are inf/nan); ``underflow`` (finite
    nonzero inputs that decode to 0); ``saturated`` (elements whose code has the format's
    largest magnitude: with per-block amax scales every nonzero block has at least one;
    for bf16/fp32 the elements that are inf); ``nonfinite_out`` (decoded inf/nan,
    including finite neighbours in a non-finite block); ``rel_l2_error`` (over
    positions where input and output are finite).
    """
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
