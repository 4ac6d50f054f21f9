#!/usr/bin/env bash
# .venv/bin/deepspeed --hostfile launch/hostfile.example --master_port 29500 --no_ssh --node_rank 0 --master_addr 127.0.0.1 launch/pretrain.py --ds-config ds_configs/gift_fp8_zero2.json --preset 600m --save-dir runs/gift_fp8_zero2_600m --metrics runs/gift_fp8_zero2_600m/metrics.jsonl "$@"
#
# Pretraining with the DeepSpeed launcher and a hostfile. The line above is what runs with
# the defaults (the shipped single-machine hostfile; a multi-node hostfile drops the three
# single-machine flags, see below); extra arguments go to launch/pretrain.py (e.g. --steps 20000 --resume).
# Environment overrides: HOSTFILE, CONFIG, PRESET, RUN (checkpoint/metrics directory),
# MASTER_PORT, MASTER_ADDR, NODE_RANK, DEEPSPEED (launcher executable).
#
# Multi-node, ssh (pdsh) from the first node: list the nodes in the hostfile, run once:
#   HOSTFILE=my_hosts bash launch/run_deepspeed.sh --steps 20000
# Multi-node without ssh: the same command on every node, each with its rank:
#   NODE_RANK=0 MASTER_ADDR=node-0 HOSTFILE=my_hosts bash launch/run_deepspeed.sh --steps 20000   # on node-0
#   NODE_RANK=1 MASTER_ADDR=node-0 HOSTFILE=my_hosts bash launch/run_deepspeed.sh --steps 20000   # on node-1
# Single machine: a hostfile whose only node is localhost (the shipped one: 2 ranks) gets the
# launcher flags --no_ssh --node_rank 0 --master_addr 127.0.0.1 (DeepSpeed would otherwise
# insist on ssh to localhost). CPU-sized:
#   PRESET=tiny bash launch/run_deepspeed.sh --steps 50
set -euo pipefail
cd "$(dirname "$0")/.."
HOSTFILE=${HOSTFILE:-launch/hostfile.example}
CONFIG=${CONFIG:-ds_configs/gift_fp8_zero2.json}
PRESET=${PRESET:-600m}
RUN=${RUN:-runs/$(basename "$CONFIG" .json)_$PRESET}
if [ -z "${DEEPSPEED:-}" ]; then
  if [ -x .venv/bin/deepspeed ]; then DEEPSPEED=.venv/bin/deepspeed; else DEEPSPEED=deepspeed; fi
fi
LAUNCH=(--hostfile "$HOSTFILE" --master_port "${MASTER_PORT:-29500}")
NODES=$(grep -Ev '^[[:space:]]*(#|$)' "$HOSTFILE" | awk '{print $1}')
if [ -z "${NODE_RANK:-}" ] && [ "$(echo "$NODES" | wc -l)" = 1 ] && \
   { [ "$NODES" = localhost ] || [ "$NODES" = 127.0.0.1 ] || [ "$NODES" = "$(hostname)" ]; }; then
  NODE_RANK=0 MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
fi
if [ -n "${NODE_RANK:-}" ]; then
  LAUNCH+=(--no_ssh --node_rank "$NODE_RANK" --master_addr "${MASTER_ADDR:?set MASTER_ADDR to the first node of the hostfile}")
elif [ -n "${MASTER_ADDR:-}" ]; then
  LAUNCH+=(--master_addr "$MASTER_ADDR")
fi
mkdir -p "$RUN"
set -x
exec "$DEEPSPEED" "${LAUNCH[@]}" launch/pretrain.py --ds-config "$CONFIG" --preset "$PRESET" \
  --save-dir "$RUN" --metrics "$RUN/metrics.jsonl" "$@"
