"""A section's fp32 values into wire bytes, with its codec, counted as they are sent."""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Callable, Dict, Optional, Tuple

import torch

from ..core.formats import DEFAULT_TILE_ELEMENTS, SampleRecorder, TensorSource, get_format
from ..core.rng import CounterRng
from .plan import Section
from .stats import StepStats


@dataclass
class Packed:
    """What this rank made of one section: the fp32 values it contributes as the receiver
    sees them (``own``; None when it does not receive the section) and the encoded bytes."""

    own: Optional[torch.Tensor] = None
    wire: Optional[torch.Tensor] = None


# A sampled step's quantization counts (saturated, underflow, non-finite) are rates: ~1M
# elements of whole blocks measure them to ~1e-3, and keep the sample's ~34 B an element (the
# values, a decode, masks) at ~34 MB, where a tile-sized sample (2^24) held ~0.5 GB on any device.
QUANT_SAMPLE_ELEMENTS = 1 << 20


def copy_codec_for(main_codec, high_codec=None):
    """The codec of ``COPY`` slices (``plan.Mode``): elementwise and round-to-nearest, so an
    element's bytes depend on its value alone; fp32 where the main or ``others`` format is fp32
    (a lossless run stays lossless), else bf16."""
    if "fp32" in (main_codec.name, getattr(high_codec, "name", None)):
        return get_format("fp32")
    return get_format("bf16")


class SectionEncoder:
    """Encodes sections for one rank: the main codec, or the high-precision one for ``others``.

    ``generator`` (a :class:`CounterRng`) keys stochastic rounding. With ``shared_seed``
    (two-level, stochastic rounding) a shared section is rounded with a generator seeded from
    (that seed, this rank = the node, step, parameters), so the same node partial encoded by the node's ranks of
    different slot groups gives the same bytes. ``tile_elements`` bounds the codec's
    temporaries and the sample that sampled steps measure. ``relay_codec`` (``gift.relay_format``)
    encodes the relay route's sums on their way to the owner (None: the main codec)."""

    def __init__(self, rank: int, main_codec, high_codec=None, *, generator: Optional[CounterRng] = None,
                 shared_seed: Optional[int] = None, tile_elements: int = DEFAULT_TILE_ELEMENTS,
                 relay_codec=None) -> None:
        self.rank = rank
        self.tile_elements = tile_elements
        self.main_codec = main_codec
        self.high_codec = high_codec
        self.relay_codec = relay_codec
        self.copy_codec = copy_codec_for(main_codec, high_codec)
        self.generator = generator
        self.shared_seed = shared_seed

    def codec_of(self, section: Section):
        if section.copy:
            return self.copy_codec
        return self.high_codec if section.high else self.main_codec

    def forward_codec_of(self, section: Section):
        """The codec of a section's relayed sums (the relay's second hop)."""
        if section.high:
            return self.codec_of(section)
        return self.relay_codec if self.relay_codec is not None else self.main_codec

    def generator_for(self, sec: Section, step: int):
        if self.shared_seed is None or not sec.shared or self.generator is None:
            return self.generator
        digest = hashlib.blake2b(repr((self.shared_seed, self.rank, step, [p.param_key for p in sec.pieces]))
                                 .encode(), digest_size=7).digest()
        return CounterRng(int.from_bytes(digest, "little"))

    def encode(self, sec: Section, values, stats: StepStats, sample: bool, generator, *,
               decode: bool, codec=None) -> Tuple[torch.Tensor, Optional[torch.Tensor]]:
        """The wire bytes of ``values`` (a tensor, or a source read tile by tile: see
        ``plan.SectionSource``) in the section's codec and, with ``decode``, what the receiver
        will decode from them. Sampled steps count the quantization on an evenly strided sample
        of whole blocks of at most ``QUANT_SAMPLE_ELEMENTS`` (``quantized`` counts the sample).
        ``codec``: another than the section's own (the relay's second hop)."""
        codec, tile = codec or self.codec_of(sec), self.tile_elements
        src = TensorSource(values.reshape(-1)) if isinstance(values, torch.Tensor) else values
        if sec.high:
            payload = codec.encode_source(src, tile_elements=tile)
        else:
            recorder = SampleRecorder(src, codec, min(tile, QUANT_SAMPLE_ELEMENTS)) if sample else None
            payload = codec.encode_source(recorder or src, generator=generator, tile_elements=tile)
            if recorder is not None:
                q = recorder.stats(payload, codec)
                stats.underflow += q["underflow"]
                stats.saturated += q["saturated"]
                stats.nonfinite += q["nonfinite"]
                stats.quantized += q["numel"]
        return codec.payload_to_bytes(payload), codec.decode(payload, tile_elements=tile) if decode else None

    def count_sent(self, sec: Section, nbytes: int, numel: int, copies: int, stats: StepStats,
                   codec=None) -> None:
        """``copies`` sends of a payload of ``nbytes`` bytes (``numel`` elements) of ``sec``."""
        stats.elements_sent += copies * numel
        if sec.high:
            stats.bytes_high += copies * nbytes
        else:
            stats.bytes_main += copies * nbytes
            stats.bytes_scales += copies * (codec or self.codec_of(sec)).scale_nbytes(numel)


class SpanBatches:
    """Sections that are spans of one flat buffer ``x`` (as it lies), gathered per codec and
    encoded a batch at a time by one call (``Codec.encode_spans``), each batch of at most
    ``limit`` elements; ``deliver(item, numel, codec, wire)`` takes each section's wire (its
    uint8 pieces, joined where it goes). A section's stochastic rounding key is drawn by the
    caller where the section's own encode would have drawn it, and given with it. Serves the
    reducer's plain sections and a relay's sums alike."""

    def __init__(self, x: torch.Tensor, limit: int, deliver: Callable) -> None:
        self.x, self.limit, self.deliver = x, limit, deliver
        self._open: Dict[int, list] = {}  # id(codec) -> [codec, [(start, numel, key, item)], elements]

    def add(self, codec, start: int, numel: int, key: Optional[Tuple[int, int]], item) -> None:
        batch = self._open.get(id(codec))
        if batch is not None and batch[2] + numel > self.limit:
            self._encode(id(codec))
            batch = None
        if batch is None:
            batch = self._open[id(codec)] = [codec, [], 0]
        batch[1].append((start, numel, key, item))
        batch[2] += numel

    def finish(self) -> None:
        for k in list(self._open):
            self._encode(k)

    def _encode(self, k: int) -> None:
        codec, entries, _ = self._open.pop(k)
        keys = [key for _, _, key, _ in entries]
        parts = codec.encode_spans(self.x, [(start, numel) for start, numel, _, _ in entries],
                                   keys=None if keys[0] is None else keys)
        for (_, numel, _, item), wire in zip(entries, parts):
            self.deliver(item, numel, codec, wire)
