"""python benchmarks/codec_speed.py --numel 50000000

Encode/decode speed of every wire format on one float32 tensor, and the time of each
whitening transform and its inverse on gradients of given layer shapes.

For each format: median wall time over ``--repeats`` runs of ``encode_to_bytes`` (tensor
-> wire bytes, what a rank sends) and ``decode_from_bytes`` (wire bytes -> float32,
header check included), elements per second, the relative L2 error of the round trip on
this Gaussian tensor, and the time relative to ``x.clone()``
of the same tensor measured in the same run (a memory-bandwidth yardstick: 1.0 means
"as fast as one read + one write of the fp32 tensor"). ``add/clone`` is the owner's use of a
payload: ``decode_into(..., add=True)``, decoded and added into an fp32 tensor that exists
(the partition's gradient), where ``decode_from_bytes`` allocates its output as the clone does
and, on a CPU, pays the same first-touch page faults (the header line gives a copy into a
tensor that exists, for scale). Each format runs in both codec modes
(``--kernels``; ``+c`` marks ``gift.kernels: compiled``, whose first use compiles before the
timing). ``nvfp4/up`` is NVFP4 with the single
block-scale rule of earlier versions (smallest E4M3 scale that clips nothing), beside the
per-block choice among three scales. Prints a table; ``--json PATH``
also writes the numbers.

Transforms: for each ``--shapes`` entry ``MxN`` (a layer's gradient: M output rows, input
dimension N; the defaults are Llama-600M's attention/up and down projections), the
geometry's whitener (fitted to a random input covariance: the cost does not depend on the
values) applied to the gradient and inverted again, per solver (``structured`` rank
``--rank``, ``cholesky``, ``hadamard``), against a ``clone()`` of the same gradient.
``--sections S``: the host's time to encode S sections of ``--section-numel`` elements of a bf16
bucket into a send buffer, an encode each against one ``Codec.encode_spans`` call for all (what
the reducer does for a rank's plain sections), per compiled block-scaled codec, per section.
Smoke run: ``--numel 100000 --repeats 2 --shapes 64x32``.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Callable, List

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from deepspeed_gift.core.formats import FORMAT_NAMES, NvFp4Codec, get_format  # noqa: E402
from deepspeed_gift.core.geometry import fit_whitener, make_whitener  # noqa: E402

TRANSFORMS = ("structured", "cholesky", "hadamard")


def _timer(device: torch.device) -> Callable[[Callable[[], object]], float]:
    def run(fn: Callable[[], object]) -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter() - start

    return run


def _median(fn: Callable[[], object], repeats: int, timer) -> float:
    timer(fn)  # warm-up: allocator, lazy init, kernel selection
    return statistics.median(timer(fn) for _ in range(repeats))


def parse_shape(text: str) -> tuple:
    try:
        m, n = (int(v) for v in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"shape {text!r}: expected MxN, e.g. 3456x1280") from None
    if m < 1 or n < 1:
        raise argparse.ArgumentTypeError(f"shape {text!r}: both sizes must be >= 1")
    return m, n


def transform_rows(shapes, rank: int, repeats: int, device: torch.device, timer) -> List[dict]:
    """Whitening + inverse of an (M, N) gradient per solver, and a clone of it, same run."""
    rows = []
    gen = torch.Generator(device=device).manual_seed(1)
    for m, n in shapes:
        g = torch.randn(m, n, generator=gen, device=device)
        x = torch.randn(4 * n, n, generator=gen, device=device)
        cov = x.T @ x / x.shape[0]
        clone_s = _median(lambda: g.clone(), repeats, timer)
        for solver in TRANSFORMS:
            if solver == "hadamard":
                w = make_whitener("hadamard", n, device=device)
            else:
                w = fit_whitener(cov, rank=min(rank, n), damping=1e-3, solver=solver)
            t = _median(lambda: w.invert(w.apply(g)), repeats, timer)
            rows.append({"shape": f"{m}x{n}", "solver": solver, "rank": w.rank if solver == "structured" else None,
                         "apply_invert_ms": t * 1e3, "clone_ms": clone_s * 1e3, "vs_clone": t / clone_s,
                         "gelem_s": m * n / t / 1e9})
    return rows


def section_rows(variants, sections: int, numel: int, repeats: int, device: torch.device, timer) -> List[dict]:
    """Per codec that encodes spans (compiled block scales, nearest): ``sections`` spans of a bf16
    bucket (as a rank's sends of a piece lie) encoded into their places in a send buffer, as the
    reducer's pack did (an encode each, then a copy into its place) and as it does now (one
    ``encode_spans`` call, then a cat into each place), in microseconds per section."""
    gen = torch.Generator(device=device).manual_seed(2)
    bucket = torch.randn(sections * numel, generator=gen, device=device).bfloat16()
    spans = [(i * numel, numel) for i in range(sections)]
    rows = []
    for label, codec in variants:
        if not codec.encodes_spans(device):
            continue
        size = codec.nbytes(numel)
        buf = torch.empty(sections * size, dtype=torch.uint8, device=device)

        def each():
            for i, (a, n) in enumerate(spans):
                buf.narrow(0, i * size, size).copy_(codec.encode_to_bytes(bucket[a:a + n]))

        def batched():
            for i, parts in enumerate(codec.encode_spans(bucket, spans)):
                torch.cat(parts, out=buf.narrow(0, i * size, size))

        each()
        want = buf.clone()
        batched()
        if not torch.equal(buf, want):
            raise AssertionError(f"{label}: encode_spans gave other bytes than an encode per section")
        t_each = _median(each, repeats, timer) / sections
        t_batched = _median(batched, repeats, timer) / sections
        rows.append({"format": label, "sections": sections, "numel": numel, "each_us": t_each * 1e6,
                     "batched_us": t_batched * 1e6, "ratio": t_each / t_batched})
    return rows


def main(argv: List[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Encode/decode speed of every wire format and the time of "
                                                 "each whitening transform, against a copy (see the docstring).")
    parser.add_argument("--numel", type=int, default=50_000_000, help="elements of the test tensor")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs per measurement (median)")
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--formats", nargs="+", default=list(FORMAT_NAMES), choices=FORMAT_NAMES)
    parser.add_argument("--rounding", default="nearest", choices=("nearest", "stochastic"))
    parser.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    parser.add_argument("--kernels", nargs="+", default=["eager", "compiled"], choices=("eager", "compiled"),
                        help="codec modes to time (gift.kernels); compiled rows are labelled '+c' (first use "
                             "compiles, outside the timing)")
    parser.add_argument("--shapes", nargs="*", type=parse_shape, default=[(1280, 1280), (3456, 1280), (1280, 3456)],
                        help="layer gradient shapes MxN for the transform table (none: skip it)")
    parser.add_argument("--rank", type=int, default=32, help="rank of the structured whitener")
    parser.add_argument("--sections", type=int, default=0,
                        help="also time the host's encode of this many sections of --section-numel elements "
                             "into a send buffer, one call each against one call for all (Codec.encode_spans)")
    parser.add_argument("--section-numel", type=int, default=4096 + 17, help="elements of each of --sections")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    args = parser.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)

    device = torch.device(args.device)
    timer = _timer(device)
    gen = torch.Generator(device=device).manual_seed(0)
    x = torch.randn(args.numel, generator=gen, device=device)

    clone_s = _median(lambda: x.clone(), args.repeats, timer)
    into = torch.zeros_like(x)  # touched once: no first-use page faults in the timings below
    copy_s = _median(lambda: into.copy_(x), args.repeats, timer)
    rows = []
    variants = []
    for name in args.formats:
        rounding = "nearest" if name == "fp32" else args.rounding
        for mode in args.kernels:
            tag = "+c" if mode == "compiled" else ""
            variants.append((name + tag, get_format(name, rounding=rounding, kernels=mode)))
            if name == "nvfp4":  # the single scale rule of earlier versions, beside the per-block choice
                variants.append(("nvfp4/up" + tag, NvFp4Codec(rounding=rounding, scale_candidates=("up",),
                                                              kernels=mode)))
    for label, codec in variants:
        rounding = codec.rounding
        wire = codec.encode_to_bytes(x)
        enc_s = _median(lambda: codec.encode_to_bytes(x), args.repeats, timer)
        dec_s = _median(lambda: codec.decode_from_bytes(wire, x.shape), args.repeats, timer)
        payload = codec.bytes_to_payload(wire, x.shape)
        add_s = _median(lambda: codec.decode_into(payload, into, add=True), args.repeats, timer)
        rel_err = float((codec.decode_from_bytes(wire, x.shape) - x).norm() / x.norm())
        rows.append(
            {
                "format": label,
                "kernels": codec.kernels,
                "rel_l2_error": rel_err,
                "rounding": rounding,
                "block_size": codec.block_size,
                "bytes_per_element": wire.numel() / args.numel,
                "encode_ms": enc_s * 1e3,
                "decode_ms": dec_s * 1e3,
                "encode_gelem_s": args.numel / enc_s / 1e9,
                "decode_gelem_s": args.numel / dec_s / 1e9,
                "encode_vs_clone": enc_s / clone_s,
                "decode_vs_clone": dec_s / clone_s,
                "decode_add_ms": add_s * 1e3,
                "decode_add_vs_clone": add_s / clone_s,
            }
        )
        del wire, payload

    print(
        f"device={device} numel={args.numel} repeats={args.repeats} threads={torch.get_num_threads()} "
        f"torch={torch.__version__} clone={clone_s * 1e3:.3f} ms (a copy into a tensor in place: "
        f"{copy_s * 1e3:.3f} ms)"
    )
    head = (
        f"{'format':<11} {'B/elem':>7} {'enc ms':>8} {'dec ms':>8} {'enc Ge/s':>9} {'dec Ge/s':>9} "
        f"{'enc/clone':>9} {'dec/clone':>9} {'add/clone':>9} {'rel err':>8}"
    )
    print(head)
    print("-" * len(head))
    for r in rows:
        print(
            f"{r['format']:<11} {r['bytes_per_element']:>7.4f} {r['encode_ms']:>8.2f} {r['decode_ms']:>8.2f} "
            f"{r['encode_gelem_s']:>9.3f} {r['decode_gelem_s']:>9.3f} {r['encode_vs_clone']:>9.2f} "
            f"{r['decode_vs_clone']:>9.2f} {r['decode_add_vs_clone']:>9.2f} {r['rel_l2_error']:>8.4f}"
        )
    spans = section_rows(variants, args.sections, args.section_numel, args.repeats, device, timer) \
        if args.sections else []
    if spans:
        print(f"\n{args.sections} sections of {args.section_numel} elements encoded into a send buffer "
              f"(a rank's sends of one piece): host time per section")
        head = f"{'format':<11} {'each us':>9} {'one call us':>12} {'ratio':>7}"
        print(head)
        print("-" * len(head))
        for r in spans:
            print(f"{r['format']:<11} {r['each_us']:>9.1f} {r['batched_us']:>12.1f} {r['ratio']:>7.2f}")
    transforms = transform_rows(args.shapes, args.rank, args.repeats, device, timer)
    if transforms:
        print(f"\nwhitening + inverse of one layer gradient (structured rank {args.rank})")
        head = f"{'shape':<11} {'solver':<10} {'ms':>9} {'clone ms':>9} {'x clone':>8} {'Ge/s':>7}"
        print(head)
        print("-" * len(head))
        for r in transforms:
            print(f"{r['shape']:<11} {r['solver']:<10} {r['apply_invert_ms']:>9.2f} {r['clone_ms']:>9.3f} "
                  f"{r['vs_clone']:>8.1f} {r['gelem_s']:>7.3f}")
    if args.json is not None:
        result = {
            "device": str(device),
            "device_name": torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor(),
            "numel": args.numel,
            "repeats": args.repeats,
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
            "rounding": args.rounding,
            "clone_ms": clone_s * 1e3,
            "copy_into_ms": copy_s * 1e3,
            "formats": rows,
            "transforms": transforms,
            "sections": spans,
        }
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
