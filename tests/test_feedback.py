"""Error-feedback residuals at ~1 byte an element: the storage's round-off against its arithmetic,
non-finite residuals, and the checkpoint forms (kept as stored, or moved out of replaced
transforms) adding exactly what the uninterrupted run adds. The bias EF removes is checked on
real reductions in tests/test_reduce_scatter.py and tests/test_route.py; resuming real engines in
tests/test_checkpoint.py."""

import math
from types import SimpleNamespace

import pytest
import torch

from deepspeed_gift.core import formats
from deepspeed_gift.core import geometry as geo
from deepspeed_gift.exchange import feedback
from deepspeed_gift.exchange.feedback import ErrorFeedback, StoredResidual
from deepspeed_gift.exchange.plan import Piece, Section

# int8 codes of x / scale rounded to nearest with scale = block amax / 127: at most half a
# step (scale / 2) off, plus fp32's rounding of the division and of the product q * scale
# (2**-24 relative each, of values up to 127 steps): 2 * 127 * 2**-24 < 2**-16 of a step.
HALF_STEP_SLACK = 0.5 + 2.0**-16
# relative L2 of the stored residual: sqrt(128) / 254 when a block holds its maximum alone
# (every other element may be off by half a step and counts nothing in ||r||)
WORST_BLOCK_REL_L2 = math.sqrt(feedback.RESIDUAL_BLOCK) / (2 * 127)


def _residual(n: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    # magnitudes over ~10 decades, a block of zeros, a block of tiny values, and blocks whose
    # elements are all equal in size: every rounding regime of the codes
    x = torch.randn(n, generator=g) * torch.exp(3 * torch.randn(n, generator=g))
    if n >= 512:
        x[128:256] = 0.0
        x[256:384] *= 1e-30
        x[384:512] = torch.where(torch.arange(128) % 2 == 0, 1.0, -1.0) * 3.0
    return x


def test_stored_residual_is_within_half_a_step_of_its_block_scale():
    # across the codec's tiles (2^20 on the CPU) and with a short last block
    n = (1 << 21) + 1000 + 37
    r = _residual(n)
    stored = StoredResidual.encode(r)
    got = stored.decode()
    block = feedback.RESIDUAL_BLOCK
    padded = torch.nn.functional.pad(r.double().abs(), (0, -n % block))
    step = padded.view(-1, block).amax(1).repeat_interleave(block)[:n] / 127
    assert bool(((got.double() - r.double()).abs() <= HALF_STEP_SLACK * step).all())
    assert torch.equal(got[128:256], torch.zeros(128))
    rel = float((got - r).norm() / r.norm())
    assert 0 < rel < WORST_BLOCK_REL_L2, rel
    # the bytes: a header, an fp32 scale per block, a byte per element
    assert stored.nbytes() == formats.HEADER_BYTES + 4 * -(-n // block) + n
    assert stored.nbytes() <= n * feedback.RESIDUAL_BYTES_PER_ELEMENT + formats.HEADER_BYTES + 4
    # added tile by tile, it adds what it decodes to
    base = torch.randn(n)
    assert torch.equal(stored.add_to(base.clone()), base + got)


PLAN = SimpleNamespace(layout_key=("bucket",), hash=1)


def _section():
    # a whitened piece of parameter 0 (3 rows of 16) and an untransformed one of parameter 2
    sec = Section((1,), False)
    sec.add(Piece(0, 48, 0, 3, 0, 0, 16))
    sec.add(Piece(100, 40, 2, 0, 1, 0, 0))
    return sec


def _whitener(seed: int, version: int):
    g = torch.Generator().manual_seed(seed)
    X = torch.randn(200, 16, generator=g) * torch.linspace(0.1, 3.0, 16)
    return geo.fit_whitener(X.T @ X / 200, rank=4, damping=1e-3, version=version)


@pytest.mark.parametrize("value", [float("nan"), float("inf")])
def test_a_non_finite_residual_is_kept_as_zeros(value):
    fb = ErrorFeedback()
    sec = _section()
    r = torch.randn(88)
    r[5] = value
    fb.keep(PLAN, sec, r, {})
    values = torch.randn(88)
    assert torch.equal(fb.add(PLAN, sec, values.clone(), {}), values)
    fb.keep_relayed(PLAN, 0, r)
    assert torch.equal(fb.add_relayed(PLAN, 0, values.clone()), values)


@pytest.mark.parametrize("refit", [False, True], ids=["same-transforms", "refit-since"])
def test_a_checkpointed_residual_adds_what_the_uninterrupted_run_adds(refit):
    # Saved in the transforms it was made in when they are still the geometry's (a resumed run
    # rebuilds them from the checkpoint: another object of the same fit), else moved back into
    # gradient coordinates and read from the checkpoint at the first step.
    sec = _section()
    made_in = {0: _whitener(0, version=1)}
    rebuilt = {0: geo.StructuredWhitener.from_tensors(made_in[0].to_tensors(), version=1)}
    now = {0: _whitener(1, version=2)} if refit else rebuilt
    fb = ErrorFeedback()
    fb.keep(PLAN, sec, _residual(88, seed=3), made_in)
    fb.keep_relayed(PLAN, 0, _residual(64, seed=4))
    saved = fb.state_dict(current=now.get)
    [entry] = saved["residuals"]
    assert entry["coords"] == (feedback.GRADIENT if refit else feedback.TRANSFORMED)
    resumed = ErrorFeedback()
    resumed.load_state_dict(saved, torch.device("cpu"))
    held = fb.nbytes() - fb.relayed[(PLAN.layout_key, 0)][1].nbytes()
    assert resumed.nbytes() == fb.nbytes() - (held if refit else 0)  # moved: on disk until used
    values = torch.randn(88)
    continued = fb.add(PLAN, sec, values.clone(), made_in if not refit else now)
    assert torch.equal(resumed.add(PLAN, sec, values.clone(), now), continued)
    if not refit:
        assert torch.equal(continued, fb.sent[(PLAN.layout_key, sec.key)][0].add_to(values.clone()))
    chunk = torch.randn(64)
    assert torch.equal(resumed.add_relayed(PLAN, 0, chunk.clone()), fb.add_relayed(PLAN, 0, chunk.clone()))


def test_a_residual_saved_without_the_geometry_is_dropped_where_its_transforms_are_gone(caplog):
    import logging

    sec = _section()
    fb = ErrorFeedback()
    fb.keep(PLAN, sec, _residual(88), {0: _whitener(0, version=1)})
    resumed = ErrorFeedback()
    resumed.load_state_dict(fb.state_dict(), torch.device("cpu"))  # no ``current``: kept as stored
    log = logging.getLogger("deepspeed_gift")
    log.addHandler(caplog.handler)
    try:
        values = torch.randn(88)
        assert torch.equal(resumed.add(PLAN, sec, values.clone(), {0: _whitener(1, version=2)}), values)
    finally:
        log.removeHandler(caplog.handler)
    assert resumed.sent == {} and "no longer has" in caplog.text


def test_residuals_of_fp32_checkpoints_load_at_int8():
    # deepspeed_gift/1 checkpoints held fp32 residuals in gradient coordinates, pieces flat
    sec = Section((1,), False)
    sec.add(Piece(0, 88, 2, 0, 0, 0, 0))
    r = _residual(88)
    old = {"residuals": [(PLAN.layout_key, sec.key, r, [tuple(vars(p).values()) for p in sec.pieces])],
           "relay_residuals": [(PLAN.layout_key, 0, PLAN.hash, r[:64].clone())]}
    fb = ErrorFeedback()
    fb.load_state_dict(old, torch.device("cpu"))
    got = fb.add(PLAN, sec, torch.zeros(88), {})
    assert torch.equal(got, StoredResidual.encode(r.clone()).decode())
    assert fb.nbytes() == sum(formats.HEADER_BYTES + 4 * -(-n // 128) + n for n in (88, 64))


def test_a_checkpoint_of_another_residual_storage_is_refused():
    with pytest.raises(ValueError, match="stored as \\['int8', 64\\]"):
        ErrorFeedback().load_state_dict({"residual_codec": ["int8", 64], "residuals": []},
                                        torch.device("cpu"))


def _residuals_after_a_step(rank, world, spec):
    from tests.harness import batches, build_engine

    engine = build_engine(spec)
    for tokens in list(batches(rank, 1, 1, 16)):
        out = engine(input_ids=tokens, labels=tokens)
        engine.backward(out.loss)
        engine.step()
    reducer = engine.gift.reducer
    me = reducer.comm.rank
    # every section this rank encodes in the main format keeps a residual of its own
    sent = sum(1 for plan in reducer._plans.values() for sec in plan.sections
               if not sec.high and not (sec.dests == (me,) and not sec.shared))
    return len(reducer.feedback.sent), sent, len(reducer._plans)


def test_buckets_of_one_shape_keep_residuals_of_their_own():
    """With buckets small enough that several hold layers of the same shape for the same owner,
    each keeps its own residual (keyed by a layout that names its parameters): before, they
    shared one, and one bucket's quantization error was fed into another's gradient."""
    from launch.spawn import run_ranks

    spec = dict(stage=2, zero={"reduce_bucket_size": 4096}, gift={"format": "nvfp4", "error_feedback": True})
    for held, sent, buckets in run_ranks(_residuals_after_a_step, 2, spec):
        assert buckets > 4 and held == sent, (held, sent, buckets)


def test_residuals_keyed_by_a_layout_without_parameters_are_dropped_and_said(caplog):
    import logging

    sec = _section()
    old_layout = ((1, 0, 48, False, ()), (1, 100, 40, False, ()))  # dst, offset, numel, high, copies
    fb = ErrorFeedback()
    made_in = {0: _whitener(0, version=1)}
    fb.keep(SimpleNamespace(layout_key=old_layout, hash=1), sec, _residual(88, seed=3), made_in)
    with caplog.at_level(logging.WARNING, logger="deepspeed_gift"):
        resumed = ErrorFeedback()
        resumed.load_state_dict(fb.state_dict(current=made_in.get), torch.device("cpu"))
    assert resumed.sent == {} and "names no parameters" in caplog.text
