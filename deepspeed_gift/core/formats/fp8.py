"""FP8 elements (E4M3, E5M2) with an fp32 scale per block or per tensor, or E8M0 scales per 32:
the eager codecs and their fused kernels."""

from __future__ import annotations

from typing import ClassVar, Optional, Tuple

import torch
from torch import Tensor

from .. import kernels as fused_kernels
from ..kernels import e8m0_to_fp32, fp32_row_scale, fp32_scales, random_bits, rows_amax, safe_divisor, stochastic_grid
from .base import (Payload, Rounding, _block_amax, _check_block, _div_scalar, _register, _ScaledCodec,
                   _stochastic_round_bits)

# ----------------------------------------------------------------------------- fused kernels


def _fp8_rounded(y: Tensor, key: Optional[Tensor], e0: int, mant_bits: int, min_normal: float) -> Tensor:
    """Scaled values ready for the fp8 cast: as they are (the cast rounds to nearest), or on the
    grid by stochastic rounding when a ``key`` is given (the cast is then exact)."""
    if key is None:
        return y
    return stochastic_grid(y, random_bits(key, e0, y, 23 - mant_bits), mant_bits=mant_bits, min_normal=min_normal)


def fp8_block_codes(x: Tensor, key: Optional[Tensor] = None, e0: int = 0, *, fmax: float, dtype: torch.dtype,
                    mant_bits: int = 0, min_normal: float = 0.0) -> Tuple[Tensor, Tensor]:
    """One tile of whole blocks: ``x`` (..., block) fp32, the encode's elements e0.. -> the blocks'
    fp32 scales and the (..., block) elements of the fp8 ``dtype``, round to nearest, or
    stochastic under ``key`` (``mant_bits``, ``min_normal``: the format's). ``x`` may be bf16/fp16
    (a source's values as they lie): widened first, exactly."""
    x = x.float()
    scale = fp32_scales(rows_amax(x), fmax)
    y = _fp8_rounded(x / safe_divisor(scale)[..., None], key, e0, mant_bits, min_normal)
    return scale, y.to(dtype)


def fp8_block_encode(x: Tensor, data: Tensor, key: Optional[Tensor] = None, e0: int = 0, *, fmax: float,
                     dtype: torch.dtype, mant_bits: int = 0, min_normal: float = 0.0) -> Tensor:
    """:func:`fp8_block_codes` written into ``data`` (their bytes); returns the scales."""
    scale, codes = fp8_block_codes(x, key, e0, fmax=fmax, dtype=dtype, mant_bits=mant_bits, min_normal=min_normal)
    data.view(dtype).copy_(codes)
    return scale


def fp8_tensor_codes(x: Tensor, divisor: Tensor, key: Optional[Tensor] = None, e0: int = 0, *,
                     dtype: torch.dtype, mant_bits: int = 0, min_normal: float = 0.0) -> Tensor:
    """One tile under a per-tensor scale: the fp8 ``dtype`` elements of x / divisor, round to
    nearest or stochastic under ``key`` (``x`` widened to fp32 first, exactly)."""
    return _fp8_rounded(x.float() / divisor, key, e0, mant_bits, min_normal).to(dtype)


def scaled_cast(x: Tensor, scale: Tensor, data: Tensor, key: Optional[Tensor] = None, e0: int = 0, *,
                dtype: torch.dtype, mant_bits: int = 0, min_normal: float = 0.0) -> None:
    """:func:`fp8_tensor_codes` under the per-tensor ``scale`` (its divisor made here, inline)
    written into ``data`` (their bytes)."""
    data.view(dtype).copy_(fp8_tensor_codes(x, safe_divisor(scale), key, e0, dtype=dtype, mant_bits=mant_bits,
                                            min_normal=min_normal))


def _fp8_values(data: Tensor) -> Tensor:
    return data.to(torch.float32)


def _e8m0_row_scale(scales: Tensor, glob: Optional[Tensor]) -> Tensor:
    return e8m0_to_fp32(scales)



# ----------------------------------------------------------------------------- codecs


class _Fp8Codec(_ScaledCodec):
    """FP8 elements, one fp32 scale per block (or per tensor), or E8M0 scales per 32."""

    fmax: ClassVar[float]
    mant_bits: ClassVar[int]
    min_normal: ClassVar[float]
    max_code: ClassVar[int]  # uint8 code of +fmax
    fill_factor: ClassVar[float] = 1.0  # _fill yields value / fill_factor

    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        self._check_scale(scale, ("fp32", "e8m0"))
        if scale == "e8m0":
            if block_size not in (None, 32):
                raise ValueError(f"{self.name} with scale='e8m0' needs block_size 32, got {block_size}")
            return 32, "e8m0"
        return _check_block(self.name, block_size, self.default_block_size), "fp32"

    def _e8m0_codes(self, amax: Tensor) -> Tensor:
        """Smallest power-of-two scale with amax / scale <= fmax, as E8M0 bytes (bias 127)."""
        mant, exp = torch.frexp(_div_scalar(amax, self.fmax))
        e = exp - (mant == 0.5).to(exp.dtype)  # ceil(log2 t): exact powers of two keep their exponent
        e = torch.where(amax > 0, e, torch.full_like(e, -127)).clamp_(-127, 127)
        over = amax / torch.ldexp(torch.ones_like(amax), e) > self.fmax
        e = (e + over.to(e.dtype)).clamp_(max=127)
        codes = (e + 127).to(torch.uint8)
        return codes.masked_fill_(~torch.isfinite(amax), 255)

    def _prepare(self, src, row_len: int, tile: int) -> Optional[Tensor]:
        return None if self.block_size else self._tensor_scale(src, row_len, tile)

    @property
    def _tensor_qmax(self) -> float:
        return self.fmax

    def _tile_divisor(self, x: Tensor, p: Payload, r0: int, r1: int) -> Tensor:
        amax = _block_amax(x)
        if self.scale_kind == "e8m0":
            codes = self._e8m0_codes(amax)
            self._put_scales(p, r0, codes)
            return e8m0_to_fp32(codes)
        scale = fp32_scales(amax, self.fmax)
        self._put_scales(p, r0, scale)
        return safe_divisor(scale)

    def _fused_tile(self, x: Tensor, p: Payload, r0: int, r1: int, e1: int, scale: Optional[Tensor],
                    key: Optional[Tensor]) -> bool:
        row_len = x.shape[1]
        e0 = r0 * row_len
        grid = dict(mant_bits=self.mant_bits, min_normal=self.min_normal) if key is not None else {}
        if scale is not None:  # one scale per tensor: a flat cast of the tile
            fused_kernels.compiled(scaled_cast, dtype=self.data_dtype, **grid)(
                x.view(-1)[: e1 - e0], scale, p.data[e0:e1].view(torch.uint8), key, e0)
            return True
        if self.scale_kind != "fp32" or e1 - e0 != x.numel():
            return False
        run = fused_kernels.compiled(fp8_block_encode, fmax=self.fmax, dtype=self.data_dtype, **grid)
        self._put_scales(p, r0, run(x, p.data[e0:e1].view(torch.uint8).view(r1 - r0, row_len), key, e0))
        return True

    def _fused_block_codes(self):
        if self.scale_kind != "fp32" or not self.block_size:
            return None
        stochastic = self.rounding == Rounding.STOCHASTIC
        grid = (("mant_bits", self.mant_bits), ("min_normal", self.min_normal)) if stochastic else ()
        return fp8_block_codes, (("fmax", self.fmax), ("dtype", self.data_dtype)) + grid, False

    def _fused_scaled_codes(self):
        if self.scale_kind != "fp32":
            return None
        stochastic = self.rounding == Rounding.STOCHASTIC
        grid = (("mant_bits", self.mant_bits), ("min_normal", self.min_normal)) if stochastic else ()
        return fp8_tensor_codes, (("dtype", self.data_dtype),) + grid, False, self.fmax

    def _fused_decode(self):
        return _fp8_values, (_e8m0_row_scale if self.scale_kind == "e8m0" else fp32_row_scale)

    def _store(self, y: Tensor, p: Payload, e0: int, e1: int, key: Optional[Tensor]) -> None:
        if key is not None:
            _stochastic_round_bits(y, self.mant_bits, self.min_normal, key, e0)
        # |y| <= fmax by construction of the scale, so the cast never overflows
        p.data[e0:e1].copy_(y)

    def _row_scales(self, p: Payload, r0: int, r1: int) -> Tensor:
        if self.scale_kind == "e8m0":
            return e8m0_to_fp32(p.scales[..., r0:r1])
        if self.block_size == 0:
            return (p.scales * self.fill_factor).expand(*p.batch, r1 - r0)
        return p.scales[..., r0:r1] * self.fill_factor  # exact (power of two), cannot overflow: scale <= fp32 max / fmax

    def _fill(self, out: Tensor, p: Payload, e0: int, e1: int) -> None:
        out.copy_(p.data[..., e0:e1])

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
    # _fill writes value / 256 (see there); fp32 scales absorb the 256
    fill_factor = 256.0

    def _fill(self, out: Tensor, p: Payload, e0: int, e1: int) -> None:
        # torch's fp8 -> fp32 cast is slow on CPU; moving the bits into an fp16 pattern is
        # exact: e4m3 and fp16 differ only in exponent bias (7 vs 15), so the fp16 value is
        # the e4m3 value / 2**8, subnormals included. Code 0x7F/0xFF (nan) would read as
        # 480; the encoder only emits it in blocks whose scale is non-finite.
        w = p.data[..., e0:e1].view(torch.int8).to(torch.int16)  # sign-extended
        sign = w & -(2**15)
        w.bitwise_and_(0x7F).bitwise_left_shift_(7).bitwise_or_(sign)
        out.copy_(w.view(torch.float16))
        if self.scale_kind == "e8m0":
            out.mul_(256.0)  # E8M0 scales go up to 2**127, too big to absorb the factor


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

    def _fill(self, out: Tensor, p: Payload, e0: int, e1: int) -> None:
        # e5m2 is the top byte of fp16 (same exponent), so the cast is a shift
        w = p.data[..., e0:e1].view(torch.int8).to(torch.int16).bitwise_left_shift_(8)
        out.copy_(w.view(torch.float16))
