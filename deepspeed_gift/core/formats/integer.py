"""Symmetric integers (INT8, and INT4 two a byte) with an fp32 scale per block or per tensor:
the eager codecs and their fused kernels."""

from __future__ import annotations

import math
from typing import ClassVar, List, Optional, Tuple

import torch
from torch import Tensor

from .. import kernels as fused_kernels
from ..kernels import (finite_or_zero, fp32_row_scale, fp32_scales, random_bits, rows_amax, safe_divisor,
                       stochastic_int)
from ..kernels import int4_bytes as _pack_int4
from .base import (Codec, Payload, Rounding, _block_amax, _check_block, _chunks, _nibbles, _pack_nibbles,
                   _register, _ScaledCodec)

# ----------------------------------------------------------------------------- fused kernels


def _int_codes(y: Tensor, key: Optional[Tensor] = None, e0: int = 0) -> Tensor:
    if key is None:
        return torch.round(y).to(torch.int8)  # half to even, as eager's round_
    return stochastic_int(y, random_bits(key, e0, y, 24)).to(torch.int8)


def int_block_codes(x: Tensor, key: Optional[Tensor] = None, e0: int = 0, *, qmax: int) -> Tuple[Tensor, Tensor]:
    """One tile of whole blocks of a symmetric integer format: the fp32 scales of the blocks of
    ``x`` (..., block; widened to fp32 first, exactly) and their int8 codes in [-qmax, qmax], round
    half to even or stochastic under ``key``."""
    x = x.float()
    scale = fp32_scales(rows_amax(x), float(qmax))
    return scale, _int_codes(x / safe_divisor(scale)[..., None], key, e0)


def int_block_encode(x: Tensor, data: Tensor, key: Optional[Tensor] = None, e0: int = 0, *, qmax: int,
                     packed: bool) -> Tensor:
    """:func:`int_block_codes` written into ``data``, the bytes of (rows, block) int8, or
    (rows, block / 2) nibbles (element 2i low) when ``packed``; returns the fp32 scales."""
    scale, codes = int_block_codes(x, key, e0, qmax=qmax)
    data.copy_(_pack_int4(codes) if packed else codes.view(torch.uint8))
    return scale


def int8_difference_encode(values: Tensor, data: Tensor, scales: Optional[Tensor], glob: Optional[Tensor],
                           res_data: Tensor, *, values_fn, row_scale, block: int, qmax: int) -> Tensor:
    """Error feedback's residual of one tile in one pass: ``values`` (n,) minus the decode of a
    sent payload's tile (``data``/``scales``/``glob``, a batch of one, decoded by the sender's
    family functions as the owner's sum decodes it), as int8 blocks of ``res_data``'s width
    written into ``res_data`` (rows, width); returns their fp32 scales, 0 where a block held
    inf/nan (:func:`.kernels.finite_or_zero`)."""
    decoded = fused_kernels.decoded_rows(data, scales, glob, values=values_fn, row_scale=row_scale, block=block)[0]
    width = res_data.shape[-1]
    torch._check(values.shape[0] == res_data.shape[0] * width)  # whole residual blocks
    return finite_or_zero(int_block_encode((values - decoded).view(-1, width), res_data, qmax=qmax, packed=False))


def feedback_difference_encode(values: Tensor, res_data: Tensor, res_scales: Tensor, data: Tensor,
                               scales: Optional[Tensor], glob: Optional[Tensor], res_out: Tensor, *, values_fn,
                               row_scale, block: int, qmax: int) -> Tensor:
    """:func:`int8_difference_encode` of error feedback's sum (``values`` plus last step's
    residual, made here again and not stored) and the payload the sum was encoded into: the new
    residual of one tile in one pass."""
    return int8_difference_encode(_fed(values, res_data, res_scales, res_out.shape[-1]), data, scales, glob,
                                  res_out, values_fn=values_fn, row_scale=row_scale, block=block, qmax=qmax)


def _fed(values: Tensor, res_data: Tensor, res_scales: Tensor, width: int) -> Tensor:
    """``values`` plus last step's int8 residual (codes ``res_data``, fp32 scales ``res_scales``
    per ``width``): error feedback's sum, as the residual's decode-and-add makes it."""
    return values + fused_kernels.decoded_rows(res_data.view(1, -1), res_scales.view(1, -1), None, values=_int8_values,
                                               row_scale=fp32_row_scale, block=width)[0]


def feedback_encode(values: Tensor, res_data: Tensor, res_scales: Tensor, data: Tensor, res_out: Tensor,
                    key: Optional[Tensor] = None, e0: int = 0, *, codes_fn, codes_kw: tuple, packed: bool,
                    block: int, qmax: int) -> Tuple[Tensor, Tensor]:
    """Error feedback's step for one tile of a payload a rank sends, in one pass: last step's
    residual (int8 codes ``res_data`` (n,), fp32 scales ``res_scales``, one per row of
    ``res_out``) added to ``values`` (n,); that encoded by the sent format's ``codes_fn``
    (``codes_kw``: its constants; element e0 first, stochastic under ``key``) into ``data`` (the
    bytes of its (rows, block) elements, nibbles when ``packed``); and the new residual, the sum
    minus the payload's decode (each code's value times its block's scale, what the owner's
    decode gives, taken from the codes before they are stored: a re-read of ``data`` would cut
    the kernel in three), as int8 blocks into ``res_out``. The operations of the residual's
    decode-and-add, the encode and :func:`int8_difference_encode`, in their order; returns
    (the payload's scales, the new residual's scales: 0 where a block held inf/nan)."""
    width = res_out.shape[-1]
    torch._check(values.shape[0] == res_out.shape[0] * width)  # whole blocks of both
    fed = _fed(values, res_data, res_scales, width)
    scale, codes = codes_fn(fed.view(-1, block), key, e0, **dict(codes_kw))
    data.copy_(_pack_int4(codes) if packed else codes.view(torch.uint8))
    decoded = (codes.to(torch.float32) * scale[:, None]).view(-1)
    res_scale, res_codes = int_block_codes((fed - decoded).view(-1, width), qmax=qmax)
    res_out.copy_(res_codes.view(torch.uint8))
    return scale, finite_or_zero(res_scale)


def feedback_sub_encode(values: Tensor, res_data: Tensor, res_scales: Tensor, data: Tensor, res_out: Tensor,
                        key: Optional[Tensor] = None, e0: int = 0, *, codes_fn, codes_kw: tuple, packed: bool,
                        block: int, top: float, qmax: int) -> Tuple[Tensor, Tensor]:
    """:func:`feedback_encode` where the sent format's blocks are finer than the residual's
    (``block`` divides the residual's width ``res_out.shape[-1]``, e.g. the relay's int8/32 under
    an int8/128 residual): every reduction over the residual's rows, so that the step stays one
    kernel. Each sent block's amax is taken over its row with the row's other elements as zero
    (|0| changes no block's amax; nan still propagates), its fp32 scale is
    :func:`.kernels.fp32_scales` over ``top`` and each element is divided by its block's, so the
    scales and codes are those of the sent format's own block kernel (``codes_fn``: its
    quantizer under a given divisor, :meth:`Codec._fused_scaled_codes`). Where the sent blocks
    were rows of their own, inductor cut the step at the two reductions' different rows and
    stored the sum in fp32 between them (12.7 B an element against 7.2). ``data``: the bytes of
    (rows, width) elements, nibbles when ``packed``. Returns (the sent blocks' scales in order,
    the new residual's scales: 0 where a block held inf/nan)."""
    width = res_out.shape[-1]
    torch._check(values.shape[0] == res_out.shape[0] * width)  # whole blocks of both
    fed = _fed(values, res_data, res_scales, width).view(-1, width)
    part = torch.arange(width, device=fed.device) // block
    scales = [fp32_scales(rows_amax(torch.where(part == j, fed, 0.0)), top) for j in range(width // block)]
    scale = scales[-1][:, None]
    for j in range(len(scales) - 2, -1, -1):
        scale = torch.where(part == j, scales[j][:, None], scale)
    codes = codes_fn(fed, safe_divisor(scale), key, e0, **dict(codes_kw))
    data.copy_(_pack_int4(codes) if packed else codes.view(torch.uint8))
    res_scale, res_codes = int_block_codes(fed - codes.to(torch.float32) * scale, qmax=qmax)
    res_out.copy_(res_codes.view(torch.uint8))
    return torch.stack(scales, dim=1).view(-1), finite_or_zero(res_scale)


def finer_blocks_fused(device) -> bool:
    """Where error feedback's step for sent blocks finer than the residual's is one kernel over
    the residual's rows (:func:`feedback_sub_encode`; a GPU, where the step's cost is its bytes:
    7.5 B an element against 12.7, ``benchmarks/codec_traffic.py --cases "relay int8/32"``),
    rather than :func:`feedback_encode` over the sent blocks' rows, which inductor cuts in two
    with the sum stored between (a CPU, where the masked reductions' arithmetic costs more than
    the bytes: 48.9 against 40.5 ms for int8/32 and 83 against 72 for fp8_e4m3/32 at 2^22
    elements, 2026-12-07). The bytes are the same either way."""
    return torch.device(device).type != "cpu"


def feedback_tensor_scale(values: Tensor, res_data: Tensor, res_scales: Tensor, best: Optional[Tensor], *,
                          width: int, qmax: float, block: int = 0) -> Tensor:
    """Error feedback's first pass for a format with one scale per tensor, one tile: the scale
    of the largest |values + last residual| so far (with ``best``, the earlier tiles'):
    :func:`.kernels.tensor_scale` of the sum, what the encode's own first pass gives for it
    (``block``: over rows of that many, those holding inf/nan left out: NVFP4's global scale).
    The sum is not stored: the second pass makes it again."""
    fed = _fed(values, res_data, res_scales, width)
    return fused_kernels.tensor_scale(fed.view(-1, block) if block else fed.view(1, -1), best,
                                      finite_blocks_only=bool(block), qmax=qmax)


def feedback_tensor_encode(values: Tensor, res_data: Tensor, res_scales: Tensor, scale: Tensor, data: Tensor,
                           res_out: Tensor, key: Optional[Tensor] = None, e0: int = 0, *, codes_fn, codes_kw: tuple,
                           packed: bool, qmax: int) -> Tensor:
    """Error feedback's second pass for a format with one scale per tensor (``scale``; its
    divisor made here, inline), one tile: the sum of :func:`feedback_tensor_scale` made again,
    encoded by the sent format's ``codes_fn`` into ``data`` (bytes of (rows, width) elements,
    nibbles when ``packed``), and the new residual (the sum minus the payload's decode, from the
    codes before they are stored) as int8 blocks into ``res_out`` (rows, width); returns their
    scales, 0 where a block held inf/nan. The operations of the three eager steps, in their
    order; every one over the residual's rows (a flat payload was a loop of its own, reading
    the tile again)."""
    width = res_out.shape[-1]
    torch._check(values.shape[0] == res_out.shape[0] * width)  # whole residual blocks
    fed = _fed(values, res_data, res_scales, width).view(-1, width)
    codes = codes_fn(fed, safe_divisor(scale), key, e0, **dict(codes_kw))
    data.copy_(_pack_int4(codes) if packed else codes.view(torch.uint8))
    res_scale, res_codes = int_block_codes(fed - codes.to(torch.float32) * scale, qmax=qmax)
    res_out.copy_(res_codes.view(torch.uint8))
    return finite_or_zero(res_scale)


# Inductor stores an intermediate that two loops read once its expression passes 30 operations
# (50 on a CPU): here the residual (the sum less the payload's decode, which holds the payload's
# scale and codes) feeds both the residual's amax and its codes, and would be written out and
# read back in fp32 (8 B an element, the kernel cut in three). Recomputed instead, the step is one
# kernel reading the values and the old residual and writing the two payloads. Only here: with it
# raised for every kernel, benchmarks/codec_traffic.py stalled for minutes in one compile.
feedback_encode.compile_options = {"realize_opcount_threshold": 100_000, "realize_reads_threshold": 64}
feedback_tensor_encode.compile_options = feedback_encode.compile_options
feedback_sub_encode.compile_options = feedback_encode.compile_options
feedback_difference_encode.compile_options = feedback_encode.compile_options


def int_tensor_codes(x: Tensor, divisor: Tensor, key: Optional[Tensor] = None, e0: int = 0) -> Tensor:
    """One tile under a per-tensor scale: the int8 codes of x / divisor (flat ``x``), round half
    to even or stochastic under ``key`` (``x`` widened to fp32 first, exactly)."""
    return _int_codes(x.float() / divisor, key, e0)


def int_scaled_round(x: Tensor, scale: Tensor, data: Tensor, key: Optional[Tensor] = None, e0: int = 0, *,
                     packed: bool) -> None:
    """:func:`int_tensor_codes` under the per-tensor ``scale`` (its divisor made here, inline)
    written into ``data`` (``packed``: nibbles, an even count)."""
    codes = int_tensor_codes(x, safe_divisor(scale), key, e0)
    data.copy_(_pack_int4(codes) if packed else codes.view(torch.uint8))


def _int8_values(data: Tensor) -> Tensor:
    return data.to(torch.float32)


# Nibbles unpacked by broadcasting each byte against two factors (element 2i the low nibble):
# one pointwise expression, where a stack of the two halves would be a buffer of its own.


def _int4_values(data: Tensor) -> Tensor:
    n = fused_kernels.fp4_nibbles(data)  # two's complement nibbles
    return torch.where(n >= 8.0, n - 16.0, n)



# ----------------------------------------------------------------------------- codecs


class _IntCodec(_ScaledCodec):
    """Symmetric integers in [-qmax, qmax], one fp32 scale per block (or per tensor)."""

    qmax: ClassVar[int]

    def _check_options(self, block_size: Optional[int], scale: str) -> Tuple[int, str]:
        self._check_scale(scale, ("fp32",))
        return _check_block(self.name, block_size, self.default_block_size), "fp32"

    def _prepare(self, src, row_len: int, tile: int) -> Optional[Tensor]:
        return None if self.block_size else self._tensor_scale(src, row_len, tile)

    @property
    def _tensor_qmax(self) -> float:
        return float(self.qmax)

    def encode_residual(self, values: Tensor, *, tile_elements: Optional[int] = None) -> Payload:
        """This codec's encode of an error-feedback residual (flat fp32): a block that holds
        inf/nan kept with scale 0 (:func:`.kernels.finite_or_zero`), as the fused residual
        kernels keep it."""
        q = self.encode(values, tile_elements=tile_elements)
        if q.scales is not None:
            q.scales.copy_(finite_or_zero(q.scales))
        return q

    def encode_difference(self, values: Tensor, sent: Codec, p: Payload, *,
                          tile_elements: Optional[int] = None) -> Payload:
        """This codec's encode of ``values`` (flat fp32) minus ``sent``'s decode of ``p`` (one
        payload of as many elements): error feedback's residual. Compiled (int8 blocks; ``sent``
        compiled too), one kernel a tile reads the values and the payload and writes the codes
        and scales, the difference never stored; a short tail, and the eager path, subtract the
        decode in ``values`` and encode that. The same bytes either way. A block that held
        inf/nan is kept with scale 0 (:func:`.kernels.finite_or_zero`: it decodes to zeros)."""
        numel = values.numel()
        fused = sent._fused_decode()
        device = values.device
        if (fused is None or numel == 0 or not self.block_size or self.elements_per_byte != 1
                or not (self.compiled_on(device) and sent.compiled_on(device))):
            for e0, e1, part in sent.decode_tiles(p, tile_elements=tile_elements):
                values[e0:e1].sub_(part)
            return self.encode_residual(values, tile_elements=tile_elements)
        block, sent_block, epb = self.block_size, sent.block_size, sent.elements_per_byte
        unit = math.lcm(block, sent_block or 1, epb)
        done = numel - numel % unit
        q = self._payload_on(numel, values.shape, device, header=False)
        batch = p.as_batch()
        run = fused_kernels.compiled(int8_difference_encode, values_fn=fused[0], row_scale=fused[1], block=sent_block,
                                     qmax=self.qmax)
        for e0, e1 in self._unit_tiles(done, unit, device, tile_elements):
            scales = (batch.scales[:, e0 // sent_block : e1 // sent_block] if sent_block and batch.scales is not None
                      else batch.scales)
            self._put_scales(q, e0 // block, run(values[e0:e1], batch.data[:, e0 // epb : e1 // epb], scales,
                                                 batch.global_scale, q.data[e0:e1].view(torch.uint8).view(-1, block)))
        if done < numel:  # the tail: its blocks start at ``done``, a multiple of the block
            for e0, e1, part in sent.decode_tiles(p, tile_elements=tile_elements, begin=done):
                values[e0:e1].sub_(part)
            tail = self.encode_residual(values[done:], tile_elements=tile_elements)
            q.scales[done // block :].copy_(tail.scales)
            q.data[done:].copy_(tail.data)
        return self._finish_header(q)

    def encode_with_residual(self, values: Tensor, residual: Optional[Payload], sent: Codec, *,
                             generator=None, tile_elements: Optional[int] = None) -> Tuple[Payload, Payload]:
        """Error feedback's step for a payload a rank sends: ``sent``'s encode of ``values`` (flat
        fp32, overwritten) plus last step's ``residual`` (this codec's payload of as many
        elements; None: none), and this codec's encode of the new residual (that sum minus the
        payload's decode). Compiled (``sent`` block-scaled fp8 or integer, this codec int8
        blocks, both compiled), one kernel a tile reads the values and the old residual and writes
        the payload and the new residual over the whole units of both blocks (the sum is never
        stored; with one scale per tensor after a first pass for the sum's amax:
        :meth:`_tensor_feedback`), a short tail after them rounded to nearest by the steps below on
        the tail alone; else the
        residual's decode is added to ``values``, ``sent`` encodes them, and
        :meth:`encode_difference` makes the new residual. The same bytes either way; the new
        residual's blocks that held inf/nan are kept with scale 0."""
        numel, device = values.numel(), values.device
        encoder = sent._fused_block_codes()
        unit = math.lcm(self.block_size or 1, sent.block_size or 1)
        if encoder is None and residual is not None:
            fused = (self._tensor_feedback(values, residual, sent, generator, tile_elements)
                     or self._global_feedback(values, residual, sent, generator, tile_elements))
            if fused is not None:
                return fused
        # the whole units compiled; a short tail after them (its blocks start at a unit's edge) by
        # the three eager steps below on the tail alone, where its bytes do not depend on where it
        # lies (rounded to nearest; a stochastic tail's bits follow its offset: the eager path)
        done = numel - numel % unit
        if (residual is None or encoder is None or done == 0
                or (done < numel and sent.rounding == Rounding.STOCHASTIC)
                or not self.block_size or self.elements_per_byte != 1
                or not (self.compiled_on(device) and sent.compiled_on(device))):
            if residual is not None:
                self.decode_into(residual, values, add=True, tile_elements=tile_elements)
            p = sent.encode(values, generator=generator, tile_elements=tile_elements)
            return p, self.encode_difference(values, sent, p, tile_elements=tile_elements)
        block, width, epb = sent.block_size, self.block_size, sent.elements_per_byte
        p, q, key = self._feedback_payloads(values, sent, generator)
        # sent blocks finer than the residual's: each reduction over the residual's rows, one kernel
        finer = (sent._fused_scaled_codes() if block < width and width % block == 0 and finer_blocks_fused(device)
                 else None)
        if finer is not None:
            row = width
            run = fused_kernels.compiled(feedback_sub_encode, codes_fn=finer[0], codes_kw=finer[1], packed=finer[2],
                                         block=block, top=finer[3], qmax=self.qmax)
        else:
            row = block
            run = fused_kernels.compiled(feedback_encode, codes_fn=encoder[0], codes_kw=encoder[1], packed=encoder[2],
                                         block=block, qmax=self.qmax)
        for e0, e1 in self._unit_tiles(done, unit, device, tile_elements):
            scale, res_scale = run(values[e0:e1], residual.data[e0:e1], residual.scales[e0 // width : e1 // width],
                                   p.data[e0 // epb : e1 // epb].view(torch.uint8).view(-1, row // epb),
                                   q.data[e0:e1].view(torch.uint8).view(-1, width), key, e0)
            sent._put_scales(p, e0 // block, scale)
            self._put_scales(q, e0 // width, res_scale)
        if done < numel:
            tail = values[done:]
            for e0, e1, part in self.decode_tiles(residual, tile_elements=tile_elements, begin=done):
                values[e0:e1].add_(part)
            sent_tail = sent.encode(tail, tile_elements=tile_elements)
            p.scales[done // block :].copy_(sent_tail.scales)
            p.data[done // epb :].copy_(sent_tail.data)
            kept = self.encode_difference(tail, sent, sent_tail, tile_elements=tile_elements)
            q.scales[done // width :].copy_(kept.scales)
            q.data[done:].copy_(kept.data)
        return sent._finish_header(p), self._finish_header(q)

    def _unit_tiles(self, numel: int, unit: int, device, tile_elements: Optional[int]) -> List[Tuple[int, int]]:
        """The fused kernels' tiles (e0, e1) of ``numel`` elements: about a tile each, a whole
        number of ``unit`` (the blocks both payloads cut), the last one shorter."""
        step = max(unit, self._tile(device, tile_elements) // unit * unit)
        return [(e0, min(e0 + step, numel)) for e0 in range(0, numel, step)]

    def _feedback_payloads(self, values: Tensor, sent: Codec, generator) -> Tuple[Payload, Payload, Optional[Tensor]]:
        """The fused feedback step's two payloads of ``values``' elements (``sent``'s and the new
        residual's, headers pending) and ``sent``'s stochastic rounding key (None: nearest)."""
        numel, device = values.numel(), values.device
        key = sent._random_key(device, generator) if sent.rounding == Rounding.STOCHASTIC else None
        return (sent._payload_on(numel, values.shape, device, header=False),
                self._payload_on(numel, values.shape, device, header=False), key)

    def _tensor_feedback(self, values: Tensor, residual: Payload, sent: Codec, generator,
                         tile_elements: Optional[int]) -> Optional[Tuple[Payload, Payload]]:
        """:meth:`encode_with_residual` for a ``sent`` format with one scale per tensor, compiled:
        a first pass over the tiles for the sum's amax (the sum not stored), then one kernel a
        tile that makes the sum again, encodes it and writes the new residual. None where it does
        not serve (no such quantizer, eager, a short residual block, an odd count of nibbles)."""
        numel, device = values.numel(), values.device
        encoder = sent._fused_tensor_codes()
        width = self.block_size
        if (encoder is None or numel == 0 or not width or numel % width or self.elements_per_byte != 1
                or (encoder[2] and width % 2) or not (self.compiled_on(device) and sent.compiled_on(device))):
            return None
        codes_fn, codes_kw, packed, top = encoder
        p, q, key = self._feedback_payloads(values, sent, generator)
        tiles = self._unit_tiles(numel, width, device, tile_elements)
        first = fused_kernels.compiled(feedback_tensor_scale, width=width, qmax=top)
        scale = None
        for e0, e1 in tiles:
            scale = first(values[e0:e1], residual.data[e0:e1], residual.scales[e0 // width : e1 // width], scale)
        sent._put_scales(p, 0, scale)
        run = fused_kernels.compiled(feedback_tensor_encode, codes_fn=codes_fn, codes_kw=codes_kw, packed=packed,
                                     qmax=self.qmax)
        epb = sent.elements_per_byte
        for e0, e1 in tiles:
            old = residual.data[e0:e1], residual.scales[e0 // width : e1 // width]
            res_scale = run(values[e0:e1], *old, scale,
                            p.data[e0 // epb : e1 // epb].view(torch.uint8).view(-1, width // epb),
                            q.data[e0:e1].view(torch.uint8).view(-1, width), key, e0)
            self._put_scales(q, e0 // width, res_scale)
        return sent._finish_header(p), self._finish_header(q)

    def _global_feedback(self, values: Tensor, residual: Payload, sent: Codec, generator,
                         tile_elements: Optional[int]) -> Optional[Tuple[Payload, Payload]]:
        """:meth:`encode_with_residual` for a ``sent`` format whose own kernel chooses its block
        scales under a global scale (NVFP4, :meth:`Codec._fused_fed_codes`), compiled: a first
        pass over the tiles for the sum's global scale, then per tile the sent format's kernel on
        the sum and :func:`feedback_difference_encode` on the sum and the payload, the sum made
        again by each and never stored. NVFP4's kernel works per 16-row and the residual's amax
        over ``block_size`` elements, so the two stay two kernels (one would hold a reduction
        across rows inside the candidates' pointwise pass). None where it does not serve."""
        numel, device = values.numel(), values.device
        encoder = sent._fused_fed_codes()
        width = self.block_size
        block = sent.block_size
        unit = math.lcm(width or 1, block or 1)
        if (encoder is None or numel == 0 or not width or self.elements_per_byte != 1 or numel % unit
                or not (self.compiled_on(device) and sent.compiled_on(device))):
            return None
        tile_fn, tile_kw, top = encoder
        p, q, key = self._feedback_payloads(values, sent, generator)
        tiles = self._unit_tiles(numel, unit, device, tile_elements)

        def old(e0, e1):
            return values[e0:e1], residual.data[e0:e1], residual.scales[e0 // width : e1 // width]

        first = fused_kernels.compiled(feedback_tensor_scale, width=width, qmax=top, block=block)
        g = None
        for e0, e1 in tiles:
            g = first(*old(e0, e1), g)
        whole = len(tiles) == 1 and p.header_pending
        if not whole:
            sent._put_global(p, g)
        run = fused_kernels.compiled(tile_fn, **dict(tile_kw), width=width)
        values_fn, row_scale = sent._fused_decode()
        rest = fused_kernels.compiled(feedback_difference_encode, values_fn=values_fn, row_scale=row_scale, block=block,
                                      qmax=self.qmax)
        batch = p.as_batch()
        for e0, e1 in tiles:
            codes, packed = run(*old(e0, e1), g, key, e0)
            if whole:
                sent._with_header(p, g, codes, packed)
            else:
                p.scales.view(torch.uint8)[e0 // block : e1 // block].copy_(codes)
                p.data[e0 // 2 : e1 // 2].copy_(packed.view(torch.uint8))
            res_scale = rest(*old(e0, e1), batch.data[:, e0 // 2 : e1 // 2], batch.scales[:, e0 // block : e1 // block],
                             batch.global_scale, q.data[e0:e1].view(torch.uint8).view(-1, width))
            self._put_scales(q, e0 // width, res_scale)
        return sent._finish_header(p), self._finish_header(q)

    def _tile_divisor(self, x: Tensor, p: Payload, r0: int, r1: int) -> Tensor:
        scale = fp32_scales(_block_amax(x), float(self.qmax))
        self._put_scales(p, r0, scale)
        return safe_divisor(scale)

    def _fused_tile(self, x: Tensor, p: Payload, r0: int, r1: int, e1: int, scale: Optional[Tensor],
                    key: Optional[Tensor]) -> bool:
        row_len = x.shape[1]
        e0, epb = r0 * row_len, self.elements_per_byte
        packed = epb == 2
        if scale is not None:  # one scale per tensor: a flat rounding of the tile
            if packed and (e0 % 2 or (e1 - e0) % 2):
                return False
            fused_kernels.compiled(int_scaled_round, packed=packed)(
                x.view(-1)[: e1 - e0], scale, p.data[e0 // epb : e1 // epb].view(torch.uint8), key, e0)
            return True
        if e1 - e0 != x.numel() or (packed and row_len % 2):
            return False
        self._put_scales(p, r0, fused_kernels.compiled(int_block_encode, qmax=self.qmax, packed=packed)(
            x, p.data[e0 // epb : e1 // epb].view(torch.uint8).view(r1 - r0, row_len // epb), key, e0))
        return True

    def _fused_block_codes(self):
        if not self.block_size or (self.elements_per_byte == 2 and self.block_size % 2):
            return None
        return int_block_codes, (("qmax", self.qmax),), self.elements_per_byte == 2

    def _fused_scaled_codes(self):
        return int_tensor_codes, (), self.elements_per_byte == 2, float(self.qmax)

    def _fused_decode(self):
        return (_int4_values if self.elements_per_byte == 2 else _int8_values), fp32_row_scale

    def _round(self, y: Tensor, key: Optional[Tensor], e0: int) -> Tensor:
        if key is None:
            return y.round_()  # half to even
        for c0, c1 in _chunks(y.numel(), y.device):  # kernels.stochastic_int, the compiled kernels' rule
            part = y[c0:c1]
            part.copy_(stochastic_int(part, random_bits(key, e0 + c0, part, 24)))
        return y

    def _row_scales(self, p: Payload, r0: int, r1: int) -> Tensor:
        return p.scales.expand(*p.batch, r1 - r0) if self.block_size == 0 else p.scales[..., r0:r1]


@_register
class Int8Codec(_IntCodec):
    name = "int8"
    default_block_size = 128
    data_dtype = torch.int8
    qmax = 127

    def _store(self, y: Tensor, p: Payload, e0: int, e1: int, key: Optional[Tensor]) -> None:
        p.data[e0:e1].copy_(self._round(y, key, e0))

    def _fill(self, out: Tensor, p: Payload, e0: int, e1: int) -> None:
        out.copy_(p.data[..., e0:e1])

    def _at_max(self, p: Payload) -> Tensor:
        return p.data.abs() == self.qmax


@_register
class Int4Codec(_IntCodec):
    """Two's-complement nibbles in [-7, 7], two per byte."""

    name = "int4"
    default_block_size = 128
    data_dtype = torch.uint8
    elements_per_byte = 2
    qmax = 7

    def _store(self, y: Tensor, p: Payload, e0: int, e1: int, key: Optional[Tensor]) -> None:
        codes = self._round(y, key, e0).to(torch.int8).view(torch.uint8).bitwise_and_(0x0F)
        _pack_nibbles(codes, p.data[e0 // 2 : (e1 + 1) // 2])

    def _fill(self, out: Tensor, p: Payload, e0: int, e1: int) -> None:
        # move each nibble to the top of an int8 and shift back arithmetically: sign-extended
        data = p.data[..., e0 // 2 : (e1 + 1) // 2].view(torch.int8)
        w = torch.empty((*data.shape[:-1], 2 * data.shape[-1]), dtype=torch.int8, device=data.device)
        pairs = w.unflatten(-1, (-1, 2))
        torch.bitwise_left_shift(data, 4, out=pairs[..., 0])
        pairs[..., 1].copy_(data)
        out.copy_(w[..., : out.shape[-1]].bitwise_right_shift_(4))

    def _at_max(self, p: Payload) -> Tensor:
        nib = _nibbles(p.data, p.numel)
        return (nib == 7) | (nib == 9)  # +7, -7
