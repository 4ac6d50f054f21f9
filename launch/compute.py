"""Which dtype the demo and the tests compute in.

A GPU run of a bf16 config computes in bf16 and sends bf16 gradients. On a CPU, bf16 matmuls
are fast only where oneDNN has a bf16 kernel (AVX512-BF16, AMX or AVX-NE-CONVERT; PyTorch asks
``torch.ops.mkldnn._is_mkldnn_bf16_supported()``). Elsewhere (an AVX2-only x86, or oneDNN held
back by ``ONEDNN_MAX_CPU_ISA=AVX2``, or ``torch.backends.mkldnn.enabled = False``) PyTorch falls
back to a scalar loop: measured on a 2-core AMD EPYC with AVX2, 0.4-0.6 GFLOP/s in bf16 against
20-29 in fp32 on one core, and the main job's bf16 baseline ran at 4.5 s a step instead of 0.2.

There the demo computes in fp32 and keeps bf16 on the wire: DeepSpeed's ZeRO-1/2 cast every
gradient bucket of an fp32 model to ``communication_data_type`` before they reduce it, so the
baseline sends what a bf16 run sends; GIFT's wire is its own format either way. Only the
arithmetic of the forward and backward differs (and the parameter all-gather, which carries
the fp32 replicas).
"""

from __future__ import annotations

import copy

COMPUTE_DTYPES = ("auto", "bf16", "fp32")


def bf16_matmul_is_fast() -> bool:
    """True where a bf16 matmul runs at a speed comparable with fp32: on a GPU, or on a CPU
    whose oneDNN has a bf16 kernel that PyTorch will use."""
    import torch

    if torch.cuda.is_available():
        return True
    mkldnn = torch.backends.mkldnn
    return bool(mkldnn.is_available() and mkldnn.enabled and torch.ops.mkldnn._is_mkldnn_bf16_supported())


def bf16_path() -> str:
    """One line for logs and reports: which bf16 matmul this process gets."""
    import torch

    if torch.cuda.is_available():
        return f"GPU {torch.cuda.get_device_name(0)}"
    isa = torch.backends.cpu.get_cpu_capability()
    if bf16_matmul_is_fast():
        return f"CPU {isa}, fast bf16 matmul (oneDNN)"
    return f"CPU {isa}, slow bf16 matmul (no oneDNN bf16 kernel: a scalar loop)"


# DeepSpeed's keys of the half-precision blocks ("bfloat16" is its other spelling of "bf16")
HALF_KEYS = {"bf16": "bf16", "bfloat16": "bf16", "fp16": "fp16"}


def enabled_half_key(ds_config: dict):
    """The key of the half-precision block the config enables, or None."""
    return next((key for key in HALF_KEYS if (ds_config.get(key) or {}).get("enabled") in (True, "true")), None)


def config_dtype(ds_config: dict) -> str:
    """The dtype a DeepSpeed config trains in: ``bf16``, ``fp16`` or ``fp32``."""
    key = enabled_half_key(ds_config)
    return HALF_KEYS[key] if key else "fp32"


def choose_compute_dtype(requested: str, ds_config: dict, fast_bf16: bool = None) -> tuple:
    """``(dtype, why)``: the dtype to compute in for ``--compute-dtype requested``. ``auto``
    keeps the config's, except bf16 on a machine without a fast bf16 matmul (fp32, with the
    config's wire kept). ``why`` is a line for the log and the report ("" when nothing changes)."""
    if requested not in COMPUTE_DTYPES:
        raise ValueError(f"--compute-dtype: got {requested!r}; allowed: {', '.join(COMPUTE_DTYPES)}")
    own = config_dtype(ds_config)
    fast_bf16 = bf16_matmul_is_fast() if fast_bf16 is None else fast_bf16
    if requested == "auto":
        if own == "bf16" and not fast_bf16:
            return "fp32", (f"compute dtype fp32 with bf16 gradients on the wire (the parameter all-gather "
                            f"carries fp32): the config asks bf16, but this machine has no fast bf16 matmul "
                            f"({bf16_path()}); --compute-dtype bf16 forces it")
        return own, ""
    if own == "fp16" and requested != "fp32":
        raise ValueError(f"--compute-dtype {requested}: the config trains in fp16; use fp32 or auto")
    if requested == own:
        return own, ""
    if requested == "fp32":
        return "fp32", (f"compute dtype fp32 with {own} gradients on the wire (the parameter all-gather carries "
                        f"fp32), as --compute-dtype asks; the config trains in {own}")
    return "bf16", f"compute dtype bf16, as --compute-dtype asks; the config trains in {own}"


def with_compute_dtype(ds_config: dict, dtype: str) -> dict:
    """A copy of ``ds_config`` that computes in ``dtype``. From bf16 or fp16 to fp32 the
    gradients keep the config's width on the wire (``communication_data_type``, unless the
    config names one)."""
    own = config_dtype(ds_config)
    out = copy.deepcopy(ds_config)
    if dtype == own:
        return out
    if dtype == "fp32":
        key = enabled_half_key(out)
        out[key] = dict(out[key], enabled=False)
        out.setdefault("communication_data_type", own)
    elif dtype == "bf16":
        out["bf16"] = dict(out.get("bf16", {}), enabled=True)
    else:
        raise ValueError(f"compute dtype: got {dtype!r}; allowed: bf16, fp32")
    return out


def agreed_compute_dtype(requested: str, ds_config: dict) -> tuple:
    """``choose_compute_dtype`` made once for every rank of the default process group: bf16
    stays only where every rank multiplies bf16 fast (ranks on different CPUs would otherwise
    train different models)."""
    import torch
    import torch.distributed as dist

    fast = bf16_matmul_is_fast()
    if not torch.cuda.is_available() and dist.is_initialized() and dist.get_world_size() > 1:
        flag = torch.tensor([1 if fast else 0], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)
        fast = bool(flag.item())
    return choose_compute_dtype(requested, ds_config, fast)
