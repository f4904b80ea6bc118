#!/usr/bin/env bash
# Launch a Megatron-LM script with Odyssey: a torchrun-style wrapper around `odyssey-launch`.
#
# Every machine runs this script with the same arguments; machine 0 also runs the agent/coordinator
# (control store on MASTER_PORT+1), the others run a node agent next to their ranks. Flags after the
# script name go to Megatron unchanged, so add --odyssey (and any --odyssey-* option) there.
#
#   single machine:  scripts/odyssey_launch.sh pretrain_gpt.py <megatron flags> --odyssey
#   two machines:    NNODES=2 NODE_RANK=0 MASTER_ADDR=host0 scripts/odyssey_launch.sh pretrain_gpt.py ...   (on host0)
#                    NNODES=2 NODE_RANK=1 MASTER_ADDR=host0 scripts/odyssey_launch.sh pretrain_gpt.py ...   (on host1)
#
# Environment (torchrun's names; SLURM's are used when these are unset):
#   NPROC_PER_NODE  ranks per machine        (default: number of visible GPUs/NPUs, else 1)
#   NNODES          machines                 (default: $SLURM_NNODES, else 1)
#   NODE_RANK       this machine's index     (default: $SLURM_NODEID, else 0)
#   MASTER_ADDR     machine 0's address      (default: first host of $SLURM_JOB_NODELIST, else 127.0.0.1)
#   MASTER_PORT     Megatron's rendezvous    (default 29500; the agent uses MASTER_PORT+1)
#   ODYSSEY_WORKDIR per-rank logs            (default ./odyssey-run)
#   ODYSSEY_JOIN    HOST:PORT of a running job's agent: this machine comes back and joins it
#                   (machine 0's $ODYSSEY_WORKDIR/agent.address; NODE_RANK as at launch)
#   ODYSSEY_SILENCE_TIMEOUT_S  a machine silent this long is lost (default 10; --silence-timeout)
#   ODYSSEY_WITNESS_DIR  a directory machines 0 and 1 share: takes a partition's tie (--witness-dir)
set -euo pipefail

if [[ $# -lt 1 ]]; then
  sed -n '2,22p' "$0" >&2
  exit 2
fi

count_devices() {
  if command -v nvidia-smi >/dev/null 2>&1; then nvidia-smi -L | wc -l
  elif command -v npu-smi >/dev/null 2>&1; then npu-smi info -l | grep -c "NPU ID" || echo 1
  else echo 1; fi
}

NPROC_PER_NODE=${NPROC_PER_NODE:-$(count_devices)}
NNODES=${NNODES:-${SLURM_NNODES:-1}}
NODE_RANK=${NODE_RANK:-${SLURM_NODEID:-0}}
if [[ -z "${MASTER_ADDR:-}" && -n "${SLURM_JOB_NODELIST:-}" ]] && command -v scontrol >/dev/null 2>&1; then
  MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
fi
MASTER_ADDR=${MASTER_ADDR:-127.0.0.1}
MASTER_PORT=${MASTER_PORT:-29500}
ODYSSEY_WORKDIR=${ODYSSEY_WORKDIR:-odyssey-run}
JOIN=()
if [[ -n "${ODYSSEY_JOIN:-}" ]]; then JOIN=(--join "$ODYSSEY_JOIN"); fi

exec python -m megatron_odyssey.launch \
  --nproc-per-node "$NPROC_PER_NODE" --nnodes "$NNODES" --node-rank "$NODE_RANK" \
  --master-addr "$MASTER_ADDR" --master-port "$MASTER_PORT" --workdir "$ODYSSEY_WORKDIR" \
  ${JOIN[@]+"${JOIN[@]}"} "$@"
