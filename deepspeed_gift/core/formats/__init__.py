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
  scale and decodes to nan in all its elements; other blocks are unaffected. With
  ``block_size=0`` the block is the whole tensor. Decoding relies on that scale: an
  fp8 nan code under a finite scale (never produced by ``encode``) would read as 480.
- fp8 with E8M0 scales: the block's scale byte is 0xFF (nan); the block decodes nan.
- nvfp4: the block's E4M3 scale is nan and the block decodes nan; the fp32 global
  scale is computed from the finite blocks only, so other blocks are unaffected.
- bf16: inf/nan stay inf/nan (sign kept); finite values above bf16's largest finite
  value round to inf, as a bf16 cast does.
- fp32: bit-identical passthrough (inf, nan payloads, -0.0 included).

Range limits (the fp32 scales cover fp32's range; what remains):

- fp8/int with fp32 scales: scale = amax / format_max (nudged up an ulp if needed so
  nothing scales past the format max). Blocks with amax below ~format_max * 2**-126
  (about 5e-36 for e4m3) get a subnormal scale and lose relative precision; no finite
  value ever decodes to a non-finite one.
- fp8 with E8M0 scales: scale = 2**ceil(log2(amax / format_max)), exponent clamped to
  [-127, 127]; blocks with amax below about 2**-127 * format_max lose precision.
- nvfp4: global g = tensor_amax / (6 * 448) (finite blocks only); block scale = per block
  the one of three E4M3 candidates whose nearest-rounded block errs least: the smallest
  value >= block_amax / (6 g) (no element clips), the value below it (the largest elements
  may saturate at 6), the smallest >= block_amax / (4 g); the first two are where the NVFP4
  recipe's rounded-to-nearest scale lies, so no block errs more than under it. Stochastic
  rounding tries only the two that never clip. With
  r = block_amax / tensor_amax: r >= 2**-6 / 448 (3.5e-5) gets a normal E4M3 scale;
  below that the scale is subnormal and coarser; below 2**-9 / 448 (4.4e-6) the block
  gets the smallest scale and its elements under ~2**-11 / 2688 (1.8e-7) of the tensor
  amax decode to 0. ``quantization_stats`` reports the underflow count.

Stochastic rounding picks one of the two neighbouring representable values with
probability proportional to the distance. Its random bits come from a counter (:mod:`.rng`:
a hash of the encode's key and the element's offset), so they do not depend on the device,
the kernel mode or the tile. For fp8/nvfp4/bf16 a uniform random integer
is added to the fp32 bits below the target precision, then they are truncated: exactly
unbiased in the target's normal range. Values in the target's subnormal range are first
shifted up by its smallest normal (same spacing there), which rounds away fp32 bits
finer than 2**-(23 - m) of a step (m mantissa bits: 2**-20 for e4m3), a bias of at most
half that. For int8/int4 a uniform draw is compared with the fractional part (bias
below 2**-24 of a step).

Each format family is a module of this package with its eager codec (the reference) and its
fused kernels (:mod:`..kernels` holds what they share): ``fp8``, ``integer``, ``nvfp4``,
``passthrough``. Adding a format means adding a module, its name to ``FORMAT_NAMES`` (the
header's format id) and its import here.
"""

from .base import *  # noqa: F401,F403  (the public names, see base.__all__)
from .base import (DEFAULT_TILE_ELEMENTS, FORMAT_NAMES, HEADER_BYTES, ROUNDING_MODES, SCALE_KINDS, Codec,  # noqa: F401
                   Payload, Rounding, SampleRecorder, TensorSource, check_tile_elements, format_class, get_format,
                   payload_rows, quantization_stats, sample_rows, spans_batch_limit, warm_device_tables)
from . import fp8, integer, nvfp4, passthrough  # noqa: F401,E402  (each registers its codecs)
from .fp8 import Fp8E4M3Codec, Fp8E5M2Codec, _Fp8Codec  # noqa: F401,E402
from .integer import Int4Codec, Int8Codec  # noqa: F401,E402
from .nvfp4 import NvFp4Codec  # noqa: F401,E402
from .passthrough import Bf16Codec, Fp32Codec  # noqa: F401,E402

__all__ = ["FORMAT_NAMES", "format_class", "HEADER_BYTES", "Codec", "Payload", "get_format", "quantization_stats",
           "DEFAULT_TILE_ELEMENTS", "TensorSource", "SampleRecorder"]
