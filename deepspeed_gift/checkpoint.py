"""GIFT's part of a DeepSpeed checkpoint: one ``gift_rank<r>.pt`` per rank (``r`` the global
rank: with pipeline or tensor parallelism every process holds its own layers' state) beside DeepSpeed's
files in the tag folder, holding the geometry (statistics, factors, selection) and counters of
that rank and the index of its error-feedback residuals, whose bytes are in
``gift_rank<r>_residuals.bin``: written one tensor at a time as each is copied off the device
(one section's or relayed chunk's residual: its int8 bytes, or fp32 values where it is saved
moved out of replaced transforms), never one host copy of them all. Loaded as plain data only
(``weights_only``); the residuals' bytes are read back one tensor at a time, those saved in
gradient coordinates at the first step that adds them (``feedback.DeferredResidual``)."""

from __future__ import annotations

import json
import logging
import os

import torch

from .config import Hierarchy, first_difference

logger = logging.getLogger("deepspeed_gift")
CHECKPOINT_FORMAT = "deepspeed_gift/2"
# deepspeed_gift/1 held fp32 residuals inside the .pt; still read (they are then stored at int8)
READABLE_FORMATS = ("deepspeed_gift/1", CHECKPOINT_FORMAT)


class _TensorWriter:
    """A sink for ``ErrorFeedback.state_dict``: appends each tensor's bytes to one file, opened at
    the first, and returns where they are: ``[offset, dtype, numel]``. The bytes go to a
    temporary name, put in place by :meth:`close`: residuals loaded from this very file and not
    yet used are read from it while the new one is written (a save over the tag just loaded)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.file = None
        self.offset = 0

    def __call__(self, tensor: torch.Tensor) -> list:
        if self.file is None:
            self.file = open(self.path + ".tmp", "wb")
        host = tensor.detach().contiguous().cpu()
        raw = host.reshape(-1).view(torch.uint8).numpy()
        self.file.write(memoryview(raw))
        token = [self.offset, str(host.dtype).removeprefix("torch."), host.numel()]
        self.offset += raw.nbytes
        return token

    def close(self, keep: bool = True) -> None:
        if self.file is not None:
            self.file.close()
            if keep:
                os.replace(self.path + ".tmp", self.path)
            else:
                os.remove(self.path + ".tmp")


class _TensorReader:
    """A source for ``ErrorFeedback.load_state_dict``: a token of :class:`_TensorWriter` back
    into a host tensor, read from the file when asked (for some residuals, a step after the load)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, token) -> torch.Tensor:
        offset, dtype, numel = token
        out = torch.empty(int(numel), dtype=getattr(torch, dtype))
        raw = out.view(torch.uint8).numpy()
        try:
            with open(self.path, "rb") as f:
                f.seek(int(offset))
                got = f.readinto(memoryview(raw))
        except OSError as exc:
            raise ValueError(f"gift: cannot read error-feedback residuals from {self.path} (a residual saved in "
                             f"gradient coordinates is read at the first step after resuming, so the checkpoint "
                             f"must stay until then): {exc}") from None
        if got != raw.nbytes:
            raise ValueError(f"gift: {self.path} ends before byte {int(offset) + raw.nbytes} (it has "
                             f"{int(offset) + got}): the residuals file is truncated or from another save")
        return out


def _groups(state) -> int:
    """How many data-parallel groups the job has."""
    import torch.distributed as dist

    return dist.get_world_size() // state.comm.world_size


def _residuals_file(rank: int) -> str:
    return f"gift_rank{rank}_residuals.bin"


def _current_transforms(state):
    """The transform each parameter's gradient goes through now (None: none), by parameter key:
    a residual made in another is saved moved out of it."""
    return lambda param_key: state.mode_of(param_key)[1]


def gift_state(state, sink=None) -> dict:
    """Everything GIFT keeps for an engine (a ``GiftState``), as plain data; each residual tensor
    goes through ``sink`` (default: a host copy, all of them in the dict)."""
    return {"format": CHECKPOINT_FORMAT, "world_size": state.comm.world_size, "rank": state.comm.rank,
            "global_rank": state.global_rank, "dp_ranks": list(state.dp_ranks), "exchange": state.exchange, "fingerprint": state.cfg.fingerprint(),
            "geometry": state.geometry.state_dict(),
            "expert_geometry": {group: g.state_dict() for group, g in state.expert_geometry.items()},
            "reducer": state.reducer.state_dict(current=_current_transforms(state), sink=sink),
            # DeepSpeed-MoE's expert groups: their exchanges' residuals and stochastic rounding
            "expert_reducers": {name: r.state_dict(current=_current_transforms(state), sink=sink)
                                for name, r in state.expert_reducers.items()},
            "run_totals": dict(state.run_totals)}


def _residual_numel(reducer_state: dict) -> int:
    return sum(e["numel"] if isinstance(e, dict) else e[2].numel() for e in reducer_state["residuals"])


def load_gift_state(state, saved: dict, source=None) -> None:
    """Load what :func:`gift_state` gave (``source``: its sink's tokens back into tensors):
    geometry always; error-feedback residuals only where the world size and exchange they were
    laid out for are this run's."""
    if saved.get("format") not in READABLE_FORMATS:
        raise ValueError(f"gift checkpoint format {saved.get('format')!r} is not one of {list(READABLE_FORMATS)}")
    if saved["fingerprint"] != state.cfg.fingerprint():
        diff = first_difference(json.loads(saved["fingerprint"]), json.loads(state.cfg.fingerprint()), "gift")
        logger.warning("gift: resuming with %s = %r (the checkpoint was written with %r)", diff[0], diff[2],
                       diff[1])
    state.geometry.load_state_dict(saved["geometry"])
    experts, geometries = saved.get("expert_reducers", {}), saved.get("expert_geometry", {})
    if sorted(experts) != sorted(state.expert_reducers) or sorted(geometries) != sorted(state.expert_geometry):
        raise ValueError(f"gift checkpoint: saved with expert groups {sorted(experts)} (geometry of "
                         f"{sorted(geometries)}), this model has {sorted(state.expert_reducers)} (geometry of "
                         f"{sorted(state.expert_geometry)})")
    for group, geometry in state.expert_geometry.items():
        geometry.load_state_dict(geometries[group])
    state.run_totals.clear()
    state.run_totals.update(saved["run_totals"])
    saved_exchange = list(saved.get("exchange", [Hierarchy.FLAT.value]))
    same_layout = saved["world_size"] == state.comm.world_size and saved_exchange == state.exchange
    for name, reducer in state.expert_reducers.items():  # an expert group's residuals: on the same layout only
        reducer.load_state_dict(experts[name] if same_layout else dict(experts[name], residuals=[]),
                                state.engine.device, source=source)
    if same_layout:
        state.reducer.load_state_dict(saved["reducer"], state.engine.device, source=source)
        return
    # Residuals belong to the old partitioning and exchange; statistics and factors carry over.
    dropped = _residual_numel(saved["reducer"]) + sum(_residual_numel(e) for e in experts.values())
    if dropped:
        logger.warning("gift: world size / hierarchy / node pieces changed (%d ranks, %s -> %d ranks, %s); "
                       "dropping %d "
                       "error-feedback residual elements of rank %d (statistics, factors and selection are "
                       "kept)", saved["world_size"], saved_exchange, state.comm.world_size, state.exchange, dropped,
                       saved["rank"])
    if not saved["reducer"]["residuals"]:
        state.reducer.load_state_dict(dict(saved["reducer"], residuals=[]), state.engine.device, source=source)


def save_files(state, save_dir: str, tag: str) -> None:
    folder = os.path.join(save_dir, str(tag))
    os.makedirs(folder, exist_ok=True)
    name = _residuals_file(state.global_rank)
    writer = _TensorWriter(os.path.join(folder, name))
    try:
        saved = gift_state(state, sink=writer)
    except BaseException:
        writer.close(keep=False)
        raise
    writer.close()
    if writer.file is not None:
        saved["reducer"]["residuals_file"] = name
    elif os.path.exists(writer.path):  # an earlier save of this tag had residuals; this one has none
        os.remove(writer.path)
    torch.save(saved, os.path.join(folder, f"gift_rank{state.global_rank}.pt"))


def load_files(state, load_dir: str, tag: str) -> None:
    folder = os.path.join(load_dir, str(tag))
    saved = sorted(f for f in os.listdir(folder) if f.startswith("gift_rank") and f.endswith(".pt"))
    if not saved:
        raise ValueError(f"gift: checkpoint {folder} has no gift_rank*.pt files: it was saved without GIFT "
                         "attached; start from it with gift.start_step past its step, or without the gift block")
    mine = f"gift_rank{state.global_rank}.pt"
    if mine not in saved or len(saved) != state.comm.world_size * (1 if state.whole_job else _groups(state)):
        if not state.whole_job:
            raise ValueError(f"gift: checkpoint {folder} has {len(saved)} gift_rank*.pt files, and this run's "
                             f"{_groups(state)} data-parallel groups of {state.comm.world_size} need one per process "
                             f"with its own layers' state; GIFT's state of a pipeline or tensor-parallel run resumes "
                             f"on the same layout only (or start without it: gift.start_step past its step)")
        mine = saved[state.comm.rank % len(saved)]  # another world size: geometry carries over
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
    group = loaded.get("dp_ranks")  # absent before the files were named by the global rank: the whole job
    if (group is not None or not state.whole_job) and group != list(state.dp_ranks) \
            and len(saved) == state.comm.world_size * _groups(state):
        raise ValueError(f"gift: {path} was saved by a process of data-parallel group {group}, and this process "
                         f"(global rank {state.global_rank}) reduces over {list(state.dp_ranks)}: its layers' "
                         "geometry would be another's; resume on the layout that saved it")
    name = loaded.get("reducer", {}).get("residuals_file")
    load_gift_state(state, loaded, _TensorReader(os.path.join(folder, name)) if name else None)
