"""    .venv/bin/python benchmarks/codec_traffic.py [--senders 3 7 31] [--json out.json]

What each codec operation costs a GPU in kernels and memory traffic, counted, not timed: per
format and operation, the kernels a tile launches and the bytes it reads and writes per gradient
element, beside the floor (what the operation must move at least) and their ratio. Both modes:

- eager (``gift.kernels: eager``): the codec runs on torch's meta device (no data; the
  accelerator's code path and its tile of 2^24 elements) under a dispatch counter; every ATen
  operator that is not a view or an allocation is a kernel, and it reads its tensor inputs and
  writes its outputs (a broadcast input counted once).
- compiled (``gift.kernels: compiled``): the same operation on this CPU with inductor compiling
  afresh (caches off), which reports each graph's fused kernels and the bytes they read and
  write (its scheduler's count: the same fusion decisions decide CUDA's kernels; it counts an
  input the graph only writes twice, once here: a written input is known by its version, and
  one it also reads by a rerun with its old values changed), plus the eager
  operators the codec still runs around the graph (counted as above: the header and the
  scales that follow it, one copy into the payload), with the tile laid out as on a GPU (NVFP4's blocks read
  as columns of a view, not the CPU's transposed copy). The CPU tile is 2^20 elements; the
  per-element figures do not depend on the tile.

Operations: ``encode`` (a tile of fp32 to its payload; per-tensor and NVFP4's global scales
need a first pass for the amax, counted), ``decode_sum`` (the owner's batched decode of S
senders' payloads and their fp32 sum into the section, S = ``--senders``), stochastic
rounding's encode, and ``encode+feedback``: error feedback's step for a section it sends (last
step's int8 residual added, the encode, the new residual, the values minus the payload's
decode, kept in int8 per 128: ``Int8Codec.encode_with_residual``, one kernel a tile for the
block-scaled fp8 and integer formats where compiled, after a first pass for the amax for those
with one scale per tensor).

``encode short``: the encode of a tile less 4 elements, a section whose length is not a
multiple of the block (most lengths; the floor as ``encode``'s).

``encode bf16``: the encode of a bf16 tile, a bf16 bucket's gradients as the reducer hands
them in (a section in gradient coordinates), its floor 2 B read + the payload.

Floors per element: encode, 4 B read + the payload's bytes (data and scales); decode-and-sum,
S payloads + 4 B written (the owner's own term, when it has one, adds 4 B read; not here);
encode+feedback, the encode's floor + the old residual read + the new one written. A format
with a scale per tensor (fp8/int ``block_size`` 0, NVFP4's global scale) cannot write an element
before it has read every element for the amax: its encode reads the input twice, and the
``2-pass`` column gives its ratio to that floor (4 B more).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from typing import Dict, List, Optional

import torch
from torch.utils._python_dispatch import TorchDispatchMode

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from benchmarks.results import write_json  # noqa: E402
from deepspeed_gift.core import formats  # noqa: E402
from deepspeed_gift.core import kernels as fused_kernels  # noqa: E402
from deepspeed_gift.exchange import feedback  # noqa: E402
from deepspeed_gift.exchange.feedback import StoredResidual  # noqa: E402

# (label, format, get_format options): the list, the relay's second hop included
CASES = (
    ("fp8_e4m3/128", "fp8_e4m3", {}),
    ("fp8_e5m2/tensor", "fp8_e5m2", {"block_size": 0}),
    ("nvfp4", "nvfp4", {}),
    ("int8/128", "int8", {}),
    ("int4/128", "int4", {}),
    ("relay int8/32", "int8", {"block_size": 32}),
)
GPU_TILE = formats.DEFAULT_TILE_ELEMENTS
CPU_TILE = 1 << 20

# operators that launch nothing on a GPU: allocations and metadata
_NO_KERNEL = {"empty", "empty_strided", "empty_like", "new_empty", "new_empty_strided", "lift_fresh",
              "detach", "alias", "_local_scalar_dense", "set_", "resize_", "sym_size", "sym_stride",
              "sym_numel", "sym_storage_offset", "is_same_size", "_has_compatible_shallow_copy_type"}
_WRITE_ONLY = {"copy_", "fill_", "zero_", "index_put_", "masked_fill_"}


def touched_bytes(t: torch.Tensor) -> int:
    """Bytes of the elements ``t`` addresses (a broadcast dimension, stride 0, counted once)."""
    n = 1
    for size, stride in zip(t.shape, t.stride()):
        if stride != 0:
            n *= size
    return n * t.element_size()


class TrafficCounter(TorchDispatchMode):
    """Kernels (ATen operators that are neither views nor allocations) and the bytes they read
    and write, as the dispatcher sees them on this thread."""

    def __init__(self) -> None:
        super().__init__()
        self.kernels = 0
        self.read = 0
        self.written = 0
        self.host_reads = 0
        self.ops: Dict[str, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        name = func.overloadpacket.__name__
        if name == "_local_scalar_dense":
            self.host_reads += 1
        if func.is_view or name in _NO_KERNEL:
            return out
        self.kernels += 1
        self.ops[name] = self.ops.get(name, 0) + 1
        schema = func._schema
        values = list(args) + [kwargs.get(a.name) for a in schema.arguments[len(args):]]
        written_inputs = set()
        for arg, value in zip(schema.arguments, values):
            if not isinstance(value, torch.Tensor):
                if isinstance(value, (list, tuple)):
                    self.read += sum(touched_bytes(v) for v in value if isinstance(v, torch.Tensor))
                continue
            writes = arg.alias_info is not None and arg.alias_info.is_write
            if writes:
                written_inputs.add(id(value))
                self.written += touched_bytes(value)
                if name not in _WRITE_ONLY and arg.name != "out" and not arg.kwarg_only:
                    self.read += touched_bytes(value)
            else:
                self.read += touched_bytes(value)
        for result in (out if isinstance(out, (list, tuple)) else (out,)):
            if isinstance(result, torch.Tensor) and id(result) not in written_inputs and not any(
                    r.alias_info is not None for r in schema.returns):
                self.written += touched_bytes(result)
        return out


def payload_bytes_per_element(codec: formats.Codec, numel: int) -> float:
    return (codec.nbytes(numel) - formats.HEADER_BYTES) / numel


def _codec(fmt: str, options: dict, kernels: str, rounding: str = "nearest") -> formats.Codec:
    return formats.get_format(fmt, kernels=kernels, rounding=rounding, **options)


def _per_tensor_scale(codec: formats.Codec) -> bool:
    return codec.block_size == 0 or codec.has_global_scale


def _inputs(numel: int, device: str, senders: int, codec: formats.Codec, seed: int = 0):
    gen = torch.Generator(device=device).manual_seed(seed) if device == "cpu" else None
    spread = torch.rand(numel // 128, 1, generator=gen, device=device)  # blocks of unlike scales
    x = (torch.randn(numel // 128, 128, generator=gen, device=device) * spread).view(-1)
    rows = torch.stack([codec.encode(x * (1 + i / 8)).wire for i in range(senders)])
    return x, rows


def _reads_written(graph, args, before, written, i) -> bool:
    """Whether a compiled ``graph`` reads input ``i``, which it writes: run again twice on the
    inputs as they were before the call, ``i`` holding its old values and then other ones, and
    compare what it returns and writes. Inductor counts an input a graph only writes twice (the
    computed buffer and a fake read of the input it copies into), and one it reads and writes
    once each: only the first is corrected. The inputs are left as the real call left them."""
    after = {j: args[j].clone() for j in written}

    def trial(change: bool) -> list:
        for j in written:
            args[j].copy_(before[j][1])
        if change:  # other bits in every byte (uint8 views of payloads, fp32 sums alike)
            args[i].copy_(before[i][1] + 1 if before[i][1].is_floating_point() else before[i][1] ^ 1)
        out = graph(*args)
        outs = out if isinstance(out, (tuple, list)) else (out,)
        return [t.clone() for t in outs if isinstance(t, torch.Tensor)] + [args[j].clone() for j in written]

    same = all(torch.equal(a, b) for a, b in zip(trial(False), trial(True)))
    for j in written:
        args[j].copy_(after[j])
    return not same


@contextlib.contextmanager
def _fresh_inductor():
    """Inductor compiling afresh (no cache hit skips its count) with its byte count on, and
    every compiled graph run outside a :class:`TrafficCounter` (a dispatch mode would keep
    dynamo from running the graph; inductor counted its kernels when it compiled it)."""
    import torch._inductor.config as inductor_config
    from torch._inductor import metrics
    from torch.utils._python_dispatch import _pop_mode_temporarily, _get_current_dispatch_mode

    real = fused_kernels.compiled
    real_columns = formats.nvfp4._blocks_as_columns
    real_pads = formats.base.pads_inside
    real_finer = formats.integer.finer_blocks_fused

    def compiled_uncounted(fn, **constants):
        graph = real(fn, **constants)

        def run(*args):
            if isinstance(_get_current_dispatch_mode(), TrafficCounter):
                with _pop_mode_temporarily():
                    return graph(*args)
            tensors = [i for i, a in enumerate(args) if isinstance(a, torch.Tensor)]
            before = {i: (args[i]._version, args[i].clone()) for i in tensors}
            counted = metrics.num_bytes_accessed
            out = graph(*args)
            if metrics.num_bytes_accessed != counted:  # compiled in this call: inductor counted it
                written = [i for i in tensors if args[i]._version != before[i][0]]
                metrics.written_inputs_bytes += sum(touched_bytes(args[i]) for i in written
                                                    if not _reads_written(graph, args, before, written, i))
            return out
        return run

    torch._dynamo.reset()
    real.cache_clear()
    torch._logging.set_logs(inductor_metrics=True)
    fused_kernels.compiled = compiled_uncounted
    formats.nvfp4._blocks_as_columns = lambda x: x.t()  # a GPU's layout: a view, no transposed copy
    formats.base.pads_inside = formats.nvfp4.pads_inside = lambda device: True  # a GPU's short block
    formats.integer.finer_blocks_fused = lambda device: True  # a GPU's feedback step of finer blocks
    try:
        with inductor_config.patch(fx_graph_cache=False, force_disable_caches=True):
            metrics.reset()
            metrics.written_inputs_bytes = 0
            yield metrics
    finally:
        fused_kernels.compiled = real
        formats.nvfp4._blocks_as_columns = real_columns
        formats.base.pads_inside = formats.nvfp4.pads_inside = real_pads
        formats.integer.finer_blocks_fused = real_finer
        torch._logging.set_logs(inductor_metrics=False)


def operation(kernels: str, fmt: str, options: dict, op: str, senders: int, numel: int, device: str,
              rounding: str = "nearest", staged: int = 0):
    """One codec operation of one format on a tile of ``numel`` elements, ready to run: the
    counted benchmark here and the timed one on a GPU (``benchmarks/gpu_check.py``) run the same
    code. Returns ``(run, codec)``; ``run()`` does the operation once. ``staged``: error
    feedback's section copies (the reducer stages a section whole) made here, this many, one a
    call, so that ``run`` neither counts nor times them."""
    codec = _codec(fmt, options, kernels, rounding)
    x, rows = _inputs(numel, device, senders, codec)
    payload = codec.bytes_to_payload(rows, (numel,), check_header=False)
    out = torch.empty(numel, device=device)
    old = StoredResidual.encode(x * 0.01, feedback.residual_codec(kernels))

    x16 = x.to(torch.bfloat16) if op == "encode_bf16" else None
    short = x[: numel - SHORT_TAIL] if op == "encode_short" else None

    def run():
        if op == "encode":
            codec.encode(x)
        elif op == "encode_short":  # a section that ends in a short block (most lengths)
            codec.encode(short)
        elif op == "encode_bf16":  # a bf16 bucket's gradients, as the reducer hands them in
            codec.encode(x16)
        elif op == "decode_sum":
            codec.decode_sum(payload, out)
        elif op == "feedback":  # error feedback: the old residual in, encode, the new one kept
            values = run.staged.pop()
            # what the reducer does for a section it sends (ErrorFeedback.send), its residual
            # codec in the same mode: one fused kernel a tile where compiled
            store = feedback.residual_codec(kernels)
            _, residual = store.encode_with_residual(values, old._payload(), codec)
            StoredResidual.kept(residual, numel, store)

    run.staged = [x.clone() for _ in range(staged)] if op == "feedback" else None
    return run, codec


def floor_bytes(codec: formats.Codec, op: str, senders: int, numel: int) -> float:
    """What ``op`` must move at least, per element (the module docstring's floors)."""
    payload = payload_bytes_per_element(codec, numel)
    residual = payload_bytes_per_element(feedback.RESIDUAL_CODEC, numel)
    return {"encode": 4 + payload, "encode_short": 4 + payload, "encode_bf16": 2 + payload,
            "decode_sum": senders * payload + 4, "feedback": 4 + payload + 2 * residual}[op]


def _measure(kernels: str, fmt: str, options: dict, op: str, senders: int, rounding: str = "nearest") -> dict:
    """One operation of one format, one tile: kernels and bytes per element."""
    # eager: the meta device, no data, an accelerator's code path and tile
    numel, device = (GPU_TILE, "meta") if kernels == "eager" else (CPU_TILE, "cpu")
    compiled_kernels = compiled_bytes = 0
    run, codec = operation(kernels, fmt, options, op, senders, numel, device, rounding, staged=3)
    if op == "encode_short":
        numel -= SHORT_TAIL  # the elements encoded

    counter = TrafficCounter()
    if kernels == "compiled":
        with _fresh_inductor() as metrics:
            run()  # compiles: inductor counts each graph's kernels and bytes once
            # a fused scheduler node is one kernel on CUDA (on a CPU one C++ function may
            # hold a few loops); its bytes are inductor's count less the inputs the graph only
            # writes (inductor counts each twice, the computed buffer and the copy into the
            # input, where the generated code stores it once; a write bumps the input's
            # version, and a rerun with the input's old values changed tells a read: see
            # _reads_written)
            compiled_kernels = len(metrics.nodes_num_elem)
            compiled_bytes = metrics.num_bytes_accessed - metrics.written_inputs_bytes
            with counter:
                run()
    else:
        run()  # warm: lazily made tables and headers
        with counter:
            run()
    floor = floor_bytes(codec, op, senders, numel)
    second_read = 2 if op == "encode_bf16" else 4  # a per-tensor scale's first pass reads the input once more
    two_pass = floor + second_read if op != "decode_sum" and _per_tensor_scale(codec) else floor
    moved = (counter.read + counter.written + compiled_bytes) / numel
    return {"kernels": counter.kernels + compiled_kernels, "compiled_kernels": compiled_kernels,
            "eager_ops": counter.kernels, "bytes_per_element": moved, "floor": floor,
            "x_floor": moved / floor, "x_two_pass_floor": moved / two_pass, "host_reads": counter.host_reads}


OPS = ("encode", "decode_sum", "encode stochastic", "encode+feedback", "encode bf16", "encode short")
SHORT_TAIL = 4  # "encode short": a tile less these elements, so that its last block is short


def measure_all(senders: List[int], cases=CASES, modes=("eager", "compiled"), ops=OPS) -> List[dict]:
    rows = []
    for label, fmt, options in cases:
        for mode in modes:
            if "encode" in ops:
                rows.append(dict(case=label, op="encode", mode=mode, **_measure(mode, fmt, options, "encode", 1)))
            for s in senders if "decode_sum" in ops else ():
                rows.append(dict(case=label, op=f"decode_sum S={s}", mode=mode,
                                 **_measure(mode, fmt, options, "decode_sum", s)))
        for mode in modes:
            if "encode stochastic" in ops:
                rows.append(dict(case=label, op="encode stochastic", mode=mode,
                                 **_measure(mode, fmt, options, "encode", 1, rounding="stochastic")))
            if "encode+feedback" in ops:
                rows.append(dict(case=label, op="encode+feedback", mode=mode,
                                 **_measure(mode, fmt, options, "feedback", 1)))
            if "encode bf16" in ops:  # a bf16 input: the floor reads 2 B an element
                rows.append(dict(case=label, op="encode bf16", mode=mode,
                                 **_measure(mode, fmt, options, "encode_bf16", 1)))
            if "encode short" in ops:  # a tile that ends in a short block
                rows.append(dict(case=label, op="encode short", mode=mode,
                                 **_measure(mode, fmt, options, "encode_short", 1)))
    return rows


def main(argv: Optional[List[str]] = None) -> List[dict]:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--senders", type=int, nargs="+", default=[3, 7, 31])
    ap.add_argument("--cases", nargs="+", default=None, help="labels of CASES to run (default: all)")
    ap.add_argument("--ops", nargs="+", default=list(OPS), choices=OPS, help="operations to count (default: all)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cases = [c for c in CASES if args.cases is None or c[0] in args.cases]
    rows = measure_all(args.senders, cases, ops=args.ops)
    print(f"{'case':<17}{'operation':<19}{'mode':<10}{'kernels':>8}{'B/elem':>9}{'floor':>8}{'x floor':>9}"
          f"{'2-pass':>8}")
    for r in rows:
        print(f"{r['case']:<17}{r['op']:<19}{r['mode']:<10}{r['kernels']:>8}{r['bytes_per_element']:>9.2f}"
              f"{r['floor']:>8.2f}{r['x_floor']:>9.2f}{r['x_two_pass_floor']:>8.2f}")
    if args.json:
        write_json(args.json, {"rows": rows})
    return rows


if __name__ == "__main__":
    main()
