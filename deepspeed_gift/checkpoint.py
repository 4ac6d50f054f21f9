"""GIFT's part of a DeepSpeed checkpoint: one ``gift_rank<r>.pt`` per rank beside DeepSpeed's
files in the tag folder, holding the geometry (statistics, factors, selection), error-feedback
residuals and counters of that rank. Loaded as plain data only (``weights_only``)."""

from __future__ import annotations

import json
import logging
import os

import torch

from .config import Hierarchy, first_difference

logger = logging.getLogger("deepspeed_gift")
CHECKPOINT_FORMAT = "deepspeed_gift/1"


def gift_state(state) -> dict:
    """Everything GIFT keeps for an engine (a ``GiftState``), as plain data."""
    return {"format": CHECKPOINT_FORMAT, "world_size": state.comm.world_size, "rank": state.comm.rank,
            "exchange": state.exchange, "fingerprint": state.cfg.fingerprint(),
            "geometry": state.geometry.state_dict(),
            "reducer": state.reducer.state_dict(), "run_totals": dict(state.run_totals)}


def load_gift_state(state, saved: dict) -> None:
    """Load what :func:`gift_state` gave: geometry always; error-feedback residuals only where the
    world size and exchange they were laid out for are this run's."""
    if saved.get("format") != CHECKPOINT_FORMAT:
        raise ValueError(f"gift checkpoint format {saved.get('format')!r} is not {CHECKPOINT_FORMAT!r}")
    if saved["fingerprint"] != state.cfg.fingerprint():
        diff = first_difference(json.loads(saved["fingerprint"]), json.loads(state.cfg.fingerprint()), "gift")
        logger.warning("gift: resuming with %s = %r (the checkpoint was written with %r)", diff[0], diff[2],
                       diff[1])
    state.geometry.load_state_dict(saved["geometry"])
    state.run_totals.clear()
    state.run_totals.update(saved["run_totals"])
    saved_exchange = list(saved.get("exchange", [Hierarchy.FLAT.value]))
    if saved["world_size"] == state.comm.world_size and saved_exchange == state.exchange:
        state.reducer.load_state_dict(saved["reducer"], state.engine.device)
    elif saved["reducer"]["residuals"]:
        # Residuals belong to the old partitioning and exchange; statistics and factors carry over.
        dropped = sum(r.numel() for _, _, r, _ in saved["reducer"]["residuals"])
        logger.warning("gift: world size / hierarchy changed (%d ranks, %s -> %d ranks, %s); dropping %d "
                       "error-feedback residual elements of rank %d (statistics, factors and selection are "
                       "kept)", saved["world_size"], saved_exchange, state.comm.world_size, state.exchange, dropped,
                       saved["rank"])
    else:
        state.reducer.load_state_dict(dict(saved["reducer"], residuals=[]), state.engine.device)


def save_files(state, save_dir: str, tag: str) -> None:
    path = os.path.join(save_dir, str(tag), f"gift_rank{state.comm.rank}.pt")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    torch.save(gift_state(state), path)


def load_files(state, load_dir: str, tag: str) -> None:
    folder = os.path.join(load_dir, str(tag))
    saved = sorted(f for f in os.listdir(folder) if f.startswith("gift_rank") and f.endswith(".pt"))
    if not saved:
        raise ValueError(f"gift: checkpoint {folder} has no gift_rank*.pt files: it was saved without GIFT "
                         "attached; start from it with gift.start_step past its step, or without the gift block")
    mine = f"gift_rank{state.comm.rank}.pt"
    if mine not in saved or len(saved) != state.comm.world_size:
        mine = saved[state.comm.rank % len(saved)]
    path = os.path.join(folder, mine)
    try:
        # GIFT's state is tensors, numbers, strings and containers: nothing in it needs
        # pickle's code execution, so a file that asks for it is refused.
        loaded = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as exc:  # torch raises UnpicklingError or RuntimeError by version
        raise ValueError(f"gift: {path} is not a GIFT checkpoint file that loads as plain data "
                         f"(tensors, numbers, strings, containers): {type(exc).__name__}: "
                         f"{str(exc).splitlines()[0] if str(exc) else ''}") from None
    if not isinstance(loaded, dict):
        raise ValueError(f"gift: {path} holds a {type(loaded).__name__}, not GIFT's state dict")
    load_gift_state(state, loaded)
