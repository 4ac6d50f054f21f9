"""GIFT state travels with DeepSpeed's checkpoint: a run resumed at step k continues
exactly as the uninterrupted run (statistics, factors, version, selection, error-feedback
residuals, stochastic-rounding generator)."""

import os
from types import SimpleNamespace

import pytest

from tests.harness import train_many
from launch.spawn import run_ranks

GIFT = {"format": "int4", "rounding": "stochastic", "error_feedback": True, "layers": "all",
        "geometry": {"rank": 8, "refresh_interval": 2, "collect_interval": 1}, "telemetry": {"every": 1}}


ADAM_GEOMETRY = dict(GIFT, geometry={"kind": "adam_factored", "refresh_interval": 2})


@pytest.mark.parametrize("optimizer,gift,save_at", [("adam", GIFT, 3), ("adam", GIFT, 2), ("muon", GIFT, 3),
                                                    ("adam", ADAM_GEOMETRY, 3)],
                         ids=["adam", "adam-no-refit-since", "muon", "adam-geometry"])
def test_resume_continues_the_loss_curve_exactly(tmp_path, optimizer, gift, save_at):
    # Under Muon, split matrices travel as shared sections with their own error-feedback residuals.
    # Adam's geometry: its scalings (built from the optimizer state at the last refresh) are saved.
    # Error-feedback residuals: saved at step 3 right after a refresh (step 2's end), they are in
    # the replaced transforms and saved moved back to gradient coordinates (fp32, read at step 3
    # after the resume); saved at step 2, their transforms are still current and they are saved
    # as stored (int8). Either way the resumed run adds what the uninterrupted one does.
    save_dir = str(tmp_path / "ckpt")
    base = dict(stage=2, steps=6, bucket=30000, gift=gift, optimizer=optimizer)
    full, first = run_ranks(train_many, 2, [base, dict(base, steps=save_at, save_at=save_at,
                                                       save_dir=save_dir)])[0]
    folder = os.path.join(save_dir, f"global_step{save_at}")
    assert sorted(f for f in os.listdir(folder) if f.startswith("gift")) == \
        ["gift_rank0.pt", "gift_rank0_residuals.bin", "gift_rank1.pt", "gift_rank1_residuals.bin"]
    import torch

    coords = {e["coords"] for e in torch.load(os.path.join(folder, "gift_rank0.pt"), weights_only=True)["reducer"]
              ["residuals"]}
    assert coords == ({"gradient"} if save_at == 3 else {"transformed"})
    (resumed,) = run_ranks(train_many, 2, [dict(base, resume=save_dir)])[0]
    assert first["losses"] == full["losses"][:save_at]
    assert bool(full["split_muon"]) == (optimizer == "muon")
    assert resumed["losses"] == full["losses"][save_at:]
    assert resumed["version"] == full["version"] and resumed["active"] == full["active"]
    assert resumed["active"]  # geometry was in use across the save
    assert resumed["whitener_digest"] == full["whitener_digest"]
    assert full["losses"][-1] < full["losses"][0]  # int4 + stochastic rounding + error feedback trains


def test_resume_on_another_world_size_keeps_geometry(tmp_path):
    from tests.harness import initialize_error  # noqa: F401  (same process layout as train)

    save_dir = str(tmp_path / "ckpt")
    base = dict(stage=2, steps=3, bucket=30000, gift=GIFT)
    (first,) = run_ranks(train_many, 2, [dict(base, save_at=3, save_dir=save_dir)])[0]
    # DeepSpeed itself refuses to re-partition ZeRO optimizer states: a clear error, not a hang.
    with pytest.raises(RuntimeError, match="DP world size of 2 but the current world size is 3"):
        run_ranks(train_many, 3, [dict(base, steps=5, resume=save_dir)])
    # Without optimizer states it loads, and GIFT keeps statistics, factors and selection.
    results = run_ranks(train_many, 3, [dict(base, steps=5, resume=save_dir, load_optimizer_states=False)])
    for (resumed,) in results:
        assert resumed["version"] == first["version"] + 1  # carried over, plus the refresh at step 4
        assert resumed["active"] == first["active"] and resumed["active"]
        assert len(resumed["losses"]) == 2 and all(x == x for x in resumed["losses"])


class _Payload:
    """Stands for anything a pickle could run on load."""

    def __reduce__(self):
        return (os.getcwd, ())


def test_a_checkpoint_file_that_needs_pickle_code_is_refused(tmp_path):
    import torch

    save_dir = str(tmp_path / "ckpt")
    base = dict(stage=2, steps=2, bucket=30000, gift=GIFT)
    run_ranks(train_many, 2, [dict(base, save_at=2, save_dir=save_dir)])
    for rank in (0, 1):
        path = os.path.join(save_dir, "global_step2", f"gift_rank{rank}.pt")
        state = torch.load(path, weights_only=True)
        state["geometry"]["extra"] = _Payload()
        torch.save(state, path)
    with pytest.raises(RuntimeError, match="is not a GIFT checkpoint file that loads as plain data"):
        run_ranks(train_many, 2, [dict(base, steps=3, resume=save_dir)])


def test_residuals_stream_to_a_file_and_survive_a_save_over_the_file_they_wait_in(tmp_path):
    # A residual moved out of replaced transforms waits in the checkpoint's file until its first
    # step; saving the same tag again before that step reads it from the file being replaced.
    import torch

    from deepspeed_gift.checkpoint import _TensorReader, _TensorWriter
    from deepspeed_gift.exchange.feedback import ErrorFeedback
    from tests.test_feedback import PLAN, _residual, _section, _whitener

    sec = _section()
    made_in, now = {0: _whitener(0, version=1)}, {0: _whitener(1, version=2)}
    fb = ErrorFeedback()
    for i in range(3):  # three layouts: three residuals in the file, one after another
        fb.keep(SimpleNamespace(layout_key=(i,)), sec, _residual(88, seed=i), made_in)
    fb.keep_relayed(PLAN, 0, _residual(64, seed=9))
    path = str(tmp_path / "gift_rank0_residuals.bin")
    loaded = fb
    for _ in range(2):  # saved, loaded, saved over the same file, loaded
        writer = _TensorWriter(path)
        saved = loaded.state_dict(current=now.get, sink=writer)
        writer.close()
        assert all(isinstance(e["values"], list) for e in saved["residuals"])  # tokens, not tensors
        loaded = ErrorFeedback()
        loaded.load_state_dict(saved, torch.device("cpu"), source=_TensorReader(path))
    assert os.path.getsize(path) == 3 * 88 * 4 + fb.relayed[(PLAN.layout_key, 0)][1].nbytes()
    for i in range(3):
        plan, values = SimpleNamespace(layout_key=(i,)), torch.randn(88)
        assert torch.equal(loaded.add(plan, sec, values.clone(), now), fb.add(plan, sec, values.clone(), now))
    chunk = torch.randn(64)
    assert torch.equal(loaded.add_relayed(PLAN, 0, chunk.clone()), fb.add_relayed(PLAN, 0, chunk.clone()))
