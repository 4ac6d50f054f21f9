"""    .venv/bin/python benchmarks/ef_study.py --seeds 3 --out-dir runs/ef_study

What error feedback (EF) does to NVFP4 under AdamW. Trains the main job's model (``small``
Llama, 2 CPU ranks, 250 steps, the main job's lr and batches) in five configs per seed: bf16
(DeepSpeed's own reduction), and NVFP4 in Euclidean and in GIFT coordinates, each without and
with EF. Each pair differs in one thing only (EF, or the geometry). On the very runs the losses
come from, a probe (``launch.pretrain.main(probe=...)``) measures every ``--probe-every`` steps:

* ``residual/grad``: the size of EF's residual (what quantization left out, carried to the
  next step) against the gradient this rank fed into the reduction that step,
  ``||r|| / ||g||`` over every bucket. For GIFT the residual of a whitened layer is in its
  whitened coordinates, so the ratio is exact for the Euclidean runs only.
* ``residual round-off``: EF keeps its residual at about 1 byte an element (int8 codes, an
  fp32 scale per 128: ``deepspeed_gift.exchange.feedback``); the relative L2 error of what is
  stored against the exact fp32 residual of the same step, ``||stored - r|| / ||r||``, over
  every residual rank 0 keeps that step (sent and relayed); and the same error against the
  gradient, ``||stored - r|| / ||g||`` (what each step loses that EF does not carry on).
* Adam's second moment ``v`` (``exp_avg_sq``) of rank 0's partition, against the bf16 run of
  the same seed at the same step, element by element: the median of ``v / v_bf16`` over all
  elements, and over the quarter with the smallest ``v_bf16`` (where a gradient is small
  beside its block's largest element: NVFP4 rounds it to zero, and EF releases it later as a
  code of the block's scale).
* Adam's update ``m_hat / (sqrt(v_hat) + eps)``: its RMS over the partition.

Writes ``report.md`` (per config: final validation loss mean +- std over seeds; per pair: the
seed-paired difference and whether it exceeds 2 standard errors; the probe's figures, mean
over seeds) and ``results.json`` under ``--out-dir``. About 5 x 55 s per seed on 2 idle cores.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from launch.compare import DEFAULTS, SE_THRESHOLD, _f, paired_verdict, pretrain_argv, seed_stats  # noqa: E402
from launch.spawn import run_ranks  # noqa: E402

CONFIGS = {  # label -> ds_config
    "bf16": "ds_configs/bf16_baseline_zero2.json",
    "euclid_nvfp4": "ds_configs/euclid_nvfp4_zero2.json",
    "euclid_nvfp4_ef": "ds_configs/euclid_nvfp4_ef_zero2.json",
    "gift_nvfp4": "ds_configs/gift_nvfp4_zero2.json",
    "gift_nvfp4_ef": "ds_configs/gift_nvfp4_ef_zero2.json",
}
# (a, b, what differs): each pair differs in that alone
PAIRS = (("euclid_nvfp4_ef", "euclid_nvfp4", "error feedback (Euclidean)"),
         ("gift_nvfp4_ef", "gift_nvfp4", "error feedback (GIFT)"),
         ("gift_nvfp4", "euclid_nvfp4", "geometry (no EF)"),
         ("gift_nvfp4_ef", "euclid_nvfp4_ef", "geometry (EF)"))
SMALL_V_QUANTILE = 0.25


class Probe:
    """Measures one run on rank 0 (see the module docstring); other ranks return nothing. The
    gradient's norm is accumulated on the device during the reductions of the steps probed only,
    and read once per probe."""

    def __init__(self, every: int) -> None:
        self.every = every
        self.grad_sq = None  # squared norm of the gradients fed into this step's reductions (a tensor)
        self.roundoff_sq = None  # (||stored - exact||^2, ||exact||^2) of this step's residuals (tensors)
        self.measuring = False  # this step is probed: the wrappers add to grad_sq and roundoff_sq
        self.wrapped = False

    def _wrap(self, engine) -> None:
        opt = engine.optimizer
        inner = opt.average_tensor

        def average_tensor(tensor, *args, **kwargs):
            if self.measuring:
                norm_sq = tensor.float().square().sum()
                self.grad_sq = norm_sq if self.grad_sq is None else self.grad_sq + norm_sq
            return inner(tensor, *args, **kwargs)

        opt.average_tensor = average_tensor
        gift = getattr(engine, "gift", None)
        if gift is not None and gift.cfg.error_feedback:
            self._wrap_feedback(_feedback(gift))
        self.wrapped = True

    def _wrap_feedback(self, fb) -> None:
        keep, keep_relayed = fb.keep, fb.keep_relayed

        def measure(stored, exact) -> None:
            err = (stored.decode() - exact.reshape(-1)).square().sum()
            ref = exact.float().square().sum()
            if self.roundoff_sq is None:
                self.roundoff_sq = (err, ref)
            else:
                self.roundoff_sq = (self.roundoff_sq[0] + err, self.roundoff_sq[1] + ref)

        def keep_measured(plan, sec, residual, transforms):
            keep(plan, sec, residual, transforms)
            if self.measuring:  # ``residual`` is what was stored, exact (keep leaves it as it is)
                measure(fb.sent[(plan.layout_key, sec.key)][0], residual)

        def keep_relayed_measured(plan, index, residual):
            keep_relayed(plan, index, residual)
            if self.measuring:
                measure(fb.relayed[(plan.layout_key, index)][1], residual)

        keep_sent, keep_relayed_sent = fb.keep_sent, fb.keep_relayed_sent

        def keep_sent_measured(plan, sec, values, codec, wire, transforms):
            # the exact residual, which the fused path never stores: values minus the payload's decode
            exact = values.reshape(-1) - codec.decode_from_bytes(wire, (values.numel(),)) if self.measuring else None
            keep_sent(plan, sec, values, codec, wire, transforms)
            if exact is not None:
                measure(fb.sent[(plan.layout_key, sec.key)][0], exact)

        def keep_relayed_sent_measured(plan, index, value, codec, wire):
            exact = value.reshape(-1) - codec.decode_from_bytes(wire, (value.numel(),)) if self.measuring else None
            keep_relayed_sent(plan, index, value, codec, wire)
            if exact is not None:
                measure(fb.relayed[(plan.layout_key, index)][1], exact)

        send, send_relayed = fb.send, fb.send_relayed

        # a section sent on an ordinary step: the residual added, encoded and kept in one call
        # (one kernel a tile where compiled); the exact residual is the values with last step's
        # residual added (as that call adds it) less the payload's decode
        def send_measured(plan, sec, values, codec, transforms, **kw):
            fed = fb.add(plan, sec, values.clone(), transforms) if self.measuring else None
            wire = send(plan, sec, values, codec, transforms, **kw)
            if fed is not None:
                measure(fb.sent[(plan.layout_key, sec.key)][0],
                        fed.reshape(-1) - codec.decode_from_bytes(wire, (fed.numel(),)))
            return wire

        def send_relayed_measured(plan, index, value, codec, **kw):
            fed = fb.add_relayed(plan, index, value.clone()) if self.measuring else None
            wire = send_relayed(plan, index, value, codec, **kw)
            if fed is not None:
                measure(fb.relayed[(plan.layout_key, index)][1],
                        fed.reshape(-1) - codec.decode_from_bytes(wire, (fed.numel(),)))
            return wire

        fb.keep, fb.keep_relayed = keep_measured, keep_relayed_measured
        fb.keep_sent, fb.keep_relayed_sent = keep_sent_measured, keep_relayed_sent_measured
        fb.send, fb.send_relayed = send_measured, send_relayed_measured

    def __call__(self, engine, step: int) -> dict:
        import torch

        if torch.distributed.get_rank() != 0:
            return {}
        if not self.wrapped:  # the first step's reductions already ran: measured from the second
            self._wrap(engine)
        grad_sq, self.grad_sq = self.grad_sq, None
        roundoff_sq, self.roundoff_sq = self.roundoff_sq, None
        self.measuring = (step + 1) % self.every == 0  # the next step is probed
        if step % self.every:
            return {}
        out = {}
        gift = getattr(engine, "gift", None)
        if gift is not None and gift.cfg.error_feedback and grad_sq is not None and float(grad_sq) > 0:
            fb = _feedback(gift)
            res_sq = sum(float(held.decode().square().sum()) for held, _, _ in fb.sent.values())
            res_sq += sum(float(held.decode().square().sum()) for _, held in fb.relayed.values())
            out["residual_over_grad"] = math.sqrt(res_sq / float(grad_sq))
            if roundoff_sq is not None and float(roundoff_sq[1]) > 0:
                out["residual_roundoff"] = math.sqrt(float(roundoff_sq[0]) / float(roundoff_sq[1]))
                out["roundoff_over_grad"] = math.sqrt(float(roundoff_sq[0]) / float(grad_sq))
        opt = engine.optimizer
        vs, updates = [], []
        for g, p32 in enumerate(opt.single_partition_of_fp32_groups):
            state = opt.optimizer.state.get(p32, {})
            if "exp_avg_sq" not in state:
                continue
            group = opt.optimizer.param_groups[g]
            (b1, b2), t = group["betas"], int(float(state["step"]))
            v = state["exp_avg_sq"].float()
            vs.append(v.clone())
            updates.append((state["exp_avg"].float() / (1 - b1 ** t))
                           / ((v / (1 - b2 ** t)).sqrt() + group["eps"]))
        if vs:
            out["update_rms"] = float(torch.cat(updates).square().mean().sqrt())
            out["_v"] = torch.cat(vs)
        return out


def _feedback(gift):
    """The reducer's error feedback (two-level: its cross-node reducer's)."""
    return getattr(gift.reducer, "inner", gift.reducer).feedback


def run_config(label: str, seed: int, args, probe_every: int) -> dict:
    # the main job's settings; one validation, at the end (a run's losses do not depend on it)
    argv = pretrain_argv(CONFIGS[label], seed, preset=args.preset, steps=args.steps, seq_len=DEFAULTS["seq_len"],
                         micro_batch=DEFAULTS["micro_batch"], lr=DEFAULTS["lr"], eval_every=args.steps,
                         eval_batches=DEFAULTS["eval_batches"])
    t0 = time.time()
    results = run_ranks(_rank_body, 2, argv, probe_every, timeout=args.timeout)
    summary = results[0]
    summary["wall_s"] = time.time() - t0
    return summary


def _rank_body(rank: int, world: int, argv: list, probe_every: int) -> dict:
    from launch.pretrain import main

    probes = {}
    probe = Probe(probe_every)

    def record(engine, step):
        out = probe(engine, step)
        if out:
            probes[step] = out
        return {k: v for k, v in out.items() if not k.startswith("_")}

    summary = main(list(argv), probe=record)
    keep = ("final_val_loss", "final_train_loss", "fidelity_rel_err", "status")
    return {**{k: summary.get(k) for k in keep}, "probes": probes if rank == 0 else {}}


def compare_v(v, v_ref) -> dict:
    """Median of ``v / v_ref``, over every element with ``v_ref > 0`` and over the quarter of
    them with the smallest ``v_ref``."""
    import torch

    seen = v_ref > 0  # elements whose gradient was ever nonzero in the bf16 run
    ratio, ref = v[seen] / v_ref[seen], v_ref[seen]
    small = ref <= torch.quantile(ref[: 2 ** 24], SMALL_V_QUANTILE)
    return {"v_ratio_median": float(ratio.median()), "v_ratio_median_small": float(ratio[small].median())}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[1], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--seeds", type=int, default=3)
    p.add_argument("--seed", type=int, default=0, help="first seed")
    p.add_argument("--steps", type=int, default=DEFAULTS["steps"])
    p.add_argument("--preset", default=DEFAULTS["preset"])
    p.add_argument("--probe-every", type=int, default=50)
    p.add_argument("--configs", nargs="+", default=list(CONFIGS), choices=list(CONFIGS))
    p.add_argument("--timeout", type=float, default=900)
    p.add_argument("--out-dir", default=os.path.join(ROOT, "runs", "ef_study"))
    args = p.parse_args(argv)
    if "bf16" not in args.configs:
        args.configs = ["bf16"] + args.configs  # the reference of the v comparison
    os.makedirs(args.out_dir, exist_ok=True)
    runs = {label: {} for label in args.configs}
    for seed in range(args.seed, args.seed + args.seeds):
        for label in args.configs:
            r = run_config(label, seed, args, args.probe_every)
            print(f"seed {seed} {label}: val loss {_f(r['final_val_loss'])} ({r['status']}, {r['wall_s']:.0f} s)",
                  flush=True)
            runs[label][seed] = r
        ref = runs["bf16"][seed]["probes"]
        for label in args.configs:
            if label == "bf16":
                continue
            for step, pr in runs[label][seed]["probes"].items():
                v = pr.pop("_v", None)
                if v is not None and "_v" in ref.get(step, {}):
                    pr.update(compare_v(v, ref[step]["_v"]))
        for pr in ref.values():
            pr.pop("_v", None)
    report = write_report(runs, args)
    with open(os.path.join(args.out_dir, "results.json"), "w") as f:
        json.dump({"args": vars(args), "runs": runs, "pairs": report["pairs"]}, f, indent=1, default=str)
    print(f"report: {os.path.join(args.out_dir, 'report.md')}")
    return report


def write_report(runs: dict, args) -> dict:
    lines = [f"# Error feedback at NVFP4 under AdamW ({len(next(iter(runs.values())))} seeds, {args.steps} steps, "
             f"{args.preset} preset, 2 ranks)", "",
             "fidelity err: relative L2 error of the reduced gradient against an exact fp32 reduction of the "
             "step's gradient, mean over the sampled steps and seeds (with EF what is sent carries the previous "
             "step's residual, so this is the error the optimizer sees).", "",
             "| config | val loss mean | std | seeds | fidelity err |", "|---|---:|---:|---|---:|"]
    for label, by_seed in runs.items():
        st = seed_stats([r["final_val_loss"] if r["status"] == "ok" else None for r in by_seed.values()])
        fid = seed_stats([r.get("fidelity_rel_err") for r in by_seed.values()])
        lines.append(f"| {label} | {_f(st['mean'])} | {_f(st['std'])} | "
                     + ", ".join(f"{s}: {_f(r['final_val_loss'])}" for s, r in by_seed.items())
                     + f" | {_f(fid['mean'])} |")
    lines += ["", f"Pairs (seed-paired difference of val loss, a - b; beyond {SE_THRESHOLD:g} SE or not):", ""]
    pairs = {}
    for a, b, what in PAIRS:
        if a not in runs or b not in runs:
            continue
        v = paired_verdict({s: r["final_val_loss"] for s, r in runs[a].items()},
                           {s: r["final_val_loss"] for s, r in runs[b].items()}, names=(a, b))
        pairs[f"{a} vs {b}"] = dict(v, differs_in=what)
        lines.append(f"- {a} vs {b} (differ in {what}): {_f(v['diff'], '+.4f')}, SE {_f(v['se'])}: {v['verdict']}")
    lines += ["", "Probe (mean over seeds): residual/grad = ||EF residual|| / ||gradient fed in that step||; "
              "round-off = ||stored residual - exact fp32 residual|| / ||exact||, and the same over ||gradient||; "
              "v/v_bf16 = median over rank 0's partition of Adam's exp_avg_sq against the bf16 run's "
              f"(all elements; the {SMALL_V_QUANTILE:g} with the smallest v_bf16); update RMS of "
              "m_hat/(sqrt(v_hat)+eps).", "",
              "| config | step | residual/grad | round-off | round-off/grad | v/v_bf16 all | v/v_bf16 small "
              "| update RMS |",
              "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for label, by_seed in runs.items():
        steps = sorted({int(s) for r in by_seed.values() for s in r["probes"]})
        for step in steps:
            cells = []
            for key in ("residual_over_grad", "residual_roundoff", "roundoff_over_grad", "v_ratio_median",
                        "v_ratio_median_small", "update_rms"):
                xs = [r["probes"][step][key] for r in by_seed.values() if key in r["probes"].get(step, {})]
                cells.append(f"{statistics.fmean(xs):.3g}" if xs else "-")
            lines.append(f"| {label} | {step} | " + " | ".join(cells) + " |")
    with open(os.path.join(args.out_dir, "report.md"), "w") as f:
        f.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return {"pairs": pairs}


if __name__ == "__main__":
    main()
