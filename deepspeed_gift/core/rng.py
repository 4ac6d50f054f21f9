"""Stochastic rounding's random numbers: counter-based, so every path draws the same bits.

A :class:`CounterRng` holds a seed and a count of the encodes it has keyed. Each encode takes
one 64-bit key from (seed, count); element i of that encode then draws ``counter_bits(key, i)``,
an integer hash of (key, i). Nothing depends on the order in which elements are visited, so
the eager chain, a compiled kernel, a CPU and a GPU, any tile size, draw the same bits for the
same element, where a stateful generator (torch's mt19937 on a CPU, Philox on CUDA) hands out
numbers in the order a kernel asks for them.

The hash works on int64 holding 32-bit values: every product is of a value below 2**32 and a
constant below 2**31, so it stays below 2**63 and no signed overflow (undefined in the C++ and
Triton that inductor writes) ever happens. Two rounds of a multiply-xorshift finalizer (odd
constants, xorshifts of 15-16 bits) mixes the counter with the key's first word; an element at offset 2**32 or past it takes a
second round for the counter's high word and the key's second.

Pure tensor math: no ``torch.distributed``.
"""

from __future__ import annotations

from typing import Tuple

import torch
from torch import Tensor

from .devices import host_to_device

__all__ = ["CounterRng", "counter_bits", "splitmix64"]

_M32 = 0xFFFFFFFF
_M64 = (1 << 64) - 1


def splitmix64(x: int) -> int:
    """One output of the SplitMix64 sequence at state ``x`` (Python ints, 64-bit wrapping): the
    key of an encode from its seed and count."""
    z = (x + 0x9E3779B97F4A7C15) & _M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _M64
    return z ^ (z >> 31)


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit finalizer on int64 values in [0, 2**32), in place: constants below 2**31 keep
    every product below 2**63."""
    # in place on ``x`` (a fresh tensor at every call site): the eager chain allocates a third
    # as often; compiled code is the same
    x.bitwise_xor_(x >> 16).mul_(0x7FEB352D).bitwise_and_(_M32)
    x.bitwise_xor_(x >> 15).mul_(0x1B873593).bitwise_and_(_M32)
    return x.bitwise_xor_(x >> 16)


def counter_bits(key: Tensor, offsets: Tensor, wide: bool = False) -> Tensor:
    """32 random bits (int64 in [0, 2**32)) per element offset (int64 >= 0) under ``key`` (an
    int64 tensor of the key's two 32-bit words). Offsets below 2**32 take one round; those at
    or past it a second, for their high word. ``wide``: some offset may be past it (the caller's
    range reaches 2**32); without it the second round is skipped, which changes no element's
    bits. So an element's bits depend on (key, offset) alone, never on the range or the tiling
    that reached it: until the commit after ``ceb486c`` a wide call gave every offset the second
    round, so a tile reaching 2**32 drew, below it, other bits than a tile ending before it (and
    NVFP4's columns, drawn at a stride of 16, other bits than its flat eager draw)."""
    x = _mix32((offsets & _M32) ^ key[0]) if wide else _mix32(offsets ^ key[0])
    if not wide:
        return x
    high = offsets >> 32
    return torch.where(high == 0, x, _mix32(x ^ high ^ key[1]))


def offsets_of(e0: int, n: int, device) -> Tensor:
    """The element offsets e0 .. e0 + n - 1 (int64)."""
    return torch.arange(e0, e0 + n, dtype=torch.int64, device=device)


class CounterRng:
    """The source of stochastic rounding's keys: one per encode, from (seed, encodes so far).

    Same seed, same sequence of encodes -> same bits, on any device and in either kernel mode.
    ``get_state`` / ``set_state`` carry it through a checkpoint."""

    def __init__(self, seed: int = 0) -> None:
        self.manual_seed(seed)

    def manual_seed(self, seed: int) -> "CounterRng":
        if isinstance(seed, bool) or not isinstance(seed, int):
            raise ValueError(f"seed must be an int, got {seed!r}")
        self.seed = seed & _M64
        self.draws = 0
        return self

    def next_key(self) -> Tuple[int, int]:
        """The next encode's key as two 32-bit words."""
        k = splitmix64((self.seed + splitmix64(self.draws)) & _M64)
        self.draws += 1
        return k & _M32, k >> 32

    def key_on(self, device) -> Tensor:
        """The next encode's key as an int64 tensor on ``device`` (one small asynchronous copy)."""
        return host_to_device(torch.tensor(self.next_key(), dtype=torch.int64), device)

    def get_state(self) -> Tensor:
        # int64 words: the seed's two halves and the count
        return torch.tensor([self.seed & _M32, self.seed >> 32, self.draws], dtype=torch.int64)

    def set_state(self, state: Tensor) -> None:
        if not isinstance(state, Tensor) or state.dtype != torch.int64 or tuple(state.shape) != (3,):
            raise ValueError("stochastic rounding state must be CounterRng.get_state()'s int64 tensor of 3 words, "
                             f"got {type(state).__name__} {getattr(state, 'dtype', '')} "
                             f"{tuple(getattr(state, 'shape', ()))} (a checkpoint from before counter-based "
                             "rounding holds a torch generator's state: resume it with the version that wrote it)")
        lo, hi, draws = (int(v) for v in state.tolist())
        self.seed = lo | (hi << 32)
        self.draws = draws

    def __repr__(self) -> str:
        return f"CounterRng(seed={self.seed}, draws={self.draws})"
