#!/usr/bin/env bash
# bash scripts/setup.sh
# Creates .venv (if missing) and installs deepspeed-gift with all extras.
# On a machine without an NVIDIA GPU, installs the CPU build of torch first so that
# deepspeed does not pull a multi-GB CUDA build. A torch already in the venv is kept.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
[ -x .venv/bin/python ] || "$PY" -m venv .venv
. .venv/bin/activate
python -m pip install -q --upgrade pip
if ! python -c "import torch" 2>/dev/null; then
  if command -v nvidia-smi >/dev/null 2>&1; then
    python -m pip install -q torch
  else
    python -m pip install -q "torch==${GIFT_CPU_TORCH:-2.13.0}" \
      || python -m pip install -q torch --index-url https://download.pytorch.org/whl/cpu
  fi
fi
# Constrain torch to the installed build so no dependency replaces it.
python -c "import torch; print('torch==' + torch.__version__.split('+')[0])" > .venv/torch-constraint.txt
python -m pip install -q -c .venv/torch-constraint.txt -e ".[dev,train,mpi]"
# An editable install does not place deepspeed_gift.pth (the startup hook behind
# DEEPSPEED_GIFT=1 and the warning about a gift block that is not in effect): write it.
python -m deepspeed_gift_hook enable
python -c "import deepspeed_gift, deepspeed, torch; print('ready: torch', torch.__version__, 'deepspeed', deepspeed.__version__)"
