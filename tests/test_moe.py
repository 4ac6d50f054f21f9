"""DeepSpeed-MoE (``deepspeed.moe.layer.MoE``) with GIFT under ZeRO stage 1/2: 4 ranks, 4 experts,
expert parallelism 2, so ranks {0, 2} hold experts 0-1 and {1, 3} experts 2-3. DeepSpeed reduces
the dense parameters over the data-parallel group and each expert parameter over its
expert-data-parallel group (both divided by the data-parallel size); GIFT runs one exchange per
group, each with its own plans, and gives each expert group's layers a geometry of their own,
shared over the group's ranks (one module name holds another expert on each expert-parallel rank,
the same one on each rank of its group). Real engines on gloo ranks, real text."""

import pytest

from launch.spawn import run_ranks
from tests.spread import assert_within_native_spread, native_perturbed

LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1}}
FP8_KFAC_EF = {"format": "fp8_e4m3", "rounding": "stochastic", "error_feedback": True, "layers": "all",
               "telemetry": {"every": 1}, "geometry": {"rank": 8, "refresh_interval": 2, "collect_interval": 1}}
VOCAB, WIDTH, SEQ = 256, 64, 16
# SGD for the lossless comparison: Adam divides by sqrt(v), so an element whose 4-rank sum nearly
# cancels turns a rounding of that sum into a step of order lr, and one element's luck decides the
# distance (tests/spread.py); SGD moves each parameter by lr times the rounding
SGD = {"optimizer": {"type": "SGD", "params": {"lr": 0.5}}, "zero_allow_untested_optimizer": True}


def _moe_body(rank, world, specs):
    """Per spec: an embedding, one DeepSpeed MoE layer of MLP experts and a head trained on the
    corpus natively or with GIFT; losses, parameters, GIFT's records and geometry."""
    import sys

    import deepspeed
    import deepspeed.comm.torch  # noqa: F401
    import torch
    from deepspeed.moe.layer import MoE
    from deepspeed.moe.utils import split_params_into_different_moe_groups_for_optimizer
    from torch import nn

    import deepspeed_gift
    from tests.harness import batches, ds_config, perturb_gradients

    sys.modules["deepspeed.comm.torch"].build_shm_op = lambda: None
    deepspeed.init_distributed(dist_backend="gloo")

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, WIDTH)
            self.proj = nn.Linear(WIDTH, WIDTH)
            expert = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.GELU(), nn.Linear(2 * WIDTH, WIDTH))
            self.moe = MoE(hidden_size=WIDTH, expert=expert, num_experts=4, ep_size=2, k=1, min_capacity=0,
                           use_rts=False)  # no random token selection: a resumed run routes as the whole one
            self.head = nn.Linear(WIDTH, VOCAB)

        def forward(self, tokens):
            h = torch.tanh(self.proj(self.embed(tokens)))
            out, aux, _ = self.moe(h)
            return self.head(h + out), aux

    out = []
    for spec in specs:
        torch.manual_seed(0)
        model = Net()
        groups = split_params_into_different_moe_groups_for_optimizer({"params": list(model.parameters()),
                                                                       "name": "dense"})
        init = deepspeed_gift.initialize if spec.get("gift") else deepspeed.initialize
        try:
            engine, _, _, _ = init(model=model, model_parameters=groups, config=ds_config(spec))
        except ValueError as exc:
            if not spec.get("init_error"):
                raise
            out.append(str(exc))
            continue
        if spec.get("perturb_ulps"):
            perturb_gradients(engine.module, spec["perturb_ulps"], rank)
        done = 0
        if spec.get("resume"):
            engine.load_checkpoint(spec["resume"])
            done = engine.global_steps
        losses = []
        for i, x in enumerate(batches(rank, spec["steps"], 4, SEQ + 1)):
            if i < done:
                continue
            logits, aux = engine(x[:, :-1])
            loss = nn.functional.cross_entropy(logits.reshape(-1, VOCAB), x[:, 1:].reshape(-1)) + 0.01 * aux
            engine.backward(loss)
            engine.step()
            losses.append(float(loss.detach()))
            if spec.get("save_at") == engine.global_steps:
                engine.save_checkpoint(spec["save_dir"])
        gift = getattr(engine, "gift", None)
        result = {"losses": losses, "params": {k: v.detach().clone() for k, v in engine.module.named_parameters()}}
        if gift is not None:
            result.update(records=list(gift.records), version=gift.geometry.version,
                          active=sorted(gift.geometry.active), experts=sorted(gift.expert_reducers),
                          expert_active={k: sorted(g.active) for k, g in gift.expert_geometry.items()},
                          expert_versions={k: g.version for k, g in gift.expert_geometry.items()})
        out.append(result)
        torch.distributed.barrier()
    return out


@pytest.mark.parametrize("stage,rounds", [(2, True), (1, True), (1, False)],
                         ids=["stage2", "stage1-rounds", "stage1-buckets"])
def test_lossless_gift_is_within_native_spread_with_experts_reduced_over_their_groups(stage, rounds):
    # the expert groups have 2 ranks (one addition: exact); the dense group 4 (GIFT sums in rank
    # order, gloo in its own): within native's own spread under rounding-sized changes
    base = dict(stage=stage, steps=3, bucket=12000, extra=SGD)
    specs = [base, dict(base, gift=dict(LOSSLESS, stage1_rounds=rounds)), native_perturbed(base, 4)]
    results = run_ranks(_moe_body, 4, specs, timeout=300)
    for rank, (native, lossless, perturbed) in enumerate(results):
        assert lossless["experts"] == ["ep_size_2"]
        assert_within_native_spread(native, perturbed, lossless)
        # the fidelity check's exact reduction sums the 4 ranks in another order: W u = 2.4e-7 at most
        assert len(lossless["records"]) == 3 and all(r["fidelity_rel_err"] <= 4 * 2.0**-24
                                                     for r in lossless["records"]), lossless["records"]
        assert all((r["rounds"] > 0) == (stage == 1 and rounds) for r in lossless["records"])
    # each expert group ends with one model: ranks 0 and 2 hold the same experts, 1 and 3 theirs
    for a, b in ((0, 2), (1, 3)):
        for k in results[a][1]["params"]:
            assert bool((results[a][1]["params"][k] == results[b][1]["params"][k]).all()), k


def test_fp8_with_geometry_on_dense_and_expert_layers_trains_and_resumes_exactly(tmp_path):
    # stochastic rounding and error feedback in every exchange: the expert groups' residuals,
    # generators and geometry are in the checkpoint beside the dense one's
    save_dir = str(tmp_path / "ckpt")
    base = dict(stage=2, steps=6, bucket=12000, gift=FP8_KFAC_EF, lr=1e-2)
    experts_only = dict(base, steps=2, gift=dict(FP8_KFAC_EF, layers=["*.deepspeed_experts.*"]))
    results = run_ranks(_moe_body, 4, [dict(base, extra={}), dict(base, steps=3, save_at=3, save_dir=save_dir),
                                       experts_only], timeout=300)
    resumed = run_ranks(_moe_body, 4, [dict(base, resume=save_dir)], timeout=300)
    for (full, first, named), (again,) in zip(results, resumed):
        assert full["losses"][-1] < full["losses"][0] - 0.3, full["losses"]
        assert full["version"] >= 2 and full["active"]
        assert not any("deepspeed_experts" in name for name in full["active"]), full["active"]
        # each local expert's two linears whitened by the expert group's shared statistics
        (group, layers), = full["expert_active"].items()
        assert group == "ep_size_2" and full["expert_versions"][group] == full["version"]
        assert len(layers) == 4 and all("deepspeed_experts" in name for name in layers), layers
        # a layers pattern may name the experts alone
        assert named["active"] == [] and len(named["expert_active"]["ep_size_2"]) == 4
        assert all(1.0 < (r["bytes_payload"] + r["bytes_header"]) / r["elements_sent"] < 1.1
                   for r in full["records"])
        assert all(r["error_feedback_bytes"] > 0 for r in full["records"])
        # the expert groups' stochastic rounding and residuals continue from the checkpoint
        assert first["losses"] == full["losses"][:3] and again["losses"] == full["losses"][3:]
        assert all(bool((full["params"][k] == again["params"][k]).all()) for k in full["params"])
    # the ranks of an expert group whiten with the same shared factors: they end with one model
    for a, b in ((0, 2), (1, 3)):
        assert all(bool((results[a][0]["params"][k] == results[b][0]["params"][k]).all())
                   for k in results[a][0]["params"])


def test_what_the_expert_exchanges_do_not_carry_yet_fails_at_initialize_naming_the_key():
    cases = [
        (dict(FP8_KFAC_EF, params={}), "gift.params: the compressed parameter all-gather serves one"),
    ]
    results = run_ranks(_moe_body, 4, [dict(stage=2, steps=1, gift=g, init_error=True) for g, _ in cases],
                        timeout=300)
    for per_rank in results:
        for message, (_, expected) in zip(per_rank, cases):
            assert expected in message, (expected, message)
