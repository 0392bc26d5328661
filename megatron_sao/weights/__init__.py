"""Moving the actor's weights to the rollout engines after each actor step: the one home of refit.

The trainer calls one thing, ``push.WeightPush.push(version, step)``, on every rank. From there the
bytes flow down this package, in the order they move:

    export.export_hf_weights     Megatron's TP/EP/PP shards -> full HF-named tensors, in size-bounded
                                 buckets (collectives on every rank; rank 0 yields the buckets)
    check                        the weight check's fixed tokens and the actor's reference log-probs
    push.WeightPush              rank 0 hands the bucket generator to the rollout side, which picks the
                                 servers in the update and settles their failures (rollout_side.py)
    stream.stream_update         bucket k sent on the rollout loop while bucket k+1 is produced
    sync.WeightSync              one versioned update of every engine: begin / bucket / finish / check,
                                 per-engine timeouts and failures
    server_group                 the one transfer group of every ``vllm serve`` (rank offsets, re-formed
                                 when the servers change)
    inprocess_transports         how an in-process vLLM engine takes the bytes (gloo group, CUDA IPC,
                                 safetensors reload)
    vllm_worker/                 the receiving end, inside vLLM's worker processes (imports only the
                                 standard library, torch, vLLM and itself)

``buckets`` holds what moves (``WeightBucket``, its size, its two wire forms) and the transport names.
The engines use this package (``rollout/engines/``); it imports no engine: what it needs of one is a
protocol (``sync.UpdatableEngine``, ``server_group.GroupMember``). The colocated placement loads the
same buckets in-process on every rank instead (``export.export_hf_weights(every_rank=True)``,
``rollout/colocate/cycle.py``).
"""
