#!/bin/bash
# Checkpoint conversion with the recipe's layout (TP/PP/EP from the same YAML as training).
#
#   SAO_MODEL_DIR=/ckpt/Qwen3-30B-A3B-Thinking-2507 SAO_MEGATRON_CKPT=/ckpt/qwen3-30b-a3b-tp4-ep32 \
#       sbatch -A <account> -p <partition> slurm/convert.sh hf-to-megatron
#   SAO_MEGATRON_CKPT=/runs/sao-aime-1234/checkpoints/step_600/actor SAO_HF_OUT=/ckpt/sao-aime-hf \
#       sbatch slurm/convert.sh megatron-to-hf
#   bash slurm/convert.sh --dry-run hf-to-megatron     (prints the command)
#
# One node, one task. SAO_CONFIG picks the recipe whose layout the checkpoint gets (default: AIME
# disaggregated); the reverse direction reads the layout from the Megatron checkpoint itself.
#SBATCH --job-name=sao-convert
#SBATCH --nodes=1
#SBATCH --ntasks-per-node=1
#SBATCH --exclusive
#SBATCH --time=04:00:00
#SBATCH --output=slurm-%x-%j.out
set -euo pipefail
_here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
[[ -f "$_here/common.sh" ]] || _here="${SAO_REPO:-${SLURM_SUBMIT_DIR:?}}/slurm"  # sbatch spool copy
export SAO_CONFIG="${SAO_CONFIG:-examples/qwen3_30b_a3b/aime_disaggregated.yaml}"
export SLURM_JOB_NODELIST="${SLURM_JOB_NODELIST:-$(hostname -s)}"  # conversion also runs outside SLURM
# shellcheck source=slurm/common.sh
source "$_here/common.sh"

dry="${SAO_DRY_RUN:-0}"
if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
direction="${1:?usage: convert.sh [--dry-run] hf-to-megatron|megatron-to-hf [key=value ...]}"; shift
sao_defaults
cd "$SAO_REPO"
args=(--config "$SAO_CONFIG" "$direction" --python "$SAO_PYTHON")
case "$direction" in
    hf-to-megatron) args+=(--hf-dir "${SAO_MODEL_DIR:?set SAO_MODEL_DIR}" --megatron-dir "${SAO_MEGATRON_CKPT:?set SAO_MEGATRON_CKPT}") ;;
    megatron-to-hf) args+=(--megatron-dir "${SAO_MEGATRON_CKPT:?set SAO_MEGATRON_CKPT}" --out-dir "${SAO_HF_OUT:?set SAO_HF_OUT}") ;;
    *) sao_die "direction must be hf-to-megatron or megatron-to-hf, got $direction" 2 ;;
esac
cmd_line="$("$SAO_PYTHON" -m megatron_sao.cluster.convert_cmd "${args[@]}" "$@")" || exit 2
if [[ "$dry" == 1 ]]; then echo "$cmd_line"; exit 0; fi
eval "cmd=($cmd_line)"
sao_log "convert: $cmd_line"
if command -v srun >/dev/null 2>&1 && [[ -n "${SLURM_JOB_ID:-}" ]]; then
    # shellcheck disable=SC2086
    exec srun --nodes=1 --ntasks=1 ${SAO_SRUN_ARGS:-} "${cmd[@]}"
fi
exec "${cmd[@]}"
