#!/usr/bin/env bash
# `dllm-rl train` under torchrun. Arguments are the usual key=value overrides.
# On GPUs each rank takes its own GPU (LOCAL_RANK) and NCCL; without GPUs, one CPU process per rank over gloo.
# LLaDA and Dream run their own code: add trust_remote_code=true (your consent; a recipe cannot give it).
#
#   one node, 8 GPUs:   NPROC=8 scripts/launch_torchrun.sh deepspeed=zero2 model=/ckpt/LLaDA-8B-Instruct
#   several nodes:      run on every node with NNODES=4 NODE_RANK=<0..3> MASTER_ADDR=node0 NPROC=8
#                       scripts/launch_torchrun.sh deepspeed=zero3 ...   (or under srun, one task per node)
#   this laptop, CPU:   NPROC=2 scripts/launch_torchrun.sh deepspeed=zero2 steps=2
#
# torchrun passes ranks in the environment only. Without GPUs each process gets one OpenMP thread.
set -euo pipefail
NPROC=${NPROC:-$(python -c "import torch; print(max(torch.cuda.device_count(), 1))")}
if ! python -c "import torch, sys; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  export OMP_NUM_THREADS=${OMP_NUM_THREADS:-1} DS_ACCELERATOR=${DS_ACCELERATOR:-cpu}
fi
exec torchrun --nproc_per_node "$NPROC" --nnodes "${NNODES:-1}" --node_rank "${NODE_RANK:-0}" \
  --master_addr "${MASTER_ADDR:-127.0.0.1}" --master_port "${MASTER_PORT:-29500}" -m dllm_rl.cli train "$@"
