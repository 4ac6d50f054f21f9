"""    .venv/bin/python benchmarks/gpu_check.py --json gpu_check.json          # on a GPU machine (~5 min)
    .venv/bin/python benchmarks/gpu_check.py --device cpu --quick --json c.json  # the CPU part (the suite runs it)

What the plugin must do on an accelerator before a user trusts it there, in one command; it
writes a JSON and prints a table:

1. ``parity``: every format's encode/decode on the device (``gift.kernels``' default: compiled on
   CUDA; and eager) against the CPU's eager codec (nearest rounding): the same bytes, the same byte count, the same decoded values; stochastic
   rounding, compiled and eager on the device, gives the CPU's eager bytes from the same seed (its
   random bits come from a counter); a batch of 5 payloads laid out as an owner
   receives them (one stride, fp32 scales misaligned) decodes on the device to what each decodes
   to alone, and to the CPU's batch (nan equal to nan); error feedback's step for a payload a
   rank sends (one fused kernel a tile on CUDA for the block formats) gives the CPU's eager
   payload and residual bytes. (On ``--device cpu``: the codec
   against itself, run twice; the byte count against ``nbytes``.)
2. ``codec``: encode and decode throughput (GB/s of fp32 input), eager and compiled, and peak
   extra memory per element for fp8 per block and per tensor, nvfp4 and int4 at 64M and 512M elements
   (``--quick``: 1M), beside a device copy of the same tensor.
3. ``whitener``: a kfac whitener's apply + inverse on a (4096 x 4096) gradient (quick: 512):
   seconds and round-trip error, with TF32 matmuls on and off, and inside the reducer's
   ``full_fp32_matmuls`` with TF32 on.
4. ``reducer``: ``GiftReducer`` with W = 4 and 8 thread ranks (``comm.LocalComm``) on the
   device, fp8 + kfac whitening + error feedback on ordinary steps (the plan agreed before):
   relative error against the exact mean and the host conversions and pageable copies counted
   in the reduction (must be 0), and on CUDA
   the syncs ``torch.cuda.set_sync_debug_mode`` reports.
5. ``engine``: DeepSpeed ZeRO-2 engines with GIFT on the device, one process: the lossless
   config equals native bit for bit, also with ``overlap_comm`` (the reduction stream); fp8 +
   kfac trains, also with the new TF32 API set.
6. ``processes``: 2 and 4 processes on the one device (on CUDA over ``cuda:gloo``, a group that
   takes only CUDA tensors): two-level forced, the compressed parameter gather and
   ``overlap_comm`` lossless == native bit for bit (2); the relay lossless within native's
   spread and fp8 over it training (4).
"""

from __future__ import annotations

import argparse
import gc
import itertools
import json
import os
import sys
import time
import warnings
from typing import Optional, Tuple

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.host_syncs import HostSyncCounter  # noqa: E402
from benchmarks.results import write_json  # noqa: E402
from deepspeed_gift.core import formats, geometry as geo  # noqa: E402
from deepspeed_gift.exchange.comm import run_local  # noqa: E402
from deepspeed_gift.core.geometry import full_fp32_matmuls  # noqa: E402
from deepspeed_gift.exchange.plan import GEO, ParamSlice  # noqa: E402
from deepspeed_gift.exchange.reducer import GiftReducer  # noqa: E402

CODEC_ROWS = [("fp8_e4m3 block 128", "fp8_e4m3", {}), ("fp8_e4m3 per tensor", "fp8_e4m3", {"block_size": 0}),
              ("nvfp4", "nvfp4", {}), ("int4", "int4", {})]


def synchronize(device) -> None:
    if device.type != "cpu":
        getattr(torch, device.type).synchronize(device)


def timed(fn, device, repeats: int) -> float:
    fn()  # warm-up (kernels, caches)
    synchronize(device)
    t0 = time.perf_counter()
    for _ in range(repeats):
        fn()
    synchronize(device)
    return (time.perf_counter() - t0) / repeats


def check_parity(device, numel: int, mode: str = "by_device") -> list:
    """``mode``: the device codec's ``gift.kernels`` (``by_device``: compiled on CUDA, eager on a
    CPU; ``compiled`` checks inductor's C++ kernels on a CPU against the eager ones, e.g. built with
    TORCHINDUCTOR_CPP_ENABLE_FLOATING_POINT_CONTRACT_FLAG=fast, as Triton contracts by default)."""
    rows = []
    x_cpu = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, numel)
    for name in formats.FORMAT_NAMES:
        cpu_codec, dev_codec = formats.get_format(name, kernels="eager"), formats.get_format(name, kernels=mode)
        ref = cpu_codec.encode_to_bytes(x_cpu)
        got = dev_codec.encode_to_bytes(x_cpu.to(device))
        decoded = dev_codec.decode_from_bytes(got, (numel,)).cpu()
        row = {"format": name, "nbytes": cpu_codec.nbytes(numel), "bytes_equal": torch.equal(ref, got.cpu()),
               "count_equal": got.numel() == ref.numel() == cpu_codec.nbytes(numel),
               # bits, not values: torch.equal holds -0.0 equal to +0.0 (the H200's first run passed
               # a fused NVFP4 decode that made every -0.0 +0.0)
               "decode_equal": _same_values(decoded, cpu_codec.decode_from_bytes(ref, (numel,)))}
        row["batch_decode_equal"], row["batch_decode_differ"] = _batch_decode_equal(dev_codec, cpu_codec, x_cpu,
                                                                                    device)
        # the device codec above runs gift.kernels' default: compiled on CUDA; eager beside it
        eager = formats.get_format(name, kernels="eager")
        row["eager_bytes_equal"] = torch.equal(ref, eager.encode_to_bytes(x_cpu.to(device)).cpu())
        try:
            sr_cpu = formats.get_format(name, rounding="stochastic", seed=7, kernels="eager")
        except ValueError:  # fp32 is exact: it takes no rounding
            pass
        else:
            # counter-based random bits: the device's compiled and eager encodes draw what the
            # CPU's eager chain draws from the same seed, so the bytes are the CPU's
            x, sr_ref = x_cpu.to(device), sr_cpu.encode_to_bytes(x_cpu)
            for kernels, key in ((mode, "stochastic_equal"), ("eager", "stochastic_eager_equal")):
                codec = formats.get_format(name, rounding="stochastic", seed=7, kernels=kernels)
                row[key] = torch.equal(sr_ref, codec.encode_to_bytes(x).cpu())
        row["spans_equal"] = _spans_equal(name, x_cpu, device, mode)
        row["feedback_differ"] = _feedback_differ(name, device, mode)
        row["feedback_equal"] = not any(row["feedback_differ"].values())
        rows.append(row)
    return rows


def _spans_equal(name: str, x_cpu: torch.Tensor, device, mode: str):
    """Spans of one tensor (a short block each, one of a single element) encoded by one device
    call (``Codec.encode_spans``, Triton's gathered loads on CUDA), rounded to nearest and
    stochastically, against the CPU eager encode of each span alone: True, False, or "-" where
    the codec does not batch spans on this device."""
    from deepspeed_gift.core.rng import CounterRng

    n = x_cpu.numel()
    spans = [(0, 300), (300, 1), (301, n // 2 - 301), (n // 2 + 5, n - n // 2 - 5)]
    same = None
    for rounding in ("nearest", "stochastic"):
        codec = formats.get_format(name, kernels=mode, rounding=rounding, seed=7)
        if not codec.encodes_spans(device):
            return "-"
        ref = formats.get_format(name, kernels="eager", rounding=rounding, seed=7)
        keys = None
        if rounding == "stochastic":  # each span's key, drawn in order as their own encodes draw them
            rng = CounterRng(9)
            keys = [codec.next_key(rng) for _ in spans]
        parts = codec.encode_spans(x_cpu.to(device).bfloat16(), spans, keys=keys)
        rng = CounterRng(9)
        for (a, k), wire in zip(spans, parts):
            want = ref.encode_to_bytes(x_cpu.bfloat16()[a:a + k], generator=rng)
            same = (same is not False) and torch.equal(torch.cat(wire).cpu(), want)
    return same


def _feedback_differ(name: str, device, mode: str, numel: int = 128 * 33) -> dict:
    """Error feedback's step for a payload a rank sends (``Int8Codec.encode_with_residual``: one
    compiled kernel a tile on CUDA for the block-scaled fp8 and integer formats) on ``device``
    against the CPU's eager payload and new residual: the bytes that differ, per rounding and
    part (all 0: the same bytes). The block formats again with blocks of 32, finer than the
    residual's 128 (the relay's int8/32 hop): on CUDA one kernel over the residual's rows
    (``integer.feedback_sub_encode``), which a CPU does not take."""
    from deepspeed_gift.exchange import feedback

    x = torch.randn(numel, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 2, numel)
    store_cpu, store = feedback.residual_codec("eager"), feedback.residual_codec(mode)
    old = store_cpu.encode(torch.randn(numel, generator=torch.Generator().manual_seed(4)) * 1e-3)
    old_dev = store.bytes_to_payload(old.wire.to(device), (numel,), check_header=False)
    differ = {}
    finer = [{"block_size": 32}] if name in ("fp8_e4m3", "fp8_e5m2", "int8", "int4") else []
    for options in [{}] + finer:
        label = "" if not options else " /32"
        for rounding in ("nearest", "stochastic"):
            try:
                sent_cpu = formats.get_format(name, rounding=rounding, seed=7, kernels="eager", **options)
            except ValueError:  # fp32 is exact: it takes no rounding
                continue
            sent = formats.get_format(name, rounding=rounding, seed=7, kernels=mode, **options)
            want = store_cpu.encode_with_residual(x.clone(), old, sent_cpu)
            got = store.encode_with_residual(x.to(device), old_dev, sent)
            for part, a, b in zip(("payload", "residual"), want, got):
                differ[f"{rounding} {part}{label}"] = int((a.wire != b.wire.cpu()).sum())
    return differ


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, a nan equal to any nan (its payload bits depend on the kernel)."""
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def _batch_decode_equal(codec, cpu_codec, x_cpu: torch.Tensor, device, senders: int = 5):
    """The owner's batched decode (``Codec.bytes_to_payload`` of a 2-D buffer) on ``device``:
    every row equals that payload decoded alone there, and the whole equals the CPU's eager
    batch. Returns (equal, the elements that differ: batch against alone, against the CPU)."""
    numel = x_cpu.numel()
    wires = [cpu_codec.encode_to_bytes(x_cpu * (s + 1)) for s in range(senders)]
    stride = 16 + wires[0].numel() + 3  # a control header before, a misaligned stride
    recv = torch.zeros(senders * stride + 5, dtype=torch.uint8)
    rows = recv[5:].view(senders, stride)[:, 16:16 + wires[0].numel()]
    for row, wire in zip(rows, wires):
        row.copy_(wire)
    on_cpu = cpu_codec.decode(cpu_codec.bytes_to_payload(rows, (numel,)))
    dev_rows = recv.to(device)[5:].view(senders, stride)[:, 16:16 + wires[0].numel()]
    batch = codec.decode(codec.bytes_to_payload(dev_rows, (numel,)))
    alone = torch.stack([codec.decode(codec.bytes_to_payload(w.to(device), (numel,))) for w in wires])

    def differ(a, b):
        return int((~((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan()))).sum())

    counts = {"batch_vs_alone": differ(batch, alone), "batch_vs_cpu": differ(batch.cpu(), on_cpu),
              "alone_vs_cpu": differ(alone.cpu(), on_cpu)}
    return not any(counts.values()), counts


def codec_speed(device, sizes, repeats: int) -> list:
    rows = []
    for numel in sizes:
        x = torch.randn(numel, device=device)
        copy_s = timed(lambda: x.clone(), device, repeats)
        # compiled on CUDA only: the CPU part checks the check, not inductor's C++ (minutes to build)
        modes = ("eager", "compiled") if device.type == "cuda" else ("eager",)
        for (label, name, options), kernels in itertools.product(CODEC_ROWS, modes):
            codec = formats.get_format(name, kernels=kernels, **options)
            wire = codec.encode_to_bytes(x)  # compiled: compiles here, before the timing
            enc_s = timed(lambda: codec.encode_to_bytes(x), device, repeats)
            dec_s = timed(lambda: codec.decode_from_bytes(wire, (numel,)), device, repeats)
            peak = None
            if device.type == "cuda":
                torch.cuda.synchronize(device)
                base = torch.cuda.memory_allocated(device)
                torch.cuda.reset_peak_memory_stats(device)
                codec.decode_from_bytes(codec.encode_to_bytes(x), (numel,))
                torch.cuda.synchronize(device)
                peak = (torch.cuda.max_memory_allocated(device) - base) / numel
            rows.append({"codec": label, "kernels": kernels, "numel": numel, "encode_gbs": 4 * numel / enc_s / 1e9,
                         "decode_gbs": 4 * numel / dec_s / 1e9, "copy_gbs": 4 * numel / copy_s / 1e9,
                         "encode_vs_copy": enc_s / copy_s, "peak_extra_bytes_per_elem": peak})
    return rows


def cuda_kernels(fn) -> Tuple[Optional[int], Optional[float]]:
    """Device kernels (memsets and copies included) one call of ``fn`` launches, and their summed
    time on the device in microseconds, read off torch's profiler; (None, None) where the
    profiler cannot see the device. Device time well under the call's wall time means the host
    sets the pace (launches, Python, guards), not the kernels."""
    from torch.profiler import ProfilerActivity, profile

    try:
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn()
            torch.cuda.synchronize()
        events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
        return len(events), sum(e.time_range.elapsed_us() for e in events)
    except Exception:  # noqa: BLE001 (a profiler that cannot start is a missing figure, not a failure)
        return None, None


def traffic_timed(device, senders: int, repeats: int, numel: Optional[int] = None, on_row=None) -> list:
    """``benchmarks/codec_traffic.py``'s operations on the device at a GPU tile, timed: seconds,
    the kernels launched, and the time against the byte floor moved at a device copy's rate
    (a copy reads and writes 4 B an element: floor bytes / copy's bytes per second)."""
    from benchmarks import codec_traffic as ct

    numel = numel or ct.GPU_TILE
    x = torch.randn(numel, device=device)
    copy_s = timed(lambda: x.clone(), device, repeats)
    copy_bps = 8 * numel / copy_s
    rows = []
    ops = [("encode", "encode", 1, "nearest"), (f"decode_sum S={senders}", "decode_sum", senders, "nearest"),
           ("encode stochastic", "encode", 1, "stochastic"), ("encode+feedback", "feedback", 1, "nearest"),
           ("encode bf16", "encode_bf16", 1, "nearest"),  # a bf16 bucket's values read as they lie
           ("encode short", "encode_short", 1, "nearest")]  # a section that ends in a short block
    modes = ("eager", "compiled") if device.type == "cuda" else ("eager",)
    for (label, fmt, options), (op_label, op, s, rounding), mode in itertools.product(ct.CASES, ops, modes):
        row = {"case": label, "op": op_label, "mode": mode, "numel": numel}
        try:
            # error feedback's staging copies made beforehand, one a call: warm-up, timed()'s
            # own warm-up, the repeats and the profiled call
            run, codec = ct.operation(mode, fmt, options, op, s, numel, device.type, rounding,
                                      staged=repeats + 3)
            run()  # compiles, warms
            seconds = timed(run, device, repeats)
            kernels, device_us = cuda_kernels(run) if device.type == "cuda" else (None, None)
            floor = ct.floor_bytes(codec, op, s, numel)
            row.update(seconds=seconds, us=seconds * 1e6, input_gbs=4 * numel / seconds / 1e9,
                       floor_bytes_per_elem=floor, x_floor_time=seconds / (floor * numel / copy_bps),
                       kernels=kernels, device_us=device_us)
        except Exception as exc:  # noqa: BLE001 (one case's failure is reported, the others still run)
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
        row["copy_us"] = copy_s * 1e6
        rows.append(row)
        if on_row is not None:  # a run stopped at its time limit keeps the rows it finished
            on_row(rows)
    return rows


def _tf32(on: bool) -> None:
    torch.set_float32_matmul_precision("high" if on else "highest")


def whitener_check(device, dim: int, repeats: int) -> list:
    g = torch.Generator().manual_seed(1)
    X = torch.randn(4 * dim, dim, generator=g) * torch.linspace(0.05, 4.0, dim)
    w = geo.fit_whitener(X.T @ X / X.shape[0], rank=32, damping=1e-3).to(device)
    grad = torch.randn(dim, dim, generator=g).to(device)
    rows, saved = [], torch.get_float32_matmul_precision()
    try:
        for label, tf32, guarded in (("tf32 off", False, False), ("tf32 on", True, False),
                                     ("tf32 on, reducer's guard", True, True)):
            _tf32(tf32)

            def round_trip():
                if guarded:
                    with full_fp32_matmuls():
                        return w.invert(w.apply(grad))
                return w.invert(w.apply(grad))

            seconds = timed(round_trip, device, repeats)
            err = float((round_trip() - grad).norm() / grad.norm())
            rows.append({"case": label, "dim": dim, "apply_invert_s": seconds, "round_trip_rel_err": err})
    finally:
        torch.set_float32_matmul_precision(saved)
    return rows


def _reducer_rank(comm, device, steps, grads, whitener):
    world, n = comm.world_size, grads.shape[1]
    width = whitener.dim
    bounds = [n * j // world for j in range(world + 1)]
    # one weight (n / width rows) cut by every partition boundary: whole rows whitened, cut rows as is
    slices = [ParamSlice(d, bounds[d], bounds[d + 1] - bounds[d], bounds[d], 0, width, GEO) for d in range(world)]
    reducer = GiftReducer(comm, formats.get_format("fp8_e4m3"), error_feedback=True, defer_checks=True)
    reducer.plan_for(slices, {0: whitener.version})  # agreed by the ranks when made (a host read), as at attach
    syncs, errs = 0, []
    for step in range(steps):
        bucket = grads[comm.rank].to(device)
        exact = grads.to(device).mean(0)
        with HostSyncCounter() as counter:
            reducer.reduce(bucket, slices, {0: whitener}, divisor=world, step=step)
        syncs += counter.total
        reducer.verify_checks()
        me = slice(bounds[comm.rank], bounds[comm.rank + 1])
        errs.append(float((bucket[me] - exact[me]).norm() / exact[me].norm()))
    return syncs, max(errs)


def reducer_check(device, worlds, numel: int, steps: int) -> list:
    rows = []
    width = 256
    X = torch.randn(2048, width, generator=torch.Generator().manual_seed(2)) * torch.linspace(0.05, 4.0, width)
    whitener = geo.fit_whitener(X.T @ X / 2048, rank=16, damping=1e-3).to(device)
    for world in worlds:
        grads = torch.randn(world, numel, generator=torch.Generator().manual_seed(world))
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode("warn")
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            out = run_local(world, _reducer_rank, device, steps, grads, whitener)
        if device.type == "cuda":
            torch.cuda.set_sync_debug_mode(0)
        sync_warnings = sum("synchroniz" in str(w.message) for w in caught)
        rows.append({"world": world, "numel": numel, "steps": steps,
                     "host_conversions_per_bucket": sum(s for s, _ in out) / (world * steps),
                     "sync_debug_warnings": sync_warnings if device.type == "cuda" else None,
                     "max_rel_err": max(e for _, e in out)})
    return rows


def _engine_body(rank, world, specs, device_type):
    from tests.harness import train

    out = []
    for spec in specs:
        r = train(rank, world, spec)
        params = {k: v.cpu() for k, v in r["params"].items()}
        out.append({"losses": r["losses"], "params": params, "records": r.get("records", [])})
    return out


LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1}}
FP8 = {"format": "fp8_e4m3", "layers": "all", "geometry": {"rank": 8, "refresh_interval": 2},
       "telemetry": {"every": 1}}


def _same_bits(a: dict, b: dict) -> bool:
    return a["losses"] == b["losses"] and all(torch.equal(a["params"][k], b["params"][k]) for k in a["params"])


def engine_check(device, steps: int) -> dict:
    """World 1: lossless == native, without and with ``overlap_comm`` (DeepSpeed's reduction
    stream, where GIFT's reduction then runs); fp8 + kfac trains, also under the new TF32 API
    (``torch.backends.fp32_precision = "tf32"``, what transformers 5 sets for ``tf32=True``)."""
    from launch.spawn import run_ranks

    base = dict(stage=2, steps=steps, bucket=20000)
    overlap = dict(base, overlap=True)
    specs = [base, dict(base, gift=LOSSLESS), dict(base, gift=FP8), overlap, dict(overlap, gift=LOSSLESS),
             dict(base, gift=FP8, tf32_new_api=True)]
    native, exact, lowp, native_overlap, exact_overlap, new_api = run_ranks(_engine_body, 1, specs, device.type,
                                                                             timeout=600)[0]
    return {"world1_lossless_equals_native": _same_bits(native, exact),
            "world1_overlap_comm_lossless_equals_native": _same_bits(native_overlap, exact_overlap),
            "world1_fp8_trains": lowp["losses"][-1] < lowp["losses"][0], "world1_fp8_losses": lowp["losses"],
            "world1_fp8_new_tf32_api_trains": new_api["losses"][-1] < new_api["losses"][0]}


def processes_check(device, steps: int) -> dict:
    """Several processes on the one device (on CUDA in a ``cuda:gloo`` group, which takes only
    CUDA tensors: no host tensor may reach a collective; elsewhere gloo). Two processes, where
    the lossless config must equal native bit for bit: two-level forced (``ranks_per_node`` 1),
    the compressed parameter gather (exact format), ``overlap_comm``. Four, where the relay
    route runs (it needs three ranks or more): lossless within native's own spread
    (``tests/spread.py``: the owner sums four ranks in another order), fp8 + kfac trains."""
    from launch.spawn import run_ranks
    from tests.spread import native_perturbed, norm_param_diff, spread_bounds

    group = dict(dist_backend="cuda:gloo", env={"LOCAL_RANK": "0"}) if device.type == "cuda" else {}
    base = dict(stage=2, steps=steps, bucket=20000, **group)
    overlap = dict(base, overlap=True)
    two = [base, dict(base, gift=dict(LOSSLESS, hierarchy="two_level", ranks_per_node=1)),
           dict(base, gift=dict(LOSSLESS, params={"format": "fp32"})), overlap, dict(overlap, gift=LOSSLESS)]
    result: dict = {"group": group.get("dist_backend", "gloo")}
    try:
        per_rank = run_ranks(_engine_body, 2, two, device.type, timeout=600)
        native, two_level, params, native_overlap, gift_overlap = per_rank[0]
        result.update({"w2_two_level_lossless_equals_native": all(_same_bits(r[0], r[1]) for r in per_rank),
                       "w2_param_gather_lossless_equals_native": all(_same_bits(r[0], r[2]) for r in per_rank),
                       "w2_overlap_comm_lossless_equals_native": all(_same_bits(r[3], r[4]) for r in per_rank)})
        four = [base, native_perturbed(base, 4), dict(base, gift=dict(LOSSLESS, route="relay")),
                dict(base, gift=dict(FP8, route="relay"))]
        native, perturbed, relay, relay_fp8 = run_ranks(_engine_body, 4, four, device.type, timeout=600)[0]
        bound = spread_bounds(native, perturbed)
        result.update({"w4_relay_lossless_vs_native": norm_param_diff(native, relay),
                       "w4_native_spread_bound": bound["params"],
                       "w4_relay_lossless_within_spread": 0 < bound["params"]
                       and norm_param_diff(native, relay) <= bound["params"],
                       "w4_relay_fp8_trains": relay_fp8["losses"][-1] < relay_fp8["losses"][0],
                       "w4_relay_buckets": sum(r.get("relay_buckets", 0) for r in relay_fp8["records"])})
    except RuntimeError as exc:
        result["error"] = str(exc)[-1500:]
    return result


def _step_body(rank, world, specs, warm, timed_steps):
    """Each spec's engine on the device, its optimizer steps timed between device syncs."""
    from tests.harness import batches, build_engine

    out = []
    for spec in specs:
        engine = build_engine(spec)
        seconds = []
        for i, tokens in enumerate(batches(rank, warm + timed_steps, spec["micro"], spec["seq"])):
            tokens = tokens.to(engine.device)
            torch.cuda.synchronize() if engine.device.type == "cuda" else None
            t0 = time.perf_counter()
            loss = engine(input_ids=tokens, labels=tokens).loss
            engine.backward(loss)
            engine.step()
            torch.cuda.synchronize() if engine.device.type == "cuda" else None
            if i >= warm:
                seconds.append(time.perf_counter() - t0)
        on_cuda = engine.device.type == "cuda"
        peak = torch.cuda.max_memory_allocated() / 2**30 if on_cuda else None
        out.append({"mean_s": sum(seconds) / len(seconds), "median_s": sorted(seconds)[len(seconds) // 2],
                    "steps": len(seconds), "last_loss": float(loss.detach()), "peak_gib": peak})
        engine.destroy()  # its hooks and buffers: the next engine starts from what this one found
        del engine, loss
        gc.collect()
        if on_cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
            # what the engines left behind (the first H200 run grew 4.8 GiB an engine): reported
            out[-1]["left_allocated_gib"] = torch.cuda.memory_allocated() / 2**30
    return out


def step_work(device, preset: str, seq: int, micro: int, warm: int, steps: int, rounds: int = 2) -> dict:
    """GIFT's own step work at the device's rates, world 1 (no wire: the codec, statistics and
    judgement only): the shipped ``gift_fp8_zero2.json`` (kfac, layers measured) against
    ``euclid_fp8_e4m3_block_zero2.json`` and native bf16, each ZeRO-2 engine built and timed
    in turn, ``rounds`` times interleaved."""
    from launch.spawn import run_ranks

    def block(name):
        with open(os.path.join(ROOT, "ds_configs", name)) as f:
            cfg = json.load(f)
        return cfg["gift"]

    base = dict(stage=2, dtype="bf16", preset=preset, seq=seq, micro=micro, bucket=50_000_000, overlap=True,
                clip=1.0, lr=3e-4)
    names = ("native bf16", "euclidean fp8", "gift fp8")
    three = [base, dict(base, gift=block("euclid_fp8_e4m3_block_zero2.json")),
             dict(base, gift=block("gift_fp8_zero2.json"))]
    # each round in another order (0 1 2, 1 2 0, 2 0 1): over 3 rounds each config runs once in
    # each place (the first H200 run, in one fixed order, could not tell order from config)
    order = [(i + r) % 3 for r in range(rounds) for i in range(3)]
    runs = run_ranks(_step_body, 1, [three[i] for i in order], warm, steps, timeout=900)[0]
    out = {"preset": preset, "seq": seq, "micro": micro, "steps": steps, "rounds": rounds, "order": order,
           "runs": {}}
    for i, r in zip(order, runs):
        out["runs"].setdefault(names[i], []).append(r)
    mean = {k: sum(r["mean_s"] for r in v) / len(v) for k, v in out["runs"].items()}
    out["mean_s"] = mean
    out["gift_over_euclidean"] = mean["gift fp8"] / mean["euclidean fp8"]
    out["euclidean_over_native"] = mean["euclidean fp8"] / mean["native bf16"]
    return out


def _table(columns: str, rows) -> None:
    """A markdown table: ``columns`` the header cells split by "|" (a leading "<" left-aligns one,
    the others align right), ``rows`` lists of cells."""
    names = [c.strip() for c in columns.split("|")]
    print("| " + " | ".join(n.lstrip("<") for n in names) + " |")
    print("|" + "|".join("---" if n.startswith("<") else "---:" for n in names) + "|")
    for cells in rows:
        print("| " + " | ".join(str(c) for c in cells) + " |")


def _or_dash(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def print_tables(out: dict) -> None:
    print(f"device {out['name']} ({out['device']}), torch {out['torch']}")
    if "parity" in out:
        _table("<format | bytes | <same bytes | <eager same bytes | <same count | <same decode | <batch decode | "
               "<stochastic = CPU | <stochastic eager = CPU | <spans in one call = CPU | <error feedback = CPU",
               [[r["format"], r["nbytes"], r["bytes_equal"], r["eager_bytes_equal"], r["count_equal"],
                 r["decode_equal"], r["batch_decode_equal"], r.get("stochastic_equal", "-"),
                 r.get("stochastic_eager_equal", "-"), r.get("spans_equal", "-"), r["feedback_equal"]]
                for r in out["parity"]])
        for r in out["parity"]:
            wrong = {k: v for k, v in {**r["batch_decode_differ"], **r["feedback_differ"]}.items() if v}
            if wrong:
                print(f"  {r['format']}: elements or bytes that differ: {wrong}")
    if "traffic" in out:
        _table("<case | <operation | <kernels mode | us a tile | device kernels | their device us | "
               "x floor (time at copy rate)",
               [[r["case"], r["op"], r["mode"], f"error: {r['error'][:120]}", "", "", ""] if "error" in r else
                [r["case"], r["op"], r["mode"], f"{r['us']:.1f}", r["kernels"], _or_dash(r.get("device_us"), ".1f"),
                 f"{r['x_floor_time']:.2f}"] for r in out["traffic"]])
    if "codec" in out:
        _table("<codec | <kernels | elements | encode GB/s | decode GB/s | copy GB/s | encode/copy | peak extra B/elem",
               [[r["codec"], r["kernels"], r["numel"], f"{r['encode_gbs']:.1f}", f"{r['decode_gbs']:.1f}",
                 f"{r['copy_gbs']:.1f}", f"{r['encode_vs_copy']:.2f}", _or_dash(r["peak_extra_bytes_per_elem"], ".2f")]
                for r in out["codec"]])
    if "whitener" in out:
        _table("<whitener | dim | apply + inverse s | round-trip rel err",
               [[r["case"], r["dim"], f"{r['apply_invert_s']:.4f}", f"{r['round_trip_rel_err']:.2e}"]
                for r in out["whitener"]])
    if "reducer" in out:
        _table("reducer W | elements | host conversions per bucket | sync-debug warnings | max rel err",
               [[r["world"], r["numel"], f"{r['host_conversions_per_bucket']:.2f}",
                 _or_dash(r["sync_debug_warnings"], "d"), f"{r['max_rel_err']:.4f}"] for r in out["reducer"]])
    for key in ("engine", "processes", "step_work"):
        if key in out:
            print(f"{key}:", json.dumps({k: v for k, v in out[key].items() if k not in ("world1_fp8_losses", "runs")}))
    for key, err in out.get("errors", {}).items():
        print(f"{key}: FAILED {err[-600:]}")


def provenance() -> dict:
    """What produced the results: the repository's commit and whether its tree had changes
    (where git is there), the inductor options the compiled codecs ask for, and those this
    torch lacks (dropped; known once a codec has compiled)."""
    import subprocess

    from deepspeed_gift.core import kernels as fused

    def git(*cmd):
        try:
            return subprocess.run(["git", *cmd], cwd=ROOT, capture_output=True, text=True, timeout=10).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            return None

    return {"commit": git("rev-parse", "HEAD"), "changed_files": git("status", "--porcelain", "--untracked-files=no"),
            "compile_options": dict(fused._COMPILE_OPTIONS), "options_missing": list(fused._MISSING_LOGGED)}


# most wanted first: a run stopped at its time limit keeps the sections it finished
SECTIONS = ("parity", "codec", "step_work", "traffic", "engine", "reducer", "whitener", "processes")


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (the suite's CPU run)")
    parser.add_argument("--sections", nargs="+", default=list(SECTIONS), choices=SECTIONS)
    parser.add_argument("--kernels", default="by_device", choices=("by_device", "compiled"),
                        help="the parity section's device codecs (compiled: inductor's kernels on a CPU too)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        if device.index is None:  # set_device refuses a device without an index
            device = torch.device("cuda", torch.cuda.current_device())
        torch.cuda.set_device(device)
    quick = args.quick
    out = {"device": str(device), "torch": torch.__version__,
           "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu", "errors": {},
           "provenance": provenance()}
    work = {
        "parity": lambda: check_parity(device, 4096 + 17, args.kernels),
        "traffic": lambda: traffic_timed(device, 7, 3 if quick else 20, 1 << 16 if quick else None,
                                         on_row=lambda rows: (out.__setitem__("traffic", rows),
                                                              write_json(args.json, out))),
        "codec": lambda: codec_speed(device, [1 << 20] if quick else [64 << 20, 512 << 20], 2 if quick else 5),
        "whitener": lambda: whitener_check(device, 512 if quick else 4096, 2 if quick else 10),
        "reducer": lambda: reducer_check(device, [4, 8], 256 * 64 if quick else 256 * 4096, 3),
        "engine": lambda: engine_check(device, 3),
        "step_work": lambda: step_work(device, "tiny" if quick else "300m", 64 if quick else 2048,
                                       2 if quick else 4, 1 if quick else 3, 2 if quick else 20, 1 if quick else 3),
        "processes": lambda: processes_check(device, 3),
    }
    # each section on its own: one that fails is reported and the others still run; the JSON is
    # written after each (a run stopped at its time limit keeps what it finished)
    for name in args.sections:
        t0 = time.perf_counter()
        try:
            out[name] = work[name]()
        except Exception as exc:  # noqa: BLE001
            import traceback

            out["errors"][name] = "".join(traceback.format_exception(exc))[-3000:]
        out.setdefault("section_s", {})[name] = time.perf_counter() - t0
        print(f"[gpu_check] {name} done in {out['section_s'][name]:.1f} s", flush=True)
        write_json(args.json, out)
    out["provenance"] = provenance()  # the options a compile dropped are known by now
    write_json(args.json, out)
    print_tables(out)
    return out


if __name__ == "__main__":
    main()
