#!/usr/bin/env bash
# .venv/bin/mpirun -np 2 -x OMP_NUM_THREADS=1 .venv/bin/python launch/pretrain.py --ds-config ds_configs/gift_fp8_mpi_zero2.json --preset tiny --save-dir runs/gift_fp8_mpi_zero2_tiny --metrics runs/gift_fp8_mpi_zero2_tiny/metrics.jsonl "$@"
#
# Pretraining as an MPI job: mpirun starts the ranks, DeepSpeed reads rank and world size
# from Open MPI's environment (mpi4py), torch.distributed runs on gloo (CPU) or NCCL (GPU),
# and the config's "gift": {"backend": "mpi"} moves GIFT's payloads through MPI. The line
# above is what runs with the defaults (without .venv: mpirun and python from PATH); extra
# arguments go to launch/pretrain.py.
# Environment overrides: NP (ranks), CONFIG, PRESET, RUN (checkpoint/metrics directory),
# PYTHON, MPIRUN, MPIRUN_ARGS (extra mpirun flags).
#
# Several nodes: MPIRUN_ARGS="--hostfile my_hosts" NP=16 PRESET=600m bash launch/run_mpirun.sh --steps 20000
# As root in a container, one machine:
#   MPIRUN_ARGS="--allow-run-as-root --oversubscribe --mca btl_tcp_if_include lo" bash launch/run_mpirun.sh --steps 50
set -euo pipefail
cd "$(dirname "$0")/.."
NP=${NP:-2}
CONFIG=${CONFIG:-ds_configs/gift_fp8_mpi_zero2.json}
PRESET=${PRESET:-tiny}
RUN=${RUN:-runs/$(basename "$CONFIG" .json)_$PRESET}
if [ -z "${PYTHON:-}" ]; then
  if [ -x .venv/bin/python ]; then PYTHON=.venv/bin/python; else PYTHON=python; fi
fi
if [ -z "${MPIRUN:-}" ]; then
  if [ -x .venv/bin/mpirun ]; then MPIRUN=.venv/bin/mpirun; else MPIRUN=mpirun; fi
fi
mkdir -p "$RUN"
set -x
# MPIRUN_ARGS is split into words on purpose (several flags in one variable).
# shellcheck disable=SC2086
exec "$MPIRUN" -np "$NP" ${MPIRUN_ARGS:-} -x OMP_NUM_THREADS="${OMP_NUM_THREADS:-1}" "$PYTHON" launch/pretrain.py \
  --ds-config "$CONFIG" --preset "$PRESET" --save-dir "$RUN" --metrics "$RUN/metrics.jsonl" "$@"
