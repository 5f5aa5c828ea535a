#!/usr/bin/env bash
# sbatch ops/slurm/sbatch-example.sh  —  a 4-node job with a Spillway pool.
# Every rank runs `spillway launch`: local rank 0 of each node starts that node's Spillway
# node, the others wait for it; the job runs with SPILLWAY_SOCKET set.
# SPILLWAY_DIR must be on a shared filesystem (here: your home): host 0 leaves a one-time
# join token per other host there; each host makes its own key and joins host 0's pool.
#SBATCH --job-name=spillway
#SBATCH --nodes=4
#SBATCH --ntasks-per-node=2
#SBATCH --time=01:00:00
set -euo pipefail
export SPILLWAY_DIR=$HOME/.spillway/jobs
srun spillway launch --host-budget 64GiB -- python train.py
