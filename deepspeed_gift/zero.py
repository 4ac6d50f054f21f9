"""Attaches GIFT to DeepSpeed's ZeRO stage 1/2 optimizer. The only module that touches
DeepSpeed internals.

DeepSpeed 0.19 reduces ZeRO-1/2 gradients bucket by bucket in
``DeepSpeedZeroOptimizer.average_tensor(tensor, communication_data_type)``: stage 2 during
backward, stage 1 at the gradient-accumulation boundary. Each element of the flat bucket
belongs to one owner partition (``param_to_partition_ids``, ``grad_start_offset``), and
after the call the owner's slices of ``tensor`` must hold the averaged gradient (plus, with
fp32 gradient accumulation of a bf16 model, the same added into the compact fp32
partition buffer). GIFT replaces that method on the optimizer instance; everything
around it (accumulation, overflow check, clipping, the step) stays DeepSpeed's.

DeepSpeed's BF16_Optimizer (bf16 + stage 1 + fp32 gradient accumulation) has no buckets: the
engine all-reduces its flat fp32 gradients after the backward (``buffered_allreduce_fallback``).
GIFT replaces that call on the engine with its balanced rounds, seen through ``Bf16Layout`` (the
optimizer as the ZeRO-1 layout GIFT reads), and the norm's gradients with their partitions.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import time
from typing import Dict, List, NamedTuple, Optional

import torch

from .core import formats
from .core.formats import Rounding
from .exchange.comm import detect_ranks_per_node, make_comm, split_by_node
from . import checkpoint
from .config import (NODE_PIECES_BY_BUCKET, NODE_PIECES_CARRIED, PASSTHROUGH_FORMATS, GiftConfig, Hierarchy,
                     first_difference, get_gift_config)
from .core.geometry import row_col_sums
from .core.rng import CounterRng
from .lifecycle import GeometryManager, find_candidates, geometry_kinds
from .core import metrics
from .exchange.param_gather import ReplicaGather
from .exchange.encode import copy_codec_for
from .exchange.plan import COPY, GEO, HIGH, MAIN, ParamSlice
from .exchange.reducer import GiftReducer
from .exchange.rounds import OwnedParam, plan_rounds
from .exchange.two_level import TwoLevelReducer
from .exchange.stats import ByteKind, StepStats
from .telemetry import TelemetryLog, step_record

logger = logging.getLogger("deepspeed_gift")


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


def _check_engine(engine, cfg: GiftConfig):
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    stage = engine.zero_optimization_stage()
    _require(stage in (1, 2, 3), f"gift.enabled: GIFT replaces ZeRO's gradient reduce-scatter; "
             f"zero_optimization.stage is {stage}. Use stage 1, 2 or 3, or set gift.enabled to false")
    opt = engine.optimizer
    _require(opt is not None and type(opt).__name__ != "DeepSpeedZeRoOffload",
             f"gift.enabled: this engine has no optimizer (DeepSpeed built {type(opt).__name__}), so no gradient "
             "reduction for GIFT to replace; pass an optimizer or an \"optimizer\" block, or set gift.enabled to false")
    if stage == 3:
        return _check_stage3(engine, opt, cfg)
    if type(opt).__name__ == "BF16_Optimizer":
        return _check_bf16_optimizer(engine, opt, cfg)
    if not isinstance(opt, DeepSpeedZeroOptimizer):
        raise ValueError(f"gift.enabled: needs DeepSpeed's ZeRO stage 1/2 optimizer, got {type(opt).__name__}")
    _probe_internals(opt)
    muon = _muon_optimizer_class()
    # a Muon matrix that ZeRO's partitions cut travels whole to each owner of a slice, and the
    # owners' copies must have the same bits; a quantized node stage rounds another rank's part
    # in each slot's own payload (on that slot's block boundaries) and adds the slot's own part
    # exact, so the copies would differ
    _require(cfg.node_format is None or muon is None or not isinstance(opt.optimizer, muon),
             f"gift.node_format: got {cfg.node_format!r} with DeepSpeed's Muon, whose matrices cut by the "
             "partitions every owner of a slice receives whole, in copies that must agree bit for bit; a quantized "
             "node stage rounds each copy differently (allowed with Muon: null, the bucket's dtype)")
    if getattr(opt, "has_moe_layers", False):
        _check_moe(opt, cfg)
    _require(not getattr(opt, "zenflow", False), "gift.enabled: ZenFlow is not supported")
    if not opt.partition_gradients and opt.overlap_comm and cfg.stage1_rounds:
        # ZeRO-1 with overlap_comm reduces during the boundary micro-batch's backward, bucket by
        # bucket as gradients arrive: the rounds need every gradient first.
        _require("stage1_rounds" not in cfg.model_fields_set,
                 "gift.stage1_rounds: got true, but zero_optimization.overlap_comm is true: ZeRO-1 then reduces "
                 "during the backward, bucket by bucket, and the balanced rounds need every gradient of the step "
                 "first (allowed: overlap_comm false for the rounds, or stage1_rounds false for DeepSpeed's buckets)")
        logger.info("gift: ZeRO-1 with overlap_comm reduces DeepSpeed's buckets as the backward fills them "
                    "(gift.route decides funnel or relay); with overlap_comm false it reduces in balanced rounds "
                    "after the backward (gift.stage1_rounds), each element quantized once")
    return opt


# What GIFT reads of DeepSpeed's ZeRO stage 1/2 optimizer (present in 0.19.x). A DeepSpeed
# without one of them fails at attach with its version named, not at the first bucket.
ZERO_INTERNALS = (
    "average_tensor", "ipg_buckets", "bit16_groups", "param_to_partition_ids", "grad_start_offset",
    "grad_partition_insertion_offset", "partition_size", "params_in_partition", "single_partition_of_fp32_groups",
    "_get_compact_grad_partition_slice", "gradient_average", "sequence_parallel_size", "overlap_comm",
    "contiguous_gradients", "cpu_offload", "dp_process_group", "get_param_id", "optimizer",
    # the ZeRO-1 rounds (gift.stage1_rounds)
    "reduce_gradients", "partition_gradients", "get_gradient_for_reduction", "get_param_comm_dtype",
    "reduce_bucket_size",
    # contiguous_gradients false: DeepSpeed's reduction of gradients that do not share a buffer
    "buffered_reduce_fallback", "_clear_previous_reduced_grads",
    # two-level's pipeline carried from bucket to bucket (overlap_comm)
    "reduce_independent_p_g_buckets_and_remove_grads", "reduce_ipg_grads", "copy_grads_in_partition",
)


def _check_moe(opt, cfg: GiftConfig) -> None:
    """DeepSpeed-MoE under ZeRO stage 1/2: what GIFT serves of it. Expert parameters are reduced
    over their expert-data-parallel groups (``expert_dp_process_group``), each by an exchange of
    its own; what that exchange does not carry yet is refused here, naming the key."""
    _require(isinstance(getattr(opt, "expert_dp_process_group", None), dict) and opt.expert_dp_process_group,
             "gift.enabled: this DeepSpeed's ZeRO optimizer has MoE layers but no expert_dp_process_group, which "
             "GIFT reads (built and tested against DeepSpeed 0.19.8)")
    _require(cfg.params is None,
             "gift.params: the compressed parameter all-gather serves one data-parallel group, and DeepSpeed-MoE "
             "gathers expert partitions over expert-data-parallel groups; remove gift.params for this model")
    _require(cfg.backend == "torch",
             f"gift.backend: got {cfg.backend!r} with DeepSpeed-MoE; the expert groups' exchanges run over "
             "DeepSpeed's process groups (allowed with MoE: 'torch')")


def _split_experts(modules: Dict[str, torch.nn.Module]) -> tuple:
    """The candidate layers as (dense, {expert group: its experts' layers}): DeepSpeed-MoE's expert
    modules have one name on every rank of the data-parallel group but hold another expert on each
    expert-parallel rank, so their statistics are shared over their expert-data-parallel group
    (whose ranks hold the same experts), not over the data-parallel group."""
    from deepspeed.moe.utils import is_moe_param

    dense: Dict[str, torch.nn.Module] = {}
    experts: Dict[str, Dict[str, torch.nn.Module]] = {}
    for name, module in modules.items():
        if is_moe_param(module.weight):
            experts.setdefault(module.weight.group_name, {})[name] = module
        else:
            dense[name] = module
    return dense, experts


class _AllGeometry:
    """The dense and the expert groups' geometries as one, for telemetry's record of a step: the
    refresh count (the dense geometry's: an expert group whose layers stay Euclidean may space its
    judgements out, selection.idle_backoff), the kinds, and every layer's transform."""

    def __init__(self, managers) -> None:
        self.version = managers[0].version
        self.kinds = managers[0].kinds
        self.active = {name: kind for m in managers for name, kind in m.active.items()}
        self.whiteners = {name: w for m in managers for name, w in m.whiteners.items()}


def _probe_internals(opt) -> None:
    import deepspeed

    missing = [name for name in ZERO_INTERNALS if not hasattr(opt, name)]
    if opt.__dict__.get("overlap_comm") and not hasattr(opt, "reduction_stream"):
        missing.append("reduction_stream")
    if missing:
        raise ValueError(f"gift.enabled: DeepSpeed {deepspeed.__version__}'s {type(opt).__name__} has no "
                         f"{', '.join(missing)}, which GIFT reads (built and tested against DeepSpeed 0.19.8); "
                         "install a DeepSpeed in the range setup.py names, or set gift.enabled to false")


# What ``gift.params`` also reads: the replicas' partitions and DeepSpeed's all-gather of them.
PARAMS_INTERNALS = ("parallel_partitioned_bit16_groups", "bit16_groups_flat", "real_dp_process_group", "step")


def _probe_params_internals(opt) -> None:
    import deepspeed
    from deepspeed.runtime.zero import stage_1_and_2

    missing = [name for name in PARAMS_INTERNALS if not hasattr(opt, name)]
    if not callable(getattr(stage_1_and_2, "all_gather_dp_groups", None)):
        missing.append("stage_1_and_2.all_gather_dp_groups")
    if missing:
        raise ValueError(f"gift.params: DeepSpeed {deepspeed.__version__}'s {type(opt).__name__} has no "
                         f"{', '.join(missing)}, which the compressed parameter all-gather reads (built and tested "
                         "against DeepSpeed 0.19.8); remove gift.params or install a DeepSpeed in setup.py's range")


# What GIFT reads of DeepSpeed's BF16_Optimizer (bf16 + ZeRO stage 1 + fp32 gradient
# accumulation) and of the engine that reduces its gradients.
BF16_INTERNALS = ("bf16_groups", "bf16_groups_flat", "fp32_groups_gradients", "fp32_groups_gradients_flat",
                  "fp32_groups_flat_partition", "dp_process_group", "optimizer", "get_grads_for_norm",
                  "has_moe_layers", "mpu")
BF16_ENGINE_INTERNALS = ("buffered_allreduce_fallback", "communication_data_type", "gradient_average",
                         "gradient_predivide_factor", "postscale_gradients", "zero_reduce_bucket_size")


def _check_bf16_optimizer(engine, opt, cfg: GiftConfig) -> "Bf16Layout":
    """DeepSpeed's BF16_Optimizer (bf16 parameters, fp32 gradients accumulated in flat buffers, the
    fp32 master partitioned as ZeRO-1's): what GIFT serves of it, as a :class:`Bf16Layout`."""
    import deepspeed

    missing = [name for name in BF16_INTERNALS if not hasattr(opt, name)]
    missing += [f"engine.{name}" for name in BF16_ENGINE_INTERNALS if not hasattr(engine, name)]
    if missing:
        raise ValueError(f"gift.enabled: DeepSpeed {deepspeed.__version__}'s BF16_Optimizer has no "
                         f"{', '.join(missing)}, which GIFT reads (built and tested against DeepSpeed 0.19.8); "
                         "install a DeepSpeed in the range setup.py names, or set gift.enabled to false")
    _require(not opt.has_moe_layers,
             "gift.enabled: DeepSpeed-MoE under BF16_Optimizer is not served by GIFT (its expert gradients are "
             "all-reduced apart from the dense ones' flat buffers); GIFT serves MoE with DeepSpeed's ZeRO stage 1/2 "
             "optimizer: set data_types.grad_accum_dtype to \"bf16\", or gift.enabled to false")
    _require(not getattr(opt, "_uses_muon", False),
             "gift.enabled: DeepSpeed's BF16_Optimizer with Muon moves whole matrices between the partitions after "
             "the reduction, which GIFT does not model; with Muon, set data_types.grad_accum_dtype to \"bf16\" "
             "(DeepSpeed's ZeRO stage 1/2 optimizer then serves it, and GIFT with it) or gift.enabled to false")
    _require(cfg.params is None,
             "gift.params: the compressed parameter all-gather serves DeepSpeed's ZeRO stage 1/2 optimizer; "
             "BF16_Optimizer (bf16 + ZeRO stage 1 + data_types.grad_accum_dtype \"fp32\") gathers its bf16 "
             "partitions its own way; remove gift.params, or set data_types.grad_accum_dtype to \"bf16\"")
    _require(cfg.stage1_rounds,
             "gift.stage1_rounds: got false, but DeepSpeed's BF16_Optimizer reduces every gradient of the step "
             "after the backward, which GIFT does in balanced rounds (allowed with BF16_Optimizer: true)")
    _require(engine.gradient_predivide_factor() == 1.0 and engine.postscale_gradients(),
             f"gift.enabled: gradient_predivide_factor {engine.gradient_predivide_factor()} / prescale_gradients "
             f"{not engine.postscale_gradients()}: GIFT sums in fp32 and divides once, as ZeRO's reduce-scatter "
             "does (allowed: gradient_predivide_factor 1.0 and prescale_gradients false)")
    return Bf16Layout(engine, opt)


# ZeRO stage 3 reduces a bucket in pieces of whole parameters of at most this many tiles
# (gift.tile_elements each): the encoded sections and what arrives of one piece are held at once.
STAGE3_PIECE_TILES = 4

# What GIFT reads of DeepSpeed's ZeRO stage 3 optimizer: the per-bucket average and scatter it
# replaces, what that method reads itself, and where each parameter's slice of the optimizer state
# lies (Adam's geometry and metric).
STAGE3_INTERNALS = ("_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads",
                    "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads", "ipg_buckets",
                    "dp_process_group", "fp16_groups",
                    "reduce_scatter", "all2all_process_group", "postscale_gradients", "gradient_predivide_factor",
                    "gradient_accumulation_dtype", "dtype", "_get_param_partition_group",
                    "_gradient_averaging_world_size", "optimizer", "grad_position", "get_param_id",
                    "sub_group_to_group_id", "fp32_partitioned_groups_flat")


def _check_stage3(engine, opt, cfg: GiftConfig) -> "Stage3Layout":
    """DeepSpeed's ZeRO stage 3 optimizer: what GIFT serves of it, as a :class:`Stage3Layout`."""
    import deepspeed

    missing = [name for name in STAGE3_INTERNALS if not hasattr(opt, name)]
    if missing:
        raise ValueError(f"gift.enabled: DeepSpeed {deepspeed.__version__}'s {type(opt).__name__} has no "
                         f"{', '.join(missing)}, which GIFT reads under ZeRO stage 3 (built and tested against "
                         "DeepSpeed 0.19.8); install a DeepSpeed in the range setup.py names, or set gift.enabled "
                         "to false")
    _require(opt.reduce_scatter or getattr(opt, "sequence_parallel_size", 1) == 1,
             "gift.enabled: zero_optimization.reduce_scatter is false under ZeRO stage 3 with sequence parallelism: "
             "DeepSpeed's all-reduce path then divides by the averaging world over the sequence-parallel size, which "
             "GIFT does not model (allowed with GIFT: reduce_scatter true)")
    _require(opt.all2all_process_group is None,
             "gift.enabled: zero_optimization.zero_quantized_gradients is true: ZeRO++'s quantized gradients and "
             "GIFT both replace ZeRO-3's gradient reduce-scatter; set zero_quantized_gradients to false")
    _require(not getattr(opt, "has_moe_layers", False) and not getattr(opt, "zenflow", False),
             "gift.enabled: MoE and ZenFlow under ZeRO stage 3 are not served by GIFT (allowed: stage 1 or 2 for "
             "MoE); set gift.enabled to false for this model")
    _require(opt.gradient_predivide_factor == 1.0 and opt.postscale_gradients,
             "gift.enabled: gradient_predivide_factor other than 1.0 / prescale_gradients under ZeRO stage 3: GIFT "
             "sums in fp32 and divides once (allowed: gradient_predivide_factor 1.0, prescale_gradients false)")
    _require(cfg.params is None,
             "gift.params: under ZeRO stage 3 DeepSpeed gathers each layer's parameters itself, around its "
             "forward and backward; remove gift.params (ZeRO++'s zero_quantized_weights serves that gather)")
    _require(type(opt.optimizer).__name__ != "MuonWithAuxAdam",
             "gift.enabled: DeepSpeed's Muon under ZeRO stage 3 orthogonalizes full gradients inside its "
             "reduction, which GIFT does not model; use stage 1 or 2 with Muon")
    _check_stage3_offload(engine, reads_optimizer_state=bool(geometry_kinds(cfg.geometry.kind)))
    if cfg.error_feedback:
        logger.warning("gift: error feedback under ZeRO stage 3 keeps an int8 residual of what this rank sends, "
                       "(W-1)/W of every parameter (about 1 B a parameter on every rank, against stage 3's own "
                       "~18 B / W): benchmarks/memory_model.py prints it per model and world size")
    return Stage3Layout(opt)


def _offload_device(offload) -> str:
    """The ``device`` of a ZeRO offload config (``none`` when the block is absent)."""
    device = getattr(offload, "device", None)
    return str(getattr(device, "value", device) or "none")


def _check_stage3_offload(engine, reads_optimizer_state: bool = True) -> None:
    """Stage 3's offload to the host serves GIFT unchanged: the gradient chunks GIFT returns go
    where DeepSpeed's own reduce-scatter's would (its host partition and pinned buffers), and the
    parameters' partitions live on the host between their gathers. What keeps optimizer state
    where GIFT does not read it is refused: NVMe (swapped out between steps), SuperOffload (an
    optimizer of its own) and, where GIFT reads Adam's state (``reads_optimizer_state``: any
    geometry but identity judges layers or scales by it), a partial offload (part of the state in a
    second optimizer on the device); a Euclidean block reads none, and reduces as with a whole offload."""
    optimizer, param = engine.zero_offload_optimizer(), engine.zero_offload_param()
    for key, offload in (("offload_optimizer", optimizer), ("offload_param", param)):
        device = _offload_device(offload)
        _require(device in ("none", "cpu"),
                 f"zero_optimization.{key}.device: {device!r} under ZeRO stage 3 with GIFT: the state swapped to "
                 "NVMe is not where GIFT reads Adam's moments and not tested with it (allowed: 'cpu' or 'none')")
    if _offload_device(optimizer) == "cpu":
        ratio = float(getattr(optimizer, "ratio", 1.0))
        _require(ratio == 1.0 or not reads_optimizer_state,
                 f"zero_optimization.offload_optimizer.ratio: {ratio} under ZeRO stage 3 with GIFT's geometry: a "
                 "partial offload keeps part of Adam's state in a second optimizer GIFT does not read (allowed: 1.0, "
                 "or any ratio with gift.geometry.kind 'identity')")
        _require(not getattr(optimizer, "super_offload", False),
                 "zero_optimization.offload_optimizer.super_offload: true under ZeRO stage 3 with GIFT: SuperOffload's "
                 "optimizer is not served by GIFT (allowed: false)")


class Stage3Layout:
    """DeepSpeed's ZeRO stage 3 optimizer seen as what GIFT reads: its data-parallel group, the
    parameters by their place in its groups, no buckets of ZeRO-1/2's kind. Stage 3 partitions every
    parameter: rank r owns elements [r c, (r + 1) c) of each, c = ceil(numel / W), so a bucket's
    reduce-scatter sends every owner 1/W of every parameter (``reduce_scatter_coalesced``'s layout)."""

    overlap_comm = False
    partition_gradients = True
    cpu_offload = False
    ipg_buckets: dict = {}

    def __init__(self, opt) -> None:
        self.z3 = opt
        self.optimizer = opt.optimizer
        self.dp_process_group = opt.dp_process_group
        # A parameter's key is its place in the optimizer's groups, not its ds_id: DeepSpeed counts
        # ds_ids over every engine of the process, so a resumed run that builds one engine fewer
        # before this one would key its checkpoint's residuals and factors by other numbers.
        self.param_id = {id(p): i for i, p in enumerate(p for group in opt.fp16_groups for p in group)}

    def get_param_id(self, param) -> int:
        return self.param_id[id(param)]


def _trained_by(opt, param) -> bool:
    """Whether ``param`` is in the optimizer's groups (DeepSpeed's ``get_param_id`` knows it)."""
    try:
        opt.get_param_id(param)
    except KeyError:
        return False
    return True


class _HeldState(NamedTuple):
    """What a rank holds of one layer's optimizer state: the rule of ``metrics.UPDATE_RULES``
    that serves its param group, the weight and its group, the first element covered in the
    flattened weight, how many, their offset in the fp32 partition, the partition's state, and
    the weight's full shape."""
    rule: object
    weight: torch.nn.Parameter
    group: dict
    start: int
    numel: int
    dest: int
    state: dict
    shape: tuple


class _OptimizerStateView:
    """The optimizer's metric read from what a rank holds (``_held``, per ZeRO stage): one
    reading serves ZeRO-1/2's partitions and stage 3's slices alike."""

    def _held(self, name: str) -> Optional[_HeldState]:
        raise NotImplementedError

    def update_rule(self, name: str):
        """The update rule of the optimizer for layer ``name``, with a copy of its real state on
        this rank (called during the reduction: the state before the step being run, which the
        step then overwrites): Muon's momentum of the whole matrix, which every owner of a slice
        holds; Adam's moments of this rank's slice. None: an optimizer whose update GIFT does not
        model (its errors are then judged in plain L2)."""
        held = self._held(name)
        if held is None:
            return None
        return held.rule.from_state(_narrow_state(held.state, held.rule.state_keys, held.dest, held.numel),
                                    held.group, shape=held.shape, start=held.start, numel=held.numel,
                                    device=held.weight.device)

    def second_moment_sums(self, name: str):
        """This rank's part of the row and column sums of Adam's ``exp_avg_sq`` of layer ``name``
        and how many elements it covers (``adam_factored``); None without such state here."""
        held = self._held(name)
        if held is None or held.rule is not metrics.AdamRule or "exp_avg_sq" not in held.state:
            return None
        rows, cols = row_col_sums(held.state["exp_avg_sq"].narrow(0, held.dest, held.numel), held.start, held.shape)
        return rows, cols, held.numel


class Stage3OptimizerState(_OptimizerStateView):
    """GIFT's view of the optimizer under ZeRO stage 3. Every rank holds 1/W of every layer:
    rank r the flat elements [r c, min((r + 1) c, numel)) of each weight (c its
    ``partition_numel``), at DeepSpeed's ``grad_position`` offset in its sub-group's fp32
    partition, whose optimizer state is keyed by that partition. So each rank has Adam's moments
    of its slice of every layer (the optimizer's metric, the row and column sums of the second
    moment for ``adam_factored``); the layers whose gradients a rank captures for the profile are
    dealt round the ranks (every rank holds the bucket's full gradients when it reduces); no
    parameter goes whole to several ranks."""

    def __init__(self, layout: Stage3Layout, modules: Dict[str, torch.nn.Module], rank: int, world: int) -> None:
        self.z3 = layout.z3
        self.modules = modules
        self.rank = rank
        self.capture_rank = {name: i % world for i, name in enumerate(sorted(modules))}

    def _held(self, name: str) -> Optional[_HeldState]:
        """This rank's slice of layer ``name`` (as ``ZeroOptimizerState._held``); None when no
        rule serves it, Muon's (a whole matrix) does, or this rank's slice is empty (a parameter
        shorter than W chunks)."""
        module = self.modules.get(name)
        if module is None:
            return None
        weight, z3 = module.weight, self.z3
        where = z3.grad_position.get(z3.get_param_id(weight))
        if where is None:
            return None
        sub_group, dest, chunk = (int(v) for v in where)
        start = self.rank * chunk
        numel = min(int(weight.ds_numel) - start, chunk)
        group = z3.optimizer.param_groups[z3.sub_group_to_group_id[sub_group]]
        rule = metrics.rule_serving(group, weight)
        if numel <= 0 or rule is None or rule.whole_matrix:
            return None
        state = z3.optimizer.state.get(z3.fp32_partitioned_groups_flat[sub_group], {})
        return _HeldState(rule, weight, group, start, numel, dest, state, tuple(weight.ds_shape))

    @staticmethod
    def copy_ranks(param, runs) -> tuple:
        return ()


class Bf16Layout:
    """DeepSpeed's BF16_Optimizer seen as the ZeRO stage 1 optimizer GIFT reads: its flat groups
    cut into W equal contiguous partitions (rank r owns the r-th, as ZeRO-1's), each parameter's
    runs in them, its fp32 gradients (flat buffers, views per parameter) where ZeRO keeps bit16
    ones, and its fp32 master partition where ZeRO keeps ``single_partition_of_fp32_groups``.
    BF16_Optimizer all-reduces the whole gradient after the backward (``buffered_allreduce_fallback``
    of the engine); GIFT reduces it in balanced rounds instead, each owner's part in the bucket's
    communication dtype as DeepSpeed's all-reduce does, then copied back into the fp32 buffer."""

    overlap_comm = False
    partition_gradients = False
    cpu_offload = False
    contiguous_gradients = True

    def __init__(self, engine, opt) -> None:
        import torch.distributed as dist

        self.bf16 = opt
        self.engine = engine
        self.optimizer = opt.optimizer
        self.dp_process_group = opt.dp_process_group
        self.bit16_groups = opt.bf16_groups
        self.bit16_groups_flat = opt.bf16_groups_flat
        self.single_partition_of_fp32_groups = opt.fp32_groups_flat_partition
        self.gradient_average = engine.gradient_average
        self.sequence_parallel_size = getattr(engine, "sequence_parallel_size", 1)
        self.reduce_bucket_size = int(engine.zero_reduce_bucket_size())
        self.ipg_buckets: dict = {}  # no buckets: the rounds stage in a buffer of their own
        world = dist.get_world_size(group=opt.dp_process_group)
        self.param_id: Dict[int, int] = {}
        self._where: Dict[int, tuple] = {}  # param id -> (group, index in group)
        self.partition_size, self.grad_start_offset, self.grad_partition_insertion_offset = [], [], []
        self.param_to_partition_ids = []
        for g, params in enumerate(opt.bf16_groups):
            size = opt.bf16_groups_flat[g].numel() // world
            starts = [{} for _ in range(world)]
            inserts = [{} for _ in range(world)]
            owners: Dict[int, list] = {}
            offset = 0
            for j, param in enumerate(params):
                pid = self.param_id.setdefault(id(param), len(self.param_id))
                self._where[pid] = (g, j)
                first, last = offset // size, (offset + max(param.numel(), 1) - 1) // size
                owners[pid] = list(range(first, min(last, world - 1) + 1)) if param.numel() else []
                for part in owners[pid]:
                    start = max(offset, part * size)
                    starts[part][pid] = start - offset
                    inserts[part][pid] = start - part * size
                offset += param.numel()
            self.partition_size.append(size)
            self.grad_start_offset.append(starts)
            self.grad_partition_insertion_offset.append(inserts)
            self.param_to_partition_ids.append(owners)

    def get_param_id(self, param) -> int:
        return self.param_id[id(param)]

    def get_gradient_for_reduction(self, param):
        """The parameter's fp32 gradient: always (a parameter without one this step has zeros
        there, which DeepSpeed's all-reduce of the whole buffer reduces too)."""
        g, j = self._where[self.param_id[id(param)]]
        return self.bf16.fp32_groups_gradients[g][j]

    def get_param_comm_dtype(self, param) -> torch.dtype:
        return self.engine.communication_data_type

    def _get_compact_grad_partition_slice(self, *args):
        return None  # the fp32 gradient buffer is the partition's gradient: the rounds write it

    def owned_parts(self, tensors) -> List[torch.Tensor]:
        """This rank's parts of ``tensors`` (BF16_Optimizer's per-parameter fp32 gradients):
        where its partition of each flat group covers them."""
        import torch.distributed as dist

        me = dist.get_rank(group=self.dp_process_group)
        index = {id(t): (g, j) for g, grads in enumerate(self.bf16.fp32_groups_gradients)
                 for j, t in enumerate(grads)}
        out = []
        for t in tensors:
            g, j = index[id(t)]
            pid = self.param_id[id(self.bit16_groups[g][j])]
            if pid in self.grad_start_offset[g][me]:
                start = self.grad_start_offset[g][me][pid]
                room = self.partition_size[g] - self.grad_partition_insertion_offset[g][me][pid]
                out.append(t.view(-1).narrow(0, start, min(t.numel() - start, room)))
        return out


def _allgather_bucket_size(engine) -> int:
    """DeepSpeed's ``allgather_bucket_size`` (validated by its zero config): the elements one
    all-gather of the compressed parameters may deliver, as in DeepSpeed's own."""
    size = int(engine._config.zero_config.allgather_bucket_size)
    _require(size > 0, f"gift.params: zero_optimization.allgather_bucket_size is {size}, and the compressed "
             "parameter all-gather moves at most that many elements per all-gather, as DeepSpeed's own does "
             "(allowed: a positive number of elements; DeepSpeed's default is 5e8)")
    return size


def _params_codec(cfg: GiftConfig, replica_dtype: torch.dtype):
    """The codec of the replicas' deltas; None when ``gift.params.format`` is the replicas' own
    dtype (then DeepSpeed's exact all-gather runs)."""
    p = cfg.params
    if p.format in PASSTHROUGH_FORMATS:
        dtype = formats.format_class(p.format).data_dtype  # a passthrough codec's elements
        if dtype == replica_dtype:
            return None
        _require(dtype.itemsize < replica_dtype.itemsize,
                 f"gift.params.format: got {p.format!r}, but the parameter replicas are {replica_dtype}: that sends "
                 f"{dtype.itemsize} B per element where DeepSpeed's own all-gather sends {replica_dtype.itemsize} for "
                 f"the exact replica (allowed: the replicas' own dtype, a format of fewer bytes, or a quantized "
                 f"format)")
        return formats.get_format(p.format, kernels=cfg.kernels)
    return formats.get_format(p.format, block_size=p.effective_block_size, kernels=cfg.kernels)


def _main_codec(cfg: GiftConfig):
    if cfg.format in PASSTHROUGH_FORMATS:  # no blocks or scales; bf16 may still round stochastically
        return formats.get_format(cfg.format, rounding=cfg.rounding, seed=cfg.seed, kernels=cfg.kernels)
    return formats.get_format(cfg.format, block_size=cfg.effective_block_size, scale=cfg.scale,
                              rounding=cfg.rounding, seed=cfg.seed, kernels=cfg.kernels)


def _job_coordinates(group):
    """(this process's global rank, the global ranks of its data-parallel group in group order,
    whether that group is the whole job)."""
    import torch.distributed as dist

    ranks = list(dist.get_process_group_ranks(group)) if group is not None else list(range(dist.get_world_size()))
    return dist.get_rank(), ranks, len(ranks) == dist.get_world_size()


def _gather_over_job(obj) -> list:
    """``obj`` of every process of the job, in global rank order (a collective of all of them)."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def _relay_codec(cfg: GiftConfig):
    """The codec of the relay's second hop (``gift.relay_format``); None when it is the main one."""
    options = cfg.relay_codec_options()
    name = options.pop("name")
    if name == cfg.format and options.get("block_size", cfg.effective_block_size) == cfg.effective_block_size:
        return None
    return formats.get_format(name, **options)


def _node_codec(cfg: GiftConfig):
    """The codec of two-level's node stage (``gift.node_format``); None: the bucket's dtype."""
    options = cfg.node_codec_options()
    if options is None:
        return None
    return formats.get_format(options.pop("name"), tile_elements=cfg.tile_elements, **options)


def _tensor_parallel_size(mpu) -> int:
    """Tensor-parallel ranks of an mpu (Megatron's, DeepSpeed's pipeline grid, AutoTP's groups)."""
    for name in ("get_tensor_model_parallel_world_size", "get_model_parallel_world_size"):
        get = getattr(mpu, name, None) if mpu is not None else None
        if get is not None:
            try:
                return int(get() or 1)
            except (TypeError, AttributeError, RuntimeError, AssertionError):
                continue
    return 1


def _tensor_parallel_group(mpu):
    for name in ("get_tensor_model_parallel_group", "get_slice_parallel_group", "get_model_parallel_group"):
        get = getattr(mpu, name, None)
        if get is not None:
            return get()
    return None


def params_with_copies(engine) -> Dict[int, tuple]:
    """The parameters whose copies live outside this data-parallel group, ``id(param)`` ->
    (where, the process group of its copies, the parameter): replicated on the tensor-parallel
    peers (every parameter DeepSpeed's ``is_model_parallel_parameter`` does not mark, where the
    mpu has more than one tensor-parallel rank: layernorms, row-parallel biases) and tied across
    pipeline stages (``PipelineModule``'s tied weights). Each copy is reduced by its own
    data-parallel group; they travel as ``COPY`` so that all get the same bits."""
    from deepspeed.runtime.utils import is_model_parallel_parameter

    out: Dict[int, tuple] = {}
    module, mpu = engine.module, getattr(engine, "mpu", None)
    if _tensor_parallel_size(mpu) > 1:
        group = _tensor_parallel_group(mpu)
        for p in module.parameters():
            if p.requires_grad and not is_model_parallel_parameter(p):
                out[id(p)] = ("tensor-parallel replica", group, p)
    tied = getattr(module, "get_tied_weights_and_groups", None)
    for weight, group in (tied() if tied is not None else []):
        out[id(weight)] = ("tied across pipeline stages", group, weight)
    return out


def _check_copies_servable(everyone: list) -> None:
    """``(has copies, exchange, quantized parameter gather)`` of every process of the job: where
    any has parameters with copies in other data-parallel groups, every group must reduce them by
    one formula (the same exchange: flat, or two-level with the same node size) and the
    compressed parameter gather must be exact (its block scales would mix a copy with
    neighbours that differ between the groups); raises the same error everywhere if not."""
    if not any(has for has, _, _ in everyone):
        return
    exchanges = sorted({repr(exchange) for _, exchange, _ in everyone})
    _require(len(exchanges) == 1,
             f"gift.hierarchy: the data-parallel groups chose different exchanges ({', '.join(exchanges)}), but "
             "parameters with copies in several groups (tensor-parallel replicas, tied weights) must be reduced "
             "alike in all; set gift.hierarchy and gift.ranks_per_node explicitly")
    _require(not any(quantized for _, _, quantized in everyone),
             "gift.params: a quantized parameter gather would give the copies of a parameter held by several "
             "data-parallel groups (tensor-parallel replicas, tied weights) different replicas; set params.format "
             "to the replicas' dtype or remove gift.params")


def bits_digest(t: torch.Tensor, chunk: int = 1 << 20) -> torch.Tensor:
    """A 64-bit digest of ``t``'s bits on its device (a position-weighted sum of its words, in
    chunks: its temporaries are a chunk's): equal tensors give equal digests, and two that
    differ anywhere almost surely do not."""
    flat = t.detach().reshape(-1)
    words = flat.view({1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()])
    total = torch.zeros((), dtype=torch.int64, device=flat.device)
    for at in range(0, flat.numel(), chunk):
        part = words[at:at + chunk].to(torch.int64)
        weight = torch.arange(at, at + part.numel(), device=flat.device, dtype=torch.int64).remainder_(65521).add_(1)
        total.add_(part.mul_(weight).sum())
    return total


def check_copies(copies: Dict[int, tuple], names: Dict[int, str]) -> None:
    """Every copy of each parameter in ``copies`` (``params_with_copies``) holds the same bits: a
    digest per parameter gathered over its copy group, one gather per group; raises on every
    rank of the group, naming the parameter and the ranks, where they differ."""
    import torch.distributed as dist

    by_group: Dict[object, list] = {}
    for key, (why, group, param) in copies.items():
        by_group.setdefault(group, []).append((names.get(key, "?"), why, param))
    for group, params in by_group.items():  # the same groups in the same order on every member
        params.sort(key=lambda entry: entry[0])
        mine = torch.stack([bits_digest(p) for _, _, p in params])
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size(group))]
        dist.all_gather(everyone, mine, group=group)
        table = torch.stack(everyone).cpu()  # a refresh step's host read
        for i, (name, why, _) in enumerate(params):
            if len(set(table[:, i].tolist())) > 1:
                ranks = dist.get_process_group_ranks(group) if group is not None else list(range(len(everyone)))
                raise RuntimeError(f"deepspeed_gift: the copies of {name!r} ({why}) differ between global ranks "
                                   f"{ranks}: they must hold the same bits. If it is a tensor-parallel shard, mark it "
                                   "as Megatron does (param.tensor_model_parallel = True); otherwise a framework "
                                   "step changed one copy only")


def _fingerprint_check(comm, cfg: GiftConfig, whole_job: bool = True) -> None:
    """All ranks must run the same gift config and package version; name what differs. Where the
    data-parallel group is one of several (pipeline, tensor parallelism) the whole job is checked
    at once, so a stage or shard with another config fails everywhere, not in its own group
    while the others wait for it."""
    from . import __version__

    mine = json.dumps({"version": __version__, "gift": json.loads(cfg.fingerprint())}, sort_keys=True)
    if whole_job:
        blob = torch.frombuffer(bytearray(mine.encode()), dtype=torch.uint8)
        everyone = [json.loads(b.cpu().numpy().tobytes().decode())
                    for b in comm.all_gather_bytes(blob, kind=ByteKind.CONTROL)]
        who = "rank"
    else:
        everyone, who = [json.loads(text) for text in _gather_over_job(mine)], "global rank"
    ref = everyone[0]
    for r, other in enumerate(everyone):
        if other == ref:
            continue
        if other["version"] != ref["version"]:
            raise ValueError(f"deepspeed_gift version differs between ranks: {who} 0 has {ref['version']}, "
                             f"{who} {r} has {other['version']}")
        diff = first_difference(ref["gift"], other["gift"], "gift")
        raise ValueError(f"{diff[0]} differs between ranks: {who} 0 has {diff[1]!r}, {who} {r} has {diff[2]!r}")


def choose_topology(comm, cfg: GiftConfig):
    """(hierarchy, data-parallel ranks per node) for ``gift.hierarchy``. The flat exchange needs no
    topology; it is still detected there (1 if it cannot be) to count the bytes that leave a node."""
    world = comm.world_size
    if cfg.ranks_per_node is not None:
        per_node = cfg.ranks_per_node
        _require(world % per_node == 0, f"gift.ranks_per_node: got {per_node}; the data-parallel group has {world} "
                 f"ranks, not a multiple of it (allowed: a divisor of {world}, or null to detect)")
    else:
        per_node, why = detect_ranks_per_node(comm)
        if per_node is None:
            if cfg.hierarchy == Hierarchy.TWO_LEVEL:
                raise ValueError(f"gift.hierarchy: got 'two_level' but {why}; set gift.ranks_per_node to the number "
                                 "of data-parallel ranks per node, or use hierarchy 'flat'")
            if cfg.hierarchy == Hierarchy.BY_TOPOLOGY:
                logger.warning("gift: %s; gift.hierarchy 'by_topology' runs the flat exchange", why)
            return Hierarchy.FLAT, 1
    nodes = world // per_node
    if cfg.hierarchy == Hierarchy.TWO_LEVEL or (cfg.hierarchy == Hierarchy.BY_TOPOLOGY and nodes > 1 and per_node > 1):
        return Hierarchy.TWO_LEVEL, per_node
    if cfg.node_format is not None:
        logger.warning("gift: gift.node_format %r has no node stage to quantize here (%d node(s) of %d rank(s): "
                       "gift.hierarchy 'by_topology' runs the flat exchange)", cfg.node_format, nodes, per_node)
    return Hierarchy.FLAT, per_node


class GiftState:
    """Everything GIFT keeps for one engine: config, comm, codecs, geometry, counters."""

    def __init__(self, engine, cfg: GiftConfig) -> None:
        self.engine = engine
        self.cfg = cfg
        self.opt = opt = _check_engine(engine, cfg)
        self.comm = make_comm(cfg.backend, group=opt.dp_process_group, timeout=cfg.comm_timeout_s)
        # where this rank sits in the job: files are named by the global rank, and checked by the
        # data-parallel group (with pipeline or tensor parallelism one group of several)
        self.global_rank, self.dp_ranks, self.whole_job = _job_coordinates(opt.dp_process_group)
        _fingerprint_check(self.comm, cfg, self.whole_job)
        device = torch.device(engine.device) if not isinstance(engine.device, torch.device) else engine.device
        self.device = device
        self.main_codec = _main_codec(cfg)
        self.high_codec = (formats.get_format(cfg.others, kernels=cfg.kernels) if cfg.others in ("bf16", "fp32")
                           else None)
        generator = CounterRng(cfg.seed * 1_000_003 + self.comm.rank + 1)
        self.hierarchy, self.ranks_per_node = choose_topology(self.comm, cfg)
        # what error-feedback residuals are laid out for (the flat exchange: the ranks alone)
        self.exchange = ([Hierarchy.TWO_LEVEL.value, self.ranks_per_node] if self.hierarchy == Hierarchy.TWO_LEVEL
                         else [Hierarchy.FLAT.value])
        codecs = (self.main_codec, self.high_codec or self.main_codec)
        node_comm = slot_comm = None
        if self.hierarchy == Hierarchy.TWO_LEVEL:
            node_comm, slot_comm = split_by_node(self.comm, self.ranks_per_node)
            inner = GiftReducer(slot_comm, *codecs, generator=generator, error_feedback=cfg.error_feedback,
                                defer_checks=True, fidelity_elements=cfg.telemetry.fidelity_elements,
                                route=cfg.route, shared_seed=cfg.seed if cfg.rounding == Rounding.STOCHASTIC else None,
                                tile_elements=cfg.tile_elements, relay_codec=_relay_codec(cfg))
            self.reducer = TwoLevelReducer(node_comm, inner, self.ranks_per_node,
                                           pieces=cfg.node_pieces or NODE_PIECES_BY_BUCKET,
                                           piece_min_elements=cfg.node_piece_min_elements,
                                           node_codec=_node_codec(cfg))
            self.exchange.append(self.reducer.pieces)  # the residuals' keys follow the pieces' cut
        else:
            self.comm.split_many([])  # other data-parallel groups (pipeline, tensor parallelism) may split
            self.reducer = GiftReducer(self.comm, *codecs, generator=generator, error_feedback=cfg.error_feedback,
                                       ranks_per_node=self.ranks_per_node, defer_checks=True,
                                       fidelity_elements=cfg.telemetry.fidelity_elements, route=cfg.route,
                                       tile_elements=cfg.tile_elements, relay_codec=_relay_codec(cfg))
        # DeepSpeed-MoE: each expert group's parameters reduced over its expert-data-parallel group,
        # by a flat exchange of its own (ZeRO partitions them over that group)
        self.expert_reducers: Dict[str, GiftReducer] = {}
        for name, group in sorted((getattr(opt, "expert_dp_process_group", None) or {}).items()
                                  if getattr(opt, "has_moe_layers", False) else []):
            comm = make_comm(cfg.backend, group=group, timeout=cfg.comm_timeout_s)
            self.expert_reducers[name] = GiftReducer(
                comm, *codecs, generator=CounterRng(cfg.seed * 1_000_003 + 7919 * (len(self.expert_reducers) + 1)
                                                    + comm.rank + 1),
                error_feedback=cfg.error_feedback, ranks_per_node=1, defer_checks=True,
                fidelity_elements=cfg.telemetry.fidelity_elements,
                route=cfg.route, tile_elements=cfg.tile_elements, relay_codec=_relay_codec(cfg))
        self._expert_groups: Dict[int, str] = {}  # param id -> its expert group's name
        if self.expert_reducers:
            for g, params in enumerate(opt.bit16_groups):
                if opt.is_moe_param_group[g]:
                    name = opt.optimizer.param_groups[g]["name"]
                    self._expert_groups.update((opt.get_param_id(p), name) for p in params)
        self.params: Optional[ReplicaGather] = None
        self.params_codec = None
        self._params_pending = None  # set by the optimizer step: "exact" or the replicas before it
        self._params_sampled = False
        self.replica_dtype = opt.bit16_groups_flat[0].dtype if getattr(opt, "bit16_groups_flat", None) else None
        if cfg.params is not None:
            _probe_params_internals(opt)
            self.params_codec = _params_codec(cfg, self.replica_dtype)
            self.params = ReplicaGather(self.comm, self.params_codec or formats.get_format("fp32"),
                                        node_comm=node_comm, slot_comm=slot_comm, ranks_per_node=self.ranks_per_node,
                                        bucket_elements=_allgather_bucket_size(engine))
            import torch.distributed as dist

            for g, parts in enumerate(opt.parallel_partitioned_bit16_groups):
                _require(len(parts) == self.comm.world_size
                         and dist.get_rank(group=opt.real_dp_process_group[g]) == self.comm.rank,
                         "gift.params: DeepSpeed's partitions of the parameters do not follow GIFT's data-parallel "
                         "ranks; remove gift.params")
        modules = find_candidates(cfg, engine.module, gather=None if self.whole_job else _gather_over_job)
        # a layer the optimizer was not handed has no gradient reduction of DeepSpeed's to replace
        modules = {name: m for name, m in modules.items() if _trained_by(opt, m.weight)}
        dense, experts = _split_experts(modules) if self.expert_reducers else (modules, {})
        self.optimizer_state = (Stage3OptimizerState(opt, dense, self.comm.rank, self.comm.world_size)
                                if isinstance(opt, Stage3Layout)
                                else ZeroOptimizerState(opt, dense, self.comm.rank))
        self.geometry = GeometryManager(cfg, dense, self.comm, main_codec=self.main_codec,
                                        optimizer=self.optimizer_state)
        # DeepSpeed-MoE: each expert group's layers take geometry over its own exchange's ranks
        self.expert_geometry: Dict[str, GeometryManager] = {}
        for group, layers in sorted(experts.items()):
            comm = self.expert_reducers[group].comm
            self.expert_geometry[group] = GeometryManager(
                cfg, layers, comm, main_codec=self.main_codec, optimizer=ZeroOptimizerState(opt, layers, comm.rank))
        self._geometry_of: Dict[str, GeometryManager] = {name: g for g in self.expert_geometry.values()
                                                         for name in g.names}
        self.param_names: Dict[int, str] = {opt.get_param_id(m.weight): name for name, m in modules.items()}
        ids = getattr(opt, "param_id", {})
        self.copy_params: Dict[int, tuple] = {ids[key]: entry for key, entry in params_with_copies(engine).items()
                                              if key in ids}
        if not self.whole_job:  # one agreed answer on every process (tied weights live on some stages only)
            _check_copies_servable(_gather_over_job((bool(self.copy_params), self.exchange,
                                                     self.params_codec is not None)))
        if self.copy_params:
            logger.info("gift: %d parameters have copies outside the data-parallel group (%s): they travel "
                        "elementwise (%s), every contribution decoded, so every copy gets the same bits",
                        len(self.copy_params), ", ".join(sorted({why for why, _, _ in self.copy_params.values()})),
                        copy_codec_for(self.main_codec, self.high_codec).name)
        # every trained parameter's name, for errors that say which one ranks disagree on
        names = {opt.param_id[id(p)]: name for name, p in engine.module.named_parameters()
                 if id(p) in getattr(opt, "param_id", {})}
        for reducer in (self._header_reducer(), *self.expert_reducers.values()):
            reducer.param_names = names
        if device.type != "cpu":  # the codecs' tables on the device now, not at a first decode in a reduction
            formats.warm_device_tables(device)
        self.native_average_tensor = getattr(opt, "average_tensor", None)
        self._reduced_in_rounds = False  # this step's gradients were reduced in rounds: the buckets pass
        # Two-level's pipeline carried from bucket to bucket (see carry_applies): set while the
        # backward reduces a full bucket; the bucket left under way (its tag) and its parameters,
        # whose copies into the partition wait until it is done; the next tag
        self._in_backward_bucket = False
        self._open_bucket: Optional[int] = None
        self._open_params: set = set()
        self._deferred_copies: List[tuple] = []
        self._bucket_tags = 0
        self._carries = False  # carry_applies(), decided once at attach (_attach_zero)
        self._carried_done = None  # GPU: the event after a carried bucket's copies, not yet waited for
        self._carry_failed: Optional[str] = None  # why a reduction with a bucket carried raised
        # per (dtype, expert group or None): (the layout it was planned for, the rounds), the same step after step
        self._rounds_plan: Dict[tuple, tuple] = {}
        self.step_totals: Optional[StepStats] = None  # this step's buckets and gather, summed
        self.run_totals: Dict[str, float] = {"bytes": 0, "elements": 0}
        self.telemetry = TelemetryLog(cfg.telemetry.jsonl, self.comm.rank, cfg.telemetry.monitor,
                                      writer=None if self.whole_job else self.dp_ranks[0])
        self.replaced: List[tuple] = []  # (object, attribute, what the instance held) that attach set
        # each forward begins the geometry's step (statistics hooks are armed then)
        self._forward_hook = engine.module.register_forward_pre_hook(lambda module, inputs: self.on_forward())

    # ---- checkpointing (the files: deepspeed_gift.checkpoint) -----------------------------
    def state_dict(self) -> dict:
        return checkpoint.gift_state(self)

    def load_state_dict(self, state: dict) -> None:
        checkpoint.load_gift_state(self, state)

    # ---- step bookkeeping -----------------------------------------------------------
    @property
    def k(self) -> int:
        return self.engine.global_steps - self.cfg.start_step

    @property
    def geometries(self) -> List[GeometryManager]:
        """The dense layers' geometry, then each DeepSpeed-MoE expert group's."""
        return [self.geometry, *self.expert_geometry.values()]

    def geometry_of(self, name: str) -> GeometryManager:
        """The geometry that holds candidate layer ``name``."""
        return self._geometry_of.get(name, self.geometry)

    def on_forward(self) -> None:
        if self.params is not None:  # the last gather's headers: read with this step's reduction's
            self.params.hand_over_checks(self._header_checks())
        for geometry in self.geometries:
            geometry.begin_step(self.k)

    def close(self) -> None:
        """Remove this state's hooks from the model and close its telemetry (detach)."""
        self._forward_hook.remove()
        for geometry in self.geometries:
            geometry.remove_hooks()
        self.telemetry.close()

    def on_optimizer_step(self, k: int) -> None:
        if self.copy_params and k >= 0 and k % self.cfg.geometry.refresh_interval == 0:
            # every refresh_interval steps, whatever idle_backoff does to the refreshes
            check_copies(self.copy_params, self._header_reducer().param_names)
        for geometry in self.geometries:  # the dense one first, then each expert group's (collectives in one order)
            geometry.end_step(k)
        self._flush_telemetry(k)

    def sampled(self, k: int) -> bool:
        """Step ``k`` is one of telemetry's sampled steps (``telemetry.every``)."""
        every = self.cfg.telemetry.every
        return bool(every and k >= 0 and k % every == 0)

    def sampling(self, k: int) -> bool:
        """The fidelity check (an exact reduction beside GIFT's) runs on step ``k``."""
        return self.cfg.telemetry.fidelity and self.sampled(k)

    # ---- the reduction --------------------------------------------------------------
    def mode_of(self, param_id: int):
        if param_id in self.copy_params:
            return COPY, None
        name = self.param_names.get(param_id)
        if name is not None and self.geometry_of(name).in_branch(name):
            w = self.geometry_of(name).whitener_for(name)
            return (GEO, w) if w is not None else (MAIN, None)
        return (HIGH if self.high_codec is not None else MAIN), None

    def average_tensor(self, tensor: torch.Tensor, communication_data_type: torch.dtype):
        k = self.k
        if k < 0:
            return self.native_average_tensor(tensor, communication_data_type)
        if self._reduced_in_rounds:  # the bucket holds what the rounds reduced: nothing left to do
            return None
        self.reduce_flat(tensor, self.opt.ipg_buckets[communication_data_type].params, communication_data_type)

    def reduce_flat(self, tensor: torch.Tensor, params, communication_data_type: torch.dtype) -> None:
        """Reduce a flat bucket of the gradients of ``params`` (DeepSpeed's ``(group, index in
        group, param id)``, in the bucket's order): each owner's slices get the reduced sum (and
        DeepSpeed's compact fp32 partition, where it keeps one, has it added)."""
        k, opt = self.k, self.opt
        slices, outputs, whiteners = [], [], {}
        offset = 0
        for group_idx, param_idx, param_id in params:
            param = opt.bit16_groups[group_idx][param_idx]
            numel = param.numel()
            mode, whitener = self.mode_of(param_id)
            row_len = whitener.run_unit if mode == GEO else 0
            if whitener is not None:
                whiteners[param_id] = whitener
            name = self.param_names.get(param_id)
            if name is not None and self.geometry_of(name).wants_capture(name):
                self.geometry_of(name).capture(name, tensor.narrow(0, offset, numel).view(param.shape))
            runs = self.optimizer_state.partition_runs(group_idx, param_id, numel)
            copy_ranks = self.optimizer_state.copy_ranks(param, runs)  # then delivered whole: every row is whole
            for start, end, pid in runs:
                slices.append(ParamSlice(pid, offset + start, end - start, start, param_id, row_len, mode,
                                         copy_ranks))
                outputs.append(opt._get_compact_grad_partition_slice(group_idx, pid, param_id, end - start))
            offset += numel
        if offset != tensor.numel():
            raise RuntimeError(f"deepspeed_gift: bucket holds {tensor.numel()} elements but its parameters "
                               f"add up to {offset}; DeepSpeed's bucket layout is not what GIFT expects")
        divisor = self._divisor()
        with _reduction_stream(opt, communication_data_type):
            if self._carries and self._in_backward_bucket:
                tag, self._bucket_tags = self._bucket_tags, self._bucket_tags + 1
                self.reducer.reduce_carried(tensor, slices, whiteners, divisor=divisor, step=k, outputs=outputs,
                                            sample=self.sampling(k), tag=tag, on_done=self._bucket_done)
                if self.reducer.carrying:
                    self._open_bucket = tag
                    self._open_params = {param_id for _, _, param_id in params}
                return
            with self._abandoned_on_error():
                self.drain_carried()
            for reducer, these in self._by_group(slices, outputs):
                stats = reducer.reduce(tensor, [s for s, _ in these], whiteners, divisor=divisor, step=k,
                                       outputs=[o for _, o in these], sample=self.sampling(k))
                self._count(stats)

    # ---- two-level's pipeline carried across DeepSpeed's buckets --------------------------
    def carry_applies(self) -> bool:
        """A bucket's last pieces may finish during the next bucket's reduction
        (``gift.carry_buckets``): two-level, with DeepSpeed's double ipg buffer (``overlap_comm``
        and ``contiguous_gradients``: a bucket's buffer is filled again only after the next
        bucket is reduced), its gradients kept on the device (no ``offload_optimizer``), one
        exchange per bucket (no MoE groups), the backward DeepSpeed's engine's (a
        ``PipelineEngine`` reduces through ``reduce_gradients``, which re-makes the buffers)."""
        opt = self.opt
        return (self.cfg.carry_buckets and isinstance(self.reducer, TwoLevelReducer) and bool(opt.overlap_comm)
                and bool(opt.contiguous_gradients) and not opt.cpu_offload and not self.expert_reducers
                and not any(c.__name__ == "PipelineEngine" for c in type(self.engine).__mro__))

    def drain_carried(self) -> None:
        """Every carried bucket finished now (each reported through ``_bucket_done``, its on_done)."""
        if self._carries and self.reducer.carrying:
            self.reducer.drain()

    def _bucket_done(self, tag, stats) -> None:
        """A bucket finished: counted; the carried one's held-back copies into the partition run
        now, in DeepSpeed's order, before any later bucket's (on the reduction stream it used),
        and on a GPU an event after them, which the backward waits for before it fills the
        bucket's buffer again (after_reduce_ipg_grads)."""
        self._count(stats)
        if tag == self._open_bucket:
            self._open_bucket, self._open_params = None, set()
            copies, self._deferred_copies = self._deferred_copies, []
            for native, param, args, kwargs in copies:
                native(param, *args, **kwargs)
            from deepspeed.accelerator import get_accelerator

            acc = get_accelerator()
            if self.opt.overlap_comm and not acc.resolves_data_dependency():
                self._carried_done = acc.Event()
                self._carried_done.record(acc.current_stream())

    def backward_bucket(self, native, *args, **kwargs):
        """DeepSpeed's ``reduce_independent_p_g_buckets_and_remove_grads``: where the backward
        reduces a bucket that is full, the one place a bucket may be carried into the next. A
        reduction that raises part-way leaves nothing carried behind: the next one refuses."""
        if self._carry_failed:
            raise RuntimeError(f"deepspeed_gift: a bucket carried into the next reduction (gift.carry_buckets: "
                               f"true) was abandoned when {self._carry_failed}; the gradients of that backward "
                               f"are lost and the ranks' exchanges may no longer match: restart the processes "
                               f"from a checkpoint (gift.carry_buckets: false finishes every bucket before "
                               f"DeepSpeed's next)")
        self._in_backward_bucket = True
        try:
            with self._abandoned_on_error():
                return native(*args, **kwargs)
        finally:
            self._in_backward_bucket = False

    @contextlib.contextmanager
    def _abandoned_on_error(self):
        """A reduction that raises with a bucket carried leaves nothing of it under way: the
        carried pieces and held-back copies are dropped and every later backward refuses."""
        try:
            yield
        except BaseException as exc:
            if self._carries and (self.reducer.carrying or self._deferred_copies):
                self._carry_failed = f"a reduction raised {type(exc).__name__}: {exc}"
                self.reducer.abandon()
                self._open_bucket, self._open_params, self._deferred_copies = None, set(), []
            raise

    def copy_grads_in_partition(self, native, param, *args, **kwargs):
        """DeepSpeed's copy of a reduced gradient out of the bucket into the partition: held back
        while the bucket is still under way, run in order once it is done."""
        if self._open_bucket is not None and self.opt.get_param_id(param) in self._open_params:
            self._deferred_copies.append((native, param, args, kwargs))
            return None
        return native(param, *args, **kwargs)

    def after_reduce_ipg_grads(self) -> None:
        """After DeepSpeed's ``reduce_ipg_grads``: outside the backward's full buckets (the
        epilogue's last bucket, any other caller) every carried bucket is finished, and the
        current stream waits for the reduction stream. In the backward, a bucket finished during
        this call was last touched on the reduction stream after the wait DeepSpeed put at this
        bucket's start: the backward's next gradients, which fill its buffer again, wait for the
        event recorded when it was done (before this bucket's exchanges were waited for, so the
        backward does not wait for them, as DeepSpeed's waits for its own at the next bucket)."""
        from deepspeed.accelerator import get_accelerator

        acc = get_accelerator()
        on_stream = self.opt.overlap_comm and not acc.resolves_data_dependency()
        if not self._in_backward_bucket:
            with acc.stream(self.opt.reduction_stream) if on_stream else contextlib.nullcontext(), \
                    self._abandoned_on_error():
                self.drain_carried()
            if self._carried_done is not None:
                acc.current_stream().wait_stream(self.opt.reduction_stream)
        elif self._carried_done is not None:
            acc.current_stream().wait_event(self._carried_done)
        self._carried_done = None

    def _expert_group(self, param_id: int) -> Optional[str]:
        """The expert group a parameter belongs to (DeepSpeed-MoE), None for a dense one."""
        return self._expert_groups.get(param_id)

    def _reducer_of(self, group: Optional[str]):
        return self.reducer if group is None else self.expert_reducers[group]

    def _by_group(self, slices, outputs):
        """A bucket's slices (with their outputs) by the exchange that reduces them: the dense
        ones first, then each expert group's, in name order; empty groups left out."""
        if not self.expert_reducers:
            return [(self.reducer, list(zip(slices, outputs)))]
        parts: Dict[Optional[str], list] = {}
        for s, out in zip(slices, outputs):
            parts.setdefault(self._expert_group(s.param_key), []).append((s, out))
        order = sorted(parts, key=lambda g: (g is not None, g or ""))
        return [(self._reducer_of(g), parts[g]) for g in order]

    def reduce_fallback(self, native, rank, grads, communication_data_type: torch.dtype, *args, **kwargs):
        """DeepSpeed's reduction of a bucket whose gradients do not share one buffer
        (``contiguous_gradients: false``: ``buffered_reduce_fallback``, and its variant that adds
        into an fp32 partition): an all-reduce of their flattened copy, copied back into each.
        GIFT reduces the flattened copy as a bucket instead and copies it back: every owner's
        slices hold the reduced sum, which is all DeepSpeed reads of them (each rank's step takes
        its partition's slices; stage 2 drops the gradients of parameters outside it)."""
        k = self.k
        if k < 0 or rank is not None:
            return native(rank, grads, communication_data_type, *args, **kwargs)
        if self._reduced_in_rounds:  # the gradients hold what the rounds reduced
            return None
        opt = self.opt
        params = list(opt.ipg_buckets[communication_data_type].params)
        if len(params) != len(grads) or any(
                g.numel() != opt.bit16_groups[gi][pi].numel() for g, (gi, pi, _) in zip(grads, params)):
            raise RuntimeError(f"deepspeed_gift: DeepSpeed hands {len(grads)} gradients to reduce, its bucket lists "
                               f"{len(params)} parameters of other sizes; the bucket layout is not what GIFT expects")
        if opt.overlap_comm:  # as DeepSpeed's allreduce_and_copy: the last bucket's dropped gradients go now
            from deepspeed.accelerator import get_accelerator

            if not get_accelerator().resolves_data_dependency():
                get_accelerator().synchronize()
            opt._clear_previous_reduced_grads()
        flat = torch.cat([g.reshape(-1) for g in grads]) if grads else None
        if flat is None:
            return None
        self.reduce_flat(flat, params, communication_data_type)
        offset = 0
        for g in grads:
            g.view(-1).copy_(flat.narrow(0, offset, g.numel()))
            offset += g.numel()
        return None

    def reduce_fallback_preserving_fp32(self, native, grads, grad_params, communication_data_type: torch.dtype,
                                        *args, **kwargs):
        """The fp32-partition variant of :meth:`reduce_fallback` (``grad_accum_dtype`` fp32)."""
        if self.k < 0:
            return native(grads, grad_params, communication_data_type, *args, **kwargs)
        return self.reduce_fallback(None, None, grads, communication_data_type)

    # ---- ZeRO-1: the step's reduction in balanced rounds (gift.stage1_rounds) -------------
    def _divisor(self) -> float:
        """What DeepSpeed divides a reduced gradient by (its ``average_tensor``'s rule)."""
        opt = self.opt
        return self.comm.world_size / float(opt.sequence_parallel_size) if opt.gradient_average else 1.0

    def rounds_apply(self) -> bool:
        """Stage 1 without ``overlap_comm``: every gradient exists when DeepSpeed reduces."""
        opt = self.opt
        return self.cfg.stage1_rounds and not opt.partition_gradients and not opt.overlap_comm

    def reduce_gradients(self, native_reduce, *args, **kwargs):
        """DeepSpeed's ZeRO-1 ``reduce_gradients`` (the boundary's reduction), with the gradients
        reduced in balanced rounds first: DeepSpeed's walk then copies them through its buckets
        and into the partitions as always, and its ``average_tensor`` passes."""
        k = self.k
        if k < 0 or not self.rounds_apply():
            return native_reduce(*args, **kwargs)
        self.reduce_in_rounds(k)
        self._reduced_in_rounds = True
        try:
            return native_reduce(*args, **kwargs)
        finally:
            self._reduced_in_rounds = False

    def _step_gradients(self) -> Dict[torch.dtype, list]:
        """``(group, param, gradient)`` of every parameter DeepSpeed's walk will reduce, in its
        order, by the dtype it communicates in (one bucket kind each)."""
        opt = self.opt
        out: Dict[torch.dtype, list] = {}
        for g, group in enumerate(opt.bit16_groups):
            for param in group:
                grad = opt.get_gradient_for_reduction(param)
                if param.numel() == 0 or grad is None or not getattr(param, "ds_grad_is_ready", True):
                    continue
                out.setdefault(opt.get_param_comm_dtype(param), []).append((g, param, grad))
        return out

    def _round_staging(self, comm_dtype: torch.dtype, numel: int, device: torch.device) -> torch.Tensor:
        """Where a round is staged, in the dtype DeepSpeed communicates in (its bucket buffer's;
        BF16_Optimizer casts its fp32 gradients to it for the all-reduce): that buffer itself,
        idle until DeepSpeed's walk refills it after the rounds (so the rounds hold no bucket of
        their own), or, for a round longer than a bucket (a row's slack, a whole shared matrix)
        and where there are no buckets, a buffer of its own."""
        bucket = self.opt.ipg_buckets.get(comm_dtype)
        buffers = getattr(bucket, "buffer", None) or []
        if buffers:
            idle = buffers[bucket.index]
            if idle.numel() >= numel and idle.dtype == comm_dtype and idle.device == device:
                return idle.narrow(0, 0, numel)
        return torch.empty(numel, dtype=comm_dtype, device=device)

    def reduce_in_rounds(self, k: int) -> None:
        """Reduce every gradient of the step in rounds of at most ``reduce_bucket_size`` elements,
        each a slice of every owner's partition (``exchange.rounds``): what DeepSpeed's
        ``average_tensor`` would leave in the owner's slices of its buckets, written into the
        gradients themselves (and into the compact fp32 partition, as there)."""
        opt = self.opt
        divisor = self._divisor()
        by_group: Dict[tuple, list] = {}
        for comm_dtype, entries in sorted(self._step_gradients().items(), key=lambda item: str(item[0])):
            for entry in entries:
                group = self._expert_group(opt.get_param_id(entry[1]))
                by_group.setdefault((str(comm_dtype), group or ""), (comm_dtype, group, []))[2].append(entry)
        for key in sorted(by_group, key=lambda key: (key[0], key[1] != "", key[1])):  # dense first
            comm_dtype, group, entries = by_group[key]
            self._reduce_group_in_rounds(k, comm_dtype, group, entries, divisor)

    def _reduce_group_in_rounds(self, k: int, comm_dtype: torch.dtype, group: Optional[str], entries: list,
                                divisor: float) -> None:
        """:meth:`reduce_in_rounds` of one dtype's gradients reduced by one exchange (the dense
        one, or an expert group's over its expert-data-parallel group)."""
        opt = self.opt
        reducer = self._reducer_of(group)
        comm = self.comm if group is None else reducer.comm  # the group's ranks (two-level: all of them)
        me, world = comm.rank, comm.world_size
        owned, copies = [], []
        for g, param, grad in entries:
            param_id = opt.get_param_id(param)
            runs = self.optimizer_state.partition_runs(g, param_id, param.numel())
            name = self.param_names.get(param_id)
            if name is not None and self.geometry_of(name).wants_capture(name):
                self.geometry_of(name).capture(name, grad.view(param.shape))
            copies.append(self.optimizer_state.copy_ranks(param, runs))
            owned.append(OwnedParam(param_id, param.numel(), tuple(runs),
                                    param.shape[-1] if param.dim() >= 2 else 1, bool(copies[-1])))
        key = (tuple(owned), world, int(opt.reduce_bucket_size))
        plan = self._rounds_plan.get((comm_dtype, group))
        if plan is None or plan[0] != key:  # the same layout every step
            plan = self._rounds_plan[(comm_dtype, group)] = (key, plan_rounds(*key))
        for round_ in plan[1]:
            staging = self._round_staging(comm_dtype, round_.numel, entries[0][2].device)
            slices, outputs, whiteners, targets = [], [], {}, []
            for piece in round_.pieces:
                g, param, grad = entries[piece.param]
                flat = grad.view(-1).narrow(0, piece.start, piece.numel)
                staging.narrow(0, piece.offset, piece.numel).copy_(flat)
                mode, whitener = self.mode_of(piece.key)
                if whitener is not None:
                    whiteners[piece.key] = whitener
                run = next(r for r in owned[piece.param].runs if r[0] <= piece.start < r[1])
                copy_ranks = copies[piece.param]
                slices.append(ParamSlice(piece.owner, piece.offset, piece.numel, piece.start, piece.key,
                                         whitener.run_unit if mode == GEO else 0, mode, copy_ranks))
                out = opt._get_compact_grad_partition_slice(g, run[2], piece.key, run[1] - run[0])
                outputs.append(None if out is None else out.narrow(0, piece.start - run[0], piece.numel))
                if piece.owner == me or me in copy_ranks:
                    targets.append((flat, piece.offset, piece.numel))
            stats = reducer.reduce(staging, slices, whiteners, divisor=divisor, step=k, outputs=outputs,
                                   sample=self.sampling(k))
            stats.rounds = 1
            self._count(stats)
            for flat, offset, numel in targets:
                flat.copy_(staging.narrow(0, offset, numel))
            del staging

    def avg_scatter_stage3(self, native, params, communication_data_type: torch.dtype):
        """ZeRO stage 3's ``__avg_scatter_grads``: each parameter's full gradient averaged and its
        r-th chunk of ceil(numel / W) elements left with rank r; returns this rank's chunks (in the
        gradient accumulation dtype), as DeepSpeed's ``reduce_scatter_coalesced`` path does. The
        bucket goes in pieces of whole parameters of at most ``STAGE3_PIECE_TILES`` tiles, each an
        exchange of its own: what is encoded and received at once stays bounded whatever
        ``reduce_bucket_size`` is (DeepSpeed's default bucket is 5e8 elements)."""
        if self.k < 0:
            return native(params, communication_data_type)
        return self._avg_scatter(self.k, params, communication_data_type)

    def _avg_scatter(self, k: int, params, communication_data_type: torch.dtype) -> List[torch.Tensor]:
        """:meth:`avg_scatter_stage3` once GIFT reduces (both of stage 3's paths)."""
        import torch.distributed as dist

        z3 = self.opt.z3
        group = z3._get_param_partition_group(params[0])
        if dist.get_process_group_ranks(group) != list(self.dp_ranks):
            raise RuntimeError(f"deepspeed_gift: ZeRO-3 partitions these gradients over ranks "
                               f"{dist.get_process_group_ranks(group)}, and GIFT reduces over {list(self.dp_ranks)}")
        limit = STAGE3_PIECE_TILES * self.cfg.tile_elements
        mine: List[torch.Tensor] = []
        start = 0
        while start < len(params):
            end, numel = start + 1, params[start].ds_numel
            while end < len(params) and numel + params[end].ds_numel <= limit:
                numel += params[end].ds_numel
                end += 1
            mine += self._avg_scatter_piece(k, params[start:end], communication_data_type)
            start = end
        averaging = z3._gradient_averaging_world_size(params, self.comm.world_size)
        if averaging != self.comm.world_size:  # DeepSpeed's rescale, the same operation on the same values
            mine = [g.mul(self.comm.world_size / float(averaging)) for g in mine]
        if communication_data_type != z3.gradient_accumulation_dtype:
            mine = [g.to(z3.gradient_accumulation_dtype) for g in mine]
        return mine

    def avg_scatter_stage3_contiguous(self, native, buffer: torch.Tensor,
                                      communication_data_type: torch.dtype) -> List[torch.Tensor]:
        """ZeRO stage 3's ``__avg_scatter_contiguous_grads`` (``reduce_scatter: false``: DeepSpeed
        divides the bucket's contiguous buffer, all-reduces it and keeps each parameter's chunk):
        the same chunks reduced as :meth:`avg_scatter_stage3` reduces them, each padded with zeros
        to the parameter's ``partition_numel`` as DeepSpeed's all-reduce path pads them. The
        bucket's gradients are views of ``buffer`` in the bucket's order."""
        if self.k < 0:
            return native(buffer, communication_data_type)
        z3 = self.opt.z3
        params = z3.ipg_buckets[communication_data_type].params
        mine = self._avg_scatter(self.k, params, communication_data_type)
        padded = []
        for param, part in zip(params, mine):
            if part.numel() != param.partition_numel():
                full = torch.zeros(param.partition_numel(), device=part.device, dtype=z3.gradient_accumulation_dtype)
                full[:part.numel()] = part
                part = full
            padded.append(part)
        return padded

    def _avg_scatter_piece(self, k: int, params, communication_data_type: torch.dtype) -> List[torch.Tensor]:
        """One piece of :meth:`avg_scatter_stage3`: its gradients joined (as ``reduce_scatter_coalesced``
        joins a bucket's), every owner's chunks reduced into place, this rank's chunks returned."""
        z3 = self.opt.z3
        grads = [p.grad if communication_data_type == z3.dtype else p.grad.to(communication_data_type)
                 for p in params]
        flat = torch.cat([g.reshape(-1) for g in grads])
        world, me = self.comm.world_size, self.comm.rank
        slices, whiteners, mine = [], {}, []
        offset = 0
        for param, grad in zip(params, grads):
            numel, chunk = grad.numel(), -(-grad.numel() // world)
            key = self.opt.get_param_id(param)
            mode, whitener = self.mode_of(key)
            if whitener is not None:
                whiteners[key] = whitener
            name = self.param_names.get(key)
            if name is not None and self.geometry_of(name).wants_capture(name):
                self.geometry_of(name).capture(name, grad.view(param.ds_shape))
            for r in range(world):
                start, end = min(r * chunk, numel), min((r + 1) * chunk, numel)
                if end > start:
                    slices.append(ParamSlice(r, offset + start, end - start, start, key,
                                             whitener.run_unit if mode == GEO else 0, mode, ()))
            mine.append(flat.narrow(0, offset + min(me * chunk, numel),
                                    max(0, min((me + 1) * chunk, numel) - me * chunk)))
            offset += numel
        with _reduction_stream(self.opt, communication_data_type):
            stats = self.reducer.reduce(flat, slices, whiteners, divisor=float(world), step=k,
                                        outputs=[None] * len(slices), sample=self.sampling(k))
        self._count(stats)
        return mine

    def reduce_bf16(self, native, grads=None, *args, **kwargs):
        """The engine's ``buffered_allreduce_fallback`` for BF16_Optimizer (``grads`` None: its
        flat fp32 gradients, at the accumulation boundary; under a pipeline too): the step's
        gradients reduced in balanced rounds, each owner's part written back into the fp32
        buffer as DeepSpeed's all-reduce writes the whole."""
        k = self.k
        if k < 0 or grads is not None:
            return native(grads, *args, **kwargs)
        self.reduce_in_rounds(k)
        return None

    def bf16_grads_for_norm(self, native, for_clipping: bool = False):
        """BF16_Optimizer's gradients for its norm. DeepSpeed all-reduced every gradient, so every
        rank took the norm of all of them; with GIFT each rank holds the reduced sum of its own
        partition only. So the norm is summed per partition, then over the data-parallel group,
        and handed back as one tensor of that norm (DeepSpeed then sums it over the
        model-parallel group as it would). The same filter (pipeline replicas, tensor-parallel
        copies) picks the gradients; the order of the sum differs from DeepSpeed's, so the norm
        may differ from native in its last bits (clipping with it, where it clips)."""
        if for_clipping or self.k < 0:
            return native(for_clipping=for_clipping) if for_clipping else native()
        import torch.distributed as dist

        dense, experts = native()
        parts = self.opt.owned_parts(dense)
        device = parts[0].device if parts else self.opt.bit16_groups_flat[0].device
        local = torch.zeros((), dtype=torch.float32, device=device)
        for part in parts:
            local = local + part.detach().float().norm(2).square()
        dist.all_reduce(local, group=self.opt.dp_process_group)
        return [local.sqrt().reshape(1)], experts

    # ---- the parameter all-gather (gift.params) ----------------------------------------
    def params_exact_now(self, k: int) -> bool:
        every = self.cfg.params.resync_interval
        return self.params_codec is None or (every is not None and (k + 1) % every == 0)

    def _header_reducer(self) -> GiftReducer:
        """The reducer that exchanges the quantized payloads (two-level: among the nodes)."""
        return self.reducer.inner if isinstance(self.reducer, TwoLevelReducer) else self.reducer

    def residual_nbytes(self) -> int:
        """Memory error feedback holds: every exchange's residuals (the dense one's, each expert group's)."""
        return self.reducer.residual_nbytes() + sum(r.residual_nbytes() for r in self.expert_reducers.values())

    def drop_residuals(self) -> None:
        """Every exchange's error-feedback residuals dropped: DeepSpeed skipped the step that made
        them (its overflow check), so their error must not reach the next step."""
        for reducer in (self.reducer, *self.expert_reducers.values()):
            reducer.drop_residuals()

    def verify_checks(self) -> None:
        """Every exchange's header checks (the dense one's, each expert group's)."""
        self.reducer.verify_checks()
        for reducer in self.expert_reducers.values():
            reducer.verify_checks()

    def _header_checks(self):
        """The reducer's header checks, read once a step before the optimizer uses what came."""
        return self._header_reducer().checks

    def optimizer_step(self, native_step, *args, **kwargs):
        """DeepSpeed's optimizer step, with what its all-gather needs set aside: this rank's
        replicas before the step (the base of the deltas), or that this step gathers exactly."""
        k = self.k
        if k < 0:
            return native_step(*args, **kwargs)
        me = self.comm.rank
        self._params_pending = ("exact" if self.params_exact_now(k)
                                else [parts[me].clone() for parts in self.opt.parallel_partitioned_bit16_groups])
        self._params_sampled = self.sampled(k)  # the replica-target gap: on telemetry's sampled steps
        try:
            return native_step(*args, **kwargs)  # an overflow step returns before its all-gather
        finally:
            self._params_pending = None

    def gather_params(self, native_gather) -> None:
        """In place of DeepSpeed's all-gather of the step: the compressed one, or the exact one
        (``native_gather``) on a resync step or when the format is the replicas' own dtype."""
        pending, self._params_pending = self._params_pending, None
        parts = self.opt.parallel_partitioned_bit16_groups
        me = self.comm.rank
        if isinstance(pending, str):
            t0 = time.perf_counter()
            native_gather()
            stats = self.params.exact_stats(sum(p[me].numel() for p in parts), self.replica_dtype.itemsize,
                                            time.perf_counter() - t0)
        else:
            stats = self.params.gather(parts, me, pending, measure_gap=self._params_sampled)
        self._count(stats)

    # ---- telemetry ------------------------------------------------------------------
    def _count(self, stats: StepStats) -> None:
        self.step_totals = stats if self.step_totals is None else self.step_totals.add(stats)

    def _flush_telemetry(self, k: int) -> None:
        t, self.step_totals = self.step_totals, None
        if t is None:
            return
        t.bytes_geometry += sum(g.take_geometry_bytes() for g in self.geometries)
        # host seconds time the geometry's work only where its tensors are the host's
        geometry_s = sum(g.take_seconds() for g in self.geometries)
        profiles = {group: g.take_profile() for group, g in self.expert_geometry.items()}
        record = step_record(k, t, start_step=self.cfg.start_step, hierarchy=self.hierarchy,
                             geometry=_AllGeometry(self.geometries) if self.expert_geometry else self.geometry,
                             run_totals=self.run_totals,
                             replica_itemsize=self.replica_dtype.itemsize if self.replica_dtype is not None else None,
                             error_feedback_bytes=self.residual_nbytes() if self.cfg.error_feedback else None,
                             profile=self.geometry.take_profile(),
                             expert_profiles={group: p for group, p in profiles.items() if p is not None},
                             geometry_s=geometry_s if self.device.type == "cpu" else None)
        self.telemetry.write(record, self.engine)

    @property
    def records(self) -> List[dict]:
        return self.telemetry.records


class ZeroOptimizerState(_OptimizerStateView):
    """What GIFT reads of the ZeRO optimizer's partitions and state for the candidate layers:
    which rank holds most of a layer (it judges the layer's profile), each layer's update rule
    with a copy of its real state (the optimizer's metric), the row and column sums of Adam's
    second moment (``adam_factored``), and which ranks must receive a Muon matrix whole. What
    ``GeometryManager`` is handed at construction as its view of the optimizer."""

    def __init__(self, opt, modules: Dict[str, torch.nn.Module], rank: int) -> None:
        self.opt = opt
        self.rank = rank
        self._muon_class = _muon_optimizer_class()
        self.modules = modules
        self._layer_params = self._locate_layer_params()
        # the rank that captures each layer's gradient for the profile (it holds the layer's state)
        self.capture_rank = {name: self._main_owner(*where) for name, where in self._layer_params.items()}

    def _locate_layer_params(self) -> Dict[str, tuple]:
        """Candidate layer name -> (weight, ZeRO group index, param id)."""
        out = {}
        for name, module in self.modules.items():
            for g, group in enumerate(self.opt.bit16_groups):
                if any(p is module.weight for p in group):
                    out[name] = (module.weight, g, self.opt.get_param_id(module.weight))
                    break
        return out

    def partition_runs(self, g: int, param_id: int, numel: int) -> List[tuple]:
        """``(start, end, partition)`` of each ZeRO partition's run of a parameter, in order."""
        starts = sorted((int(self.opt.grad_start_offset[g][pid][param_id]), pid)
                        for pid in self.opt.param_to_partition_ids[g][param_id])
        return [(start, starts[j + 1][0] if j + 1 < len(starts) else numel, pid)
                for j, (start, pid) in enumerate(starts)]

    def _main_owner(self, param, g: int, param_id: int) -> int:
        """The partition holding the largest part of ``param`` (it judges the layer's profile:
        it has the optimizer state there)."""
        return -max((end - start, -pid) for start, end, pid in self.partition_runs(g, param_id, param.numel()))[1]

    def is_muon(self, param) -> bool:
        return (self._muon_class is not None and isinstance(self.opt.optimizer, self._muon_class)
                and getattr(param, "use_muon", False))

    def _held(self, name: str) -> Optional[_HeldState]:
        """What this rank holds of layer ``name``'s optimizer state; None: no rule serves the
        layer, or this rank holds none of the state the rule needs."""
        where = self._layer_params.get(name)
        if where is None:
            return None
        param, g, param_id = where
        group = self.opt.optimizer.param_groups[g]
        rule = metrics.rule_serving(group, param)
        if rule is None:
            return None
        held = self._whole_matrix(param, g) if rule.whole_matrix else self._slice(param, g, param_id)
        if held is None:
            return None
        state = self.opt.optimizer.state.get(self.opt.single_partition_of_fp32_groups[g], {})
        return _HeldState(rule, param, group, *held, state, tuple(param.shape))

    def _whole_matrix(self, param, g: int):
        """``(0, numel, offset)`` of ``param`` whole in this rank's fp32 partition, where
        DeepSpeed's Muon keeps whole matrices; None elsewhere."""
        if not self.is_muon(param):
            return None
        offset = 0
        for t in self.opt.params_in_partition[g]:
            if t is param:
                return 0, param.numel(), offset
            offset += t.numel()
        return None

    def _slice(self, param, g: int, param_id: int):
        """``(start, numel, dest)`` of this rank's ZeRO slice of ``param``: its first element in
        the flattened weight, its length and its offset in the partition; None when this rank
        owns none of it."""
        opt, me = self.opt, self.rank
        if param_id not in opt.grad_start_offset[g][me]:
            return None
        start = int(opt.grad_start_offset[g][me][param_id])
        dest = int(opt.grad_partition_insertion_offset[g][me][param_id])
        return start, min(param.numel() - start, int(opt.partition_size[g]) - dest), dest

    def copy_ranks(self, param, runs) -> tuple:
        """The ranks that must receive ``param`` whole: DeepSpeed's Muon orthogonalizes the full
        matrix, so its ``average_tensor`` all-reduces a Muon matrix split across partitions to
        every owner of a slice (``copy_ranks``). The same test as DeepSpeed's, so GIFT delivers
        exactly what the native path would."""
        if len(runs) > 1 and self.is_muon(param):
            return tuple(sorted(pid for _, _, pid in runs))
        return ()


def _narrow_state(state: dict, keys, offset: int, numel: int) -> dict:
    """An optimizer's per-partition state with the tensors named in ``keys`` narrowed to
    ``numel`` elements from ``offset`` (what an update rule's ``from_state`` takes); the rest
    (``step``) as it is."""
    return {key: value.narrow(0, offset, numel) if key in keys else value for key, value in state.items()}


def _muon_optimizer_class():
    """DeepSpeed's Muon optimizer class, or None on a DeepSpeed without it."""
    try:
        from deepspeed.runtime.zero.muon.muon_optimizer import MuonWithAuxAdam
    except ImportError:
        return None
    return MuonWithAuxAdam


class _reduction_stream:
    """Runs the reduction on DeepSpeed's reduction stream when it overlaps communication,
    with the same waits as its own average_tensor (no-op on CPU)."""

    def __init__(self, opt, comm_dtype):
        from deepspeed.accelerator import get_accelerator

        self.acc = get_accelerator()
        self.ctx = None
        if opt.overlap_comm and not self.acc.resolves_data_dependency():
            stream = opt.reduction_stream
            bucket = opt.ipg_buckets[comm_dtype]
            for producer in (getattr(bucket, "copy_streams", None) or {self.acc.current_stream()}):
                stream.wait_stream(producer)
            self.acc.current_stream().wait_stream(stream)
            self.ctx = self.acc.stream(stream)

    def __enter__(self):
        if self.ctx is not None:
            self.ctx.__enter__()
        return self

    def __exit__(self, *exc):
        if self.ctx is not None:
            return self.ctx.__exit__(*exc)
        return False


def log_like_deepspeed() -> None:
    """Route this package's log records (layer selection, refreshes) where DeepSpeed's go."""
    from deepspeed.utils import logger as ds_logger

    if not logger.handlers:
        for handler in ds_logger.handlers:
            logger.addHandler(handler)
        logger.setLevel(ds_logger.level)
        logger.propagate = False


def attach(engine) -> Optional[GiftState]:
    """Attach GIFT to an engine built by ``deepspeed.initialize`` (reads its ``gift`` block).
    Returns the state, or None when the block is missing or disabled (DeepSpeed untouched)."""
    cfg = get_gift_config(engine._config._param_dict)
    if not cfg.enabled:
        return None
    if getattr(engine, "gift", None) is not None:
        raise RuntimeError("deepspeed_gift.attach: GIFT is already attached to this engine")
    log_like_deepspeed()
    state = GiftState(engine, cfg)
    engine.gift = state
    if isinstance(state.opt, Bf16Layout):
        _attach_bf16(engine, state)
    elif isinstance(state.opt, Stage3Layout):
        native_scatter = getattr(state.opt.z3, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads")

        def avg_scatter_grads(params, communication_data_type):
            return state.avg_scatter_stage3(native_scatter, params, communication_data_type)

        _replace(state, state.opt.z3, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_grads", avg_scatter_grads)
        native_contiguous = getattr(state.opt.z3, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads")

        def avg_scatter_contiguous_grads(buffer_to_reduce, communication_data_type):
            return state.avg_scatter_stage3_contiguous(native_contiguous, buffer_to_reduce, communication_data_type)

        _replace(state, state.opt.z3, "_DeepSpeedZeroOptimizer_Stage3__avg_scatter_contiguous_grads",
                 avg_scatter_contiguous_grads)
    else:
        _attach_zero(state)
    _attach_engine(engine, state, cfg)
    return state


def _attach_bf16(engine, state: GiftState) -> None:
    """BF16_Optimizer: the engine's all-reduce of its fp32 gradients, and their norm."""
    native_fallback = engine.buffered_allreduce_fallback

    def buffered_allreduce_fallback(grads=None, *args, **kwargs):
        return state.reduce_bf16(native_fallback, grads, *args, **kwargs)

    _replace(state, engine, "buffered_allreduce_fallback", buffered_allreduce_fallback)
    bf16 = state.opt.bf16
    native_norm = bf16.get_grads_for_norm

    def get_grads_for_norm(for_clipping=False):
        return state.bf16_grads_for_norm(native_norm, for_clipping)

    _replace(state, bf16, "get_grads_for_norm", get_grads_for_norm)


def _attach_zero(state: GiftState) -> None:
    """ZeRO stage 1/2's optimizer: its bucket reduction, ZeRO-1's walk, the fallbacks for
    scattered gradients, and (``gift.params``) its step's all-gather."""
    _replace(state, state.opt, "average_tensor", state.average_tensor)
    native_reduce = state.opt.reduce_gradients

    def reduce_gradients(*args, **kwargs):
        return state.reduce_gradients(native_reduce, *args, **kwargs)

    _replace(state, state.opt, "reduce_gradients", reduce_gradients)
    native_fallback = state.opt.buffered_reduce_fallback

    def buffered_reduce_fallback(rank, grads, *args, **kwargs):
        return state.reduce_fallback(native_fallback, rank, grads, *args, **kwargs)

    _replace(state, state.opt, "buffered_reduce_fallback", buffered_reduce_fallback)
    state._carries = state.carry_applies()
    if state.cfg.node_pieces is None and isinstance(state.reducer, TwoLevelReducer) and state.reducer.pieces > 1:
        state.reducer.pieces = NODE_PIECES_CARRIED if state._carries else NODE_PIECES_BY_BUCKET
        state.exchange[-1] = state.reducer.pieces
    if state._carries:  # two-level's pipeline carried from bucket to bucket
        opt = state.opt
        native_bucket = opt.reduce_independent_p_g_buckets_and_remove_grads
        native_ipg = opt.reduce_ipg_grads
        native_copy = opt.copy_grads_in_partition

        def backward_bucket(*args, **kwargs):
            return state.backward_bucket(native_bucket, *args, **kwargs)

        def reduce_ipg_grads(*args, **kwargs):
            out = native_ipg(*args, **kwargs)
            state.after_reduce_ipg_grads()
            return out

        def copy_grads_in_partition(param, *args, **kwargs):
            return state.copy_grads_in_partition(native_copy, param, *args, **kwargs)

        _replace(state, opt, "reduce_independent_p_g_buckets_and_remove_grads", backward_bucket)
        _replace(state, opt, "reduce_ipg_grads", reduce_ipg_grads)
        _replace(state, opt, "copy_grads_in_partition", copy_grads_in_partition)
    native_preserving = getattr(state.opt, "_buffered_reduce_fallback_preserving_fp32", None)
    if native_preserving is not None:
        def preserving(grads, grad_params, *args, **kwargs):
            return state.reduce_fallback_preserving_fp32(native_preserving, grads, grad_params, *args, **kwargs)

        _replace(state, state.opt, "_buffered_reduce_fallback_preserving_fp32", preserving)
    if state.params is not None:
        native_opt_step = state.opt.step

        def optimizer_step(*args, **kwargs):
            return state.optimizer_step(native_opt_step, *args, **kwargs)

        _replace(state, state.opt, "step", optimizer_step)
        _route_param_gather(state)


def _attach_engine(engine, state: GiftState, cfg: GiftConfig) -> None:
    """The engine's model step (GIFT's per-step work) and its checkpoints."""
    # The optimizer step of both engines: DeepSpeedEngine.step calls it at the accumulation
    # boundary, PipelineEngine's OptimizerStep instruction directly (its step() only raises).
    native_model_step = getattr(engine, "_take_model_step", None)
    _require(callable(native_model_step), "gift.enabled: this DeepSpeed engine has no _take_model_step, where GIFT "
             "runs its per-step work (built and tested against DeepSpeed 0.19.8); install a DeepSpeed in the range "
             "setup.py names, or set gift.enabled to false")

    def take_model_step(*args, **kwargs):
        # The headers of this step's messages were compared on the device; read them before the
        # optimizer uses what they carried (one host read per step, not one per bucket).
        state.verify_checks()
        before = engine.global_steps
        result = native_model_step(*args, **kwargs)
        state.verify_checks()  # reductions DeepSpeed ran inside the optimizer step
        if cfg.error_feedback and not engine.was_step_applied():  # an overflow: DeepSpeed skipped it
            state.drop_residuals()
        if engine.global_steps != before:
            state.on_optimizer_step(before - cfg.start_step)
        return result

    _replace(state, engine, "_take_model_step", take_model_step)
    native_save, native_load = engine.save_checkpoint, engine.load_checkpoint

    def save_checkpoint(save_dir, tag=None, *args, **kwargs):
        tag = tag if tag is not None else f"global_step{engine.global_steps}"
        result = native_save(save_dir, tag, *args, **kwargs)
        checkpoint.save_files(state, save_dir, tag)
        return result

    def load_checkpoint(load_dir, tag=None, *args, **kwargs):
        load_path, client_state = native_load(load_dir, tag, *args, **kwargs)
        if load_path is not None:
            if tag is None:
                with open(os.path.join(load_dir, "latest")) as f:
                    tag = f.read().strip()
            checkpoint.load_files(state, load_dir, tag)
        return load_path, client_state

    _replace(state, engine, "save_checkpoint", save_checkpoint)
    _replace(state, engine, "load_checkpoint", load_checkpoint)


_ABSENT = object()

# DeepSpeed's ZeRO-1/2 step calls the module function ``all_gather_dp_groups`` of stage_1_and_2
# with the optimizer's own ``bit16_groups_flat``; while an engine with ``gift.params`` exists, that
# name points at a router that sends the call of such an engine's step to GIFT and every other
# call (other engines, ``update_lp_params`` after a universal checkpoint load) to DeepSpeed.
_PARAM_GATHERS: Dict[int, GiftState] = {}
_native_all_gather = None


def _all_gather_router(groups_flat, *args, **kwargs):
    state = _PARAM_GATHERS.get(id(groups_flat))
    if state is None or state._params_pending is None or state.opt.bit16_groups_flat is not groups_flat:
        return _native_all_gather(groups_flat, *args, **kwargs)
    return state.gather_params(lambda: _native_all_gather(groups_flat, *args, **kwargs))


def _route_param_gather(state: GiftState) -> None:
    from deepspeed.runtime.zero import stage_1_and_2

    global _native_all_gather
    if stage_1_and_2.all_gather_dp_groups is not _all_gather_router:
        _native_all_gather = stage_1_and_2.all_gather_dp_groups
        stage_1_and_2.all_gather_dp_groups = _all_gather_router
    _PARAM_GATHERS[id(state.opt.bit16_groups_flat)] = state


def _unroute_param_gather(state: GiftState) -> None:
    from deepspeed.runtime.zero import stage_1_and_2

    if _PARAM_GATHERS.get(id(state.opt.bit16_groups_flat)) is state:
        del _PARAM_GATHERS[id(state.opt.bit16_groups_flat)]
    if not _PARAM_GATHERS and stage_1_and_2.all_gather_dp_groups is _all_gather_router:
        stage_1_and_2.all_gather_dp_groups = _native_all_gather


def _replace(state: GiftState, obj, name: str, new) -> None:
    """Set ``obj.name = new``, remembering what the instance held, for :func:`detach`."""
    state.replaced.append((obj, name, obj.__dict__.get(name, _ABSENT)))
    setattr(obj, name, new)


def detach(engine) -> None:
    """Undo :func:`attach`: DeepSpeed's own reduction, ``step`` and checkpoint methods come back
    exactly as they were, GIFT's forward hooks are removed and its telemetry file closed. The
    engine then runs as if GIFT had never been attached (its gradients, from the next bucket
    on, are DeepSpeed's own); ``attach`` may be called again."""
    state = getattr(engine, "gift", None)
    if state is None:
        raise ValueError("deepspeed_gift.detach: GIFT is not attached to this engine")
    for obj, name, before in reversed(state.replaced):
        if before is _ABSENT:
            obj.__dict__.pop(name, None)  # the class's method shows again
        else:
            setattr(obj, name, before)
    state.replaced.clear()
    if state.params is not None:
        _unroute_param_gather(state)
    state.close()
    engine.gift = None
