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
    for tokens in batches(engine.global_rank, spec["steps"], 2, 32):
        out = engine(input_ids=tokens, labels=tokens)
        collected.append(g.moments.attached)  # the statistics hooks on the model in this step's forward
        engine.backward(out.loss)
        engine.step()
        versions.append(g.version)
    judged = [r["step"] for r in engine.gift.records if "profile_update" in r]
    seconds = [r["geometry_s"] for r in engine.gift.records]
    return collected, versions, judged, sorted(g.active), seconds


def _refits(versions):
    """Steps k whose end raised the geometry's version (a refit)."""
    return [k for k, v in enumerate(versions) if v > (versions[k - 1] if k else 0)]


def test_judgements_back_off_while_nothing_is_selected():
    # RI = 2, cap 4 x 2 = 8. Step 0 has no transform to judge yet; judged at 2 (none: gap -> 4),
    # 6 (-> 8), 14 (-> 8); a refit alone one interval before each spaced judgement (4, 12, 20);
    # statistics in the 4 steps before each
    (collected, versions, judged, active, seconds), other = run_ranks(_schedule_body, 2,
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


def test_a_layer_selected_keeps_every_refresh_and_backoff_1_is_the_old_schedule():
    # int4 with Adam's geometry too: most layers gain in the update (test_optimizer_metric)
    picky = dict(IDLE, format="int4", geometry=dict(IDLE["geometry"], kind=["kfac_input", "adam_factored"]),
                 selection={"min_gain": 0.0, "idle_backoff": 4})
    plain = dict(IDLE, selection={"min_gain": 0.99, "idle_backoff": 1})
    results = run_ranks(_schedule_body, 2, dict(stage=2, steps=9, gift=picky))
    collected, versions, judged, active, _ = results[0]
    assert active
    every = list(range(0, 9, 2))
    assert judged == every[1:] and _refits(versions) == every and all(collected)
    collected, versions, judged, active, _ = run_ranks(_schedule_body, 2, dict(stage=2, steps=9, gift=plain))[0]
    assert active == [] and judged == every[1:] and _refits(versions) == every
    assert all(collected)


def test_the_schedule_resumes_from_a_checkpoint(tmp_path):
    # saved at step 7, inside the gap after the judgement at 6 (refit alone at 12, judged at 14):
    # a resumed run that lost the schedule would refit and judge at 8, and its whiteners differ
    base = dict(stage=2, steps=16, gift=dict(IDLE, error_feedback=True))
    full, resumed = resumed_as_uninterrupted(base, str(tmp_path / "ckpt"), 7)
    assert full["version"] == resumed["version"] == 6  # refits at 0, 2, 4, 6, 12 and 14
    judged = [r["step"] for r in resumed["records"] if "profile_update" in r]
    assert judged == [14]
