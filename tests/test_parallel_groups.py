"""GIFT where the data-parallel group is not the world (issue 33): a Megatron-style ``mpu`` with
tensor-parallel pairs, so ranks {0, 2} and {1, 3} reduce together. Every process group GIFT makes
(two-level's node and slot groups, ``comm_timeout_s``'s own) is made on every rank of the job in
one agreed order; before that, two-level hung (torch names groups by a global counter, so {0, 2}
and {1, 3} met under one name) and ``comm_timeout_s`` refused."""

import re

import pytest

from launch.spawn import run_ranks
from tests.harness import train_many
from tests.spread import assert_within_native_spread, max_param_diff, native_perturbed

LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1}}


@pytest.mark.parametrize("stage", [1, 2])
def test_two_level_and_a_timeout_of_its_own_over_one_data_parallel_group_of_two(stage):
    # DP = 2 x TP = 2; two-level with one rank per node (two "nodes" of one rank in each DP group),
    # and the flat exchange with comm_timeout_s; lossless: DP = 2 sums x/2 + y/2, the native bits
    base = dict(stage=stage, steps=3, ga=2, bucket=12000, tp=2)
    two_level = dict(base, gift=dict(LOSSLESS, hierarchy="two_level", ranks_per_node=1))
    timed = dict(base, gift=dict(LOSSLESS, comm_timeout_s=60))
    for native, split, own_timeout in run_ranks(train_many, 4, [base, two_level, timed], timeout=300):
        for gift in (split, own_timeout):
            assert gift["losses"] == native["losses"] and max_param_diff(native, gift) == 0.0
            assert len(gift["records"]) == 3
        assert all(r["hierarchy"] == "two_level" for r in split["records"])


def test_checkpoints_and_telemetry_of_each_data_parallel_group_are_their_own(tmp_path):
    # DP = 2 x TP = 2, fp8 + kfac + error feedback + stochastic rounding: every process saves its own
    # file (named by its global rank; by the data-parallel rank, 2 files were overwritten by the
    # other group's), the resumed run continues bit for bit, and each group writes its own telemetry
    import json
    import os

    jsonl = str(tmp_path / "gift.jsonl")
    gift = {"format": "fp8_e4m3", "rounding": "stochastic", "error_feedback": True, "layers": "all",
            "geometry": {"rank": 8, "refresh_interval": 2, "collect_interval": 1},
            "telemetry": {"every": 1, "jsonl": jsonl}}
    save_dir = str(tmp_path / "ckpt")
    base = dict(stage=2, steps=5, bucket=20000, gift=gift, tp=2)
    full, first = zip(*run_ranks(train_many, 4, [base, dict(base, steps=3, save_at=3, save_dir=save_dir)],
                                 timeout=300))
    resumed = [r[0] for r in run_ranks(train_many, 4, [dict(base, resume=save_dir)], timeout=300)]
    files = sorted(f for f in os.listdir(os.path.join(save_dir, "global_step3")) if f.startswith("gift_rank"))
    assert [f for f in files if f.endswith(".pt")] == [f"gift_rank{r}.pt" for r in range(4)]
    for rank in range(4):
        assert first[rank]["losses"] == full[rank]["losses"][:3]
        assert resumed[rank]["losses"] == full[rank]["losses"][3:]
    written = sorted(os.listdir(tmp_path))
    assert "gift.rank0.jsonl" in written and "gift.rank1.jsonl" in written and "gift.jsonl" not in written
    for name in ("gift.rank0.jsonl", "gift.rank1.jsonl"):
        with open(tmp_path / name) as f:
            steps = [json.loads(line)["step"] for line in f]
        assert steps == [0, 1, 2, 3, 4, 0, 1, 2, 3, 4]  # the full run, its first part, the resumed part


def _pipe_body(rank, world, specs):
    """DP = 2 x PP = 2: a PipelineModule (a tied embedding on both stages, linear blocks between)
    trained by DeepSpeed's PipelineEngine, natively or with GIFT; per run the losses, this
    stage's parameters and GIFT's records."""
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    import torch
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from torch import nn

    import deepspeed_gift
    from tests.harness import batches, ds_config, param_digest

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    vocab, width = 256, 48

    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(width, 2 * width), nn.Linear(2 * width, width)

        def forward(self, x):
            return x + self.down(torch.nn.functional.gelu(self.up(x)))

    def logits(embedding, x):  # the tied output layer: the embedding's transpose
        return x @ embedding.weight.t()

    out = []
    for spec in specs:
        torch.manual_seed(0)
        layers = [TiedLayerSpec("embed", nn.Embedding, vocab, width), *[LayerSpec(Block) for _ in range(4)],
                  TiedLayerSpec("embed", nn.Embedding, vocab, width, forward_fn=logits)]
        model = PipelineModule(layers=layers, num_stages=2, partition_method="uniform",
                               loss_fn=lambda y, t: nn.functional.cross_entropy(y.reshape(-1, vocab), t.reshape(-1)))
        config = dict(ds_config(dict(spec, micro=2, ga=2)), train_batch_size=2 * 2 * 2)
        init = deepspeed_gift.initialize if spec.get("gift") else deepspeed.initialize
        if spec.get("install"):  # tests: DeepSpeed's own initialize with the switch on
            deepspeed_gift.install()
            init = deepspeed.initialize
        try:
            engine, _, _, _ = init(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                                   config=config)
        except ValueError as exc:
            if not spec.get("init_error"):
                raise
            out.append(str(exc))  # tests of what initialize refuses
            continue
        dp = engine.grid.get_data_parallel_id()
        start = 0
        if spec.get("resume"):  # tests: continue a run from its checkpoint (its batches too)
            engine.load_checkpoint(spec["resume"])
            start = engine.global_steps
        data = [(x[:, :-1].contiguous(), x[:, 1:].contiguous())
                for x in batches(dp, 2 * (start + spec["steps"]), 2, 17)][2 * start:]
        it = iter(data)
        losses = [float(engine.train_batch(it)) for _ in range(spec["steps"])]
        if spec.get("save_dir"):
            engine.save_checkpoint(spec["save_dir"])
        gift = getattr(engine, "gift", None)
        out.append({"losses": losses, "digest": param_digest(engine.module),
                    "params": {k: v.detach().clone() for k, v in engine.module.named_parameters()},
                    "records": list(gift.records) if gift is not None else [],
                    "version": gift.geometry.version if gift is not None else None,
                    "stage": engine.stage_id, "dp": dp})
    return out


def test_pipeline_engine_runs_gifts_step_and_lossless_equals_native():
    # DP = 2 x PP = 2, ZeRO-1 (PipelineEngine takes stage 0/1): GIFT's reduction ran under
    # PipelineEngine before, but its per-step work never did (no refresh, no telemetry)
    base = dict(stage=1, steps=4, bucket=3000)
    fp8 = {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 4, "refresh_interval": 2, "collect_interval": 1},
           "telemetry": {"every": 1}}
    results = run_ranks(_pipe_body, 4, [base, dict(base, gift=LOSSLESS), dict(base, gift=fp8)], timeout=300)
    for native, lossless, quantized in results:
        assert lossless["losses"] == native["losses"]
        assert all(bool((native["params"][k] == lossless["params"][k]).all()) for k in native["params"])
        assert [r["step"] for r in lossless["records"]] == [0, 1, 2, 3]
        assert [r["step"] for r in quantized["records"]] == [0, 1, 2, 3] and quantized["version"] == 2
        assert all(r["rounds"] > 0 for r in quantized["records"])  # ZeRO-1's rounds under the pipeline
        assert quantized["losses"][-1] < quantized["losses"][0]
    stages = {(r[0]["stage"], r[0]["dp"]) for r in results}
    assert stages == {(0, 0), (0, 1), (1, 0), (1, 1)}
    for stage in (0, 1):  # the data-parallel copies of a stage stay identical
        assert len({r[2]["digest"] for r in results if r[2]["stage"] == stage}) == 1


def _tp_body(rank, world, specs):
    """DP = 2 x TP = 2 with Megatron-style column- and row-parallel linears (classes of those
    names, not nn.Linear; their tensor-parallel all-reduces over the pair), the TP peers on the
    same data; per run the losses, this rank's parameters and GIFT's records."""
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    import torch
    import torch.distributed as dist
    from torch import nn

    import deepspeed_gift
    from tests.harness import GroupsMpu, batches, ds_config

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    mpu = GroupsMpu(2)
    vocab, width, tp = 256, 32, 2

    class ToTensorParallel(torch.autograd.Function):  # identity forward, the peers' gradients summed
        @staticmethod
        def forward(ctx, x):
            return x

        @staticmethod
        def backward(ctx, g):
            g = g.clone()
            dist.all_reduce(g, group=mpu.tp_group)
            return g

    class FromTensorParallel(torch.autograd.Function):  # the peers' partial outputs summed
        @staticmethod
        def forward(ctx, x):
            x = x.clone()
            dist.all_reduce(x, group=mpu.tp_group)
            return x

        @staticmethod
        def backward(ctx, g):
            return g

    class ColumnParallelLinear(nn.Module):
        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n_out // tp, n_in) / n_in ** 0.5)
            self.weight.tensor_model_parallel = True  # as Megatron marks its shards

        def forward(self, x):
            return ToTensorParallel.apply(x) @ self.weight.t()

    class RowParallelLinear(nn.Module):
        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n_out, n_in // tp) / n_in ** 0.5)
            self.weight.tensor_model_parallel = True

        def forward(self, x):
            return FromTensorParallel.apply(x @ self.weight.t())

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList([nn.ModuleDict({"up": ColumnParallelLinear(width, 4 * width),
                                                        "down": RowParallelLinear(4 * width, width)})
                                         for _ in range(2)])
            self.head = nn.Linear(width, vocab)

        def forward(self, ids):
            x = self.embed(ids[:, :-1])
            for block in self.blocks:
                x = x + block["down"](torch.nn.functional.gelu(block["up"](x)))
            return nn.functional.cross_entropy(self.head(x).reshape(-1, vocab), ids[:, 1:].reshape(-1))

    out = []
    for spec in specs:
        torch.manual_seed(0)
        model = Model()
        with torch.no_grad():  # each TP rank its own shard of the same full matrices
            for block in model.blocks:
                gen = torch.Generator().manual_seed(1)
                for key in ("up", "down"):
                    full = torch.randn(4 * width, width, generator=gen) / width ** 0.5
                    full = full if key == "up" else full.t().contiguous()
                    dim = 0 if key == "up" else 1
                    block[key].weight.copy_(full.chunk(tp, dim=dim)[mpu.get_model_parallel_rank()])
        init = deepspeed_gift.initialize if spec.get("gift") else deepspeed.initialize
        engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=ds_config(spec), mpu=mpu)
        losses = []
        for ids in batches(mpu.get_data_parallel_rank(), spec["steps"], 2, 17):
            if spec.get("unsync_copy") and dist.get_rank() == 1:  # tests: one replica moved behind GIFT's back
                with torch.no_grad():  # (its bit16 copy, every step: DeepSpeed's step overwrites it)
                    # every other logit moved: the softmax, and so the gradients, change (a shift
                    # of all of them would change only their rounding, which quantization may hide)
                    model.head.bias[::2].add_(1.0)
            loss = engine(ids)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss))
        gift = getattr(engine, "gift", None)
        out.append({"losses": losses, "params": {k: v.detach().clone() for k, v in engine.module.named_parameters()},
                    "records": list(gift.records) if gift is not None else [],
                    "candidates": sorted(gift.geometry.names) if gift is not None else []})
    return out


@pytest.mark.parametrize("stage", [1, 2])
def test_tensor_parallel_linears_take_geometry_and_lossless_equals_native(stage):
    # Megatron-style ColumnParallelLinear / RowParallelLinear are not nn.Linear: before, "all" found
    # only the head, and a pattern naming them raised
    base = dict(stage=stage, steps=4, bucket=4000)
    fp8 = {"format": "fp8_e4m3", "layers": ["*.up", "*.down"],
           "geometry": {"rank": 4, "refresh_interval": 2, "collect_interval": 1}, "telemetry": {"every": 1}}
    for native, lossless, quantized in run_ranks(_tp_body, 4, [base, dict(base, gift=LOSSLESS), dict(base, gift=fp8)],
                                                 timeout=300):
        assert lossless["losses"] == native["losses"] and max_param_diff(native, lossless) == 0.0
        assert quantized["candidates"] == ["blocks.0.down", "blocks.0.up", "blocks.1.down", "blocks.1.up"]
        assert all(r["geometry_layers"] == 4 for r in quantized["records"])
        # fp8 + kfac follows the native run (FP8's ~2% gradient error moves 4 steps of a loss by far less)
        assert all(abs(q - n) < 0.01 * n for q, n in zip(quantized["losses"], native["losses"]))


FP8_SR = {"format": "fp8_e4m3", "rounding": "stochastic", "error_feedback": True, "layers": "all",
          "geometry": {"rank": 4, "refresh_interval": 5, "collect_interval": 1}, "telemetry": {"every": 0}}


@pytest.mark.parametrize("stage", [1, 2])
def test_tensor_parallel_replicas_stay_bit_identical_under_fp8_with_stochastic_rounding(stage):
    # DP = 2 x TP = 2: the embedding and the head are replicated on the TP peers (not marked
    # model-parallel) and reduced by two data-parallel groups; their gradients are identical on the
    # peers, so native keeps them identical, and GIFT must too (before: the fp8 blocks they share
    # with the peers' different shards, the owner's exact own part: 4.9e-4 apart after 6 steps)
    results = run_ranks(_tp_body, 4, [dict(stage=stage, steps=20, bucket=4000, gift=FP8_SR)], timeout=300)
    for peers in ((0, 1), (2, 3)):
        a, b = (results[r][0]["params"] for r in peers)
        replicated = [k for k in a if not k.startswith("blocks.")]
        assert replicated == ["embed.weight", "head.weight", "head.bias"]
        assert all(bool((a[k] == b[k]).all()) for k in replicated), \
            {k: float((a[k] - b[k]).abs().max()) for k in replicated}
        assert any(not bool((a[k] == b[k]).all()) for k in a if k.startswith("blocks."))  # shards differ
    assert results[0][0]["losses"][-1] < results[0][0]["losses"][0]


def test_a_config_that_differs_in_one_data_parallel_group_fails_at_initialize_everywhere():
    # DP = 2 x TP = 2: global rank 1 (data-parallel group {1, 3}) runs another gift.format. The
    # config is checked over the whole job: before, only {1, 3} failed and {0, 2} trained on
    from tests.harness import initialize_error

    spec = dict(stage=2, tp=2, gift={"format": "fp8_e4m3"}, gift_on_rank={"1": {"format": "int8"}})
    errors = run_ranks(initialize_error, 4, spec, timeout=300)
    assert all("gift.format differs between ranks: global rank 0 has 'fp8_e4m3', global rank 1 has 'int8'" in e
               for e in errors), errors


def test_pipeline_stages_save_their_own_checkpoints_and_resume_bit_for_bit_two_level(tmp_path):
    # DP = 2 x PP = 2, fp8 + kfac + error feedback + stochastic rounding, two-level with one rank
    # per node: every process (both stages of both groups) saves its own GIFT file, and the run
    # resumed from step 2 continues the uninterrupted one bit for bit
    import os

    gift = dict(FP8_SR, hierarchy="two_level", ranks_per_node=1,
                geometry=dict(FP8_SR["geometry"], refresh_interval=2))
    save_dir = str(tmp_path / "ckpt")
    base = dict(stage=1, steps=4, bucket=3000, gift=gift)
    full = run_ranks(_pipe_body, 4, [base, dict(base, steps=2, save_dir=save_dir)], timeout=300)
    resumed = run_ranks(_pipe_body, 4, [dict(base, steps=2, resume=save_dir)], timeout=300)
    tags = os.listdir(save_dir)
    files = sorted(f for tag in tags if os.path.isdir(os.path.join(save_dir, tag))
                   for f in os.listdir(os.path.join(save_dir, tag)) if f.startswith("gift_rank") and f.endswith(".pt"))
    assert files == [f"gift_rank{r}.pt" for r in range(4)], files
    for (whole, first), (second,) in zip(full, resumed):
        assert all(r["hierarchy"] == "two_level" for r in whole["records"])
        assert first["losses"] == whole["losses"][:2] and second["losses"] == whole["losses"][2:]
        assert all(bool((whole["params"][k] == second["params"][k]).all()) for k in whole["params"])


def test_a_pipeline_engine_built_by_deepspeed_gets_gift_under_the_switch():
    # deepspeed.initialize builds the PipelineEngine (as GPT-NeoX does) with deepspeed_gift.install()
    # on: GIFT attaches once the engine is whole (before: the hook saw it half-built, warned and
    # left it native)
    base = dict(stage=1, steps=3, bucket=3000)
    for native, switched in run_ranks(_pipe_body, 4, [base, dict(base, gift=LOSSLESS, install=True)], timeout=300):
        assert [r["step"] for r in switched["records"]] == [0, 1, 2]
        assert switched["losses"] == native["losses"]
        assert all(bool((native["params"][k] == switched["params"][k]).all()) for k in native["params"])


def test_bf16_with_fp32_accumulation_under_the_pipeline_lossless_equals_native():
    # DeepSpeed picks BF16_Optimizer (Megatron-DeepSpeed's bf16 pipeline recipe): the pipeline's
    # reduction of its fp32 gradients goes through GIFT's rounds; the tied embedding's gradient,
    # summed over the stages first (its _hp_grad), travels elementwise as a copy
    base = dict(stage=1, steps=3, bucket=3000, dtype="bf16", grad_accum_dtype="fp32")
    for native, lossless in run_ranks(_pipe_body, 4, [base, dict(base, gift=LOSSLESS)], timeout=300):
        assert [r["step"] for r in lossless["records"]] == [0, 1, 2]
        assert all(r["rounds"] > 0 for r in lossless["records"])
        assert lossless["losses"] == native["losses"]
        assert all(bool((native["params"][k] == lossless["params"][k]).all()) for k in native["params"])


def test_a_quantized_parameter_gather_is_refused_where_parameters_have_copies_in_other_groups():
    # its block scales would mix a replica with shards that differ between the groups: the copies'
    # replicas would differ from the first gather on (every process says so at initialize)
    with pytest.raises(RuntimeError) as failure:
        run_ranks(_tp_body, 4, [dict(stage=2, steps=1, bucket=4000, gift=dict(FP8_SR, params={}))], timeout=300)
    text = str(failure.value)
    for rank in range(4):
        line = next(line for line in text.splitlines() if line.startswith(f"rank {rank} (after"))
        assert "ValueError: gift.params: a quantized parameter gather would give the copies" in line, line


def test_copies_that_differ_fail_at_the_refresh_naming_the_parameter():
    # one tensor-parallel peer's replicated head bias is moved before every forward (in its bit16
    # copy, not DeepSpeed's fp32 master): that peer's gradients differ, so the replicated copies
    # reduced by its data-parallel group do, and the digest check at a refresh step fails on the
    # peers, naming the first (refreshes at steps 0 and 2: Adam's first step, g / |g|, can leave
    # copies whose gradients differ only in size equal)
    gift = dict(FP8_SR, geometry=dict(FP8_SR["geometry"], refresh_interval=2))
    with pytest.raises(RuntimeError) as failure:
        run_ranks(_tp_body, 4, [dict(stage=2, steps=3, bucket=4000, gift=gift, unsync_copy=True)], timeout=300)
    message = str(failure.value)
    named = re.search(r"the copies of '([\w.]+)' \(tensor-parallel replica\) differ between global ranks \[0, 1\]",
                      message)
    # a replica (the embedding or the head), never a marked shard (the blocks' weights)
    assert named and not named.group(1).endswith(("up.weight", "down.weight")), message


def test_tied_pipeline_copies_stay_bit_identical_under_fp8_with_stochastic_rounding():
    # DP = 2 x PP = 2: the embedding is tied to the output layer on the other stage; DeepSpeed sums
    # its two gradients over the stages, then each stage's data-parallel group reduces its copy in
    # a bucket of another layout (before: 1.1e-3 apart after 6 steps)
    results = run_ranks(_pipe_body, 4, [dict(stage=1, steps=20, bucket=3000, gift=FP8_SR)], timeout=300)
    by = {(r[0]["stage"], r[0]["dp"]): r[0] for r in results}
    for dp in (0, 1):
        first, last = by[0, dp]["params"], by[1, dp]["params"]
        tied = [k for k in first if k.startswith("tied_modules.")]
        assert tied and tied == [k for k in last if k.startswith("tied_modules.")]
        assert all(bool((first[k] == last[k]).all()) for k in tied), \
            {k: float((first[k] - last[k]).abs().max()) for k in tied}
    assert by[1, 0]["losses"][-1] < by[1, 0]["losses"][0]


def test_a_pattern_that_matches_on_one_stage_only_is_fine_and_one_that_matches_nowhere_fails_everywhere():
    # DP = 2 x PP = 2: PipelineModule names layers by index, blocks 1-2 on stage 0 and 3-4 on stage 1.
    # Before, a pattern naming stage 1's layers only killed stage 0 at initialize (stage 1 waited).
    base = dict(stage=1, steps=2, bucket=3000)
    one_stage = {"format": "fp8_e4m3", "layers": ["4.*"], "geometry": {"rank": 4}, "telemetry": {"every": 1}}
    results = run_ranks(_pipe_body, 4, [dict(base, gift=one_stage)], timeout=300)
    layers = {r[0]["stage"]: r[0]["records"][-1]["geometry_layers"] for r in results}
    assert layers[0] == 0 and layers[1] == 2
    with pytest.raises(RuntimeError) as info:
        run_ranks(_pipe_body, 4, [dict(base, gift=dict(one_stage, layers=["9.*"]))], timeout=300)
    lines = [line for line in str(info.value).splitlines() if line.startswith("rank ")]
    assert len(lines) == 4 and all("gift.layers: pattern(s) ['9.*'] match no trainable linear module" in line
                                   for line in lines), lines  # every stage raised, none waits


def _ulysses_body(rank, world, specs):
    """Sequence parallelism of 2 on 4 ranks, in one of two layouts. ``"ulysses"``: DeepSpeed's own
    Ulysses ``mpu`` (``parallel_state_sp``, what its Hugging Face integration hands
    ``deepspeed.initialize``): SP pairs {0, 1} and {2, 3}, DP = 2, one sequence-data-parallel group
    of all 4. ``"tp_sp"``: a Megatron-style ``mpu`` with TP pairs {0, 1} and {2, 3} (the model
    replicated on them, as ``GroupsMpu`` does), SP pairs {0, 2} and {1, 3}, DP = 1: the
    sequence-data-parallel group is an SP pair. The model works token by token (no attention, so no
    all-to-all) and each SP rank takes its half of the positions; per run the losses, this rank's
    parameters, what the ZeRO optimizer was handed and GIFT's records."""
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    import torch
    import torch.distributed as dist
    from torch import nn

    import deepspeed_gift
    from tests.harness import GroupsMpu, batches, ds_config, param_digest, perturb_gradients

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")
    sp, vocab, width = 2, 256, 32

    class TensorAndSequenceMpu(GroupsMpu):
        """``GroupsMpu(2)``'s data-parallel pairs as sequence-parallel pairs; DP = 1."""

        def __init__(self):
            super().__init__(2)
            self.sp_group = self.dp_group
            singles = [dist.new_group(ranks=[r]) for r in range(world)]  # every rank makes every group
            self.dp_group, self.dp_ranks = singles[rank], [rank]

        def get_sequence_parallel_group(self):
            return self.sp_group

        def get_sequence_parallel_rank(self):
            return dist.get_rank(group=self.sp_group)

        def get_sequence_parallel_world_size(self):
            return sp

        get_sequence_data_parallel_group = get_sequence_parallel_group
        get_sequence_data_parallel_rank = get_sequence_parallel_rank
        get_sequence_data_parallel_world_size = get_sequence_parallel_world_size

    mpus = {}

    def layout_mpu(layout):  # once per process: parallel_state_sp is module state
        if layout not in mpus:
            if layout == "ulysses":
                from deepspeed.runtime.sequence_parallel import parallel_state_sp

                parallel_state_sp.initialize_sequence_parallel(sequence_parallel_size=sp)
                mpus[layout] = parallel_state_sp
            else:
                mpus[layout] = TensorAndSequenceMpu()
        return mpus[layout]

    class Model(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(vocab, width)
            self.blocks = nn.ModuleList([nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(),
                                                       nn.Linear(4 * width, width)) for _ in range(2)])
            self.head = nn.Linear(width, vocab)

        def forward(self, x, y):
            x = self.embed(x)
            for block in self.blocks:
                x = x + block(x)
            return nn.functional.cross_entropy(self.head(x).reshape(-1, vocab), y.reshape(-1))

    out = []
    for spec in specs:
        mpu = layout_mpu(spec["layout"])
        sp_rank, dp_rank = mpu.get_sequence_parallel_rank(), mpu.get_sequence_data_parallel_rank() // sp
        torch.manual_seed(0)
        model = Model()
        init = deepspeed_gift.initialize if spec.get("gift") else deepspeed.initialize
        engine, _, _, _ = init(model=model, model_parameters=model.parameters(), config=ds_config(spec), mpu=mpu)
        if spec.get("perturb_ulps"):
            perturb_gradients(engine.module, spec["perturb_ulps"], rank)
        losses = []
        for ids in batches(dp_rank, spec["steps"], 2, 17):  # 16 positions, 8 on each SP rank
            x, y = (t.chunk(sp, dim=1)[sp_rank].contiguous() for t in (ids[:, :-1], ids[:, 1:]))
            loss = engine(x, y)
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
        opt, gift = engine.optimizer, getattr(engine, "gift", None)
        out.append({"losses": losses, "digest": param_digest(engine.module),
                    "params": {k: v.detach().clone() for k, v in engine.module.named_parameters()},
                    "zero_group": dist.get_process_group_ranks(opt.dp_process_group),
                    "sp_size": opt.sequence_parallel_size,
                    "divisor": gift._divisor() if gift is not None else None,
                    "records": list(gift.records) if gift is not None else []})
    return out


# SGD, not Adam: Adam divides by sqrt(v), so a gradient off by a constant factor (a wrong divisor)
# would move its steps only through eps
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True}


@pytest.mark.parametrize("stage", [1, 2])
def test_ulysses_sequence_parallel_lossless_equals_native(stage):
    # DeepSpeed's ZeRO reduces over the sequence-data-parallel group and divides by its size over
    # sequence_parallel_size (the SP parts of a sequence add up, the DP copies average); GIFT must
    # take that group and divisor. TP x SP (a group of 2, divisor 1): the very bits of native (one
    # addition); without the SP factor GIFT would halve every gradient. DeepSpeed's own Ulysses
    # (a group of 4, divisor 2): GIFT sums 4 ranks in rank order and gloo in its own, as plain
    # DP = 4 does (1 ulp apart there too), so within native's spread (tests/spread.py)
    base = dict(stage=stage, steps=3, bucket=4000, extra=SGD)
    ulysses, tp_sp = dict(base, layout="ulysses"), dict(base, layout="tp_sp")
    specs = [tp_sp, dict(tp_sp, gift=LOSSLESS), ulysses, dict(ulysses, gift=LOSSLESS), native_perturbed(ulysses, 4)]
    results = run_ranks(_ulysses_body, 4, specs, timeout=300)
    for rank, (native, lossless, u_native, u_lossless, u_perturbed) in enumerate(results):
        assert native["zero_group"] == lossless["zero_group"] == [rank % 2, rank % 2 + 2]
        assert native["sp_size"] == lossless["sp_size"] == 2 and lossless["divisor"] == 1.0
        assert lossless["losses"] == native["losses"] and max_param_diff(native, lossless) == 0.0
        assert u_native["zero_group"] == u_lossless["zero_group"] == [0, 1, 2, 3]
        assert u_native["sp_size"] == u_lossless["sp_size"] == 2 and u_lossless["divisor"] == 2.0
        assert_within_native_spread(u_native, u_perturbed, u_lossless)
        for gift in (lossless, u_lossless):
            assert [r["step"] for r in gift["records"]] == [0, 1, 2]
    for run in range(len(specs)):  # SP peers see different halves; every rank holds one model
        tp_peer, sp_peer = (1, 2) if specs[run]["layout"] == "tp_sp" else (None, 1)
        assert results[0][run]["losses"] != results[sp_peer][run]["losses"]
        assert tp_peer is None or results[0][run]["losses"] == results[tp_peer][run]["losses"]
        assert len({r[run]["digest"] for r in results}) == 1
