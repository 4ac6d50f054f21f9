#!/usr/bin/env bash
# bash scripts/as_avx2.sh COMMAND...    e.g. bash scripts/as_avx2.sh .venv/bin/python -m pytest -q tests/test_zero.py
#
# Runs COMMAND with the kernels of an x86 that has AVX2 but no AVX512, AVX512-BF16 or AMX: oneDNN
# held to AVX2 (so no bf16 GEMM: PyTorch falls back to its scalar loop, as there) and ATen's
# AVX2 kernels (the same fp32 rounding in vectorized reductions). Nothing changes on a machine
# that is AVX2 already. Inductor (DeepSpeed compiles Muon's Newton-Schulz) keys its on-disk
# cache without the ISA: a kernel built with AVX512 and loaded under avx2 crashed a rank or
# returned nan, so these runs keep a cache of their own (beside the one they would use).
set -euo pipefail
export ONEDNN_MAX_CPU_ISA=AVX2 ATEN_CPU_CAPABILITY=avx2
export TORCHINDUCTOR_CACHE_DIR="${TORCHINDUCTOR_CACHE_DIR:-${TMPDIR:-/tmp}/torchinductor}-isa-avx2"
exec "$@"
