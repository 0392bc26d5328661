#!/bin/bash
# SAO on Qwen3-30B-A3B, repository-level coding (mini-swe-agent in the sandbox, hidden tests as the reward),
# paper settings (DIS eps 0.8/3.0, 300 turns, 128K); what the cluster provides: docs/cluster.md section 10.
# Recipe: examples/qwen3_30b_a3b/coding_disaggregated.yaml (4 trainer + 4 rollout nodes by default).
#
#   sbatch -A <account> -p <partition> slurm/sao_coding.sh [key=value overrides ...]
#   bash slurm/sao_coding.sh --dry-run      (needs SLURM_JOB_NODELIST; prints every node's commands)
#
# #SBATCH lines cannot expand variables: the values below are defaults, override them on the
# sbatch command line (--nodes, --gpus-per-node, --time, -A, -p, --qos). Inside the job every
# count is read back from SLURM (SLURM_JOB_NODELIST, SLURM_NNODES, SLURM_GPUS_ON_NODE) and the
# SAO_* variables documented in slurm/common.sh and docs/cluster.md.
#SBATCH --job-name=sao-coding
#SBATCH --nodes=8
#SBATCH --ntasks-per-node=1
#SBATCH --gpus-per-node=8
#SBATCH --exclusive
#SBATCH --time=48:00:00
#SBATCH --requeue
#SBATCH --signal=B:USR1@600
#SBATCH --open-mode=append
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ -f "$_here/common.sh" ]] || _here="${SAO_REPO:-${SLURM_SUBMIT_DIR:?}}/slurm"  # sbatch spool copy
export SAO_CONFIG="${SAO_CONFIG:-examples/qwen3_30b_a3b/coding_disaggregated.yaml}"
# Sandbox calls at once on trainer rank 0's node: 256 agents' commands and test runs share its cores.
export SAO_SANDBOX_CONCURRENCY="${SAO_SANDBOX_CONCURRENCY:-64}"
# shellcheck source=slurm/common.sh
source "$_here/common.sh"
sao_launch "$@"
