"""One bucket's reduce-scatter: per-owner chunks -> transform -> quantize -> all-to-all
-> dequantize + fp32 sum at the owner -> inverse transform.

Knows nothing of DeepSpeed: the caller describes the bucket as ``ParamSlice``s (which
part of the flat bucket goes to which owner, and whether it belongs to a weight whose
rows can be whitened). Knows no wire details: codecs from ``formats`` turn fp32 into
bytes, a ``Comm`` moves bytes.

Wire layout of the message from rank ``src`` to owner ``dst`` for one bucket::

    [16-byte control header][main-format payload][high-precision payload]

The control header carries a hash of the bucket plan (layout, selected layers and
whitener versions) so an owner fails loudly if ranks disagree on what they send. The
owner's own contribution never goes through the codec (it is exact and costs no bytes).
"""

from __future__ import annotations

import hashlib
import time
from dataclasses import dataclass, field
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from .formats import quantization_stats

CONTROL_HEADER_BYTES = 16
MAX_CACHED_PLANS = 256  # a few buckets x a few versions; each refresh makes the old ones stale
GEO, MAIN, HIGH = "geo", "main", "high"


@dataclass(frozen=True)
class ParamSlice:
    """A contiguous run of one parameter's gradient inside the flat bucket, bound for ``dst``."""

    dst: int
    bucket_offset: int
    numel: int
    param_offset: int  # where the run starts inside the flattened parameter
    param_key: int
    row_len: int = 0  # width ("in") of a 2-D weight whose rows may be whitened; 0 = not a matrix
    mode: str = MAIN  # GEO: whiten whole rows; MAIN: main format as is; HIGH: others=bf16/fp32


@dataclass(frozen=True)
class Piece:
    """A run of the bucket that is packed contiguously into one payload."""

    bucket_offset: int
    numel: int
    param_key: int
    rows: int = 0  # > 0: ``rows`` whole rows of length numel // rows, whitened
    slice_index: int = -1  # index of the ParamSlice it came from (for compact outputs)
    slice_start: int = 0  # offset of this piece inside that slice


@dataclass
class OwnerPlan:
    main: List[Piece] = field(default_factory=list)
    high: List[Piece] = field(default_factory=list)
    main_numel: int = 0
    high_numel: int = 0


def split_slice_rows(s: ParamSlice) -> List[Tuple[int, int, int]]:
    """Cut a slice of a row-major (out x in) weight into (start, numel, rows) runs:
    whole rows (rows > 0) and the partial rows at either end (rows = 0), which travel
    in Euclidean coordinates because no single rank holds them whole."""
    if s.mode != GEO or s.row_len <= 0:
        return [(0, s.numel, 0)]
    width = s.row_len
    first_row = -(-s.param_offset // width)
    end_row = (s.param_offset + s.numel) // width
    if end_row <= first_row:
        return [(0, s.numel, 0)]
    head = first_row * width - s.param_offset
    whole = (end_row - first_row) * width
    runs = []
    if head:
        runs.append((0, head, 0))
    runs.append((head, whole, end_row - first_row))
    tail = s.numel - head - whole
    if tail:
        runs.append((head + whole, tail, 0))
    return runs


class BucketPlan:
    """Where every element of a bucket goes, per owner, and how it is packed."""

    def __init__(self, slices: Sequence[ParamSlice], world_size: int, versions: Dict[int, int]) -> None:
        self.slices = tuple(slices)
        self.world_size = world_size
        self.owners = [OwnerPlan() for _ in range(world_size)]
        for index, s in enumerate(self.slices):
            owner = self.owners[s.dst]
            for start, numel, rows in split_slice_rows(s):
                piece = Piece(s.bucket_offset + start, numel, s.param_key, rows, index, start)
                if s.mode == HIGH:
                    owner.high.append(piece)
                    owner.high_numel += numel
                else:
                    owner.main.append(piece)
                    owner.main_numel += numel
        digest = hashlib.blake2b(repr((self.slices, sorted(versions.items()))).encode(), digest_size=8)
        self.hash = int.from_bytes(digest.digest(), "little", signed=True)
        # Element positions of the main payloads depend only on which slices are HIGH: an
        # error-feedback residual survives re-selection and refreshes under this key.
        self.layout_key = tuple((s.dst, s.bucket_offset, s.numel, s.mode == HIGH) for s in self.slices)


class GiftReducer:
    """Runs bucket reductions for one engine. Holds codecs, the comm and per-plan caches."""

    def __init__(self, comm, main_codec, high_codec=None, *, generator: Optional[torch.Generator] = None,
                 error_feedback: bool = False) -> None:
        self.comm = comm
        self.main_codec = main_codec
        self.high_codec = high_codec
        self.generator = generator
        self.error_feedback = error_feedback
        self._plans: Dict[tuple, BucketPlan] = {}
        # (layout key, dst) -> (fp32 residual of the main payload, pieces, whiteners it is expressed in)
        self.residuals: Dict[Tuple[tuple, int], Tuple[torch.Tensor, List[Piece], Dict[int, object]]] = {}
        self.last: Dict[str, float] = {}

    # ---- planning -------------------------------------------------------------------
    def plan_for(self, slices: Sequence[ParamSlice], versions: Dict[int, int]) -> BucketPlan:
        key = (tuple(slices), tuple(sorted(versions.items())))
        plan = self._plans.pop(key, None)
        if plan is None:
            plan = BucketPlan(slices, self.comm.world_size, versions)
            while len(self._plans) >= MAX_CACHED_PLANS:  # plans of older whitener versions
                self._plans.pop(next(iter(self._plans)))
        self._plans[key] = plan  # most recently used last
        return plan

    def message_nbytes(self, owner: OwnerPlan) -> int:
        n = CONTROL_HEADER_BYTES
        if owner.main_numel:
            n += self.main_codec.nbytes(owner.main_numel)
        if owner.high_numel:
            n += self.high_codec.nbytes(owner.high_numel)
        return n

    # ---- packing --------------------------------------------------------------------
    @staticmethod
    def _gather(tensor: torch.Tensor, pieces: List[Piece], numel: int, whiteners) -> torch.Tensor:
        """fp32 staging buffer of ``pieces`` (whole rows moved into whitened coordinates)."""
        out = torch.empty(numel, dtype=torch.float32, device=tensor.device)
        pos = 0
        for p in pieces:
            src = tensor.narrow(0, p.bucket_offset, p.numel)
            dst = out.narrow(0, pos, p.numel)
            if p.rows:
                rows = src.view(p.rows, p.numel // p.rows)
                dst.view_as(rows).copy_(whiteners[p.param_key].apply(rows))
            else:
                dst.copy_(src)
            pos += p.numel
        return out

    @staticmethod
    def _transform_rows(buf: torch.Tensor, pieces: List[Piece], whiteners, *, inverse: bool) -> None:
        """In place, on a packed buffer: whole-row pieces into (or back from) whitened coordinates."""
        pos = 0
        for p in pieces:
            if p.rows:
                view = buf.narrow(0, pos, p.numel).view(p.rows, p.numel // p.rows)
                w = whiteners[p.param_key]
                view.copy_(w.invert(view) if inverse else w.apply(view))
            pos += p.numel

    def _control_header(self, plan: BucketPlan, step: int, device) -> torch.Tensor:
        head = torch.tensor([plan.hash, step], dtype=torch.int64)
        return head.view(torch.uint8).to(device)

    # ---- the reduction --------------------------------------------------------------
    def reduce(self, tensor: torch.Tensor, slices: Sequence[ParamSlice], whiteners: Dict[int, object],
               versions: Dict[int, int], *, divisor: float, step: int = 0,
               outputs: Optional[Sequence[Optional[torch.Tensor]]] = None, sample: bool = False) -> Dict:
        """Reduce ``tensor`` (a flat bucket, this rank's local gradients) so that every
        slice owned by this rank holds the sum over ranks divided by ``divisor``.

        ``outputs[i]`` (optional, owner side) is an extra fp32 destination for slice i:
        the result is added to it (DeepSpeed's compact fp32 gradient partition).
        Returns statistics for telemetry."""
        comm = self.comm
        me, world = comm.rank, comm.world_size
        plan = self.plan_for(slices, versions)
        exact = self._exact_reduction(tensor, plan, divisor) if sample else None
        stats = {"elements": 0, "elements_sent": 0, "bytes_main": 0, "bytes_high": 0, "bytes_header": 0,
                 "transform_s": 0.0, "codec_s": 0.0, "comm_s": 0.0}

        # 1. Pack one message per owner (own chunk kept exact, in fp32).
        messages, sizes = [], []
        own_main = own_high = None
        for dst, owner in enumerate(plan.owners):
            t0 = time.perf_counter()
            main = self._gather(tensor, owner.main, owner.main_numel, whiteners) if owner.main_numel else None
            high = self._gather(tensor, owner.high, owner.high_numel, whiteners) if owner.high_numel else None
            stats["transform_s"] += time.perf_counter() - t0
            stats["elements"] += owner.main_numel + owner.high_numel
            if dst != me:
                stats["elements_sent"] += owner.main_numel + owner.high_numel
            if dst == me:
                own_main, own_high = main, high
                if sample:  # the own chunk skips the codec; count its non-finite inputs too
                    for t in (main, high):
                        if t is not None:
                            stats["nonfinite"] = stats.get("nonfinite", 0) + int((~torch.isfinite(t)).sum())
                messages.append(torch.empty(0, dtype=torch.uint8, device=tensor.device))
                sizes.append(0)
                continue
            t0 = time.perf_counter()
            parts = [self._control_header(plan, step, tensor.device)]
            if main is not None:
                if self.error_feedback:
                    main = self._add_residual(plan, dst, main, whiteners)
                payload = self.main_codec.encode(main, generator=self.generator)
                parts.append(self.main_codec.payload_to_bytes(payload))  # before main is reused below
                if sample:
                    q = quantization_stats(main, payload, self.main_codec)
                    for key in ("underflow", "saturated", "nonfinite"):
                        stats[key] = stats.get(key, 0) + q[key]
                    stats["quantized"] = stats.get("quantized", 0) + q["numel"]
                if self.error_feedback:
                    residual = main.sub_(self.main_codec.decode(payload))
                    if bool(torch.isfinite(residual).all()):
                        self.residuals[(plan.layout_key, dst)] = (residual, owner.main, dict(whiteners))
                    else:  # an overflowing step (DeepSpeed skips it): its error must not leak into the next
                        self.residuals.pop((plan.layout_key, dst), None)
                stats["bytes_main"] += parts[-1].numel()
                stats["bytes_scales"] = stats.get("bytes_scales", 0) + self.main_codec.scale_nbytes(owner.main_numel)
            if high is not None:
                parts.append(self.high_codec.encode_to_bytes(high))
                stats["bytes_high"] += parts[-1].numel()
            stats["bytes_header"] += CONTROL_HEADER_BYTES
            stats["codec_s"] += time.perf_counter() - t0
            msg = torch.cat(parts)
            expected = self.message_nbytes(owner)
            if msg.numel() != expected:
                raise RuntimeError(f"deepspeed_gift: message to rank {dst} has {msg.numel()} bytes, "
                                   f"plan expects {expected}; codec byte count is inconsistent")
            messages.append(msg)
            sizes.append(msg.numel())

        # 2. Exchange: what I send to each owner, and what each rank sends me.
        mine = plan.owners[me]
        my_size = self.message_nbytes(mine)
        recv_sizes = [0 if src == me else my_size for src in range(world)]
        t0 = time.perf_counter()
        recv = comm.all_to_all_bytes(torch.cat(messages), sizes, recv_sizes, kind="payload")
        stats["comm_s"] += time.perf_counter() - t0

        # 3. Owner: decode every source, sum in fp32, divide, map rows back.
        t0 = time.perf_counter()
        total_main = own_main.clone() if own_main is not None else None
        total_high = own_high.clone() if own_high is not None else None
        pos = 0
        for src in range(world):
            if src == me or my_size == 0:
                continue
            msg = recv.narrow(0, pos, my_size)
            pos += my_size
            self._check_header(msg, plan, src, step)
            off = CONTROL_HEADER_BYTES
            if mine.main_numel:
                n = self.main_codec.nbytes(mine.main_numel)
                total_main += self.main_codec.decode_from_bytes(msg.narrow(0, off, n), (mine.main_numel,))
                off += n
            if mine.high_numel:
                n = self.high_codec.nbytes(mine.high_numel)
                total_high += self.high_codec.decode_from_bytes(msg.narrow(0, off, n), (mine.high_numel,))
        stats["codec_s"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        for total, pieces in ((total_main, mine.main), (total_high, mine.high)):
            if total is None:
                continue
            total.div_(divisor)
            self._transform_rows(total, pieces, whiteners, inverse=True)
            self._scatter(tensor, total, pieces, plan, outputs)
        stats["transform_s"] += time.perf_counter() - t0
        if exact is not None:
            result = torch.cat([t for t in (total_main, total_high) if t is not None])
            stats["fidelity_err_sq"] = float((result - exact).square().sum())
            stats["fidelity_ref_sq"] = float(exact.square().sum())
        self.last = stats
        return stats

    def _add_residual(self, plan: BucketPlan, dst: int, main: torch.Tensor, whiteners) -> torch.Tensor:
        """Add last step's quantization error, first moved into this step's coordinates when
        a refresh or re-selection changed the whiteners of some rows."""
        entry = self.residuals.get((plan.layout_key, dst))
        if entry is None:
            return main
        residual, pieces, used = entry
        new_pieces = plan.owners[dst].main
        if pieces != new_pieces or any(used.get(p.param_key) is not whiteners.get(p.param_key)
                                       for p in new_pieces + pieces if p.rows):
            self._transform_rows(residual, pieces, used, inverse=True)
            self._transform_rows(residual, new_pieces, whiteners, inverse=False)
        return main.add_(residual)

    def state_dict(self) -> dict:
        """Error-feedback residuals, moved to gradient coordinates (the whiteners they were
        made with are not saved; the next step maps them into its own), and the stochastic
        rounding generator."""
        residuals = []
        for (layout_key, dst), (residual, pieces, used) in self.residuals.items():
            grad_coords = residual.clone()
            self._transform_rows(grad_coords, pieces, used, inverse=True)
            flat = [Piece(p.bucket_offset, p.numel, p.param_key, 0, p.slice_index, p.slice_start) for p in pieces]
            residuals.append((layout_key, dst, grad_coords.cpu(), [tuple(vars(p).values()) for p in flat]))
        gen = self.generator.get_state() if self.generator is not None else None
        return {"residuals": residuals, "generator": gen}

    def load_state_dict(self, state: dict, device) -> None:
        self.residuals = {(layout_key, dst): (r.to(device), [Piece(*p) for p in pieces], {})
                          for layout_key, dst, r, pieces in state["residuals"]}
        if state["generator"] is not None and self.generator is not None:
            self.generator.set_state(state["generator"])

    def residual_nbytes(self) -> int:
        """Memory held by error feedback (fp32 residuals of every payload this rank sends)."""
        return sum(r.numel() * r.element_size() for r, _, _ in self.residuals.values())

    @staticmethod
    def _scatter(tensor, total, pieces, plan, outputs) -> None:
        pos = 0
        for p in pieces:
            result = total.narrow(0, pos, p.numel)
            tensor.narrow(0, p.bucket_offset, p.numel).copy_(result)
            if outputs is not None and outputs[p.slice_index] is not None:
                outputs[p.slice_index].narrow(0, p.slice_start, p.numel).add_(result)
            pos += p.numel

    @staticmethod
    def _check_header(msg: torch.Tensor, plan: BucketPlan, src: int, step: int) -> None:
        head = msg.narrow(0, 0, CONTROL_HEADER_BYTES).clone().view(torch.int64).tolist()
        if head[0] != plan.hash or head[1] != step:
            raise RuntimeError(
                f"deepspeed_gift: rank {src} sent a bucket for plan {head[0]:#x} at step {head[1]}, this "
                f"owner expects plan {plan.hash:#x} at step {step}: ranks disagree on the bucket layout, "
                "the selected layers or the whitener versions")

    def _exact_reduction(self, tensor, plan: BucketPlan, divisor: float) -> Optional[torch.Tensor]:
        """fp32 reduction of this owner's chunk (main pieces then high pieces, gradient
        coordinates) by a plain exchange; extra traffic on sampled steps, counted as telemetry."""
        comm = self.comm
        me, world = comm.rank, comm.world_size
        chunks, sizes, own = [], [], None
        for dst, owner in enumerate(plan.owners):
            pieces = [Piece(p.bucket_offset, p.numel, p.param_key) for p in owner.main + owner.high]
            raw = self._gather(tensor, pieces, owner.main_numel + owner.high_numel, {})
            if dst == me:
                own = raw
                raw = raw[:0]
            chunks.append(raw.view(torch.uint8))
            sizes.append(raw.numel() * 4)
        my_bytes = own.numel() * 4
        recv = comm.all_to_all_bytes(torch.cat(chunks), sizes,
                                     [0 if src == me else my_bytes for src in range(world)], kind="telemetry")
        if own.numel() == 0:
            return None
        exact = own.clone()
        if world > 1:
            exact += recv.view(torch.float32).view(world - 1, own.numel()).sum(0)
        return exact.div_(divisor)
