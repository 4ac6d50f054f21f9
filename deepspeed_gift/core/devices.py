"""Host values onto a device without making the host wait.

A ``.to(device)`` of pageable host memory synchronizes: on a GPU the host waits for
everything queued before the copy (the backward, DeepSpeed's reduction stream) and loses its
run-ahead. Constants the exchange needs on the device go through :func:`host_to_device` once
(and are cached by their owners); per-step values are made on the device by a fill
(``exchange.headers.int64_bytes_on``).
"""

from __future__ import annotations

import torch
from torch import Tensor


def host_to_device(t: Tensor, device) -> Tensor:
    """A host tensor's copy on ``device``: staged in pinned memory and copied asynchronously
    on the current stream. The pinned block comes from the caching host allocator, which does
    not hand it out again before the copy has run, so ``t`` and its staging may be dropped at
    once. On the host itself: ``t``."""
    device = torch.device(device)
    if device.type == "cpu":
        return t
    return t.pin_memory().to(device, non_blocking=True) if _can_pin(device) else t.to(device)


def _can_pin(device: torch.device) -> bool:
    """Pinned memory serves ``device`` (it belongs to the process's current accelerator)."""
    try:
        return torch.accelerator.is_available() and torch.accelerator.current_accelerator().type == device.type
    except (AttributeError, RuntimeError):
        return device.type == "cuda" and torch.cuda.is_available()
