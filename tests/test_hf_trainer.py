"""GIFT under the HF Trainer on 2 real CPU ranks, switched on by ``deepspeed_gift.install()``
(or ``DEEPSPEED_GIFT=1``), with a shipped ds_config whose Trainer-owned keys are "auto"."""

import pytest

from launch.hf_trainer import run_rank
from launch.spawn import run_ranks

LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1}}
INT4_EF = {"format": "int4", "rounding": "stochastic", "error_feedback": True, "layers": "all",
           "geometry": {"rank": 8, "refresh_interval": 2, "collect_interval": 1}, "telemetry": {"every": 1}}


def _many(rank, world, runs):
    return [run_rank(rank, world, opts) for opts in runs]


def test_trainer_gets_gift_from_a_shipped_config(tmp_path):
    opts = dict(ds_config="ds_configs/gift_fp8_zero2.json", steps=4, out=str(tmp_path / "fp8"))
    for (r,) in run_ranks(_many, 2, [opts]):
        assert r["attached"] and r["global_step"] == 4 and len(r["records"]) == 4
        assert 1.0 < r["records"][-1]["bytes_per_elem"] < 1.1  # fp8 + scales + headers; bf16 would be 2
        assert r["losses"][-1] < r["losses"][0]


def test_trainer_with_a_lossless_block_matches_the_native_trainer(tmp_path):
    base = dict(ds_config="ds_configs/gift_fp8_zero2.json", steps=4, fp32=True)
    runs = [dict(base, native=True, out=str(tmp_path / "native")),
            dict(base, gift=LOSSLESS, out=str(tmp_path / "lossless"))]
    for native, lossless in run_ranks(_many, 2, runs):
        assert not native["attached"] and lossless["attached"]
        # fp32 at two ranks: x/2 + y/2 == (x + y)/2, one addition in any order: the very same bits
        assert lossless["losses"] == native["losses"]


def test_trainer_checkpoint_resumes_with_gifts_state(tmp_path):
    base = dict(ds_config="ds_configs/gift_nvfp4_ef_zero2.json", gift=INT4_EF, fp32=True)
    full, first = run_ranks(_many, 2, [dict(base, steps=6, out=str(tmp_path / "full")),
                                       dict(base, steps=6, save_steps=3, out=str(tmp_path / "ckpt"), stop_at=3)])[0]
    checkpoint = tmp_path / "ckpt" / "checkpoint-3"
    assert sorted(p.name for p in checkpoint.glob("global_step3/gift_rank*.pt")) == ["gift_rank0.pt", "gift_rank1.pt"]
    (resumed,) = run_ranks(_many, 2, [dict(base, steps=6, out=str(tmp_path / "ckpt"), resume=str(checkpoint))])[0]
    assert first["losses"] == full["losses"][:3]
    assert resumed["losses"][:3] == full["losses"][:3]  # the log history comes back with the checkpoint
    assert resumed["losses"][3:] == pytest.approx(full["losses"][3:], rel=1e-5)
    assert resumed["version"] == full["version"] and resumed["whitener_digest"] == full["whitener_digest"]


def _accelerate_many(rank, world, runs):
    from launch.hf_trainer import run_accelerate_rank

    return [run_accelerate_rank(rank, world, opts) for opts in runs]


def test_accelerate_deepspeed_plugin_gets_gift_and_lossless_matches_native():
    base = dict(ds_config="ds_configs/gift_fp8_zero2.json", steps=4)
    runs = [dict(base), dict(base, fp32=True, native=True), dict(base, fp32=True, gift=LOSSLESS)]
    for fp8, native, lossless in run_ranks(_accelerate_many, 2, runs):
        assert fp8["attached"] and 1.0 < fp8["records"][-1]["bytes_per_elem"] < 1.1
        assert fp8["losses"][-1] < fp8["losses"][0]
        assert not native["attached"] and lossless["attached"]
        assert lossless["losses"] == native["losses"]  # as under the Trainer: the very same bits


def test_accelerate_save_state_resumes_with_gifts_state(tmp_path):
    base = dict(ds_config="ds_configs/gift_nvfp4_ef_zero2.json", gift=INT4_EF, fp32=True, steps=6)
    save = str(tmp_path / "state")
    full, first = run_ranks(_accelerate_many, 2, [dict(base, out=str(tmp_path / "full")),
                                                  dict(base, steps=3, save_at=3, out=save)])[0]
    assert sorted(p.name for p in (tmp_path / "state").glob("*/gift_rank*.pt")) == ["gift_rank0.pt", "gift_rank1.pt"]
    (resumed,) = run_ranks(_accelerate_many, 2, [dict(base, out=save, resume=save)])[0]
    assert first["losses"] == full["losses"][:3]
    assert resumed["losses"] == pytest.approx(full["losses"][3:], rel=1e-5)
    assert resumed["version"] == full["version"]


def test_a_trainer_run_starts_with_every_shipped_config(tmp_path):
    import glob
    import json
    import os

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    configs = []
    for path in sorted(glob.glob(os.path.join(root, "ds_configs", "*.json"))):
        with open(path) as f:
            gift = json.load(f).get("gift")
        if gift and gift.get("backend") == "mpi":  # needs mpirun; tests/test_launchers.py runs it
            continue
        configs.append((os.path.relpath(path, root), bool(gift and gift.get("enabled", True))))
    runs = [dict(ds_config=path, steps=2, out=str(tmp_path / str(i))) for i, (path, _) in enumerate(configs)]
    for results in run_ranks(_many, 2, runs):
        for (path, has_gift), r in zip(configs, results):
            assert r["global_step"] == 2, path
            assert r["attached"] == has_gift, path
            assert all(x == x for x in r["losses"]), path
