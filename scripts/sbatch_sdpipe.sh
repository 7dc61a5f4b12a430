#!/bin/bash
# Two 4-GPU nodes under SLURM: one sdpipe launcher per node, started by srun. Each launcher reads
# its node (SLURM_NODEID / SLURMD_NODENAME) and the job's store port (from SLURM_JOB_ID) from the
# environment, so neither run.node nor run.port is given. Submit with:  sbatch scripts/sbatch_sdpipe.sh
#
# The cluster config names its nodes either with addresses (configs/cluster/gpu_2node.yaml; nodes
# then match by SLURM_NODEID, in order) or by the hostnames SLURM gives, with no host at all:
#   nodes: [{name: gpu07, devices: [{}, {}, {}, {}]}, {name: gpu08, devices: [{}, {}, {}, {}]}]
# The run folder must be on a filesystem every node shares (checkpoints need every shard).
#SBATCH --job-name=sdpipe
#SBATCH --nodes=2
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=4
#SBATCH --cpus-per-task=16
#SBATCH --time=02:00:00
#SBATCH --output=sdpipe-%j.out
set -euo pipefail

RUN_DIR=${RUN_DIR:-$HOME/runs/sdpipe-$SLURM_JOB_ID}
srun --kill-on-bad-exit=1 sdpipe train cluster=gpu_2node "run.dir=$RUN_DIR" "$@"
