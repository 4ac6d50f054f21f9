"""GIFT where the data-parallel group is not the world (issue 33): a Megatron-style ``mpu`` with
tensor-parallel pairs, so ranks {0, 2} and {1, 3} reduce together. Every process group GIFT makes
(two-level's node and slot groups, ``comm_timeout_s``'s own) is made on every rank of the job in
one agreed order; before that, two-level hung (torch names groups by a global counter, so {0, 2}
and {1, 3} met under one name) and ``comm_timeout_s`` refused."""

import pytest

from launch.spawn import run_ranks
from tests.harness import train_many
from tests.spread import max_param_diff

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
        engine, _, _, _ = init(model=model, model_parameters=[p for p in model.parameters() if p.requires_grad],
                               config=config)
        dp = engine.grid.get_data_parallel_id()
        data = [(x[:, :-1].contiguous(), x[:, 1:].contiguous()) for x in batches(dp, 2 * spec["steps"], 2, 17)]
        it = iter(data)
        losses = [float(engine.train_batch(it)) for _ in range(spec["steps"])]
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

        def forward(self, x):
            return ToTensorParallel.apply(x) @ self.weight.t()

    class RowParallelLinear(nn.Module):
        def __init__(self, n_in, n_out):
            super().__init__()
            self.weight = nn.Parameter(torch.randn(n_out, n_in // tp) / n_in ** 0.5)

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
