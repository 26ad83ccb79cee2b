#!/usr/bin/env bash
# `dllm-rl train` under the deepspeed launcher. Arguments are the usual key=value overrides.
# On GPUs each rank takes its own GPU (LOCAL_RANK) and NCCL; without GPUs, one CPU process per rank over gloo.
# LLaDA and Dream run their own code: add trust_remote_code=true (your consent; a recipe cannot give it).
#
#   one node, 8 GPUs:   NUM_GPUS=8 scripts/launch_deepspeed.sh deepspeed=zero2 model=/ckpt/LLaDA-8B-Instruct
#   several nodes:      HOSTFILE=hostfile MASTER_ADDR=node0 scripts/launch_deepspeed.sh deepspeed=zero3 ...
#                       (hostfile lines: "node0 slots=8"; NUM_NODES=k uses the first k hosts; the launcher
#                       reaches the other nodes over ssh (pdsh), LAUNCHER=slurm|openmpi picks another backend)
#   this laptop, CPU:   NUM_GPUS=2 scripts/launch_deepspeed.sh deepspeed=zero2 steps=2
#
# The launcher appends --local_rank=N to every process; `dllm-rl` strips it before Hydra reads the overrides
# and takes the rank from the environment. On a machine without GPUs each process gets one OpenMP thread
# (OMP_NUM_THREADS), otherwise the processes oversubscribe the cores.
set -euo pipefail
NUM_GPUS=${NUM_GPUS:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
fi
args=(--num_gpus "$NUM_GPUS" --master_port "${MASTER_PORT:-29500}")
if [[ -n "${HOSTFILE:-}" ]]; then
  args+=(--hostfile "$HOSTFILE" --launcher "${LAUNCHER:-pdsh}")
  [[ -n "${NUM_NODES:-}" ]] && args+=(--num_nodes "$NUM_NODES")
  [[ -n "${MASTER_ADDR:-}" ]] && args+=(--master_addr "$MASTER_ADDR")
fi
exec deepspeed "${args[@]}" --module dllm_rl.cli train "$@"
