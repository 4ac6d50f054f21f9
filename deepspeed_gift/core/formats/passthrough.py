"""Unscaled elements: bfloat16 (nearest or stochastic) and the exact fp32 passthrough."""

from __future__ import annotations

from typing import Optional, Tuple

import torch
from torch import Tensor

from .. import kernels as fused_kernels
from ..kernels import random_bits
from .base import Codec, Payload, Rounding, TensorSource, _chunks, _register

# ----------------------------------------------------------------------------- fused kernels


def bf16_stochastic_cast(x: Tensor, key: Tensor, e0: int, data: Tensor) -> None:
    """``data`` (bf16) = ``x`` stochastically rounded to bfloat16 (16 random bits added to the
    dropped ones). inf (low bits 0) truncates to itself; the largest finite values may carry into
    inf, as round-to-nearest can; a nan stays nan (its pattern plus the bits could wrap past the
    int32 range into a finite value: it is passed through as it is)."""
    bits = (x.view(torch.int32) + random_bits(key, e0, x, 16)) & ~0xFFFF
    rounded = torch.where(torch.isnan(x), x, bits.view(torch.float32))
    data.copy_(rounded.to(torch.bfloat16))  # exact but for a nan's payload: the low 16 bits are zero


def _cast_values(data: Tensor) -> Tensor:
    return data.to(torch.float32)



# ----------------------------------------------------------------------------- codecs


class _PassthroughCodec(Codec):
    _decode_temporaries = False
    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        self._check_scale(scale, ("fp32",))
        if block_size not in (None, 0):
            raise ValueError(f"format {self.name!r} has no blocks: block_size must be None or 0, got {block_size}")
        return 0, "none"

    def _encode_into(self, src, p: Payload, key: Optional[Tensor], tile: int) -> None:
        if isinstance(src, TensorSource):  # a cast, with no temporary to bound
            p.data.copy_(src.flat)
            return
        step = tile
        work = None  # fp32 values of a tile the source cannot give as they lie
        native = getattr(src, "native", None)
        for e0 in range(0, src.numel, step):
            e1 = min(e0 + step, src.numel)
            # a cast straight from the source's dtype: a bf16 bucket's values are not widened to
            # an fp32 tile first (the same bits: the widening is exact)
            values = native(e0, e1) if native is not None else None
            if values is None:
                if work is None:
                    work = torch.empty(min(step, src.numel), dtype=torch.float32, device=src.device)
                values = src.read(e0, e1, work)
            p.data[e0:e1].copy_(values)

    def _decode_range(self, p: Payload, out: Tensor, e0: int, e1: int, row_len: int) -> None:
        out.copy_(p.data[..., e0:e1])

    def _at_max(self, p: Payload) -> Tensor:
        return torch.isinf(p.data)

    def _fused_decode(self):
        return _cast_values, None


@_register
class Bf16Codec(_PassthroughCodec):
    """bfloat16 elements: torch's round-to-nearest-even cast, or stochastic rounding."""

    name = "bf16"
    data_dtype = torch.bfloat16
    bytes_per_element = 2

    def _encode_into(self, src, p: Payload, key: Optional[Tensor], tile: int) -> None:
        if key is None:
            super()._encode_into(src, p, key, tile)
            return
        numel = src.numel
        step = tile
        work = torch.empty(min(step, numel), dtype=torch.float32, device=src.device)
        fused = fused_kernels.compiled(bf16_stochastic_cast) if self.compiled_on(src.device) else None
        for e0 in range(0, numel, step):
            e1 = min(e0 + step, numel)
            y = work[: e1 - e0]
            values = src.read(e0, e1, y)
            if values.dtype != torch.float32:
                values = y.copy_(values)
            if fused:
                fused(values, key, e0, p.data[e0:e1])
                continue
            for c0, c1 in _chunks(e1 - e0, values.device):
                bf16_stochastic_cast(values[c0:c1], key, e0 + c0, p.data[e0 + c0 : e0 + c1])


@_register
class Fp32Codec(_PassthroughCodec):
    """float32 elements, bit-identical passthrough."""

    name = "fp32"
    data_dtype = torch.float32
    bytes_per_element = 4

    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        if self.rounding != Rounding.NEAREST:
            raise ValueError(f"fp32 is exact: rounding must be 'nearest', got {self.rounding!r}")
        return super()._check_options(block_size, scale)
