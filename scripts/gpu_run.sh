#!/usr/bin/env bash
# bash scripts/gpu_run.sh OUT_DIR [gpu_check.py args...]     (on a lent GPU machine, from the repo root)
#
# benchmarks/gpu_check.py on a GPU machine whose image has torch but not DeepSpeed or pydantic
# (nothing can be installed from a registry there). Prepare beside the repo, on a machine with pip:
#   mkdir -p .whl .gpu/site && echo /.whl/ >> .git/info/exclude && echo /.gpu/ >> .git/info/exclude
#   python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 -d .whl \
#       pydantic==2.14.4 pydantic_core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
#       hjson==3.1.0 typing_extensions==4.16.0      (add --platform manylinux2014_x86_64 for pydantic_core)
#   cp -r .venv/lib/python3.11/site-packages/deepspeed .gpu/site/     (pure Python: its ops build on use)
# and carry .whl and .gpu there. Everything the run prints is kept in OUT_DIR/gpu_check.log, the
# results in OUT_DIR/gpu_check.json (written after each section: a run stopped early keeps them).
set -o pipefail
out=${1:?OUT_DIR}
shift
mkdir -p "$out" || exit 1
site=/tmp/gift-site
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" .whl/*.whl || exit 1
cp -r .gpu/site/deepspeed "$site/" || exit 1
export PYTHONPATH="$site:$PWD" PYTHONUNBUFFERED=1
nvidia-smi --query-gpu=name,driver_version,memory.total,clocks.max.sm --format=csv 2>&1 | tee "$out/env.txt"
python3 -c "import sys, torch, triton, deepspeed, transformers; print(sys.version.split()[0], torch.__version__, \
torch.version.cuda, triton.__version__, deepspeed.__version__, transformers.__version__)" 2>&1 | tail -3 | tee -a "$out/env.txt"
python3 benchmarks/gpu_check.py --json "$out/gpu_check.json" "$@" 2>&1 \
    | grep --line-buffered -v -E "FutureWarning|return func\(\*args|^\s*$" | tee "$out/gpu_check.log"
