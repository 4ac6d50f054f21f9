"""    .venv/bin/python benchmarks/memory_measure.py [--sizes 1536,768] [--steps 4] [--profile] [--json out.json]

Issue 31's CPU measurement of GIFT's memory, beside ``benchmarks/memory_model.py``'s prediction
for the same run. A Llama with wide inputs (``LlamaConfig`` hidden 1536, intermediate 4096, 2
layers, 12 heads, vocab 256: 57M parameters; and the same at hidden 768, intermediate 2048, so
the model is checked at two sizes), fp32, ZeRO-2 with DeepSpeed's default buckets (5e8), AdamW
(``torch_adam``), micro-batch 2 x 64 tokens, 2 ranks over gloo, 4 steps; each mode in its own
processes (``launch.spawn.run_ranks``, engines built by ``tests/harness.py``): DeepSpeed native,
the README's gift block ``{"format": "fp8_e4m3"}``, and that block with ``error_feedback`` on.

Per mode it prints the peak RSS of each rank (``ru_maxrss``) and GIFT's over native's; and, after
the run, the bytes of the tensors reachable from ``engine.gift`` (each storage once; the model's
parameters and gradients and DeepSpeed's optimizer, partitions and buckets excluded), by
component (:func:`component_of`: the attribute path that reaches them), over the model's fp32
parameter bytes, each beside the memory model's bytes for that component and run. The memory
model's peak extra beside the RSS difference is not a like-for-like pair: the difference of two
peaks is a lower bound of GIFT's extra (native's peak, Adam's state made at the first step, and
GIFT's, the first step's reduction, come at different moments). The transients are checked where
they happen instead (``--profile``, a run of its own: the profiler's records raise the RSS): the
torch profiler's memory records inside each bucket reduction (:func:`live_peak`), its peak
allocation on the sampled step 0 and on the ordinary steps after, beside the model's
``reduce_sampled`` and ``reduce``.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Dict, Iterable, List, Optional

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks import memory_model  # noqa: E402
from benchmarks.results import write_json  # noqa: E402

WIDE = {1536: dict(hidden_size=1536, intermediate_size=4096, num_hidden_layers=2, num_attention_heads=12,
                   num_key_value_heads=12, vocab_size=256, max_position_embeddings=128),
        768: dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=2, num_attention_heads=12,
                  num_key_value_heads=12, vocab_size=256, max_position_embeddings=128)}
MODES = {"native": None, "gift": dict(memory_model.README_GIFT),
         "gift_ef": dict(memory_model.README_GIFT, error_feedback=True)}
DEFAULT_BUCKET = 500_000_000  # DeepSpeed's reduce_bucket_size and allgather_bucket_size


def spec_for(model: dict, gift: Optional[dict], steps: int = 4, micro: int = 2, seq: int = 64,
             bucket: int = DEFAULT_BUCKET) -> dict:
    """A ``tests/harness.py`` spec of the measured run (fp32, ZeRO-2, AdamW)."""
    return {"model": model, "gift": gift, "steps": steps, "micro": micro, "seq": seq, "bucket": bucket,
            "zero": {"allgather_bucket_size": bucket}}


# ---- what GIFT holds ---------------------------------------------------------------------------
def component_of(path: str) -> str:
    """The memory model's component of a tensor reached from ``engine.gift`` by ``path``."""
    if ".lowrank" in path or path.startswith("geometry.transforms"):
        return "transforms"
    if path.startswith("geometry.moments"):
        return "statistics_step"
    if path.startswith("geometry.kfac"):
        return "statistics"
    if path.startswith("geometry.selection.captured"):
        return "refresh_captures"
    if ".feedback.relayed" in path:
        return "relay_residuals"
    if ".feedback" in path:
        return "error_feedback"
    if "._plans" in path and ".samples" in path:
        return "telemetry_samples"
    if path.startswith("params"):
        return "param_gather"
    if path.startswith("telemetry"):
        return "telemetry"
    return "other"


def _opaque(obj) -> bool:
    """Objects the walk does not enter: the model, DeepSpeed's engine and optimizer (not GIFT's),
    process groups, code, and generators (their state is not a tensor GIFT allocated)."""
    import types

    import torch

    if isinstance(obj, (torch.nn.Module, torch.optim.Optimizer, torch.Generator, type, types.ModuleType,
                        types.FunctionType, types.MethodType, types.BuiltinFunctionType)):
        return True
    name = type(obj).__module__ or ""
    return name.startswith(("deepspeed.", "torch.distributed", "logging", "io", "threading"))


def _tensors_under(root, skip_ids=()) -> Iterable[tuple]:
    """(path, tensor) of every tensor reachable from ``root`` through attributes, dicts, lists and
    tuples, breadth first (a tensor is reported at its shortest path)."""
    import torch

    seen = set(skip_ids)
    queue = [("", root)]
    while queue:
        path, obj = queue.pop(0)
        if id(obj) in seen:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            yield path, obj
            continue
        if isinstance(obj, (str, bytes, int, float, bool, type(None))) or _opaque(obj):
            continue
        if isinstance(obj, dict):
            items = [(f"{path}[{k!r}]", v) for k, v in obj.items()]
        elif isinstance(obj, (list, tuple, set, frozenset)):
            items = [(f"{path}[{i}]", v) for i, v in enumerate(obj)]
        else:
            attrs = getattr(obj, "__dict__", None) or {}
            items = [(f"{path}.{k}" if path else k, v) for k, v in attrs.items()]
        queue.extend(items)


def _storage(t) -> tuple:
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def excluded_storages(engine) -> set:
    """Storages of the model's parameters and gradients and of DeepSpeed's optimizer state,
    partitions and buckets (what native DeepSpeed holds too)."""
    out = set()
    for p in engine.module.parameters():
        out.add(_storage(p)[0])
        if p.grad is not None:
            out.add(_storage(p.grad)[0])
    opt = engine.optimizer
    for _, t in _tensors_under(opt.__dict__, skip_ids={id(engine.gift)}):
        out.add(_storage(t)[0])
    for state in opt.optimizer.state.values():
        for v in state.values():
            if hasattr(v, "untyped_storage"):
                out.add(_storage(v)[0])
    return out


def held_by_component(engine) -> Dict[str, int]:
    """Bytes of the storages reachable from ``engine.gift`` and not DeepSpeed's, by component."""
    skip = excluded_storages(engine)
    counted: set = set()
    out: Dict[str, int] = {}
    gift = engine.gift
    skip_ids = {id(gift.engine), id(gift.opt), id(gift.optimizer_state.opt)}
    for path, t in _tensors_under(gift, skip_ids):
        ptr, nbytes = _storage(t)
        if t.device.type == "meta" or ptr in skip or ptr in counted or nbytes == 0:
            continue
        counted.add(ptr)
        key = component_of(path)
        out[key] = out.get(key, 0) + nbytes
    return out


# ---- a bucket's reduction, by the profiler ------------------------------------------------------
def live_peak(prof) -> int:
    """Peak bytes allocated and not yet freed inside a profiled region, from the CPU profiler's
    memory records: each op's own allocations less its frees at the op's start, frees outside ops
    as ``[memory]`` records (a temporary made and freed inside one op is not seen)."""
    events = sorted((e for e in prof.events() if e.self_cpu_memory_usage), key=lambda e: e.time_range.start)
    live = peak = 0
    for e in events:
        live += e.self_cpu_memory_usage
        peak = max(peak, live)
    return peak


def profile_reductions(engine) -> List[tuple]:
    """Wrap GIFT's bucket reduction so each call records (step, peak bytes it allocated)."""
    from torch.profiler import ProfilerActivity, profile

    reducer, native, peaks = engine.gift.reducer, engine.gift.reducer.reduce, []

    def reduce(*args, **kwargs):
        with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
            out = native(*args, **kwargs)
        peaks.append((engine.global_steps, live_peak(prof)))
        return out

    reducer.reduce = reduce
    return peaks


# ---- one rank ---------------------------------------------------------------------------------
def measure_rank(rank: int, world_size: int, spec: dict) -> dict:
    """Train ``spec`` (``tests/harness.py``'s engine and batches); peak RSS and GIFT's held bytes;
    with ``spec["profile_reduce"]``, each bucket reduction's peak allocation too (the profiler
    runs only inside them)."""
    import resource

    import torch

    from tests.harness import batches, build_engine

    engine = build_engine(spec)
    peaks = profile_reductions(engine) if spec.get("profile_reduce") and getattr(engine, "gift", None) else None
    for tokens in batches(engine.global_rank, spec["steps"], spec["micro"], spec["seq"]):
        out = engine(input_ids=tokens, labels=tokens)
        engine.backward(out.loss)
        engine.step()
    result = {"rss_mib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0,
              "param_bytes": sum(4 * p.numel() for p in engine.module.parameters())}
    if getattr(engine, "gift", None) is not None:
        result["held"] = held_by_component(engine)
    if peaks is not None:  # step 0 is telemetry's sampled step, the others ordinary
        result["reduce_sampled"] = max((b for k, b in peaks if k == 0), default=0)
        result["reduce"] = max((b for k, b in peaks if k > 0), default=0)
    torch.distributed.barrier()
    return result


def measure_many(rank: int, world_size: int, specs: List[dict]) -> List[dict]:
    """Several specs in one set of processes (the test: held bytes do not need fresh processes)."""
    return [measure_rank(rank, world_size, spec) for spec in specs]


def predicted(model: dict, gift: Optional[dict], world: int = 2, bucket: int = DEFAULT_BUCKET) -> Dict[str, float]:
    """The memory model's components for the measured run (fp32 replicas, on the CPU)."""
    gift = gift or {}
    run = memory_model.Run(world=world, bucket=bucket, allgather_bucket=bucket, params_bytes=4, device="cpu",
                           format=gift.get("format", "fp8_e4m3"), error_feedback=bool(gift.get("error_feedback")),
                           sampled_versions=1, optimizer_state=False)  # steps 0-3: step 0 alone is
    # sampled and refreshes, before the optimizer's first step made any state
    return memory_model.gift_memory(model, run, memory_model.design_now())


def main(argv=None) -> List[dict]:
    from launch.spawn import run_ranks

    parser = argparse.ArgumentParser()
    parser.add_argument("--sizes", default="1536,768", help="hidden sizes among " + ", ".join(map(str, WIDE)))
    parser.add_argument("--steps", type=int, default=4)
    parser.add_argument("--modes", default=",".join(MODES))
    parser.add_argument("--profile", action="store_true",
                        help="the profiler inside each bucket reduction: its peak allocation (the profiler's "
                        "own records raise the peak RSS: measure RSS without it)")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    rows = []
    for hidden in (int(h) for h in args.sizes.split(",")):
        model = WIDE[hidden]
        measured = {mode: run_ranks(measure_rank, 2, dict(spec_for(model, MODES[mode], args.steps),
                                                          profile_reduce=args.profile))
                    for mode in args.modes.split(",")}
        native = measured.get("native")
        params = measured[next(iter(measured))][0]["param_bytes"]
        print(f"\n## hidden {hidden}: {params / 4 / 1e6:.1f}M parameters, fp32 {params / 2**20:.0f} MiB; "
              f"2 ranks, {args.steps} steps")
        for mode, ranks in measured.items():
            rss = [r["rss_mib"] for r in ranks]
            row = {"hidden": hidden, "mode": mode, "rss_mib": rss, "param_bytes": params}
            line = f"{mode}: peak RSS per rank {', '.join(f'{x:.0f}' for x in rss)} MiB"
            if native is not None and mode != "native":
                base = [r["rss_mib"] for r in native]
                over = [g / n - 1 for g, n in zip(rss, base)]
                row["rss_over_native"] = over
                line += f", over native {', '.join(f'{100 * o:+.1f}%' for o in over)}"
            print(line)
            if mode == "native":
                rows.append(row)
                continue
            model_bytes = predicted(model, MODES[mode])
            held = ranks[0]["held"]
            total = sum(held.values())
            row.update(held=held, held_over_params=total / params, predicted=model_bytes)
            if native is not None:
                delta = max(g - n for g, n in zip(rss, [r["rss_mib"] for r in native]))
                row["rss_delta_mib"] = delta
                print(f"  RSS over native (worst rank) {delta:.0f} MiB; the model's peak extra "
                      f"{model_bytes['peak'] / 2**20:.0f} MiB, held {model_bytes['held'] / 2**20:.0f} MiB")
            print(f"  held by GIFT after the run (rank 0): {total / 2**20:.1f} MiB = {100 * total / params:.1f}% "
                  "of the model's fp32 parameter bytes")
            if "reduce" in ranks[0]:
                for key, what in (("reduce_sampled", "a sampled step's"), ("reduce", "an ordinary step's")):
                    got = [r[key] for r in ranks]
                    row[key] = got
                    print(f"  {what} bucket reduction, peak allocation per rank "
                          f"{', '.join(f'{g / 2**20:.1f}' for g in got)} MiB; model {model_bytes[key] / 2**20:.1f} MiB")
            print("  | component | held MiB | model MiB |\n  |---|---:|---:|")
            for key in sorted(set(held) | set(memory_model.HELD)):
                want = model_bytes.get(key)
                print(f"  | {key} | {held.get(key, 0) / 2**20:.2f} | "
                      f"{'-' if want is None else f'{want / 2**20:.2f}'} |")
            rows.append(row)
    write_json(args.json, rows)
    return rows


if __name__ == "__main__":
    main()
