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
import itertools
import json
import os
import sys
import time
import warnings

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


def check_parity(device, numel: int) -> list:
    rows = []
    x_cpu = torch.randn(numel, generator=torch.Generator().manual_seed(0)) * torch.logspace(-3, 2, numel)
    for name in formats.FORMAT_NAMES:
        cpu_codec, dev_codec = formats.get_format(name), formats.get_format(name)
        ref = cpu_codec.encode_to_bytes(x_cpu)
        got = dev_codec.encode_to_bytes(x_cpu.to(device))
        decoded = dev_codec.decode_from_bytes(got, (numel,)).cpu()
        row = {"format": name, "nbytes": cpu_codec.nbytes(numel), "bytes_equal": torch.equal(ref, got.cpu()),
               "count_equal": got.numel() == ref.numel() == cpu_codec.nbytes(numel),
               "decode_equal": torch.equal(decoded, cpu_codec.decode_from_bytes(ref, (numel,)))}
        row["batch_decode_equal"] = _batch_decode_equal(cpu_codec, x_cpu, device)
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
            for mode, key in (("by_device", "stochastic_equal"), ("eager", "stochastic_eager_equal")):
                codec = formats.get_format(name, rounding="stochastic", seed=7, kernels=mode)
                row[key] = torch.equal(sr_ref, codec.encode_to_bytes(x).cpu())
        row["feedback_equal"] = _feedback_equal(name, device)
        rows.append(row)
    return rows


def _feedback_equal(name: str, device, numel: int = 128 * 33) -> bool:
    """Error feedback's step for a payload a rank sends (``Int8Codec.encode_with_residual``: one
    compiled kernel a tile on CUDA for the block-scaled fp8 and integer formats) on ``device``
    gives the CPU's eager payload and new residual, byte for byte, nearest and stochastic."""
    from deepspeed_gift.exchange import feedback

    x = torch.randn(numel, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 2, numel)
    store_cpu, store = feedback.residual_codec("eager"), feedback.residual_codec("by_device")
    old = store_cpu.encode(torch.randn(numel, generator=torch.Generator().manual_seed(4)) * 1e-3)
    old_dev = store.bytes_to_payload(old.wire.to(device), (numel,), check_header=False)
    same = True
    for rounding in ("nearest", "stochastic"):
        try:
            sent_cpu = formats.get_format(name, rounding=rounding, seed=7, kernels="eager")
        except ValueError:  # fp32 is exact: it takes no rounding
            continue
        sent = formats.get_format(name, rounding=rounding, seed=7)
        want = store_cpu.encode_with_residual(x.clone(), old, sent_cpu)
        got = store.encode_with_residual(x.to(device), old_dev, sent)
        same = same and all(torch.equal(a.wire, b.wire.cpu()) for a, b in zip(want, got))
    return same


def _same_values(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bit for bit, a nan equal to any nan (its payload bits depend on the kernel)."""
    return bool(((a.view(torch.int32) == b.view(torch.int32)) | (a.isnan() & b.isnan())).all())


def _batch_decode_equal(codec, x_cpu: torch.Tensor, device, senders: int = 5) -> bool:
    """The owner's batched decode (``Codec.bytes_to_payload`` of a 2-D buffer) on ``device``:
    every row equals that payload decoded alone there, and the whole equals the CPU's."""
    numel = x_cpu.numel()
    wires = [codec.encode_to_bytes(x_cpu * (s + 1)) for s in range(senders)]
    stride = 16 + wires[0].numel() + 3  # a control header before, a misaligned stride
    recv = torch.zeros(senders * stride + 5, dtype=torch.uint8)
    rows = recv[5:].view(senders, stride)[:, 16:16 + wires[0].numel()]
    for row, wire in zip(rows, wires):
        row.copy_(wire)
    on_cpu = codec.decode(codec.bytes_to_payload(rows, (numel,)))
    dev_rows = recv.to(device)[5:].view(senders, stride)[:, 16:16 + wires[0].numel()]
    batch = codec.decode(codec.bytes_to_payload(dev_rows, (numel,)))
    alone = torch.stack([codec.decode(codec.bytes_to_payload(w.to(device), (numel,))) for w in wires])
    return _same_values(batch, alone) and _same_values(batch.cpu(), on_cpu)


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


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser()
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--quick", action="store_true", help="small sizes (the suite's CPU run)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    quick = args.quick
    out = {"device": str(device), "torch": torch.__version__,
           "name": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"}
    out["parity"] = check_parity(device, 4096 + 17)
    out["codec"] = codec_speed(device, [1 << 20] if quick else [64 << 20, 512 << 20], 2 if quick else 5)
    out["whitener"] = whitener_check(device, 512 if quick else 4096, 2 if quick else 10)
    out["reducer"] = reducer_check(device, [4, 8], 256 * 64 if quick else 256 * 4096, 3)
    out["engine"] = engine_check(device, 3)
    out["processes"] = processes_check(device, 3)
    print(f"device {out['name']} ({out['device']}), torch {out['torch']}")
    print("| format | bytes | same bytes | eager same bytes | same count | same decode | batch decode | "
          "stochastic = CPU | stochastic eager = CPU | error feedback = CPU |")
    print("|---|---:|---|---|---|---|---|---|---|---|")
    for r in out["parity"]:
        print(f"| {r['format']} | {r['nbytes']} | {r['bytes_equal']} | {r['eager_bytes_equal']} | {r['count_equal']} | "
              f"{r['decode_equal']} | {r['batch_decode_equal']} | {r.get('stochastic_equal', '-')} | "
              f"{r.get('stochastic_eager_equal', '-')} | {r['feedback_equal']} |")
    print("| codec | elements | encode GB/s | decode GB/s | copy GB/s | encode/copy | peak extra B/elem |")
    print("|---|---:|---:|---:|---:|---:|---:|")
    for r in out["codec"]:
        peak = "-" if r["peak_extra_bytes_per_elem"] is None else f"{r['peak_extra_bytes_per_elem']:.2f}"
        print(f"| {r['codec']} | {r['numel']} | {r['encode_gbs']:.1f} | {r['decode_gbs']:.1f} | {r['copy_gbs']:.1f} | "
              f"{r['encode_vs_copy']:.1f} | {peak} |")
    print("| whitener | dim | apply + inverse s | round-trip rel err |")
    print("|---|---:|---:|---:|")
    for r in out["whitener"]:
        print(f"| {r['case']} | {r['dim']} | {r['apply_invert_s']:.4f} | {r['round_trip_rel_err']:.2e} |")
    print("| reducer W | elements | host conversions per bucket | sync-debug warnings | max rel err |")
    print("|---:|---:|---:|---:|---:|")
    for r in out["reducer"]:
        print(f"| {r['world']} | {r['numel']} | {r['host_conversions_per_bucket']:.2f} | "
              f"{r['sync_debug_warnings'] if r['sync_debug_warnings'] is not None else '-'} | {r['max_rel_err']:.4f} |")
    print("engine:", json.dumps({k: v for k, v in out["engine"].items() if k != "world1_fp8_losses"}))
    print("processes:", json.dumps(out["processes"]))
    write_json(args.json, out)
    return out


if __name__ == "__main__":
    main()
