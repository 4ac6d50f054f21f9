"""The bucket reduction on real gloo ranks, without DeepSpeed: row splitting at partition
boundaries, whitened rows, owner-side sums, compact outputs, error feedback."""

import os
import subprocess
import sys
import time

import torch

from deepspeed_gift.core import formats
from deepspeed_gift.core.rng import CounterRng
from deepspeed_gift.core import geometry as geo
from deepspeed_gift.exchange.plan import GEO, HIGH, MAIN, ParamSlice, split_slice_rows
from deepspeed_gift.exchange.reducer import GiftReducer
from launch.spawn import run_ranks

# fp32 wire + whitening: the only error is the transform round trip (a few fp32 ulps,
# amplified by the conditioning of S; the test whitener has condition number ~ 1e2).
FP32_WHITENED_RTOL = 1e-5


def test_split_slice_rows_keeps_whole_rows_only():
    s = ParamSlice(dst=0, bucket_offset=0, numel=25, param_offset=3, param_key=0, row_len=10, mode=GEO)
    # elements 3..27 of a 10-wide matrix: head 3..9, rows 1 (10..19), tail 20..27
    assert split_slice_rows(s) == [(0, 7, 0), (7, 10, 1), (17, 8, 0)]
    inside = ParamSlice(0, 0, 8, 11, 0, 10, GEO)  # no whole row inside
    assert split_slice_rows(inside) == [(0, 8, 0)]
    plain = ParamSlice(0, 0, 25, 3, 0, 10, MAIN)
    assert split_slice_rows(plain) == [(0, 25, 0)]


def _layout(world):
    """Two matrices and a vector in one bucket, owners cutting through rows."""
    shapes = [(6, 16), (5, 32), (40,)]
    total = sum(torch.Size(s).numel() for s in shapes)
    bounds = [round(total * j / world) for j in range(world + 1)]
    slices, offset = [], 0
    for key, shape in enumerate(shapes):
        numel = torch.Size(shape).numel()
        for dst in range(world):
            lo, hi = max(bounds[dst], offset), min(bounds[dst + 1], offset + numel)
            if hi > lo:
                mode = GEO if len(shape) == 2 else (HIGH if key == 2 else MAIN)
                slices.append(ParamSlice(dst, lo, hi - lo, lo - offset, key, shape[-1] if mode == GEO else 0, mode))
        offset += numel
    return shapes, slices, total


def _whiteners(version: int = 0):
    out = {}
    for key, dim in ((0, 16), (1, 32)):
        g = torch.Generator().manual_seed(key)
        X = torch.randn(200, dim, generator=g) * torch.linspace(0.1, 3.0, dim)
        A = X.T @ X / 200
        out[key] = geo.fit_whitener(A, rank=4, damping=1e-3, version=version)
    return out


def _reduce_body(rank, world, fmt):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm

    dist.init_process_group("gloo")
    shapes, slices, total = _layout(world)
    comm = TorchComm()
    reducer = GiftReducer(comm, formats.get_format(fmt), formats.get_format("bf16"))
    grads = [torch.randn(total, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    bucket = grads[rank].clone()
    outputs = [torch.zeros(s.numel) if s.dst == rank else None for s in slices]
    whiteners = _whiteners()
    stats = reducer.reduce(bucket, slices, whiteners, divisor=world, step=7,
                           outputs=outputs, sample=True)
    exact = torch.stack(grads).sum(0) / world
    mine = [(s, o) for s, o in zip(slices, outputs) if s.dst == rank]
    return [(s, bucket[s.bucket_offset:s.bucket_offset + s.numel].clone(), o,
             exact[s.bucket_offset:s.bucket_offset + s.numel]) for s, o in mine], stats


def test_owner_gets_the_average_with_whitened_rows_and_cut_rows():
    for world in (2, 3):
        for per_rank, stats in run_ranks(_reduce_body, world, "fp32"):
            # the sampled fidelity sees the delivered result (the bf16 sections' rounding only)
            assert 0 < (stats.fidelity_err_sq / stats.fidelity_ref_sq) ** 0.5 < 2 ** -8
            for s, got, out, exact in per_rank:
                if s.mode == HIGH:  # others=bf16: exact up to one bf16 rounding per rank
                    torch.testing.assert_close(got, exact, rtol=2 ** -7, atol=1e-2)
                else:
                    torch.testing.assert_close(got, exact, rtol=FP32_WHITENED_RTOL, atol=FP32_WHITENED_RTOL)
                torch.testing.assert_close(out, got)  # compact output receives the same result


def _one_piece_body(rank, world):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm

    dist.init_process_group("gloo")
    # one 8 x 16 matrix cut between whole rows: every section is a single transformed piece,
    # packed and unpacked straight from the transform's own output
    slices = [ParamSlice(dst, dst * 64, 64, dst * 64, 0, 16, GEO) for dst in range(2)]
    grads = [torch.randn(128, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    bucket = grads[rank].clone()
    stats = GiftReducer(TorchComm(), formats.get_format("fp32")).reduce(
        bucket, slices, {0: _whiteners()[0]}, divisor=world, sample=True)
    exact = (torch.stack(grads).sum(0) / world)[rank * 64:(rank + 1) * 64]
    return bucket[rank * 64:(rank + 1) * 64], exact, grads[rank], stats


def test_single_piece_sections_reduce_exactly_and_the_fidelity_sees_the_result():
    for got, exact, mine, stats in run_ranks(_one_piece_body, 2):
        torch.testing.assert_close(got, exact, rtol=FP32_WHITENED_RTOL, atol=FP32_WHITENED_RTOL)
        assert not torch.equal(got, mine)  # reduced, not left as this rank's own gradient
        assert (stats.fidelity_err_sq / stats.fidelity_ref_sq) ** 0.5 < FP32_WHITENED_RTOL


def test_fp8_reduction_error_is_bounded():
    for per_rank, _ in run_ranks(_reduce_body, 2, "fp8_e4m3"):
        got = torch.cat([g for s, g, _, _ in per_rank if s.mode != HIGH])
        exact = torch.cat([e for s, _, _, e in per_rank if s.mode != HIGH])
        rel = float((got - exact).norm() / exact.norm())
        assert 0 < rel < 0.06, rel  # e4m3: 3 mantissa bits, half-ulp 2^-4 at worst


def _feedback_body(rank, world, error_feedback, switch_at):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm

    dist.init_process_group("gloo")
    shapes, slices, total = _layout(world)
    slices = [ParamSlice(s.dst, s.bucket_offset, s.numel, s.param_offset, s.param_key, s.row_len,
                         MAIN if s.mode == HIGH else s.mode) for s in slices]
    comm = TorchComm()
    reducer = GiftReducer(comm, formats.get_format("int4"), error_feedback=error_feedback)
    grad = torch.randn(total, generator=torch.Generator().manual_seed(100 + rank))
    first = _whiteners()
    second = {k: geo.make_whitener("hadamard", w.dim, seed=5, version=1) for k, w in first.items()}
    acc = torch.zeros(total)
    steps = 12
    for step in range(steps):
        whiteners = first if step < switch_at else second
        bucket = grad.clone()
        reducer.reduce(bucket, slices, whiteners, divisor=world, step=step)
        acc += bucket
    exact = torch.stack([torch.randn(total, generator=torch.Generator().manual_seed(100 + r))
                         for r in range(world)]).mean(0)
    mask = torch.zeros(total, dtype=torch.bool)
    for s in slices:
        if s.dst == rank:
            mask[s.bucket_offset:s.bucket_offset + s.numel] = True
    drift = float(((acc - steps * exact)[mask]).norm() / (exact[mask].norm() * steps))
    return drift, reducer.residual_nbytes()


def test_error_feedback_cancels_accumulated_error_across_a_whitener_switch():
    # The same gradient every step with round-to-nearest: without feedback the error repeats
    # and the running sum drifts by 12x one step's error; with feedback it stays at one step's.
    plain = run_ranks(_feedback_body, 2, False, 6)
    fed = run_ranks(_feedback_body, 2, True, 6)
    for (drift_plain, mem_plain), (drift_fed, mem_fed) in zip(plain, fed):
        assert mem_plain == 0 and mem_fed > 0
        # measured: ~0.006 with feedback, ~0.2 without; ~0.03-0.07 if the residual were not
        # moved into the new coordinates at the switch
        assert drift_fed < drift_plain / 10, (drift_fed, drift_plain)


def _disagree_body(rank, world):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm

    dist.init_process_group("gloo")
    shapes, slices, total = _layout(world)
    reducer = GiftReducer(TorchComm(), formats.get_format("fp8_e4m3"), formats.get_format("bf16"))
    whiteners = _whiteners(version=rank)  # rank 1 believes in a newer whitener
    try:
        reducer.reduce(torch.randn(total), slices, whiteners, divisor=world, step=3)
    except RuntimeError as exc:
        return str(exc)
    return ""


def test_ranks_that_disagree_on_whitener_versions_fail_loudly():
    messages = run_ranks(_disagree_body, 2)
    assert all("ranks disagree on the bucket layout, the selected layers or the whitener versions" in m
               for m in messages), messages


def _selection_differs(rank, comm_of, world):
    """Rank 1 believes parameter 2 (the vector) is not in the high-precision group: its messages to
    that parameter's owners are shorter than the others expect."""
    shapes, slices, total = _layout(world)
    if rank == 1:
        slices = [ParamSlice(s.dst, s.bucket_offset, s.numel, s.param_offset, s.param_key, s.row_len,
                             MAIN if s.param_key == 2 else s.mode) for s in slices]
    reducer = GiftReducer(comm_of(), formats.get_format("fp8_e4m3"), formats.get_format("bf16"), defer_checks=True)
    reducer.param_names = {0: "layers.0.q_proj.weight", 1: "layers.0.o_proj.weight", 2: "layers.0.norm.weight"}
    try:
        reducer.reduce(torch.randn(total), slices, _whiteners(), divisor=world, step=3)
        reducer.verify_checks()
    except RuntimeError as exc:
        return str(exc)
    return ""


def _selection_differs_gloo(rank, world):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm

    dist.init_process_group("gloo")
    return _selection_differs(rank, TorchComm, world)


class _UncheckedComm:
    """A thread rank's comm that, like NCCL, trusts the split sizes it is given: an all-to-all whose
    sizes disagree between ranks would hang or deliver the wrong bytes; here it fails the test."""

    def __init__(self, comm):
        self._comm = comm

    def __getattr__(self, name):
        return getattr(self._comm, name)

    def all_to_all_bytes(self, send, send_splits, recv_splits, *, kind=None):
        sent = self._comm._exchange([int(n) for n in send_splits])
        if [sent[src][self._comm.rank] for src in range(self._comm.world_size)] != [int(n) for n in recv_splits]:
            raise AssertionError("an all-to-all of unequal sizes ran: a backend that does not check them hangs here")
        return self._comm.all_to_all_bytes(send, send_splits, recv_splits)


def _expect_named_disagreement(messages):
    assert len(set(messages)) == 1, messages  # every rank raises the same error
    message = messages[0]
    assert "ranks disagree on the bucket layout, the selected layers or the whitener versions" in message, message
    assert "how 'layers.0.norm.weight' (parameter 2) travels" in message, message
    assert "in the high-precision format on ranks [0, 2]; in the main format on ranks [1]" in message, message
    assert "before its exchange" in message


def test_ranks_that_plan_a_bucket_differently_fail_before_its_exchange_naming_the_parameter():
    # rank 1 puts parameter 2 in the main format, the others in bf16 (others): the message sizes
    # differ. The plan's fingerprint is agreed when it is made, so no all-to-all of unequal sizes
    # ever runs: on gloo and on a comm that, like NCCL, does not check sizes
    _expect_named_disagreement(run_ranks(_selection_differs_gloo, 3))
    from deepspeed_gift.exchange.comm import run_local

    _expect_named_disagreement(run_local(3, lambda comm: _selection_differs(comm.rank, lambda: _UncheckedComm(comm), 3)))


def _shared_body(rank, world, fmt, error_feedback):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm

    dist.init_process_group("gloo")
    shapes, slices, total = _layout(world)
    # parameter 1 (5 x 32, whitened) is cut by the partitions: make it a shared (Muon) matrix
    owners = tuple(sorted({s.dst for s in slices if s.param_key == 1}))
    assert len(owners) > 1
    slices = [ParamSlice(s.dst, s.bucket_offset, s.numel, s.param_offset, s.param_key, 32, GEO, owners)
              if s.param_key == 1 else s for s in slices]
    reducer = GiftReducer(TorchComm(), formats.get_format(fmt), formats.get_format("bf16"),
                          error_feedback=error_feedback)
    grads = [torch.randn(total, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    outputs = [torch.zeros(s.numel) if s.dst == rank else None for s in slices]
    whiteners = _whiteners()
    bucket = grads[rank].clone()
    stats = {}
    for step in range(2):  # the second step adds the first one's residual when error feedback is on
        bucket = grads[rank].clone()
        stats = reducer.reduce(bucket, slices, whiteners, divisor=world, step=step,
                               outputs=outputs if step == 1 else None)
    start = min(s.bucket_offset for s in slices if s.param_key == 1)
    numel = 5 * 32
    exact = torch.stack(grads).sum(0) / world
    mine = [(s.param_offset, o) for s, o in zip(slices, outputs) if s.param_key == 1 and o is not None]
    return (rank in owners, bucket[start:start + numel].clone(), exact[start:start + numel], mine,
            stats.elements_sent)


def test_a_shared_matrix_reaches_every_copy_rank_whole_and_identical():
    for fmt in ("fp32", "fp8_e4m3"):
        for world in (2, 3):
            per_rank = run_ranks(_shared_body, world, fmt, fmt != "fp32")
            copies = [(got, exact, mine) for is_copy, got, exact, mine, _ in per_rank if is_copy]
            assert len(copies) >= 2
            first = copies[0][0]
            for got, exact, mine in copies:
                assert torch.equal(got, first)  # bit-identical at every copy rank, as an all-reduce gives
                if fmt == "fp32":
                    torch.testing.assert_close(got, exact, rtol=FP32_WHITENED_RTOL, atol=FP32_WHITENED_RTOL)
                else:
                    assert 0 < float((got - exact).norm() / exact.norm()) < 0.06
                for start, out in mine:  # compact outputs receive only this rank's own slice
                    torch.testing.assert_close(out, got[start:start + out.numel()])


def _two_level_body(rank, world, fmt, rounding, error_feedback):
    import torch.distributed as dist

    from deepspeed_gift.exchange.comm import TorchComm, split_by_node
    from deepspeed_gift.exchange.two_level import TwoLevelReducer

    dist.init_process_group("gloo")
    shapes, slices, total = _layout(world)
    # parameter 1 (5 x 32) spans owners of both slots and nodes: a shared (Muon) matrix
    owners = tuple(sorted({s.dst for s in slices if s.param_key == 1}))
    assert len({o % 2 for o in owners}) == 2 and len({o // 2 for o in owners}) >= 2, owners
    slices = [ParamSlice(s.dst, s.bucket_offset, s.numel, s.param_offset, s.param_key, 32, GEO, owners)
              if s.param_key == 1 else s for s in slices]
    comm = TorchComm()
    node_comm, slot_comm = split_by_node(comm, 2)
    codec = formats.get_format(fmt) if fmt == "fp32" else formats.get_format(fmt, rounding=rounding, seed=3)
    inner = GiftReducer(slot_comm, codec, formats.get_format("bf16"), error_feedback=error_feedback,
                        generator=CounterRng(1000 + rank), shared_seed=3)
    two = TwoLevelReducer(node_comm, inner, 2)
    flat = GiftReducer(comm, codec, formats.get_format("bf16"), error_feedback=error_feedback,
                       generator=CounterRng(1000 + rank))
    grads = [torch.randn(total, generator=torch.Generator().manual_seed(100 + r)) for r in range(world)]
    exact = torch.stack(grads).sum(0) / world
    whiteners = _whiteners()
    out = {}
    for name, reducer in (("two", two), ("flat", flat)):
        for step in range(2):  # step 1 carries step 0's residual when error feedback is on
            bucket = grads[rank].clone()
            outputs = [torch.zeros(s.numel) if s.dst == rank else None for s in slices]
            stats = reducer.reduce(bucket, slices, whiteners, divisor=world, step=step,
                                   outputs=outputs)
        mine = [(s, bucket[s.bucket_offset:s.bucket_offset + s.numel].clone(), o) for s, o in zip(slices, outputs)
                if s.dst == rank and not s.copy_ranks]
        start = min(s.bucket_offset for s in slices if s.param_key == 1)
        shared = bucket[start:start + 160].clone() if rank in owners else None
        out[name] = (mine, shared, stats)
    return out, exact, owners, start


def test_two_level_reduction_matches_the_flat_one_and_keeps_shared_copies_identical():
    for world in (4, 6):
        for fmt, rounding, ef in (("fp32", "nearest", False), ("fp8_e4m3", "stochastic", True)):
            per_rank = run_ranks(_two_level_body, world, fmt, rounding, ef)
            exact, owners, start = per_rank[0][1], per_rank[0][2], per_rank[0][3]
            shared = [out["two"][1] for out, *_ in per_rank if out["two"][1] is not None]
            assert len(shared) == len(owners) >= 2
            for copy in shared:  # copies made in different slot groups, bit for bit
                assert torch.equal(copy, shared[0])
            got = torch.cat([g for out, *_ in per_rank for s, g, o in out["two"][0] if s.mode != HIGH])
            ref = torch.cat([exact[s.bucket_offset:s.bucket_offset + s.numel]
                             for out, *_ in per_rank for s, g, o in out["two"][0] if s.mode != HIGH])
            rel = float((got - ref).norm() / ref.norm())
            shared_rel = float((shared[0] - exact[start:start + 160]).norm() / exact[start:start + 160].norm())
            for out, *_ in per_rank:
                for s, g, o in out["two"][0]:
                    torch.testing.assert_close(o, g)  # the compact output receives the same result
            if fmt == "fp32":
                assert rel < FP32_WHITENED_RTOL and shared_rel < FP32_WHITENED_RTOL, (rel, shared_rel)
                flat = torch.cat([g for out, *_ in per_rank for s, g, o in out["flat"][0] if s.mode != HIGH])
                torch.testing.assert_close(got, flat, rtol=FP32_WHITENED_RTOL, atol=FP32_WHITENED_RTOL)
            else:  # e4m3 as in test_fp8_reduction_error_is_bounded (stochastic rounding and the step-0
                # residual carried into step 1 make it ~0.05 here, flat and two-level alike)
                assert 0 < rel < 0.08 and 0 < shared_rel < 0.08, (rel, shared_rel)
            # Each element leaves every rank but its owner's (flat) or every node but its owner's (two-level),
            # a shared matrix once per copy rank in both: summed over ranks, exactly (N-1)/(W-1) of flat's.
            sent_two = sum(out["two"][2].elements_sent for out, *_ in per_rank)
            sent_flat = sum(out["flat"][2].elements_sent for out, *_ in per_rank)
            assert sent_flat * (world // 2 - 1) == sent_two * (world - 1), (sent_flat, sent_two)


def test_step_stats_sum_counters_keep_the_largest_gap_and_any_sample():
    from deepspeed_gift.exchange.stats import StepStats

    a = StepStats(elements=3, bytes_main=10, codec_s=0.5, params_gap_rel=None)
    b = StepStats(elements=4, bytes_main=1, bytes_header=16, sampled=True, quantized=7, params_gap_rel=0.25)
    total = StepStats().add(a).add(b).add(StepStats(params_gap_rel=0.125))
    assert (total.elements, total.bytes_main, total.bytes_sent, total.quantized) == (7, 11, 27, 7)
    assert total.codec_s == 0.5 and total.sampled and total.params_gap_rel == 0.25
    assert StepStats().add(a).params_gap_rel is None  # never measured stays unmeasured, not 0


# ---- the sampled fidelity check is bounded in bytes ---------------------------------------
def _sampled_body(comm, limit, grads):
    from deepspeed_gift.exchange.plan import ParamSlice

    world = comm.world_size
    n = grads.shape[1]
    bounds = [n * j // world for j in range(world + 1)]
    slices = [ParamSlice(d, bounds[d], bounds[d + 1] - bounds[d], bounds[d], 0) for d in range(world)]
    reducer = GiftReducer(comm, formats.get_format("fp8_e4m3"), fidelity_elements=limit)
    stats = reducer.reduce(grads[comm.rank].clone(), slices, {}, divisor=world, sample=True)
    return stats.bytes_fidelity, (stats.fidelity_err_sq / stats.fidelity_ref_sq) ** 0.5, comm.bytes_sent["telemetry"]


def test_the_fidelity_check_reduces_a_bounded_sample_of_what_each_owner_receives():
    from deepspeed_gift.exchange.comm import run_local

    world, n = 4, 400_000
    grads = torch.randn(world, n, generator=torch.Generator().manual_seed(0)) * torch.linspace(0.01, 3.0, n)
    whole = run_local(world, _sampled_body, n, grads)  # a limit above the bucket: every element
    sample = run_local(world, _sampled_body, 1000, grads)
    for (whole_bytes, whole_err, _), (bytes_, err, counted) in zip(whole, sample):
        # every rank sends each of the 3 other owners 4 bytes per element of its 100,000 (whole)
        # or of every 100th of them (stride ceil(100,000 / 1000))
        assert whole_bytes == 3 * 100_000 * 4 and bytes_ == 3 * 1000 * 4 == counted
        # fp8 e4m3's error is the same on every element in relative terms: the sample sees it
        assert 0 < whole_err < 0.0625 and abs(err - whole_err) < 0.15 * whole_err, (err, whole_err)


class _PrecisionProbe:
    """A transform that records the fp32 matmul precision it runs under (identity otherwise)."""

    version, run_unit = 0, 1

    def __init__(self):
        self.seen = set()

    def apply_run(self, flat, start):
        self.seen.add(torch.get_float32_matmul_precision())
        time.sleep(0.005)  # ranks as threads overlap here: one leaving must not restore the setting for all
        self.seen.add(torch.get_float32_matmul_precision())
        return flat.clone()

    invert_run = apply_run


def test_transforms_run_in_full_fp32_whatever_the_users_tf32_setting():
    from deepspeed_gift.exchange.comm import run_local
    from deepspeed_gift.exchange.plan import ParamSlice

    probe = _PrecisionProbe()

    def body(comm):
        slices = [ParamSlice(d, d * 64, 64, d * 64, 0, 1, GEO) for d in range(comm.world_size)]
        reducer = GiftReducer(comm, formats.get_format("fp32"))
        for step in range(3):
            reducer.reduce(torch.randn(64 * comm.world_size), slices, {0: probe}, divisor=comm.world_size, step=step)

    saved = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("high")  # what HF's tf32=True sets
    try:
        run_local(4, body)
        assert torch.get_float32_matmul_precision() == "high"  # the user's setting is back
    finally:
        torch.set_float32_matmul_precision(saved)
    assert probe.seen == {"highest"}


# In a fresh interpreter: the new API leaves the process unable to answer the legacy getter.
NEW_TF32_API_SCRIPT = """
import torch
from deepspeed_gift.core import formats
from deepspeed_gift.exchange.comm import run_local
from deepspeed_gift.exchange.plan import GEO, ParamSlice
from deepspeed_gift.exchange.reducer import GiftReducer

torch.backends.fp32_precision = "tf32"  # what transformers 5 sets for tf32=True
seen = set()


class Probe:
    version, run_unit = 0, 1

    def apply_run(self, flat, start):
        seen.add((torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision))
        return flat.clone()

    invert_run = apply_run


def body(comm):
    slices = [ParamSlice(d, d * 64, 64, d * 64, 0, 1, GEO) for d in range(comm.world_size)]
    reducer = GiftReducer(comm, formats.get_format("fp32"))
    reducer.reduce(torch.randn(64 * comm.world_size), slices, {0: Probe()}, divisor=comm.world_size, step=0)


run_local(2, body)
print(sorted(seen), torch.backends.cuda.matmul.fp32_precision, torch.backends.mkldnn.matmul.fp32_precision)
"""


def test_transforms_run_in_full_fp32_under_the_new_tf32_api():
    # torch.backends.fp32_precision = "tf32" makes torch.get_float32_matmul_precision() raise; the
    # guard read it and the first bucket's reduction died (HF Trainer with tf32=True on transformers 5)
    proc = subprocess.run([sys.executable, "-c", NEW_TF32_API_SCRIPT], capture_output=True, text=True,
                          timeout=120, cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.strip().splitlines()[-1] == "[('ieee', 'ieee')] tf32 tf32"  # full fp32 inside, restored


def test_relayed_residuals_are_held_once_per_layout_across_refreshes():
    # a refresh changes the plan's hash (it names the transform versions): the chunk residual of
    # the old hash is not added to the new plan's sum, and it is replaced, not kept beside it
    from types import SimpleNamespace

    from deepspeed_gift.exchange.feedback import ErrorFeedback

    fb = ErrorFeedback()
    before, after = (SimpleNamespace(layout_key=("bucket",), hash=h) for h in (1, 2))
    fb.keep_relayed(before, 0, torch.full((4,), 0.5))
    assert torch.equal(fb.add_relayed(before, 0, torch.ones(4)), torch.full((4,), 1.5))
    assert torch.equal(fb.add_relayed(after, 0, torch.ones(4)), torch.ones(4))  # afresh after a refresh
    fb.keep_relayed(after, 0, torch.full((4,), 0.25))
    # one residual of 4 elements: a header, one fp32 block scale, 4 int8 codes
    assert len(fb.relayed) == 1 and fb.nbytes() == formats.HEADER_BYTES + 4 + 4
    restored = ErrorFeedback()
    restored.load_state_dict(fb.state_dict(), torch.device("cpu"))
    assert torch.equal(restored.add_relayed(after, 0, torch.zeros(4)), torch.full((4,), 0.25))


def test_relayed_residuals_of_the_earlier_format_are_dropped_with_a_warning(caplog):
    from deepspeed_gift.exchange.feedback import ErrorFeedback

    import logging

    fb = ErrorFeedback()
    log = logging.getLogger("deepspeed_gift")  # attach may have stopped it propagating to the root
    log.addHandler(caplog.handler)
    try:
        fb.load_state_dict({"residuals": [], "relay_residuals": [(7, 0, torch.ones(4))]}, torch.device("cpu"))
    finally:
        log.removeHandler(caplog.handler)
    assert fb.relayed == {} and "1 relayed error-feedback residuals" in caplog.text
