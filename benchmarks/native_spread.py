"""    .venv/bin/python benchmarks/native_spread.py [--cases two_level_w4_s1_muon ...] [--json out.json]

Where the tolerances of the lossless-equals-native tests come from (``tests/spread.py``): for
each case of those tests, the parameters and losses after the run of native DeepSpeed, of
native with its other reduction collective (reduce to each owner instead of all-reduce of the
bucket: gloo's other summation order), of native with every gradient element moved by W units
u (the tests' yardstick) and of GIFT's lossless config; each run twice, once with this
machine's own kernels and once with another SIMD width (``ATEN_CPU_CAPABILITY=avx2
ONEDNN_MAX_CPU_ISA=AVX2``, or ``default``, scalar, where the machine is AVX2 already). Prints,
per case, native's spreads (across collectives, under the perturbation, across SIMD widths),
GIFT's distance to native, and its ratio to the perturbed spread, by the largest element and in
the L2 norm of all parameters: the tests require the latter to be at most SPREAD_FACTOR.
"""

from __future__ import annotations

import argparse
import os
import pickle
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.results import write_json  # noqa: E402

LOSSLESS = {"format": "fp32", "geometry": {"kind": "identity"}, "layers": "all", "telemetry": {"every": 1}}
MUON = dict(optimizer="muon", lr=2e-2, bucket=20000, muon_ns_fp32=True)
TWO_LEVEL = dict(LOSSLESS, hierarchy="two_level", ranks_per_node=2)
RELAY = dict(LOSSLESS, route="relay")
# name: (world, the tests' spec, GIFT's block): the cases of tests/test_zero.py,
# tests/test_two_level.py and tests/test_route.py that compare the lossless config with native
CASES = {
    "zero_w2_s1": (2, dict(stage=1, steps=3, ga=2, bucket=12000), LOSSLESS),
    "zero_w3_s2": (3, dict(stage=2, steps=3, bucket=15000), LOSSLESS),
    "zero_w3_s1_muon": (3, dict(stage=1, steps=5, **MUON), LOSSLESS),
    "zero_w3_s2_muon": (3, dict(stage=2, steps=5, **MUON), LOSSLESS),
    "two_level_w4_s1": (4, dict(stage=1, steps=10, ga=2, bucket=12000), TWO_LEVEL),
    "two_level_w4_s2": (4, dict(stage=2, steps=10, ga=2, bucket=12000), TWO_LEVEL),
    "two_level_w4_s1_muon": (4, dict(stage=1, steps=10, ga=2, **MUON), TWO_LEVEL),
    "two_level_w6_s1": (6, dict(stage=1, steps=10, ga=2, bucket=12000), TWO_LEVEL),
    "two_level_w6_s2_muon": (6, dict(stage=2, steps=10, ga=2, **MUON), TWO_LEVEL),
    "relay_w4_s1": (4, dict(stage=1, steps=3, ga=2, bucket=12000), RELAY),
    "relay_w4_s2": (4, dict(stage=2, steps=3, ga=2, bucket=12000), RELAY),
    "relay_w3_s2_muon": (3, dict(stage=2, steps=3, **MUON), RELAY),
}
AVX2_ENV = {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2"}


def native_reordered(spec: dict) -> dict:
    """``spec`` with DeepSpeed's other collective (each owner's slices reduced to it, not one
    all-reduce of the bucket): the same fp32 sums in another of gloo's orders."""
    return dict(spec, zero=dict(spec.get("zero", {}), use_multi_rank_bucket_allreduce=False))


def run_cases(names: list) -> dict:
    """Every case's runs on this process's kernels: {case: [native, reordered, perturbed, gift]} of rank 0."""
    from launch.spawn import run_ranks
    from tests.harness import train_many
    from tests.spread import native_perturbed

    out = {}
    for name in names:
        world, spec, gift = CASES[name]
        runs = run_ranks(train_many, world, [spec, native_reordered(spec), native_perturbed(spec, world),
                                             dict(spec, gift=gift)])[0]
        out[name] = [{"losses": r["losses"], "params": r["params"]} for r in runs]
        print(f"[native_spread] {name}: done", file=sys.stderr, flush=True)
    return out


def other_isa() -> dict:
    """The environment of the second run: AVX2 kernels, or scalar ones on an AVX2 machine."""
    import torch

    if torch.backends.cpu.get_cpu_capability() in ("AVX2", "DEFAULT"):
        return {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "AVX2"}
    return dict(AVX2_ENV)


def run_with(env: dict, names: list, path: str) -> None:
    # a fresh interpreter: ATEN_CPU_CAPABILITY and ONEDNN_MAX_CPU_ISA are read once per process.
    # Inductor (DeepSpeed compiles Muon's Newton-Schulz) keys its cache without the ISA: a kernel
    # built under one capability and loaded under the other crashed the rank (heap corruption)
    # or returned nan here, so each width keeps a cache of its own.
    full = dict(os.environ, **env)
    isa = env.get("ATEN_CPU_CAPABILITY", "own")
    full["TORCHINDUCTOR_CACHE_DIR"] = os.path.join(tempfile.gettempdir(), f"torchinductor-isa-{isa}")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--child", path, "--cases", *names],
                   env=full, cwd=ROOT, check=True)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description="Native DeepSpeed's own spread against GIFT's lossless distance.")
    p.add_argument("--cases", nargs="+", default=list(CASES), choices=list(CASES))
    p.add_argument("--json")
    p.add_argument("--child", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.child:
        with open(args.child, "wb") as f:
            pickle.dump(run_cases(args.cases), f)
        return {}
    from tests.spread import SPREAD_FACTOR, max_loss_diff, max_param_diff, norm_param_diff

    import torch

    isas = {"own": ({}, torch.backends.cpu.get_cpu_capability()), "other": (other_isa(), "")}
    isas["other"] = (isas["other"][0], isas["other"][0]["ATEN_CPU_CAPABILITY"].upper())
    runs = {}
    with tempfile.TemporaryDirectory() as tmp:
        for key, (env, _) in isas.items():
            path = os.path.join(tmp, key + ".pkl")
            run_with(env, args.cases, path)
            with open(path, "rb") as f:
                runs[key] = pickle.load(f)
    own, other = isas["own"][1], isas["other"][1]
    print(f"parameters, max |difference| (losses in brackets), {own} kernels / {other} kernels; the tests' bound: "
          f"GIFT vs native <= {SPREAD_FACTOR:g} x native vs native with gradients moved by W u (perturbed), "
          f"in the L2 norm of all parameters (last column)")
    head = ("| case | W | native vs reordered collective | native vs perturbed | "
            f"native {own} vs {other} | GIFT vs native | GIFT / perturbed spread | the same in L2 norm |")
    print(head)
    print("|" + "---|" * (head.count("|") - 1))
    rows = []

    def pair(i, j, f):
        return [f(runs[key][name][i], runs[key][name][j]) for key in ("own", "other")]

    for name in args.cases:
        a, b = runs["own"][name], runs["other"][name]
        row = {"case": name, "world": CASES[name][0],
               "collective_spread": pair(0, 1, max_param_diff), "perturbed_spread": pair(0, 2, max_param_diff),
               "gift": pair(0, 3, max_param_diff), "collective_spread_loss": pair(0, 1, max_loss_diff),
               "perturbed_spread_loss": pair(0, 2, max_loss_diff), "gift_loss": pair(0, 3, max_loss_diff),
               "simd_spread": max_param_diff(a[0], b[0]), "simd_spread_loss": max_loss_diff(a[0], b[0])}
        row["ratio"] = [g / s if s > 0 else float("inf") for g, s in zip(row["gift"], row["perturbed_spread"])]
        row["norm_perturbed_spread"], row["norm_gift"] = pair(0, 2, norm_param_diff), pair(0, 3, norm_param_diff)
        row["norm_ratio"] = [g / s if s > 0 else float("inf")
                             for g, s in zip(row["norm_gift"], row["norm_perturbed_spread"])]
        rows.append(row)

        def both(key):
            return " / ".join(f"{x:.2e}" for x in row[key]) + " [" + " / ".join(
                f"{x:.1e}" for x in row[key + "_loss"]) + "]"

        print(f"| {name} | {row['world']} | {both('collective_spread')} | {both('perturbed_spread')} | "
              f"{row['simd_spread']:.2e} [{row['simd_spread_loss']:.1e}] | {both('gift')} | "
              f"{row['ratio'][0]:.2f} / {row['ratio'][1]:.2f} | {row['norm_ratio'][0]:.2f} / "
              f"{row['norm_ratio'][1]:.2f} |", flush=True)
    result = {"isas": [own, other], "spread_factor": SPREAD_FACTOR, "rows": rows}
    write_json(args.json, result)
    return result


if __name__ == "__main__":
    main()
