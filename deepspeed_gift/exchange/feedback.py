"""Error feedback: what quantization left out of this step's payloads, added to the next.

Two stores, both on the reducer's device at :data:`RESIDUAL_BYTES_PER_ELEMENT` (an int8 code
per element and an fp32 scale per block of 128, the ``int8`` codec of ``core.formats``):

* per payload a rank sends (its main-format sections), the residual in the coordinates of the
  transforms it was made with, keyed by the plan's layout and the section; a refresh or a
  re-selection that changes some rows' transform moves it into the new coordinates;
* per chunk sum a rank relays (the relay route's second quantization), keyed by the plan's
  layout and the section, and kept with the plan's hash: the hash names the transform versions
  and the selection, and a residual of another hash is dropped (a refresh starts it afresh,
  since a chunk holds rows cut by its edges and cannot be moved), so one residual per layout
  is held however many refreshes a run has.

A residual is what the wire format rounded away, so it is small beside the gradient (6-8% of
it at NVFP4, docs/results.md); storing it at int8 with a scale per 128 elements loses at most
half a step of that block's scale per element, a round-off ``benchmarks/ef_study.py`` measures.
That loss is not fed back (it would need a residual of the residual): EF then tracks the true
sum up to the sum of these round-offs, not exactly.

Non-finite values never reach a later step through a residual. A block of a residual that held
inf/nan is kept with scale 0, so it decodes to zeros (its codes are left: times a zero scale
each decodes to zero); the kernel that makes the scales decides it, on the device, with no pass
and no host read of its own. A step DeepSpeed skips (its overflow check found an inf/nan anywhere
in the gradients) drops every residual (:meth:`ErrorFeedback.drop_all`, from the engine's
step): that step's gradients were thrown away, so the error of their encode must not reach the
next, whichever section or bucket held the overflow.

A payload this rank sends (and does not decode for itself) gets its residual in one pass where
the codecs are compiled: the int8 codec encodes the staged values minus the payload's decode
(``Int8Codec.encode_difference``), and the difference is never stored in fp32.

Checkpoints (:meth:`ErrorFeedback.state_dict`) hand the residuals one tensor at a time to a
sink (the checkpoint streams each to disk): the stored bytes as they are, with the transform
fits (class and version) they were made in, where those are the geometry's current ones; a
residual made in transforms a refresh has since replaced is saved moved back into gradient
coordinates in fp32 (the move the next step would make), and read back from the checkpoint at
that step, so a resumed run adds what the uninterrupted one would, bit for bit.
"""

from __future__ import annotations

import logging
from typing import Callable, Dict, List, Optional, Tuple, Union

import torch

from ..core import formats
from .plan import BucketPlan, Piece, Section, transform_pieces

logger = logging.getLogger("deepspeed_gift")

RESIDUAL_FORMAT = "int8"
RESIDUAL_BLOCK = 128
# Bytes a residual holds per element: an int8 code plus an fp32 scale per 128 elements
# (4 / 128), i.e. 1.03125, and a 16-byte header per residual (one per section and bucket).
# A memory model multiplies the elements a rank sends (and relays) by it.
RESIDUAL_BYTES_PER_ELEMENT = 1 + 4 / RESIDUAL_BLOCK
# The codec encodes and decodes in its tiles (gift.tile_elements' default): a store or an add
# has a tile's fp32 transients, not a section's.
RESIDUAL_CODEC = formats.get_format(RESIDUAL_FORMAT, block_size=RESIDUAL_BLOCK)
_RESIDUAL_CODECS = {RESIDUAL_CODEC.kernels: RESIDUAL_CODEC}


def residual_codec(kernels: str = "by_device") -> formats.Codec:
    """The residuals' int8 codec running its kernels as ``kernels`` says (``gift.kernels``: the
    same bytes in every mode)."""
    if kernels not in _RESIDUAL_CODECS:
        _RESIDUAL_CODECS[kernels] = formats.get_format(RESIDUAL_FORMAT, block_size=RESIDUAL_BLOCK, kernels=kernels)
    return _RESIDUAL_CODECS[kernels]

# how a saved residual's values are laid out
TRANSFORMED, GRADIENT = "transformed", "gradient"

Fit = Tuple[str, int]  # a transform's class and version: names the fit across a checkpoint


def fit_of(transform) -> Optional[Fit]:
    return None if transform is None else (type(transform).__name__, int(transform.version))


def _fit_named(transform_or_fit) -> Fit:
    return transform_or_fit if isinstance(transform_or_fit, tuple) else fit_of(transform_or_fit)


class StoredResidual:
    """One residual at :data:`RESIDUAL_BYTES_PER_ELEMENT`: the int8 codec's wire bytes (header,
    block scales, codes)."""

    def __init__(self, wire: torch.Tensor, numel: int, codec: Optional[formats.Codec] = None) -> None:
        self.wire = wire
        self.numel = numel
        self.codec = codec or RESIDUAL_CODEC  # (its kernel mode: the bytes are the same in any)

    @classmethod
    def encode(cls, residual: torch.Tensor, codec: Optional[formats.Codec] = None) -> "StoredResidual":
        """``residual`` stored, a block that holds inf/nan as zeros."""
        codec = codec or RESIDUAL_CODEC
        return cls.kept(codec.encode_residual(residual.reshape(-1)), residual.numel(), codec)

    @classmethod
    def of_sent(cls, values: torch.Tensor, sent_codec, payload: formats.Payload,
                codec: Optional[formats.Codec] = None) -> "StoredResidual":
        """The residual ``values`` - ``sent_codec``'s decode of ``payload`` stored (a block that
        held inf/nan as zeros); ``values`` may be overwritten."""
        codec = codec or RESIDUAL_CODEC
        return cls.kept(codec.encode_difference(values.reshape(-1), sent_codec, payload), values.numel(), codec)

    @classmethod
    def kept(cls, stored: formats.Payload, numel: int, codec: formats.Codec) -> "StoredResidual":
        """A residual ``codec`` has just encoded, its blocks that held inf/nan at scale 0 (the
        residual encoders' rule: ``Int8Codec.encode_difference``, ``encode_with_residual``)."""
        return cls(stored.wire, numel, codec)

    def _payload(self) -> formats.Payload:
        return self.codec.bytes_to_payload(self.wire, self.numel, check_header=False)

    def add_to(self, values: torch.Tensor) -> torch.Tensor:
        return self.codec.decode_into(self._payload(), values, add=True)

    def decode(self) -> torch.Tensor:
        return self.codec.decode(self._payload())

    def nbytes(self) -> int:
        return self.wire.numel()


class DeferredResidual:
    """An fp32 residual read from a checkpoint at its first use (``read()`` gives it on the
    device): between the load and that step it holds no memory."""

    def __init__(self, read: Callable[[], torch.Tensor], numel: int) -> None:
        self.read = read
        self.numel = numel

    def add_to(self, values: torch.Tensor) -> torch.Tensor:
        return values.add_(self.read())

    def decode(self) -> torch.Tensor:
        return self.read()

    def nbytes(self) -> int:
        return 0


Held = Union[StoredResidual, DeferredResidual]
Sink = Callable[[torch.Tensor], object]  # a tensor to save -> what the state dict holds for it
Source = Callable[[object], torch.Tensor]  # what the state dict holds -> the tensor (host or device)


def _flat(pieces: List[Piece]) -> List[Piece]:
    """The pieces of a residual in gradient coordinates: the same runs, none transformed."""
    return [Piece(p.bucket_offset, p.numel, p.param_key, 0, p.slice_index, p.slice_start, p.param_start)
            for p in pieces]


def _resolve(used: Dict[int, object], pieces: List[Piece], transforms) -> Optional[Dict[int, object]]:
    """The transforms a residual was made with, as objects: a loaded residual names them by fit,
    which this step's transform of the same fit stands for (the same factors, rebuilt from the
    checkpoint). None if one is no longer this step's: it cannot be moved."""
    if not any(isinstance(t, tuple) for t in used.values()):
        return used
    out = {}
    for p in pieces:
        if p.rows:
            now = transforms.get(p.param_key)
            if fit_of(now) != used.get(p.param_key):
                return None
            out[p.param_key] = now
    return out


def _names_parameters(layout_key) -> bool:
    """Not a layout key of the earlier form, whose slice entries (5 fields) named no parameter
    (this version's name its parameter and offset: 7)."""
    return not any(isinstance(entry, (tuple, list)) and len(entry) == 5 for entry in layout_key)


class ErrorFeedback:
    """The residuals of one reducer (see the module docstring)."""

    def __init__(self, kernels: str = "by_device") -> None:
        self.codec = residual_codec(kernels)  # gift.kernels, as the wire codecs
        # (layout key, section key) -> (residual, pieces, transforms it is expressed in: objects,
        # or fits for one loaded from a checkpoint)
        self.sent: Dict[Tuple[tuple, object], Tuple[Held, List[Piece], Dict[int, object]]] = {}
        # (layout key, section index) -> (plan hash, residual of the chunk sum this rank relays)
        self.relayed: Dict[Tuple[tuple, int], Tuple[int, StoredResidual]] = {}

    def add(self, plan: BucketPlan, sec: Section, values: torch.Tensor, transforms) -> torch.Tensor:
        """``values`` plus last step's residual of this payload, first moved into this step's
        coordinates when a refresh or re-selection changed the transforms of some rows."""
        values, held = self._take(plan, sec, values, transforms)
        return values if held is None else held.add_to(values)

    def _take(self, plan: BucketPlan, sec: Section, values: torch.Tensor,
              transforms) -> Tuple[torch.Tensor, Optional[StoredResidual]]:
        """Last step's residual of this payload: (``values``, the stored residual) where it is in
        this step's coordinates, else (``values`` with it added, None): moved into them when a
        refresh or re-selection changed the transforms of some rows, or read from a checkpoint."""
        key = (plan.layout_key, sec.key)
        entry = self.sent.get(key)
        if entry is None:
            return values, None
        held, pieces, used = entry
        used = _resolve(used, pieces, transforms)
        if used is None:  # a checkpoint's state_dict without the geometry's transforms (see there)
            logger.warning("gift: an error-feedback residual was saved in transforms this run no longer has; "
                           "it is dropped")
            del self.sent[key]
            return values, None
        if pieces != sec.pieces or any(used.get(p.param_key) is not transforms.get(p.param_key)
                                       for p in sec.pieces + pieces if p.rows):
            residual = transform_pieces(held.decode(), pieces, used, inverse=True)
            residual = transform_pieces(residual, sec.pieces, transforms, inverse=False)
            return values.add_(residual), None
        if not isinstance(held, StoredResidual):
            return held.add_to(values), None
        return values, held

    def send(self, plan: BucketPlan, sec: Section, values: torch.Tensor, codec, transforms, *,
             generator=None, tile_elements: Optional[int] = None) -> torch.Tensor:
        """The wire bytes of ``values`` plus last step's residual of this payload in ``codec``,
        the new residual kept (:meth:`add`, the encode and :meth:`keep_sent` in one pass where
        the codecs are compiled: :meth:`Int8Codec.encode_with_residual`); ``values`` (staged,
        flat fp32) is overwritten."""
        values, held = self._take(plan, sec, values, transforms)
        wire, kept = self._encode_with(values, held, codec, generator, tile_elements)
        self.sent[(plan.layout_key, sec.key)] = (kept, sec.pieces, dict(transforms))
        return wire

    def _encode_with(self, values: torch.Tensor, held: Optional[StoredResidual], codec, generator,
                     tile_elements: Optional[int]) -> Tuple[torch.Tensor, StoredResidual]:
        """``codec``'s wire bytes of ``values`` plus ``held`` (None: nothing to add) and the new
        residual to keep: :meth:`send`'s and :meth:`send_relayed`'s one step."""
        payload, residual = self.codec.encode_with_residual(
            values.reshape(-1), None if held is None else held._payload(), codec, generator=generator,
            tile_elements=tile_elements)
        return codec.payload_to_bytes(payload), StoredResidual.kept(residual, values.numel(), self.codec)

    def keep(self, plan: BucketPlan, sec: Section, residual: torch.Tensor, transforms) -> None:
        self.sent[(plan.layout_key, sec.key)] = (StoredResidual.encode(residual, self.codec), sec.pieces,
                                                 dict(transforms))

    def keep_sent(self, plan: BucketPlan, sec: Section, values: torch.Tensor, codec, wire: torch.Tensor,
                  transforms) -> None:
        """:meth:`keep` of ``values`` minus what ``wire`` (``codec``'s bytes of them) decodes to,
        in one pass where the codecs are compiled; ``values`` may be overwritten."""
        payload = codec.bytes_to_payload(wire, values.numel(), check_header=False)
        self.sent[(plan.layout_key, sec.key)] = (StoredResidual.of_sent(values, codec, payload, self.codec),
                                                 sec.pieces, dict(transforms))

    def send_relayed(self, plan: BucketPlan, index: int, value: torch.Tensor, codec, *, generator=None,
                     tile_elements: Optional[int] = None) -> torch.Tensor:
        """:meth:`send` of a chunk sum this rank relays (:meth:`add_relayed`, the encode and
        :meth:`keep_relayed_sent` in one)."""
        wire, kept = self._encode_with(value, self._relayed_held(plan, index), codec, generator, tile_elements)
        self.relayed[(plan.layout_key, index)] = (plan.hash, kept)
        return wire

    def _relayed_held(self, plan: BucketPlan, index: int) -> Optional[StoredResidual]:
        """The residual of this relayed chunk sum, if kept for this plan (its hash: a refresh
        starts it afresh)."""
        held = self.relayed.get((plan.layout_key, index))
        return None if held is None or held[0] != plan.hash else held[1]

    def add_relayed(self, plan: BucketPlan, index: int, value: torch.Tensor) -> torch.Tensor:
        held = self._relayed_held(plan, index)
        return value if held is None else held.add_to(value)

    def keep_relayed(self, plan: BucketPlan, index: int, residual: torch.Tensor) -> None:
        self.relayed[(plan.layout_key, index)] = (plan.hash, StoredResidual.encode(residual, self.codec))

    def keep_relayed_sent(self, plan: BucketPlan, index: int, value: torch.Tensor, codec, wire: torch.Tensor) -> None:
        """:meth:`keep_relayed` of ``value`` minus what ``wire`` (``codec``'s bytes) decodes to."""
        payload = codec.bytes_to_payload(wire, value.numel(), check_header=False)
        self.relayed[(plan.layout_key, index)] = (plan.hash, StoredResidual.of_sent(value, codec, payload, self.codec))

    # ---- checkpoints ----------------------------------------------------------------
    def state_dict(self, current: Optional[Callable[[int], object]] = None, sink: Optional[Sink] = None) -> dict:
        """The residuals as plain data, each tensor handed to ``sink`` as it is made (default: a
        host copy) and replaced by what it returns.

        ``current(param_key)`` is the transform the geometry holds for a parameter now (None:
        none). A residual made in those is saved as stored, with their fits; one made in a
        transform since replaced, in gradient coordinates (fp32). Without ``current`` every
        residual is saved as stored, and one whose fits a resumed run lacks is dropped there."""
        sink = sink or (lambda t: t.cpu())
        sent = []
        for (layout_key, key), (held, pieces, used) in self.sent.items():
            fits = {p.param_key: _fit_named(used[p.param_key]) for p in pieces if p.rows}
            entry = {"layout": layout_key, "key": key, "numel": held.numel}
            stale = current is not None and any(fit_of(current(k)) != fit for k, fit in fits.items())
            if isinstance(held, StoredResidual) and not stale:
                entry.update(coords=TRANSFORMED, pieces=[tuple(vars(p).values()) for p in pieces], fits=fits,
                             wire=sink(held.wire))
            else:  # the move the next step would make, its first half: out of the old transforms
                old = _resolve(used, pieces, {k: current(k) for k in fits} if current else {})
                if old is None:
                    continue  # made in fits neither this run nor the one saved from has: never added
                grad = transform_pieces(held.decode(), pieces, old, inverse=True)
                entry.update(coords=GRADIENT, pieces=[tuple(vars(p).values()) for p in _flat(pieces)], fits={},
                             values=sink(grad))
            sent.append(entry)
        relayed = [{"layout": layout_key, "index": index, "hash": plan_hash, "numel": held.numel,
                    "wire": sink(held.wire)}
                   for (layout_key, index), (plan_hash, held) in self.relayed.items()]
        return {"residual_codec": [RESIDUAL_FORMAT, RESIDUAL_BLOCK],
                "residuals": sent, "relay_residuals": relayed}

    def load_state_dict(self, state: dict, device, source: Optional[Source] = None) -> None:
        """What :meth:`state_dict` gave (``source`` turns what its sink returned back into
        tensors; default: they are tensors), or the fp32 residuals of checkpoints written before
        residuals were stored at int8 (held from now on as these are)."""
        source = source or (lambda t: t)
        codec = state.get("residual_codec")
        if codec is not None and list(codec) != [RESIDUAL_FORMAT, RESIDUAL_BLOCK]:
            raise ValueError(f"gift: this checkpoint's error-feedback residuals are stored as {list(codec)} "
                             f"(format, block); this version reads [{RESIDUAL_FORMAT!r}, {RESIDUAL_BLOCK}]")
        self.sent = {}
        unnamed = 0
        for entry in state["residuals"]:
            if not _names_parameters(entry["layout"] if isinstance(entry, dict) else entry[0]):
                unnamed += 1
                continue
            if isinstance(entry, dict):
                self.sent[(entry["layout"], entry["key"])] = _load_sent(entry, device, source, self.codec)
            else:  # (layout key, section key, fp32 residual in gradient coordinates, pieces)
                layout_key, key, residual, pieces = entry
                self.sent[(layout_key, key)] = (StoredResidual.encode(source(residual).to(device), self.codec),
                                                [Piece(*p) for p in pieces], {})
        self.relayed = {}
        old = 0
        for entry in state.get("relay_residuals", []):
            if isinstance(entry, (dict, tuple, list)) and len(entry) != 3 and not _names_parameters(
                    entry["layout"] if isinstance(entry, dict) else entry[0]):
                unnamed += 1
                continue
            if isinstance(entry, dict):
                held = StoredResidual(source(entry["wire"]).to(device), entry["numel"], self.codec)
                self.relayed[(entry["layout"], entry["index"])] = (entry["hash"], held)
            elif len(entry) == 4:  # (layout key, index, hash, fp32 residual)
                layout_key, index, plan_hash, residual = entry
                self.relayed[(layout_key, index)] = (plan_hash, StoredResidual.encode(source(residual).to(device),
                                                                                      self.codec))
            else:
                old += 1
        # entries of (hash, index, residual), as saved before residuals were held per layout: their
        # hash cannot name a layout, so they cannot be matched; said, and the relay starts afresh
        if old:
            logger.warning("gift: %d relayed error-feedback residuals in this checkpoint are of an earlier "
                           "format and are dropped; the relay route's feedback starts afresh", old)
        if unnamed:
            logger.warning("gift: %d error-feedback residuals in this checkpoint are keyed by a bucket layout "
                           "that names no parameters (buckets of one shape shared a residual then) and are "
                           "dropped; their feedback starts afresh", unnamed)

    def drop_all(self) -> None:
        """Every residual dropped: the step that made them was skipped (see the module docstring),
        so the next step adds none."""
        self.sent.clear()
        self.relayed.clear()

    def nbytes(self) -> int:
        """Device bytes the residuals hold: codes, block scales and tile headers (a residual
        waiting in a checkpoint for its first step holds none)."""
        return (sum(held.nbytes() for held, _, _ in self.sent.values())
                + sum(held.nbytes() for _, held in self.relayed.values()))


def _load_sent(entry: dict, device, source: Source,
               codec: formats.Codec) -> Tuple[Held, List[Piece], Dict[int, object]]:
    pieces = [Piece(*p) for p in entry["pieces"]]
    if entry["coords"] == TRANSFORMED:
        held: Held = StoredResidual(source(entry["wire"]).to(device), entry["numel"], codec)
        return held, pieces, {int(k): tuple(fit) for k, fit in entry["fits"].items()}
    token = entry["values"]
    return DeferredResidual(lambda: source(token).to(device), entry["numel"]), pieces, {}
