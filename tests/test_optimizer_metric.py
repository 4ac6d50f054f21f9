"""The optimizer's metric reads the real optimizer state: the update rule GIFT builds for a
layer predicts the step DeepSpeed actually takes (Muon's whole-matrix momentum, Adam's
moments of a ZeRO slice), and ``layers: "measured"`` judges layers in it."""

import pytest
import torch

from deepspeed_gift.core import metrics
from launch.spawn import run_ranks

LOSSLESS = {"format": "fp32", "geometry": {"kind": "hadamard"}, "layers": "all", "telemetry": {"every": 0}}
# DeepSpeed's Muon runs the Gram form of Newton-Schulz, ours the standard quintic form
# (mathematically the same map). DeepSpeed 0.19.8 runs it in fp16 where the accelerator has
# fp16, CPU included; the test runs it in fp32 (harness switch muon_ns_fp32), as the metric
# does, so directions agree to ~1e-4 and the comparison sees the rule, not fp16 rounding.
MUON_DIRECTION_RTOL = 2e-3
# torch's Adam and the rule compute m_hat / (sqrt(v_hat) + eps) in a different order.
ADAM_DIRECTION_RTOL = 1e-4


def _predict_body(rank, world, spec):
    import torch.distributed as dist

    from tests.harness import batches, build_engine

    engine = build_engine(spec)
    gift = engine.gift
    local = {}
    for name, module in gift.geometry.modules.items():
        module.weight.register_hook(lambda g, name=name: local.__setitem__(name, g.detach().clone()) or g)
    out = []
    for step, tokens in enumerate(batches(engine.global_rank, 4, 2, 32)):
        loss = engine(input_ids=tokens, labels=tokens).loss
        engine.backward(loss)
        if step < 3:
            engine.step()
            continue
        mine = sorted(n for n, r in gift.geometry.capture_rank.items() if r == rank)
        rules = {n: gift.optimizer_state.update_rule(n) for n in mine}  # state before this step
        before = {n: m.weight.detach().clone() for n, m in gift.geometry.modules.items()}
        avg = {}
        for name in sorted(local):
            g = local[name].clone()
            dist.all_reduce(g)
            avg[name] = g / world
        engine.step()
        lr = engine.optimizer.optimizer.param_groups[0]["lr"]
        for name in mine:
            rule = rules[name]
            delta = (gift.geometry.modules[name].weight.detach() - before[name])
            if isinstance(rule, metrics.MuonRule):
                rows, cols = delta.shape
                scale = (rows / cols) ** 0.5 if rows > cols else 1.0
                predicted = -lr * scale * rule.direction(avg[name])
                out.append((name, "muon", metrics.relative_error(delta, predicted)))
            else:
                n = rule.exp_avg.numel()
                taken = delta.reshape(-1).narrow(0, rule.start, n)
                group = engine.optimizer.optimizer.param_groups[-1]
                decay = group["lr"] * group.get("weight_decay", 0.0) * before[name].reshape(-1).narrow(0, rule.start, n)
                predicted = -group["lr"] * rule.direction(avg[name]) - decay  # AdamW's decoupled decay
                out.append((name, "adam", metrics.relative_error(taken, predicted)))
    return out


@pytest.mark.parametrize("optimizer", [pytest.param("muon", marks=pytest.mark.isa), "adam"])
def test_update_rule_predicts_the_step_deepspeed_takes(optimizer):
    spec = dict(stage=2, steps=4, bucket=20000, optimizer=optimizer, gift=LOSSLESS,
                lr=2e-2 if optimizer == "muon" else 3e-3, muon_ns_fp32=True)
    results = run_ranks(_predict_body, 2, spec)
    seen = {kind for per_rank in results for _, kind, _ in per_rank}
    # under Muon, lm_head is in the Adam half: both rules are exercised
    assert seen == ({"muon", "adam"} if optimizer == "muon" else {"adam"})
    for per_rank in results:
        for name, kind, err in per_rank:
            assert err <= (MUON_DIRECTION_RTOL if kind == "muon" else ADAM_DIRECTION_RTOL), (name, kind, err)


def test_rules_see_what_plain_l2_does_not():
    # A gradient with a few strong input directions: the same relative L2 error put along the
    # strong directions (as whitening does) or along weak ones (as Euclidean block scaling
    # leaves it) is far apart after Newton-Schulz, which amplifies weak directions.
    g = torch.Generator().manual_seed(0)
    U = torch.linalg.qr(torch.randn(64, 64, generator=g)).Q
    spectrum = torch.logspace(0, -3, 64)
    G = torch.randn(32, 64, generator=g) @ torch.diag(spectrum) @ U.T
    noise = torch.randn(32, 64, generator=g)
    strong = noise @ torch.diag(spectrum) @ U.T
    weak = noise @ torch.diag(spectrum.flip(0)) @ U.T
    strong *= 0.01 * G.norm() / strong.norm()
    weak *= 0.01 * G.norm() / weak.norm()
    rule = metrics.MuonRule(momentum=torch.zeros_like(G), beta=0.0, nesterov=False)
    assert metrics.relative_error(G + strong, G) == pytest.approx(metrics.relative_error(G + weak, G), rel=1e-6)
    assert metrics.update_relative_error(rule, G + weak, G) > 5 * metrics.update_relative_error(rule, G + strong, G)


def _auto_body(rank, world, spec):
    from tests.harness import train

    result = train(rank, world, spec)
    return [r for r in result["records"] if "profile_update" in r], result["active"], result["gains"]


def test_auto_selects_layers_by_the_muon_update_error():
    gift = {"format": "nvfp4", "layers": "measured", "geometry": {"rank": 8, "refresh_interval": 2},
            "selection": {"min_gain": 0.0, "metric": "optimizer"}, "telemetry": {"every": 1}}
    spec = dict(stage=2, steps=5, bucket=20000, optimizer="muon", gift=gift)
    (profiles, active, gains), _ = run_ranks(_auto_body, 2, spec)
    assert len(profiles) == 2  # refreshes at steps 2 and 4 judge the whiteners of 0 and 2
    last = profiles[-1]
    assert last["update_metric"] == "adam+muon" and last["profile_judged"] == 15
    assert last["profile_layers"] == len(active) > 0
    for name, row in last["profile_per_layer"].items():
        gain = 1 - row["geo_optimizer"] / row["euclid_optimizer"]
        assert gain == pytest.approx(gains[name], rel=1e-4, abs=1e-5)  # per-layer rows keep 6 digits
        assert row["selected"] == (gain >= 0.0)
    # the selection's own metric can only improve on all-Euclidean at the step it was judged on
    assert last["profile_update"] < last["profile_update_euclid"]
    assert 0 < last["profile_l2_euclid"] < 0.3 and 0 < last["profile_whitened"] < 0.3


def _choice_body(rank, world, spec):
    from tests.harness import train

    result = train(rank, world, spec)
    return [r for r in result["records"] if "profile_update" in r], result["kinds"], result["gains"]


def test_each_layer_takes_the_geometry_that_measures_best_in_adams_update():
    # Two kinds judged per layer at every refresh; the layer takes the better one (or stays
    # Euclidean), all ranks alike. Under AdamW at int4, Adam's own geometry should win layers.
    gift = {"format": "int4", "layers": "measured", "geometry": {"kind": ["kfac_input", "adam_factored"], "rank": 8,
                                                             "refresh_interval": 2},
            "selection": {"min_gain": 0.0, "metric": "optimizer"}, "telemetry": {"every": 1}}
    spec = dict(stage=2, steps=5, bucket=20000, gift=gift)
    results = run_ranks(_choice_body, 2, spec)
    (profiles, kinds, gains) = results[0]
    assert results[1][1] == kinds and results[1][2] == gains
    last = profiles[-1]
    assert last["update_metric"] == "adam" and last["profile_judged"] == 15
    for name, row in last["profile_per_layer"].items():
        both = row["kinds"]
        assert set(both) == {"kfac_input", "adam_factored"}
        best = min(both, key=lambda k: both[k]["optimizer"])
        assert row["kind"] == best and row["geo_optimizer"] == both[best]["optimizer"]
        gain = 1 - row["geo_optimizer"] / row["euclid_optimizer"]
        # per-layer rows keep 6 decimals: the gain from them is off by up to ~1e-6 / euclid
        assert gain == pytest.approx(gains[name], abs=2e-6 / row["euclid_optimizer"])
        assert row["selected"] == (gains[name] >= 0.0) == (name in kinds)
        if name in kinds:
            assert kinds[name] == best
    assert sum(k == "adam_factored" for k in kinds.values()) > len(kinds) / 2, kinds
    assert last["profile_update"] < last["profile_update_euclid"]
    assert last["geometry_kinds"] == {kind: sum(k == kind for k in kinds.values())
                                      for kind in ("kfac_input", "adam_factored")}


def test_the_rules_follow_one_contract():
    # Every rule the metric knows is found by its parameter group alone and built from a state
    # dict narrowed to what this rank holds: the seam needs nothing rule-specific.
    class Param:
        use_muon = True

    muon_group = {"use_muon": True, "momentum": 0.9, "lr": 0.02}
    adam_group = {"use_muon": False, "betas": (0.9, 0.95), "eps": 1e-8, "lr": 3e-3}
    assert metrics.rule_serving(muon_group, Param()) is metrics.MuonRule
    assert metrics.rule_serving(adam_group, Param()) is metrics.AdamRule
    assert metrics.rule_serving({"lr": 0.1, "momentum": 0.9}, Param()) is None  # SGD: plain L2
    assert metrics.rule_kind(None) == metrics.RuleKind.L2
    g = torch.randn(6, 4, generator=torch.Generator().manual_seed(0))
    for rule in metrics.UPDATE_RULES:
        assert isinstance(rule.kind, metrics.RuleKind) and isinstance(rule.whole_matrix, bool)
        assert rule.state_keys and all(isinstance(k, str) for k in rule.state_keys)
        group = muon_group if rule is metrics.MuonRule else adam_group
        start, numel = (0, 24) if rule.whole_matrix else (8, 10)
        fresh = rule.from_state({}, group, shape=g.shape, start=start, numel=numel, device=g.device)
        assert metrics.rule_kind(fresh) == rule.kind
        assert fresh.direction(g).numel() == numel  # the elements whose state it holds
    # from a real state, Adam's first step is the sign of the gradient's bias-corrected moment
    v = torch.full((10,), 4.0)
    adam = metrics.AdamRule.from_state({"exp_avg": torch.zeros(10), "exp_avg_sq": v, "step": torch.tensor(3.0)},
                                       adam_group, shape=g.shape, start=8, numel=10, device=g.device)
    assert adam.step == 3 and adam.betas == (0.9, 0.95)
    m_hat = 0.1 * g.reshape(-1)[8:18] / (1 - 0.9 ** 4)
    v_hat = (0.95 * v + 0.05 * g.reshape(-1)[8:18] ** 2) / (1 - 0.95 ** 4)
    assert torch.allclose(adam.direction(g), m_hat / (v_hat.sqrt() + 1e-8), rtol=1e-6)
