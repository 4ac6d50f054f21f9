"""``selection.idle_backoff``: while measured selection chooses no layer, the judged refreshes
come twice as far apart each time (up to idle_backoff x refresh_interval), each preceded by a
refit alone one refresh interval before it, with the statistics collected only in the two
intervals before it; a judgement that selects a layer brings back every refresh interval; the
schedule is in the checkpoint. Real engines on 2 ranks over gloo."""

from launch.spawn import run_ranks
from tests.harness import resumed_as_uninterrupted

STEPS = 22
# min_gain 0.99: no layer can gain that much, so every judgement selects none
IDLE = {"format": "fp8_e4m3", "layers": "measured",
        "geometry": {"rank": 8, "refresh_interval": 2, "collect_interval": 1},
        "selection": {"min_gain": 0.99, "idle_backoff": 4}, "telemetry": {"every": 1}}


def _schedule_body(rank, world, spec):
    from tests.harness import batches, build_engine

    engine = build_engine(spec)
    g = engine.gift.geometry
    collected, versions = [], []
    periods = {"fold": [], "refit": []}  # what each fold and refit was told had passed since the last
    fold, refit = g.kfac.fold, g.kfac.refit
    g.kfac.fold = lambda means, p=1: (periods["fold"].append(p), fold(means, p))[1]
    g.kfac.refit = lambda version, p=1: (periods["refit"].append(p), refit(version, p))[1]
    for tokens in batches(engine.global_rank, spec["steps"], 2, 32):
        out = engine(input_ids=tokens, labels=tokens)
        collected.append(g.moments.attached)  # the statistics hooks on the model in this step's forward
        engine.backward(out.loss)
        engine.step()
        versions.append(g.version)
    judged = [r["step"] for r in engine.gift.records if "profile_update" in r]
    seconds = [r["geometry_s"] for r in engine.gift.records]
    return collected, versions, judged, sorted(g.active), seconds, periods


def _refits(versions):
    """Steps k whose end raised the geometry's version (a refit)."""
    return [k for k, v in enumerate(versions) if v > (versions[k - 1] if k else 0)]


def test_judgements_back_off_while_nothing_is_selected():
    # RI = 2, cap 4 x 2 = 8. Step 0 has no transform to judge yet; judged at 2 (none: gap -> 4),
    # 6 (-> 8), 14 (-> 8); a refit alone one interval before each spaced judgement (4, 12, 20);
    # statistics in the 4 steps before each
    (collected, versions, judged, active, seconds, periods), other = run_ranks(_schedule_body, 2,
                                                                              dict(stage=2, steps=STEPS, gift=IDLE))
    assert active == [] and other[3] == []
    assert judged == [2, 6, 14]
    assert _refits(versions) == [0, 2, 4, 6, 12, 14, 20]
    assert [k for k, on in enumerate(collected) if on] == list(range(0, 7)) + list(range(10, 15)) + [18, 19, 20, 21]
    assert other[:3] == (collected, versions, judged)[:3]  # both ranks on the same steps
    # telemetry's geometry_s: time on every step with statistics, a refit or a judgement, none between
    busy = set(k for k, on in enumerate(collected) if on) | set(_refits(versions))
    assert [k for k, s in enumerate(seconds) if s > 0] == sorted(busy)
    assert all(s == 0.0 for k, s in enumerate(seconds) if k not in busy)
    # after a gap the average ages by the steps that passed: the folds at 10 and 18 stand for the
    # 4 collections since 6 and 14, the refits alone at 12 and 20 for the 3 intervals since 6 and 14
    assert periods["fold"] == [1] * 7 + [4] + [1] * 4 + [4] + [1] * 3
    assert periods["refit"] == [1, 1, 1, 1, 3, 1, 3]
    assert other[5] == periods


def test_a_layer_selected_keeps_every_refresh_and_backoff_1_is_the_old_schedule():
    # int4 with Adam's geometry too: most layers gain in the update (test_optimizer_metric)
    picky = dict(IDLE, format="int4", geometry=dict(IDLE["geometry"], kind=["kfac_input", "adam_factored"]),
                 selection={"min_gain": 0.0, "idle_backoff": 4})
    plain = dict(IDLE, selection={"min_gain": 0.99, "idle_backoff": 1})
    results = run_ranks(_schedule_body, 2, dict(stage=2, steps=9, gift=picky))
    collected, versions, judged, active, _, periods = results[0]
    assert active
    every = list(range(0, 9, 2))
    assert judged == every[1:] and _refits(versions) == every and all(collected)
    assert set(periods["fold"]) == set(periods["refit"]) == {1}  # nothing skipped: the EMAs as before
    collected, versions, judged, active, _, periods = run_ranks(_schedule_body, 2,
                                                                dict(stage=2, steps=9, gift=plain))[0]
    assert active == [] and judged == every[1:] and _refits(versions) == every
    assert all(collected) and set(periods["fold"]) == set(periods["refit"]) == {1}


def test_the_schedule_resumes_from_a_checkpoint(tmp_path):
    # saved at step 7, inside the gap after the judgement at 6 (refit alone at 12, judged at 14):
    # a resumed run that lost the schedule would refit and judge at 8, and its whiteners differ
    base = dict(stage=2, steps=16, gift=dict(IDLE, error_feedback=True))
    full, resumed = resumed_as_uninterrupted(base, str(tmp_path / "ckpt"), 7)
    assert full["version"] == resumed["version"] == 6  # refits at 0, 2, 4, 6, 12 and 14
    judged = [r["step"] for r in resumed["records"] if "profile_update" in r]
    assert judged == [14]
    # resumed with idle_backoff 1, which could not have made that gap: judged at the multiples of 2
    from tests.harness import train_many
    plain = dict(base, resume=str(tmp_path / "ckpt"), gift=dict(base["gift"], selection={"min_gain": 0.99,
                                                                                        "idle_backoff": 1}))
    (changed,) = run_ranks(train_many, 2, [plain])[0]
    assert [r["step"] for r in changed["records"] if "profile_update" in r] == [8, 10, 12, 14]


def test_a_collection_after_a_gap_weighs_the_old_average_by_the_steps_that_passed():
    # SketchEMA.update(mean, p) is p updates with the same mean: decay^p old + (1 - decay^p) new
    import torch
    from deepspeed_gift.refresh import SketchEMA

    g = torch.Generator().manual_seed(0)
    old, new = torch.randn(6, 6, generator=g), torch.randn(6, 6, generator=g)
    once, thrice = SketchEMA(6, None, 0.9), SketchEMA(6, None, 0.9)
    for ema in (once, thrice):
        ema.update(old)
    once.update(new, periods=3)
    for _ in range(3):
        thrice.update(new)
    # the blend of 0.9 ** 3 as the code makes it, to the bit
    assert torch.equal(once.Y, old.clone().mul_(0.9 ** 3).add_(new, alpha=1 - 0.9 ** 3))
    # three blends against one: each blend rounds an element at most three times (the product, the
    # scaled input, the sum) with scalars rounded to fp32 (two more), every value at most the
    # largest input: 3 x 5 + 5 half-ulps of it, 10 ulps
    bound = 10 * torch.finfo(torch.float32).eps * float(torch.maximum(old.abs().max(), new.abs().max()))
    assert torch.allclose(once.Y, thrice.Y, rtol=0, atol=bound)
    assert not torch.allclose(once.Y, 0.9 * old + 0.1 * new, atol=1e-2)  # one period would be this


def test_collections_between_counts_the_unspaced_schedules_collections():
    # at the multiples of collect_interval or of refresh_interval, in (last, k]; also where
    # neither divides the other (their common multiples counted once)
    from deepspeed_gift.lifecycle import collections_between

    for c, r in ((1, 2), (3, 2), (4, 6), (10, 4), (10, 50), (7, 7)):
        for last in range(0, 40):
            for k in range(last + 1, 90):
                made = sum(1 for x in range(last + 1, k + 1) if x % c == 0 or x % r == 0)
                assert collections_between(last, k, c, r) == max(1, made), (c, r, last, k)
    assert collections_between(None, 500, 10, 50) == 1
