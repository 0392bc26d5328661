#!/bin/bash
# Shared logic of the SAO sbatch scripts. Two entry points:
#   source slurm/common.sh; sao_launch "$@"   on the batch host (sbatch scripts): preflight plan,
#                                             then one srun with one task per node
#   bash slurm/common.sh node                 on every node (that srun's task): eval this node's
#                                             part of the launch plan, start it, supervise it
# Everything with arithmetic in it (roles, ranks, ports, addresses, server URLs) comes from
# `python -m megatron_sao.cluster.launch_plan`, which is unit-tested; this file only starts,
# watches and stops processes.
#
# Variables (all optional; see docs/cluster.md):
#   SAO_CONFIG            recipe YAML (each sbatch script sets its default)
#   SAO_REPO              repository root (default: this file's parent, or SLURM_SUBMIT_DIR under sbatch)
#   SAO_PYTHON            python with megatron_sao installed (default: python)
#   SAO_RUN_ROOT          parent of run dirs (default: $SAO_REPO/runs)
#   SAO_RUN_DIR           run dir (default: $SAO_RUN_ROOT/<job name>-<job id>; same after a requeue)
#   SAO_MODEL_DIR         local HF checkpoint: model.path of the trainer and the model vllm serve loads
#   SAO_MEGATRON_CKPT     converted Megatron checkpoint for actor.init (slurm/convert.sh makes it)
#   SAO_TRAINER_NODES     trainer nodes (default cluster.trainer_nodes); the rest are rollout nodes; "all":
#                         every node of the allocation (colocated jobs that may be requeued on fewer nodes)
#   SAO_GPUS_PER_NODE     default SLURM_GPUS_ON_NODE, else the recipe's cluster.gpus_per_node
#   SAO_GPU_MEM_GIB       GPU memory for the preflight plan (default 80); SAO_SKIP_PLAN=1 skips it
#   SAO_HEALTH_TIMEOUT_S  deadline for every vLLM server to answer /health, counted by the trainer once
#                         its models are built (rollout.server_start_timeout_s; default: the recipe's, 1800)
#   SAO_KILL_GRACE_S      SIGTERM -> SIGKILL grace, e.g. for a final checkpoint (default 120)
#   SAO_POLL_S            poll interval of the done/stop-file and server checks (default 5 s)
#   SAO_SERVER_RESTARTS   restarts of one rollout server that exited before the trainer finished (default 3)
#   SAO_RESTART_BACKOFF_S delay before restart n: this * 2^(n-1) seconds, at most 300 (default 10)
#   SAO_SRUN_ARGS         extra srun flags: container (--container-image=... --container-mounts=...), --mpi, ...
#   SAO_TORCHRUN, SAO_VLLM executables on the nodes (default torchrun, vllm)
#   SAO_DRY_RUN=1 (or --dry-run) prints every node's commands and exits without srun
#   NCCL_SOCKET_IFNAME, NCCL_IB_HCA, NCCL_IB_*, NCCL_DEBUG: passed through; defaults set below
#   GLOO_SOCKET_IFNAME    gloo's interface (exact names); default: NCCL_SOCKET_IFNAME's names, else
#                         the interface that routes to the master, picked by each trainer process

sao_log() { echo "[sao $(date '+%F %T') ${SAO_HOST:-$(hostname -s 2>/dev/null || echo ?)}] $*" >&2; }
sao_die() { sao_log "error: $1"; exit "${2:-1}"; }  # sao_die MESSAGE [EXIT_CODE]

sao_defaults() {
    if [[ -z "${SAO_REPO:-}" ]]; then
        local here
        here="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
        # Under sbatch the script runs from a spool copy; the submit dir is the checkout then.
        if [[ -f "$here/common.sh" && -d "$here/../megatron_sao" ]]; then SAO_REPO="$(dirname "$here")"
        else SAO_REPO="${SLURM_SUBMIT_DIR:?set SAO_REPO to the megatron-sao checkout}"; fi
    fi
    export SAO_REPO
    export SAO_PYTHON="${SAO_PYTHON:-python}"
    export SAO_CONFIG="${SAO_CONFIG:?SAO_CONFIG is not set}"
    [[ "$SAO_CONFIG" = /* ]] || SAO_CONFIG="$SAO_REPO/$SAO_CONFIG"
    [[ -f "$SAO_CONFIG" ]] || sao_die "SAO_CONFIG=$SAO_CONFIG does not exist" 2
    export SAO_JOB_ID="${SLURM_JOB_ID:-local}"
    export SAO_RESTART_COUNT="${SLURM_RESTART_COUNT:-0}"
    export SAO_RUN_ROOT="${SAO_RUN_ROOT:-$SAO_REPO/runs}"
    export SAO_RUN_DIR="${SAO_RUN_DIR:-$SAO_RUN_ROOT/${SLURM_JOB_NAME:-sao}-$SAO_JOB_ID}"
    # The batch host asks for a stop (time limit, scancel --batch) by creating this file; every
    # trainer node polls it (the run dir is on a file system all nodes see, like the done file).
    export SAO_STOP_FILE="$SAO_RUN_DIR/.stop-$SAO_JOB_ID-$SAO_RESTART_COUNT"
    # GPUs per node: SAO_GPUS_PER_NODE, else what SLURM allocated, else (none: a CPU job) the
    # recipe's cluster.gpus_per_node.
    export SAO_GPUS_PER_NODE="${SAO_GPUS_PER_NODE:-${SLURM_GPUS_ON_NODE:-}}"
    [[ "$SAO_GPUS_PER_NODE" == 0 ]] && SAO_GPUS_PER_NODE=""
    export SAO_GPU_MEM_GIB="${SAO_GPU_MEM_GIB:-80}"
    export SAO_KILL_GRACE_S="${SAO_KILL_GRACE_S:-120}"
    # torchrun gives its workers this long between its SIGTERM and SIGKILL (its default, 30 s, is
    # shorter than a large model's final checkpoint).
    export TORCH_ELASTIC_SHUTDOWN_TIMEOUT="${TORCH_ELASTIC_SHUTDOWN_TIMEOUT:-$SAO_KILL_GRACE_S}"
    export SAO_SERVER_RESTARTS="${SAO_SERVER_RESTARTS:-3}" SAO_RESTART_BACKOFF_S="${SAO_RESTART_BACKOFF_S:-10}"
    export SAO_TORCHRUN="${SAO_TORCHRUN:-torchrun}" SAO_VLLM="${SAO_VLLM:-vllm}"
    export SAO_NODELIST="${SAO_NODELIST:-${SLURM_JOB_NODELIST:?SLURM_JOB_NODELIST is not set (run under sbatch, or export it for a dry run)}}"
}

sao_nccl_env() {
    # Defaults only: anything already in the environment wins (site modules, the user).
    export NCCL_SOCKET_IFNAME="${NCCL_SOCKET_IFNAME:-^lo,docker}"  # never bootstrap over loopback/docker
    # megatron-core also creates gloo groups, and gloo takes exact interface names, not NCCL's
    # ^-exclusions: the launch plan hands the trainers GLOO_SOCKET_IFNAME (this one, or
    # NCCL_SOCKET_IFNAME's names), and without either each trainer picks the interface that routes
    # to the master (megatron_sao/distributed/socket_ifname.py) instead of what its host name resolves to.
    if [[ -n "${GLOO_SOCKET_IFNAME:-}" ]]; then export GLOO_SOCKET_IFNAME; fi
    export NCCL_IB_TIMEOUT="${NCCL_IB_TIMEOUT:-22}"               # IB verbs retry timeout (4.096us * 2^22)
    export NCCL_IB_RETRY_CNT="${NCCL_IB_RETRY_CNT:-7}"
    export NCCL_DEBUG="${NCCL_DEBUG:-WARN}"
    # A failed/hung collective raises on every rank instead of hanging the job until the time limit.
    export TORCH_NCCL_ASYNC_ERROR_HANDLING="${TORCH_NCCL_ASYNC_ERROR_HANDLING:-1}"
    export TORCH_NCCL_ENABLE_MONITORING="${TORCH_NCCL_ENABLE_MONITORING:-1}"
    export TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC="${TORCH_NCCL_HEARTBEAT_TIMEOUT_SEC:-1800}"
    export TORCH_NCCL_DUMP_ON_TIMEOUT="${TORCH_NCCL_DUMP_ON_TIMEOUT:-1}"
    export CUDA_DEVICE_MAX_CONNECTIONS="${CUDA_DEVICE_MAX_CONNECTIONS:-1}"  # Megatron TP/SP comm overlap ordering
    export PYTHONUNBUFFERED=1
}

# The allocation's hostlist exactly as SLURM wrote it ("n[1-2],gpu7"): the launch plan expands
# the brackets itself (cluster/hostlist.py). Not `scontrol show hostnames`: its answer depends on
# the host's SLURM configuration, and the same plan must come out on a laptop and on the nodes.
sao_hostlist() { echo "$SAO_NODELIST"; }

# Arguments shared by every launch_plan call; user overrides ("$@") go last.
sao_plan_cmd() {
    SAO_PLAN_CMD=("$SAO_PYTHON" -m megatron_sao.cluster.launch_plan --config "$SAO_CONFIG"
        --nodelist "$(sao_hostlist)" --run-dir "$SAO_RUN_DIR" --job-id "$SAO_JOB_ID"
        --restart-count "$SAO_RESTART_COUNT" --torchrun "$SAO_TORCHRUN" --vllm "$SAO_VLLM")
    [[ -n "${SAO_GPUS_PER_NODE:-}" ]] && SAO_PLAN_CMD+=(--gpus-per-node "$SAO_GPUS_PER_NODE")
    [[ -n "${SAO_TRAINER_NODES:-}" ]] && SAO_PLAN_CMD+=(--trainer-nodes "$SAO_TRAINER_NODES")
    [[ -n "${SAO_MODEL_DIR:-}" ]] && SAO_PLAN_CMD+=(--model-dir "$SAO_MODEL_DIR")
    SAO_PLAN_CMD+=("${SAO_OVERRIDES[@]}")
}

sao_collect_overrides() {
    SAO_OVERRIDES=()
    [[ -n "${SAO_MODEL_DIR:-}" ]] && SAO_OVERRIDES+=("model.path=$SAO_MODEL_DIR")
    [[ -n "${SAO_MEGATRON_CKPT:-}" ]] && SAO_OVERRIDES+=("actor.init=$SAO_MEGATRON_CKPT")
    [[ -n "${SAO_HEALTH_TIMEOUT_S:-}" ]] && SAO_OVERRIDES+=("rollout.server_start_timeout_s=$SAO_HEALTH_TIMEOUT_S")
    SAO_OVERRIDES+=("$@")
}

# ------------------------------------------------------------------ batch host: sao_launch

sao_launch() {
    local dry="${SAO_DRY_RUN:-0}"
    if [[ "${1:-}" == "--dry-run" ]]; then dry=1; shift; fi
    sao_defaults
    sao_nccl_env
    sao_collect_overrides "$@"
    export SAO_OVERRIDES_STR
    SAO_OVERRIDES_STR="$(printf '%q ' "${SAO_OVERRIDES[@]}")"  # srun tasks rebuild the array from it
    cd "$SAO_REPO"
    sao_plan_cmd
    if [[ "${SAO_SKIP_PLAN:-0}" != 1 ]]; then
        # Refuse an impossible layout or memory plan here, not 20 minutes into model loading.
        "${SAO_PLAN_CMD[@]}" --format memory --gpu-mem-gib "$SAO_GPU_MEM_GIB" \
            || sao_die "the memory/layout plan refused this job (SAO_SKIP_PLAN=1 launches anyway)" 2
    fi
    if [[ "$dry" == 1 ]]; then
        "${SAO_PLAN_CMD[@]}" --format text || exit 2
        echo "# srun --nodes=\$SLURM_NNODES --ntasks-per-node=1 --kill-on-bad-exit=1 ${SAO_SRUN_ARGS:-}" \
             "bash $SAO_REPO/slurm/common.sh node"
        return 0
    fi
    mkdir -p "$SAO_RUN_DIR/logs"
    "${SAO_PLAN_CMD[@]}" --format text > "$SAO_RUN_DIR/logs/launch-plan-$SAO_JOB_ID-$SAO_RESTART_COUNT.txt" \
        || sao_die "launch plan failed (see above)" 2
    sao_log "run dir $SAO_RUN_DIR (restart $SAO_RESTART_COUNT), nodes $(sao_hostlist)"

    # One task per node; --kill-on-bad-exit: any node failing stops all of them.
    # shellcheck disable=SC2086
    srun --nodes="${SLURM_NNODES}" --ntasks="${SLURM_NNODES}" --ntasks-per-node=1 --kill-on-bad-exit=1 \
        --wait="${SAO_SRUN_WAIT_S:-$((SAO_KILL_GRACE_S + 60))}" ${SAO_SRUN_ARGS:-} \
        bash "$SAO_REPO/slurm/common.sh" node &
    SAO_SRUN_PID=$!
    # USR1 (--signal=B:USR1@T, before the time limit): every trainer node SIGTERMs its trainer, which
    # finishes its step and writes a checkpoint; then this job id is requeued and the next attempt
    # resumes from the run dir. TERM/INT (scancel --batch, Ctrl-C): the same stop, no requeue.
    # Never a signal to srun: srun turns TERM into SIGKILL for every task (no checkpoint).
    SAO_REQUEUE=0
    trap 'sao_log "time limit near: stopping the trainer (checkpoint), then requeueing"; SAO_REQUEUE=1; \
          touch "$SAO_STOP_FILE"' USR1
    trap 'sao_log "signal: stopping the trainer (checkpoint)"; touch "$SAO_STOP_FILE"' TERM INT
    local rc=0
    while :; do
        rc=0
        wait "$SAO_SRUN_PID" || rc=$?
        kill -0 "$SAO_SRUN_PID" 2>/dev/null || break  # else a trap interrupted the wait
    done
    sao_log "srun finished with exit code $rc"
    if [[ "$SAO_REQUEUE" == 1 ]]; then
        sao_log "requeueing job $SLURM_JOB_ID (restart $((SAO_RESTART_COUNT + 1)) resumes from $SAO_RUN_DIR)"
        scontrol requeue "$SLURM_JOB_ID" || sao_die "scontrol requeue $SLURM_JOB_ID failed (is the job --requeue?)"
        exit 0
    fi
    [[ -e "$SAO_STOP_FILE" && "$rc" == 0 ]] && rc=143  # stopped by a signal: not a finished run
    return "$rc"
}

# ------------------------------------------------------------------ every node: sao_node_main

SAO_PIDS=()

# Start argv in its own session/process group (pgid = pid) so that stopping it reaches the
# whole tree (torchrun's workers, vLLM's engine and TP workers).
sao_start() {
    local name="$1" log="$2"; shift 2
    mkdir -p "$(dirname "$log")"
    sao_log "start $name -> $log"
    setsid "$@" >>"$log" 2>&1 < /dev/null &
    SAO_PIDS+=("$!")
}

sao_stop_all() {
    local pid deadline
    ((${#SAO_PIDS[@]})) || return 0
    for pid in "${SAO_PIDS[@]}"; do [[ -n "$pid" ]] && { kill -TERM -- "-$pid" 2>/dev/null || true; }; done
    deadline=$((SECONDS + SAO_KILL_GRACE_S))
    for pid in "${SAO_PIDS[@]}"; do
        [[ -n "$pid" ]] || continue
        while kill -0 -- "-$pid" 2>/dev/null && ((SECONDS < deadline)); do sleep 1; done
        kill -KILL -- "-$pid" 2>/dev/null || true
    done
    SAO_PIDS=()
}

sao_node_main() {
    set -euo pipefail
    sao_defaults
    cd "$SAO_REPO"
    eval "SAO_OVERRIDES=(${SAO_OVERRIDES_STR:-})"
    sao_plan_cmd
    local plan
    plan="$("${SAO_PLAN_CMD[@]}" --node-rank "${SLURM_NODEID:?SLURM_NODEID is not set}" --format bash)" \
        || sao_die "launch plan failed on node ${SLURM_NODEID}" 2
    eval "$plan"
    trap sao_stop_all EXIT
    trap 'exit 143' TERM
    trap 'exit 130' INT
    local i name log cmd
    for ((i = 0; i < SAO_NPROCS; i++)); do
        eval "name=\$SAO_PROC_NAME_$i; log=\$SAO_PROC_LOG_$i; cmd=(\"\${SAO_PROC_CMD_$i[@]}\")"
        sao_start "$name" "$log" "${cmd[@]}"
    done
    if [[ "$SAO_ROLE" == trainer ]]; then sao_supervise_trainer; else sao_supervise_servers; fi
}

# Trainer node: wait for torchrun; on the batch host's stop request SIGTERM it (torchrun passes the
# SIGTERM to every rank, which finishes its step and writes a checkpoint). Exit with the trainer's
# code, 0 after a requested stop (the batch host requeues or reports it; a non-zero exit here would
# make srun kill the other nodes at once).
sao_supervise_trainer() {
    local pid="${SAO_PIDS[0]}" rc=0 stopping=0
    while kill -0 "$pid" 2>/dev/null; do
        if ((!stopping)) && [[ -e "$SAO_STOP_FILE" ]]; then
            sao_log "stop requested: SIGTERM to the trainer (it checkpoints after its step)"
            kill -TERM -- "-$pid" 2>/dev/null || true
            stopping=1
        fi
        sleep "${SAO_POLL_S:-5}"
    done
    wait "$pid" || rc=$?
    # Trainer node 0 tells the rollout nodes that the end is intended, not a crash.
    [[ "$SAO_NODE_RANK" == 0 ]] && touch "$SAO_DONE_FILE"
    if ((stopping)); then sao_log "trainer stopped on request (exit $rc)"; exit 0; fi
    sao_log "trainer exited with $rc"
    exit "$rc"
}

# Rollout node: run until the trainer is done. A server that exits before that is restarted, at
# most SAO_SERVER_RESTARTS times, after SAO_RESTART_BACKOFF_S * 2^(n-1) s (capped at 300 s); the
# trainer's server pool takes it out of service meanwhile and readmits it with a complete weight
# update once it answers /health again (rollout/server_pool.py). A server out of restarts stays
# down; the trainer decides whether the run can go on (it stops, with a checkpoint, when no server
# is left past rollout.server_deadline_s). This node never fails the job: a failing exit would make
# srun --kill-on-bad-exit stop the trainer mid-step.
sao_supervise_servers() {
    local i pid rc name log cmd n delay
    local -a restarts=() due=()
    for ((i = 0; i < SAO_NPROCS; i++)); do restarts[i]=0; due[i]=-1; done
    while [[ ! -e "$SAO_DONE_FILE" ]]; do
        for ((i = 0; i < SAO_NPROCS; i++)); do
            eval "name=\$SAO_PROC_NAME_$i; log=\$SAO_PROC_LOG_$i"
            pid="${SAO_PIDS[i]}"
            if [[ -n "$pid" ]] && ! kill -0 "$pid" 2>/dev/null; then
                rc=0; wait "$pid" || rc=$?
                kill -KILL -- "-$pid" 2>/dev/null || true  # what is left of its group (engine workers)
                SAO_PIDS[i]=""
                n=$((restarts[i] + 1))
                if ((n > SAO_SERVER_RESTARTS)); then
                    sao_log "$name exited with $rc; no restart left (SAO_SERVER_RESTARTS=$SAO_SERVER_RESTARTS; log $log)"
                    continue
                fi
                delay=$((SAO_RESTART_BACKOFF_S * (1 << (n - 1)))); ((delay > 300)) && delay=300
                # SECONDS counts whole seconds: +1 so that at least `delay` seconds pass, never delay - 1.
                restarts[i]=$n; due[i]=$((SECONDS + delay + 1))
                sao_log "$name exited with $rc before the trainer finished; restart $n of $SAO_SERVER_RESTARTS in ${delay}s (log $log)"
            fi
            if [[ -z "${SAO_PIDS[i]}" ]] && ((due[i] >= 0 && SECONDS >= due[i])); then
                due[i]=-1
                eval "cmd=(\"\${SAO_PROC_CMD_$i[@]}\")"
                setsid "${cmd[@]}" >>"$log" 2>&1 < /dev/null &
                SAO_PIDS[i]=$!
                sao_log "restarted $name (restart ${restarts[i]} of $SAO_SERVER_RESTARTS, pid ${SAO_PIDS[i]})"
            fi
        done
        sleep "${SAO_POLL_S:-5}"
    done
    sao_log "trainer done: stopping vLLM"
    exit 0
}

if [[ "${BASH_SOURCE[0]}" == "$0" ]]; then
    case "${1:-}" in
        node) sao_node_main ;;
        *) echo "usage: bash slurm/common.sh node   (run by srun; sbatch scripts source this file)" >&2; exit 2 ;;
    esac
fi
