#!/bin/bash
# minipar on a Slurm cluster: one torchrun per node, one process per GPU, NCCL between them.
#
#   sbatch --nodes 4 scripts/slurm_train.sh --model gpt2-xl --dp 4 --tp 8 --precision bf16 --global-batch 64
#
# torchrun's c10d rendezvous runs on the first node of the allocation; every node starts 8 ranks, and
# `python -m minipar train` joins the job (RANK and WORLD_SIZE are set) instead of starting workers.
# Keep tp within a node (8 GPUs on NVLink): minipar's grid puts tp innermost, so that happens by itself.
#SBATCH --job-name=minipar
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --cpus-per-task=64
#SBATCH --exclusive
#SBATCH --time=01:00:00
set -euo pipefail
GPUS_PER_NODE=${GPUS_PER_NODE:-8}
HEAD=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
srun torchrun \
    --nnodes "$SLURM_NNODES" --nproc-per-node "$GPUS_PER_NODE" \
    --rdzv-id "$SLURM_JOB_ID" --rdzv-backend c10d --rdzv-endpoint "$HEAD:29500" \
    -m minipar train --device cuda --data synthetic --plot "" --sample 0 "$@"
