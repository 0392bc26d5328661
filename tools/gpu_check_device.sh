#!/bin/bash
# The GPU check in one command, for a machine with CUDA GPUs and torch already installed and no
# internet (the project's H200 machine; any cluster node). `make gpu-check` runs it.
#
#   bash tools/gpu_check_device.sh [OUT_JSON] [gpu_check.py options...]
#
# Wheels the machine lacks come from a local wheelhouse, $SAO_WHEELHOUSE (default .whl/, filled by
# `make gpu-wheels`): those whose distribution this Python lacks, or has at another version
# (tools/wheelhouse.py), are installed with --no-index --no-deps into a private directory
# ($SAO_GPU_CHECK_SITE, never the system Python) that goes first on PYTHONPATH. On the project's H200 image torch, transformers, safetensors, numpy and
# pyyaml are there and megatron-core is not; docs/cluster.md ("The GPU check") has the pip download
# line that fills .whl/ on a machine with internet.
# Variables: SAO_GPU_PYTHON (python3), SAO_WHEELHOUSE (.whl), SAO_GPU_CHECK_SITE (/tmp/sao-gpu-check-site),
# SAO_GPU_CHECK_TIMEOUT_S (480, the whole
# check), SAO_GPU_CHECK_BUDGET_S (420: sections not started by then are skipped).
set -uo pipefail
cd "$(dirname "$0")/.."
out_json="${1:-runs/gpu_check.json}"
shift || true
py="${SAO_GPU_PYTHON:-python3}"
wheels="${SAO_WHEELHOUSE:-.whl}"
site="${SAO_GPU_CHECK_SITE:-/tmp/sao-gpu-check-site}"
if compgen -G "$wheels/*.whl" >/dev/null; then
    # Only what this Python lacks (or has at another version): the machine's own torch, numpy, ... stay.
    mapfile -t need < <("$py" tools/wheelhouse.py "$wheels"/*.whl) || { echo "gpu-check: reading $wheels failed" >&2; exit 2; }
    for i in "${!need[@]}"; do [[ -n "${need[$i]}" ]] || unset 'need[i]'; done  # never `pip install ""`
    echo "gpu-check: ${#need[@]} of $(compgen -G "$wheels/*.whl" | wc -l) wheels in $wheels needed here: ${need[*]##*/}"
    if ((${#need[@]})); then
        "$py" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target "$site" \
            "${need[@]}" || { echo "gpu-check: installing the wheels in $wheels failed" >&2; exit 2; }
        export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}"
    fi
fi
export PYTHONPATH="$PWD:${PYTHONPATH:-}" PYTHONUNBUFFERED=1 TOKENIZERS_PARALLELISM=false
export OMP_NUM_THREADS="${OMP_NUM_THREADS:-8}"
mkdir -p "$(dirname "$out_json")"
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader 2>/dev/null || echo "gpu-check: no nvidia-smi"
"$py" -c "import torch, megatron.core as m; print('torch', torch.__version__, 'cuda', torch.cuda.is_available(), \
'megatron-core', m.__version__)" || { echo "gpu-check: torch or megatron-core does not import (carry wheels in $wheels)" >&2; exit 2; }
exec timeout "${SAO_GPU_CHECK_TIMEOUT_S:-480}" "$py" tools/gpu_check.py --out "$out_json" \
    --budget-s "${SAO_GPU_CHECK_BUDGET_S:-420}" "$@"
