"""GIFT from the config alone: ``deepspeed_gift.install()`` / ``DEEPSPEED_GIFT=1`` attach it to
engines that other code builds (here ``deepspeed.initialize`` itself), and an enabled block
that does not take effect is warned about, never silent."""

import logging

import pytest

from deepspeed_gift.config import get_gift_config
from launch.spawn import run_ranks

FP8 = {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 8, "refresh_interval": 2},
       "telemetry": {"every": 1}}


def _build_body(rank, world, spec, switch):
    import os

    import deepspeed_gift
    from tests.harness import build_engine, train

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("deepspeed_gift").addHandler(Keep())
    if switch == "env":
        os.environ["DEEPSPEED_GIFT"] = "1"
    elif switch == "install":
        deepspeed_gift.install()
        deepspeed_gift.install()  # idempotent
    out = {}
    result = train(rank, world, dict(spec, builder="deepspeed"))
    out["attached"] = "records" in result
    out["bytes_per_elem"] = [r["bytes_per_elem"] for r in result.get("records", [])]
    out["losses"] = result["losses"]
    out["warnings_while_on"] = [m for m in records if "was built without GIFT" in m]
    if switch == "install":  # after uninstall, the next engine is native again, and warned about
        deepspeed_gift.uninstall()
        again = train(rank, world, dict(spec, builder="deepspeed"))
        out["attached_after_uninstall"] = "records" in again
    if switch == "none":  # a second engine does not warn again
        build_engine(dict(spec, builder="deepspeed"))
    out["warnings"] = [m for m in records if "was built without GIFT" in m]
    return out


@pytest.mark.parametrize("switch", ["install", "env"])
def test_the_switch_attaches_gift_to_engines_deepspeed_builds(switch):
    spec = dict(stage=2, steps=2, bucket=20000, gift=FP8)
    for out in run_ranks(_build_body, 2, spec, switch):
        assert out["attached"]
        # fp8 + block scales + headers (step 0 also carries the first fit's factors)
        assert 1.0 < out["bytes_per_elem"][-1] < 1.1, out["bytes_per_elem"]
        assert out["warnings_while_on"] == []
        if switch == "install":
            assert out["attached_after_uninstall"] is False and len(out["warnings"]) == 1


def test_an_enabled_block_without_gift_is_warned_about_once():
    spec = dict(stage=2, steps=2, bucket=20000, gift=FP8)
    for out in run_ranks(_build_body, 2, spec, "none"):
        assert not out["attached"]
        assert len(out["warnings"]) == 1 and "deepspeed_gift.install()" in out["warnings"][0]
        assert "DEEPSPEED_GIFT=1" in out["warnings"][0]


def test_deepspeed_gift_initialize_neither_warns_nor_attaches_twice():
    spec = dict(stage=2, steps=1, bucket=20000, gift=FP8)
    for out in run_ranks(_init_body, 2, spec):
        assert out == {"attached": True, "warnings": []}


def _init_body(rank, world, spec):
    import deepspeed_gift
    from tests.harness import build_engine

    records = []

    class Keep(logging.Handler):
        def emit(self, record):
            records.append(record.getMessage())

    logging.getLogger("deepspeed_gift").addHandler(Keep())
    deepspeed_gift.install()  # the hook attaches inside deepspeed_gift.initialize; initialize must not again
    engine = build_engine(spec)
    return {"attached": engine.gift is not None, "warnings": [m for m in records if "without GIFT" in m]}


def test_no_shipped_config_has_auto_in_its_gift_block():
    import glob
    import json
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    for path in glob.glob(os.path.join(root, "ds_configs", "*.json")):
        with open(path) as f:
            raw = json.load(f)
        assert '"auto"' not in json.dumps(raw.get("gift", {})), path
        get_gift_config(raw)
