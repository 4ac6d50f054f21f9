"""The pretraining entry points: ``launch/pretrain.py`` on 2 gloo ranks (ZeRO 1 and 2, GIFT
and native), the launcher scripts, checkpoint resume, ``launch/compare.py``'s report and
plot, the data pipeline and the shipped ds_configs. Tiny model, a few steps: the whole file
runs in about two minutes on 2 CPU cores."""

import glob
import json
import math
import os
import shutil
import subprocess
import sys

import pytest
import torch

import deepspeed_gift
from launch import compute, data
from launch.pretrain import read_metrics, run_rank
from launch.spawn import free_port, run_ranks

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
RUN_TIMEOUT_S = 180
# a tiny run: 4 steps of 2 x 32 tokens per rank, validation on 1 batch per rank
QUICK = ["--preset", "tiny", "--seq-len", "32", "--micro-batch", "2", "--eval-every", "2", "--eval-batches", "1",
         "--no-progress", "--lr", "3e-3"]
# FP8 e4m3 with 128-element blocks: per-element relative error <= 2^-4, so the reduced
# gradient's relative L2 error is below it.
FP8_FIDELITY_MAX = 0.0625
# bf16 model, same data and seed: a lossy wire moves the loss by bf16/FP8 noise only.
LOSS_RTOL = 2e-2
# Resumed vs uninterrupted: same arithmetic in the same order; allow fp32 rounding.
RESUME_RTOL = 1e-5


def _config(name):
    return os.path.join(ROOT, "ds_configs", name)


def _train_many(rank, world_size, argvs):
    """Several pretrain runs in one set of ranks (spawning costs more than a tiny run)."""
    return [run_rank(rank, world_size, argv) for argv in argvs]


def _env():
    env = dict(os.environ)
    env["PATH"] = BIN + os.pathsep + env.get("PATH", "")
    env.update({"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1", "OMP_NUM_THREADS": "1"})
    return env


# ---- pretrain.py on real ranks ----------------------------------------------------------
def _gradient_bytes(engine, step):
    """A probe: from step 1 on, the bytes DeepSpeed's gradient collectives receive, and the dtypes."""
    from benchmarks.exchange_bytes import count_gradient_receives

    if step == 1:
        engine._test_calls = count_gradient_receives(engine.optimizer)
        return {}
    return {"received": sum(n for call in engine._test_calls for n, _ in call),
            "comm_dtype": str(engine.communication_data_type),
            "param_dtype": str(next(engine.module.parameters()).dtype)}


def _probed_rank(rank, world_size, argv):
    from launch.pretrain import main

    return main(list(argv), probe=_gradient_bytes)


@pytest.mark.isa
def test_compute_dtype_fp32_keeps_bf16_gradients_on_the_wire(tmp_path):
    # the bf16 baseline computed in bf16 and in fp32: the same bytes reach every rank (DeepSpeed casts
    # the fp32 buckets to communication_data_type bf16); auto takes fp32 exactly where bf16 is slow
    argvs = [["--ds-config", _config("bf16_baseline_zero2.json"), "--steps", "3", "--compute-dtype", dtype,
              "--metrics", str(tmp_path / f"{dtype}.jsonl"), *QUICK] for dtype in ("bf16", "fp32", "auto")]
    per_rank = run_ranks(_many_probed, 2, argvs, timeout=RUN_TIMEOUT_S)
    assert all(s["status"] == "ok" for res in per_rank for s in res)
    m = {dtype: read_metrics(str(tmp_path / f"{dtype}.jsonl")) for dtype in ("bf16", "fp32", "auto")}
    fast = compute.bf16_matmul_is_fast()
    assert m["bf16"]["start"]["compute_dtype"] == "bf16" and m["fp32"]["start"]["compute_dtype"] == "fp32"
    assert m["auto"]["start"]["compute_dtype"] == ("bf16" if fast else "fp32")
    assert ("no fast bf16 matmul" in m["auto"]["start"]["compute_note"]) == (not fast)
    assert m["fp32"]["start"]["ds_config"]["communication_data_type"] == "bf16"
    last = {dtype: m[dtype]["train"][-1] for dtype in m}
    assert last["bf16"]["param_dtype"] == "torch.bfloat16" and last["fp32"]["param_dtype"] == "torch.float32"
    assert last["fp32"]["comm_dtype"] == last["bf16"]["comm_dtype"] == "torch.bfloat16"
    assert last["fp32"]["received"] == last["bf16"]["received"] > 0
    assert last["fp32"]["bytes_per_elem"] == 2.0 and last["fp32"]["params_bytes_per_elem"] == 4.0
    # fp32 compute trains the same model: the losses differ by bf16's rounding of the forward only
    assert m["fp32"]["train"][-1]["loss"] == pytest.approx(m["bf16"]["train"][-1]["loss"], rel=LOSS_RTOL)


def _many_probed(rank, world_size, argvs):
    return [_probed_rank(rank, world_size, argv) for argv in argvs]


def test_compute_dtype_choices():
    bf16 = {"bf16": {"enabled": True}, "zero_optimization": {"stage": 2}}
    assert compute.choose_compute_dtype("auto", bf16, fast_bf16=True) == ("bf16", "")
    dtype, note = compute.choose_compute_dtype("auto", bf16, fast_bf16=False)
    assert dtype == "fp32" and "bf16 gradients on the wire" in note and "--compute-dtype bf16" in note
    assert compute.choose_compute_dtype("bf16", bf16, fast_bf16=False) == ("bf16", "")  # asked for: kept
    assert compute.choose_compute_dtype("auto", {}, fast_bf16=False) == ("fp32", "")  # an fp32 config
    assert compute.choose_compute_dtype("fp32", {}, fast_bf16=True) == ("fp32", "")
    as_fp32 = compute.with_compute_dtype(bf16, "fp32")
    assert as_fp32["bf16"]["enabled"] is False and as_fp32["communication_data_type"] == "bf16"
    assert bf16["bf16"]["enabled"] is True  # a copy
    own_wire = compute.with_compute_dtype(dict(bf16, communication_data_type="fp32"), "fp32")
    assert own_wire["communication_data_type"] == "fp32"  # a config's own wire is kept
    assert compute.with_compute_dtype({}, "bf16")["bf16"] == {"enabled": True}
    spelled = compute.with_compute_dtype({"bfloat16": {"enabled": True}}, "fp32")  # DeepSpeed's other key
    assert spelled["bfloat16"]["enabled"] is False and spelled["communication_data_type"] == "bf16"
    with pytest.raises(ValueError, match="--compute-dtype: got 'fp8'; allowed: auto, bf16, fp32"):
        compute.choose_compute_dtype("fp8", bf16)
    with pytest.raises(ValueError, match="trains in fp16; use fp32 or auto"):
        compute.choose_compute_dtype("bf16", {"fp16": {"enabled": True}})


@pytest.mark.parametrize("stage", [1, 2])
def test_pretrain_gift_and_baseline_two_ranks(stage, tmp_path):
    runs = {"gift": _config(f"gift_fp8_zero{stage}.json"), "native": _config(f"bf16_baseline_zero{stage}.json")}
    argvs = [["--ds-config", cfg, "--steps", "4", "--metrics", str(tmp_path / f"{name}.jsonl"), *QUICK]
             for name, cfg in runs.items()]
    per_rank = run_ranks(_train_many, 2, argvs, timeout=RUN_TIMEOUT_S)
    (gift0, native0), (gift1, native1) = per_rank
    assert gift0["losses"] == gift1["losses"] and native0["losses"] == native1["losses"]  # all-reduced
    for summary in (gift0, native0):
        assert summary["status"] == "ok" and len(summary["losses"]) == 4
        assert all(math.isfinite(x) for x in summary["losses"])
        assert summary["losses"][-1] < summary["losses"][0]
    assert gift0["losses"] == pytest.approx(native0["losses"], rel=LOSS_RTOL)
    assert gift0["losses"] != native0["losses"]  # the FP8 wire really was used

    gift, native = read_metrics(str(tmp_path / "gift.jsonl")), read_metrics(str(tmp_path / "native.jsonl"))
    for m in (gift, native):
        assert m["start"]["zero_stage"] == stage and m["start"]["world_size"] == 2
        assert [r["step"] for r in m["train"]] == [1, 2, 3, 4]
        assert [r["step"] for r in m["eval"]] == [2, 4]
        assert all(0.0 <= r["val_acc"] <= 1.0 and math.isfinite(r["val_loss"]) for r in m["eval"])
        assert all(r["tokens_per_s"] > 0 and r["step_time_s"] > 0 for r in m["train"])
        assert m["end"]["status"] == "ok"
    assert all(r["wire"] == "native" and r["bytes_per_elem"] == 2.0 for r in native["train"])
    assert all(r["wire"] == "gift" and 1.0 < r["bytes_per_elem"] < 1.1 for r in gift["train"][1:])
    sampled = [r["fidelity_rel_err"] for r in gift["train"] if "fidelity_rel_err" in r]
    assert sampled and 0.0 < max(sampled) < FP8_FIDELITY_MAX
    assert gift["start"]["gift"]["format"] == "fp8_e4m3" and native["start"]["gift"] is None


def test_pretrain_muon_with_gift_two_ranks(tmp_path):
    # DeepSpeed's Muon under ZeRO-2 with GIFT attached, whitening refitted every 2 steps so the
    # geometry branch is in play within the run.
    with open(_config("muon_gift_fp8_e5m2_tensor_zero2.json")) as f:
        spec = json.load(f)
    muon_lr = spec["optimizer"]["params"]["muon_lr"]
    spec["gift"].update(layers="all", geometry=dict(spec["gift"]["geometry"], rank=8, refresh_interval=2),
                        telemetry=dict(every=2, fidelity=True))
    cfg = tmp_path / "muon_gift.json"
    cfg.write_text(json.dumps(spec))
    argv = ["--ds-config", str(cfg), "--steps", "6", "--metrics", str(tmp_path / "m.jsonl"), *QUICK]
    ((s0,), (s1,)) = run_ranks(_train_many, 2, [argv], timeout=RUN_TIMEOUT_S)
    assert s0["status"] == "ok" and s0["losses"] == s1["losses"] and len(s0["losses"]) == 6
    assert all(math.isfinite(x) for x in s0["losses"]) and s0["losses"][-1] < s0["losses"][0]
    m = read_metrics(str(tmp_path / "m.jsonl"))
    assert m["start"]["ds_config"]["optimizer"]["type"] == "Muon"
    # DeepSpeed puts Muon's matrices in the first param group: its lr is muon_lr, not --lr
    assert m["train"][0]["lr"] == pytest.approx(muon_lr)
    assert all(r["wire"] == "gift" and r["bytes_per_elem"] > 1.0 for r in m["train"])
    assert min(r["bytes_per_elem"] for r in m["train"]) < 1.1  # FP8 between refreshes
    sampled = [r["fidelity_rel_err"] for r in m["train"] if "fidelity_rel_err" in r]
    assert len(sampled) >= 2 and all(0.0 < x < 1.0 for x in sampled)
    assert m["train"][-1]["geometry_version"] >= 2 and m["train"][-1]["geometry_layers"] > 0
    profiled = [r for r in m["train"] if "profile_update" in r]
    assert all(math.isfinite(r["profile_l2"]) for r in profiled)  # plain L2 always beside the update error
    assert m["end"]["status"] == "ok"


def test_muon_lr_flag():
    from launch import pretrain

    args = pretrain.parse_args(["--ds-config", _config("muon_bf16_baseline_zero2.json"), "--lr", "1e-3",
                                "--muon-lr", "0.05"])
    params = pretrain.load_ds_config(args)["optimizer"]["params"]
    assert (params["lr"], params["muon_lr"]) == (1e-3, 0.05)
    with pytest.raises(SystemExit, match="--muon-lr needs"):
        pretrain.load_ds_config(pretrain.parse_args(["--ds-config", _config("bf16_baseline_zero2.json"),
                                                     "--muon-lr", "0.05"]))


def test_resume_continues_the_loss_curve(tmp_path):
    # GIFT with state in play at the checkpoint: whiteners refitted every 2 steps on every
    # layer, NVFP4 error-feedback residuals. The checkpoint holds them, the data depends on
    # the step only, so the resumed steps repeat the uninterrupted run's losses.
    with open(_config("gift_nvfp4_ef_zero2.json")) as f:
        spec = json.load(f)
    spec["gift"].update(layers="all", geometry=dict(spec["gift"]["geometry"], rank=8, refresh_interval=2))
    cfg = tmp_path / "gift_state.json"
    cfg.write_text(json.dumps(spec))
    cfg = str(cfg)
    ckpt = tmp_path / "ckpt"
    # "--resume" with an empty --save-dir starts fresh (a job script may always pass it)
    full = ["--ds-config", cfg, "--steps", "6", "--save-dir", str(ckpt), "--save-every", "3", "--resume",
            "--metrics", str(tmp_path / "full.jsonl"), *QUICK]
    resumed = ["--ds-config", cfg, "--steps", "6", "--resume", str(ckpt / "step3"),
               "--metrics", str(tmp_path / "resumed.jsonl"), *QUICK]
    (first,), _ = run_ranks(_train_many, 2, [full], timeout=RUN_TIMEOUT_S)
    assert first["resumed_from"] == 0 and len(first["losses"]) == 6
    assert {"latest", "step3", "step6"} <= set(os.listdir(ckpt))
    (second,), _ = run_ranks(_train_many, 2, [resumed], timeout=RUN_TIMEOUT_S)
    assert second["resumed_from"] == 3 and len(second["losses"]) == 3
    assert second["losses"] == pytest.approx(first["losses"][3:], rel=RESUME_RTOL)
    assert second["losses"][0] != pytest.approx(first["losses"][0], rel=1e-3)  # not restarted from scratch
    resumed_metrics = read_metrics(str(tmp_path / "resumed.jsonl"))
    assert resumed_metrics["start"]["resumed_from"] == 3
    assert [r["step"] for r in resumed_metrics["train"]] == [4, 5, 6]
    full_metrics = read_metrics(str(tmp_path / "full.jsonl"))
    assert resumed_metrics["eval"][-1]["val_loss"] == pytest.approx(full_metrics["eval"][-1]["val_loss"],
                                                                    rel=RESUME_RTOL)
    assert [r["geometry_version"] for r in resumed_metrics["train"]] == \
        [r["geometry_version"] for r in full_metrics["train"][3:]]


def test_read_metrics_merges_an_interrupted_run(tmp_path):
    path = tmp_path / "m.jsonl"
    lines = [{"event": "start", "resumed_from": 0}]
    lines += [{"event": "train", "step": s, "loss": 10.0 - s} for s in (1, 2, 3)]
    lines += [{"event": "start", "resumed_from": 2}, {"event": "train", "step": 3, "loss": 6.5},
              {"event": "train", "step": 4, "loss": 6.0}, {"event": "end", "status": "ok"}]
    path.write_text("".join(json.dumps(x) + "\n" for x in lines))
    m = read_metrics(str(path))
    assert [(r["step"], r["loss"]) for r in m["train"]] == [(1, 9.0), (2, 8.0), (3, 6.5), (4, 6.0)]
    assert m["start"]["resumed_from"] == 2 and len(m["starts"]) == 2 and m["end"]["status"] == "ok"


# ---- the launcher scripts ---------------------------------------------------------------
def _run_script(cmd, env, out_dir):
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=RUN_TIMEOUT_S)
    assert proc.returncode == 0, f"{cmd}\nstdout:\n{proc.stdout[-3000:]}\nstderr:\n{proc.stderr[-3000:]}"
    m = read_metrics(os.path.join(out_dir, "metrics.jsonl"))
    assert [r["step"] for r in m["train"]] == [1, 2] and m["end"]["status"] == "ok"
    assert os.path.exists(os.path.join(out_dir, "step2"))
    return m


def test_run_deepspeed_script_single_machine(tmp_path):
    env = dict(_env(), PRESET="tiny", RUN=str(tmp_path), MASTER_PORT=str(free_port()),
               DEEPSPEED=os.path.join(BIN, "deepspeed"))
    m = _run_script(["bash", "launch/run_deepspeed.sh", "--steps", "2", *QUICK], env, str(tmp_path))
    assert m["start"]["world_size"] == 2 and m["train"][-1]["wire"] == "gift"


def test_run_mpirun_script_with_mpi_backend(tmp_path):
    mpirun = shutil.which("mpirun", path=BIN + os.pathsep + os.environ.get("PATH", ""))
    if mpirun is None:
        pytest.skip("mpirun not installed (pip install 'deepspeed-gift[mpi]')")
    env = dict(_env(), RUN=str(tmp_path), MPIRUN=mpirun, PYTHON=sys.executable,
               MPIRUN_ARGS="--allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo")
    m = _run_script(["bash", "launch/run_mpirun.sh", "--steps", "2", *QUICK], env, str(tmp_path))
    assert m["start"]["world_size"] == 2 and m["start"]["gift"]["backend"] == "mpi"


# ---- compare.py -------------------------------------------------------------------------
@pytest.mark.isa
def test_compare_writes_report_and_plot_and_keeps_failed_runs(tmp_path):
    from launch import compare

    broken = tmp_path / "broken_rank.json"  # geometry rank wider than the tiny model's layers
    with open(_config("gift_fp8_zero2.json")) as f:
        cfg = json.load(f)
    cfg["gift"]["geometry"]["rank"] = 4096
    broken.write_text(json.dumps(cfg))
    out = tmp_path / "out"
    configs = [_config("bf16_baseline_zero2.json"), _config("euclid_fp8_e4m3_block_zero2.json"), str(broken)]
    res = compare.main(["--configs", *configs, "--out-dir", str(out), "--preset", "tiny", "--steps", "3",
                        "--seq-len", "32", "--micro-batch", "2", "--eval-every", "3", "--eval-batches", "1",
                        "--timeout", str(RUN_TIMEOUT_S)])
    status = {r["label"]: r["status"] for r in res["results"]}
    assert status == {"bf16_baseline_zero2": "ok", "euclid_fp8_e4m3_block_zero2": "ok", "broken_rank": "failed"}
    report = (out / "report.md").read_text()
    first_table = report[report.index("| config |"):].split("\n\n")[0].splitlines()
    rows = [line for line in first_table if "---" not in line][1:]
    assert len(rows) == 3  # the failed run has its row
    base_row, fp8_row, broken_row = rows
    assert "+0.00%" in base_row and "1.00 |" in base_row
    assert "1.03" in fp8_row and "Euclidean fp8_e4m3 block 128" in fp8_row
    assert "**failed**" in broken_row and "gift.geometry.rank" in report
    # which dtype the bf16 configs computed in, as the runs recorded it (fp32 where bf16 is slow)
    compute_line = next(line for line in report.splitlines() if line.startswith("- compute: "))
    assert ("no fast bf16 matmul" in compute_line) == (not compute.bf16_matmul_is_fast()), compute_line
    assert os.path.exists(out / "runs" / "euclid_fp8_e4m3_block_zero2.jsonl")
    assert json.loads((out / "results.json").read_text())["results"][2]["status"] == "failed"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert res["plot"] is None and "matplotlib is not installed" in report
    else:
        with open(out / "loss_curves.png", "rb") as f:
            assert f.read(8) == b"\x89PNG\r\n\x1a\n"
        assert "![loss curves](loss_curves.png)" in report


def test_compare_default_configs_are_stage2_format_variants():
    from launch import compare

    configs = compare.default_configs()
    assert compare.is_baseline(configs[0])
    assert all("_zero2" in c and "mpi" not in c for c in configs)
    descs = [compare.describe_gift(c) for c in configs]
    kinds = {(g["optimizer"], g["format"], g["block"], g["geometry"], g["error_feedback"], str(g["layers"]))
             for g in descs if g["wire"] == "gift"}
    assert len(kinds) == sum(g["wire"] == "gift" for g in descs)  # no two differ only in backend or stage
    for optimizer in ("adamw", "muon"):  # each optimizer: its baseline, then the paper's pair
        assert {"optimizer": optimizer, "wire": "native"} in descs
        assert (optimizer, "fp8_e5m2", 0, "identity", False, "all") in kinds
        assert (optimizer, "fp8_e5m2", 0, "kfac_input", False, "measured") in kinds
    order = [g["optimizer"] for g in descs]
    assert order == sorted(order, key=compare.OPTIMIZER_ORDER.index)
    assert set(configs) < set(compare.stage2_configs())
    # like with like: every GIFT config has a Euclidean one that differs from it in the geometry only
    results = [{"label": c, "gift": g} for c, g in zip(configs, descs)]
    assert compare.unpaired(results) == []
    assert len(compare.matched_pairs(results)) == sum(g["wire"] == "gift" and g["geometry"] != "identity"
                                                      for g in descs)


def test_pairs_differ_in_the_geometry_only():
    from launch import compare

    runs = {name: {"label": name, "gift": compare.describe_gift(_config(name + ".json"))}
            for name in ("euclid_nvfp4_zero2", "euclid_nvfp4_ef_zero2", "gift_nvfp4_zero2", "gift_nvfp4_ef_zero2")}
    pairs = {(g["label"], e["label"]) for g, e in compare.matched_pairs(list(runs.values()))}
    assert pairs == {("gift_nvfp4_zero2", "euclid_nvfp4_zero2"), ("gift_nvfp4_ef_zero2", "euclid_nvfp4_ef_zero2")}
    alone = [runs["gift_nvfp4_ef_zero2"], runs["euclid_nvfp4_zero2"]]  # error feedback on one side only
    assert compare.matched_pairs(alone) == []
    assert [r["label"] for r in compare.unpaired(alone)] == ["gift_nvfp4_ef_zero2", "euclid_nvfp4_zero2"]
    g, e = runs["gift_nvfp4_zero2"]["gift"], runs["euclid_nvfp4_zero2"]["gift"]
    assert compare.geometry_difference(g, e) == "geometry kfac_input vs identity, layers measured vs all"
    assert not compare.same_but_geometry(dict(g, rounding="stochastic"), e)


def _quick_compare_args(out):
    return ["--out-dir", str(out), "--preset", "tiny", "--steps", "3", "--seq-len", "32", "--micro-batch", "2",
            "--eval-every", "3", "--eval-batches", "1", "--timeout", str(RUN_TIMEOUT_S)]


def test_compare_seeds_mean_std_and_verdict_from_the_per_seed_values(tmp_path):
    from launch import compare

    euclid, gift = "muon_euclid_fp8_e5m2_tensor_zero2", "muon_gift_fp8_e5m2_tensor_zero2"
    out = tmp_path / "out"
    res = compare.main(["--configs", _config(euclid + ".json"), _config(gift + ".json"), "--seeds", "2",
                        "--seed", "5", *_quick_compare_args(out)])
    saved = json.loads((out / "results.json").read_text())
    assert saved["seeds"] == [5, 6] and len(saved["results"]) == 4
    assert all(r["status"] == "ok" for r in saved["results"])
    per_seed = {(r["label"], r["seed"]): r["final_val_loss"] for r in saved["results"]}
    assert per_seed[(euclid, 5)] != per_seed[(euclid, 6)]  # the seed changes init and data
    assert sorted(os.listdir(out / "runs")) == sorted(f"{c}_seed{s}.jsonl" for c in (euclid, gift) for s in (5, 6))
    report = (out / "report.md").read_text()
    assert "## Seeds: final validation loss over 2 seeds (5, 6)" in report
    assert "## Muon: GIFT vs Euclidean at the same format" in report

    stats = {}
    for label in (euclid, gift):
        values = [per_seed[(label, 5)], per_seed[(label, 6)]]
        mean, std = sum(values) / 2, abs(values[0] - values[1]) / math.sqrt(2)  # sample std of two values
        stats[label] = (mean, std)
        row = next(line for line in report.splitlines() if line.startswith(f"| {label} |") and "5: " in line)
        assert f"| 2 | {mean:.4f} | {std:.4f} | 5: {values[0]:.4f}, 6: {values[1]:.4f} |" in row
    (mg, sg), (me, se_) = stats[gift], stats[euclid]
    diff, se = mg - me, math.sqrt(sg ** 2 / 2 + se_ ** 2 / 2)
    verdict = ("no difference at 2 SE" if abs(diff) <= 2 * se else "GIFT better" if diff < 0 else "Euclidean better")
    line = next(x for x in report.splitlines() if x.startswith("- Muon, GIFT fp8_e5m2 per-tensor"))
    assert f"{mg:.4f} ± {sg:.4f} (n=2) vs {me:.4f} ± {se_:.4f} (n=2)" in line
    assert f"difference {diff:+.4f}, 2 SE = {2 * se:.4f}: **{verdict}**" in line
    (pair,) = res["seed_stats"]["pairs"]
    assert pair["verdict"] == verdict and pair["diff"] == pytest.approx(diff) and pair["se"] == pytest.approx(se)
    diffs = [per_seed[(gift, s)] - per_seed[(euclid, s)] for s in (5, 6)]
    paired_se = abs(diffs[0] - diffs[1]) / math.sqrt(2) / math.sqrt(2)  # s_d / sqrt(n), n = 2
    assert pair["paired"]["diffs"] == pytest.approx(diffs) and pair["paired"]["se"] == pytest.approx(paired_se)
    assert f"paired by seed (n=2, differences {diffs[0]:+.4f}, {diffs[1]:+.4f}): mean {sum(diffs) / 2:+.4f}" in line
    assert saved["seed_stats"]["by_config"][0]["final_val_loss"] == [per_seed[(euclid, 5)], per_seed[(euclid, 6)]]
    verdict_line = next(x for x in report.splitlines() if x.startswith(f"- Muon, `{gift}` vs `{euclid}`, differ in "))
    assert "differ in geometry kfac_input vs identity, layers measured vs all:" in verdict_line
    assert f"paired over 2 seeds {sum(diffs) / 2:+.4f} against 2 SE = {2 * paired_se:.4f}" in verdict_line


def test_seed_verdict_rules():
    from launch import compare

    assert compare.seed_verdict([1.0, 1.2], [2.0, 2.2])["verdict"] == "GIFT better"  # diff -1, 2 SE 0.28
    assert compare.seed_verdict([2.0, 2.2], [1.0, 1.2])["verdict"] == "Euclidean better"
    assert compare.seed_verdict([1.0, 1.4], [1.1, 1.5])["verdict"] == "no difference at 2 SE"
    assert compare.seed_verdict([1.0, float("nan")], [1.0, 1.1])["verdict"].startswith("not enough seeds")
    # Paired by seed: a shift smaller than the seed-to-seed spread but the same on every seed counts.
    gift, euclid = {0: 1.0, 1: 1.4, 2: 1.2}, {0: 1.02, 1: 1.41, 2: 1.22}
    assert compare.seed_verdict(list(gift.values()), list(euclid.values()))["verdict"] == "no difference at 2 SE"
    paired = compare.paired_verdict(gift, euclid)
    assert paired["verdict"] == "GIFT better" and paired["diff"] == pytest.approx(-0.05 / 3)
    assert compare.paired_verdict({0: 1.0, 1: 1.1}, {1: 1.0, 2: 1.0})["verdict"].startswith("not enough paired")


# ---- data -------------------------------------------------------------------------------
def test_embedded_corpus_split_is_deterministic_and_disjoint():
    a = data.build_corpus(max_bytes=300_000)
    b = data.build_corpus(max_bytes=300_000)
    assert torch.equal(a.train, b.train) and torch.equal(a.validation, b.validation)
    assert a.train_names and a.val_names and not set(a.train_names) & set(a.val_names)
    assert a.vocab_size == 256 and a.train.dtype == torch.uint8
    # a file's side depends on its name only, not on which other files were read
    assert all(data.in_validation(n, data.DEFAULT_VAL_FRACTION) for n in a.val_names)
    assert not any(data.in_validation(n, data.DEFAULT_VAL_FRACTION) for n in a.train_names)
    text = bytes(a.validation.tolist()).decode("utf-8", errors="replace")
    assert "def " in text or "import " in text  # real Python source


def test_batches_depend_only_on_seed_step_and_rank():
    stream = torch.arange(10_000, dtype=torch.int32)
    kw = dict(micro=3, seq=16, seed=5)
    x = data.train_batch(stream, step=7, micro_step=0, rank=1, **kw)
    assert x.shape == (3, 16) and x.dtype == torch.long
    assert torch.equal(x, data.train_batch(stream, step=7, micro_step=0, rank=1, **kw))
    assert torch.equal(x[:, 1:], x[:, :-1] + 1)  # contiguous windows
    for other in (dict(step=8, micro_step=0, rank=1), dict(step=7, micro_step=1, rank=1),
                  dict(step=7, micro_step=0, rank=0)):
        assert not torch.equal(x, data.train_batch(stream, **other, **kw))
    r0 = torch.cat(data.eval_batches(stream, n_batches=2, micro=2, seq=8, rank=0, world=2))
    r1 = torch.cat(data.eval_batches(stream, n_batches=2, micro=2, seq=8, rank=1, world=2))
    assert not set(r0[:, 0].tolist()) & set(r1[:, 0].tolist())


def test_user_text_file(tmp_path):
    text = "".join(f"line {i}: the quick brown fox\n" for i in range(500))
    path = tmp_path / "notes.txt"
    path.write_text(text)
    c = data.build_corpus([str(path)], val_fraction=0.1)
    assert "split by position" in c.source
    joined = bytes(torch.cat([c.train, c.validation]).tolist())
    assert joined == text.encode() + b"\x00"
    assert c.validation.numel() == pytest.approx(0.1 * (len(text) + 1), abs=1)


def test_user_jsonl_files_and_errors(tmp_path):
    path = tmp_path / "docs.jsonl"
    docs = [f"document number {i} " * 5 for i in range(200)]
    path.write_text("".join(json.dumps({"text": d, "id": i}) + "\n" for i, d in enumerate(docs)))
    c = data.build_corpus([str(path)])
    assert len(c.train_names) + len(c.val_names) == 200 and c.val_names
    assert not set(c.train_names) & set(c.val_names)
    assert c.train.numel() + c.validation.numel() == sum(len(d) + 1 for d in docs)
    assert data.build_corpus([str(tmp_path)]).train.numel() == c.train.numel()  # a directory of files
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"text": "ok"}) + "\n" + json.dumps({"body": "no text"}) + "\n")
    with pytest.raises(ValueError, match=r"bad.jsonl:2.*'text'.*--text-field"):
        data.build_corpus([str(bad)])


def test_local_hf_tokenizer(tmp_path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    text = "".join(f"def function_{i}(x):\n    return x * {i}\n\n" for i in range(300))
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer, tok.decoder = pre_tokenizers.ByteLevel(add_prefix_space=False), decoders.ByteLevel()
    tok.train_from_iterator([text], trainers.BpeTrainer(vocab_size=300, special_tokens=["<unk>", "</s>"]))
    hf_tok = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="</s>", unk_token="<unk>")
    hf_tok.save_pretrained(tmp_path / "tok")
    (tmp_path / "code.txt").write_text(text)
    c = data.build_corpus([str(tmp_path / "code.txt")], str(tmp_path / "tok"), val_fraction=0.1)
    hf = data.HFTokenizer(str(tmp_path / "tok"))
    assert c.vocab_size == len(hf.tok) and c.train.dtype == torch.int32
    ids = torch.cat([c.train, c.validation])
    assert ids[-1].item() == hf.separator and int(ids.max()) < c.vocab_size
    assert hf.decode(ids[:-1].tolist()) == text
    assert c.train.numel() < len(text) / 2  # merges, not bytes
    with pytest.raises(ValueError, match="does not exist"):
        data.build_corpus([str(tmp_path / "code.txt")], str(tmp_path / "missing"))


def test_saved_dataset_needs_datasets(tmp_path):
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "dataset_info.json").write_text("{}")
    try:
        import datasets  # noqa: F401
    except ImportError:
        with pytest.raises(ValueError, match="'datasets' package is not installed"):
            data.build_corpus([str(saved)])
    else:
        pytest.skip("datasets is installed; the missing-package message is not reachable")


# ---- configs ----------------------------------------------------------------------------
def test_shipped_configs_validate():
    paths = sorted(glob.glob(os.path.join(ROOT, "ds_configs", "*.json")))
    assert len(paths) >= 10
    for path in paths:
        with open(path) as f:
            cfg = json.load(f)
        gift = deepspeed_gift.get_gift_config(cfg)
        assert cfg["optimizer"]["params"]["torch_adam"] is True
        assert cfg["zero_optimization"]["stage"] == int(path[-len("N.json")]), path  # the name's _zeroN
        assert gift.enabled == ("baseline" not in path), path
    e5m2 = deepspeed_gift.get_gift_config(json.load(open(_config("euclid_fp8_e5m2_tensor_zero2.json"))))
    assert (e5m2.format, e5m2.block_size, e5m2.geometry.kind, e5m2.layers) == ("fp8_e5m2", 0, "identity", "all")
    ef = deepspeed_gift.get_gift_config(json.load(open(_config("gift_nvfp4_ef_zero2.json"))))
    assert ef.format == "nvfp4" and ef.error_feedback and ef.geometry.kind == "kfac_input"
    assert deepspeed_gift.get_gift_config(json.load(open(_config("gift_fp8_mpi_zero2.json")))).backend == "mpi"
    # the Muon pairs differ from each other only in geometry, and from their AdamW twins only in the optimizer
    for euclid, gift, adamw in (("muon_euclid_fp8_e5m2_tensor_zero2", "muon_gift_fp8_e5m2_tensor_zero2",
                                 "gift_fp8_e5m2_tensor_zero2"),
                                ("muon_euclid_nvfp4_zero2", "muon_gift_nvfp4_zero2", "euclid_nvfp4_zero2")):
        e, g = (json.load(open(_config(name + ".json"))) for name in (euclid, gift))
        assert e["optimizer"] == g["optimizer"] and e["optimizer"]["type"] == "Muon"
        assert {k: v for k, v in e.items() if k != "gift"} == {k: v for k, v in g.items() if k != "gift"}
        ge, gg = deepspeed_gift.get_gift_config(e), deepspeed_gift.get_gift_config(g)
        assert (ge.format, ge.block_size, ge.error_feedback) == (gg.format, gg.block_size, gg.error_feedback)
        assert (ge.geometry.kind, gg.geometry.kind) == ("identity", "kfac_input")
        twin = json.load(open(_config(adamw + ".json")))
        assert twin["optimizer"]["type"] == "AdamW" and twin["zero_optimization"] == g["zero_optimization"]
