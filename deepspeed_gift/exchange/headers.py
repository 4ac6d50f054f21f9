"""The bytes that open every exchanged message, and their checks.

Every message of a bucket's exchange opens with a 16-byte control header: a hash of the
bucket plan (layout, selected layers and whitener versions) and the step. A receiver compares
it, and each payload's codec header, with what it expects on the device, and reads the results
once per step (:class:`HeaderChecks`), so ranks that disagree fail loudly without a host wait
per bucket.
"""

from __future__ import annotations

import json
import struct
from typing import Dict, Sequence, Union

import torch

from ..core.formats import HEADER_BYTES
from .stats import ByteKind

CONTROL_HEADER_BYTES = 16
FINGERPRINT_BYTES = 8  # what each rank shows the others when a new plan is agreed (agree_on_plan)
DISAGREE = "ranks disagree on the bucket layout, the selected layers or the whitener versions"


class HeaderChecks:
    """Header comparisons made on the device and read on the host once, not once per message.

    A message's header is compared with the one the receiver expects by a device op; reading
    the result would make the host wait for the reduction, so the results are kept and read
    together by :meth:`verify` (the reducer calls it at the end of ``reduce`` unless it defers,
    and then its owner calls it before the optimizer takes the step). A mismatch raises there,
    with the message the host-side check would have given."""

    def __init__(self) -> None:
        self._pending: list = []  # (0-dim bool "differs", received header copy, explain(raw bytes) -> message)
        self._cache: Dict[tuple, torch.Tensor] = {}  # the step's part of control headers, per device

    def expect(self, got: torch.Tensor, want: torch.Tensor, explain) -> None:
        """Check later that ``got`` (bytes; 2-D: several messages, a row each, all checked by one
        comparison) opens with ``want``; ``explain(got_bytes)`` (the rows' headers one after the
        other) returns the error message (or raises its own error) when it does not."""
        head = got[..., : want.numel()]
        self._pending.append((head.ne(want).any(), head.clone(), explain))

    def verify(self) -> None:
        pending, self._pending = self._pending, []
        if not pending:
            return
        differs = torch.stack([flag for flag, _, _ in pending]).tolist()  # the one host read
        for bad, (_, head, explain) in zip(differs, pending):
            if bad:
                raise RuntimeError(explain(bytes(head.cpu().reshape(-1).tolist())))

    def control_header(self, plan, step: int, device) -> torch.Tensor:
        """The control header of ``plan`` (its ``hash_on``) at ``step`` on ``device``: what every
        message of the bucket opens with, and what a receiver expects."""
        return control_header(plan.hash_on(device), self.step_bytes(step, device))

    def step_bytes(self, step: int, device) -> torch.Tensor:
        """The step as 8 bytes on ``device``, made once per step and device."""
        key = (step, str(device))
        got = self._cache.get(key)
        if got is None:
            self._cache = {k: v for k, v in self._cache.items() if k[0] == step}
            got = self._cache[key] = int64_bytes_on(step, device)
        return got


def control_header(plan_hash_bytes: torch.Tensor, step_bytes: torch.Tensor) -> torch.Tensor:
    """The 16 bytes that open every message: the plan's hash and the step (both already on
    the message's device)."""
    return torch.cat([plan_hash_bytes, step_bytes])


def int64_bytes_on(value: int, device) -> torch.Tensor:
    """``value`` as 8 little-endian bytes made on ``device`` by a fill: the value travels as a
    kernel argument, never as host memory copied over (a pageable host-to-device copy
    would make the host wait for the reduction stream)."""
    return torch.full((1,), value, dtype=torch.int64, device=device).view(torch.uint8)


Senders = Union[str, Sequence[Union[int, str]]]  # one sender's name, or the ranks (or names) of a batch's rows


def _rows(raw: bytes, sender: Senders, size: int):
    """(sender's name, its header) of every row of ``raw``, the headers of a batch of messages."""
    names = [sender] if isinstance(sender, str) else [r if isinstance(r, str) else f"rank {r}" for r in sender]
    return [(name, raw[i * size:(i + 1) * size]) for i, name in enumerate(names)]


def expect_control_header(checks: HeaderChecks, msg: torch.Tensor, want: torch.Tensor,
                          sender: Senders, meaning: str) -> None:
    """Fail loudly (at ``checks.verify``) when ``msg`` was sent for another plan or step than
    the receiver's (``want``: its own control header). ``msg`` 2-D: the messages of several
    senders (``sender``: their ranks, a row each), one comparison for all."""

    def explain(raw: bytes) -> str:
        want_raw = bytes(want.cpu().tolist())
        want_hash, want_step = struct.unpack("<qq", want_raw)
        rows = _rows(raw, sender, CONTROL_HEADER_BYTES)
        name, got = next(((s, r) for s, r in rows if r != want_raw), rows[0])
        got_hash, got_step = struct.unpack("<qq", got)
        return (f"deepspeed_gift: {name} sent a bucket for plan {got_hash:#x} at step {got_step}, "
                f"this rank expects plan {want_hash:#x} at step {want_step}: {meaning}")

    checks.expect(msg, want, explain)


def expect_codec_header(checks: HeaderChecks, codec, buf: torch.Tensor, numel: int,
                        sender: Senders) -> None:
    """The codec's own header of a payload from ``sender``, checked as the codec would (``buf``
    2-D: one payload a row, from rank ``sender[row]``)."""

    def explain(raw: bytes) -> str:
        rows = _rows(raw, sender, HEADER_BYTES)
        for name, got in rows:
            try:
                codec.check_header_bytes(got, numel)
            except ValueError as exc:
                return f"deepspeed_gift: payload from {name}: {exc}"
        return f"deepspeed_gift: payload from {rows[0][0]} has an unexpected header"

    checks.expect(buf, codec.header_on(numel, buf.device), explain)


def agree_on_plan(comm, fingerprint: int, describe, explain, what: str) -> None:
    """Every rank of ``comm`` shows the others its ``fingerprint`` of a plan just made, before
    the plan's first exchange: ranks that planned differently would size their messages
    differently, and a backend that does not check sizes (NCCL) would hang or mix the bytes
    up before any header could be read. Once per new plan (a bucket's first step, and the
    first after a refresh), never per reduction: one small gather and one host read. On a
    disagreement every rank gathers ``describe()`` (JSON-able) and raises the same error, with
    ``explain(everyone's descriptions)`` naming what differs."""
    if comm.world_size == 1:
        return
    blob = int64_bytes_on(fingerprint, comm.device)
    everyone = torch.cat(comm.all_gather_bytes(blob, kind=ByteKind.CONTROL, same_size=True))
    prints = everyone.view(torch.int64).tolist()  # the one host read
    if len(set(prints)) == 1:
        return
    mine = torch.frombuffer(bytearray(json.dumps(describe()).encode()), dtype=torch.uint8)
    described = [json.loads(bytes(b.cpu().tolist()).decode())
                 for b in comm.all_gather_bytes(mine, kind=ByteKind.CONTROL)]
    raise RuntimeError(f"deepspeed_gift: {DISAGREE} ({what}): they differ in {explain(described)}. Stopped when "
                       "the plan was made, before its exchange (messages of unequal sizes hang a backend that "
                       "does not check them)")
