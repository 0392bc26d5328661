"""The CPU side of a CUDA IPC refit at Qwen3-30B-A3B's tensor count, one handle per tensor (vLLM's ipc
engine with packed=False, IPCTransport's first design) against one per bucket (packed, what
weights/inprocess_transports.py::IPCTransport sends now): what the handles themselves cost in the
trainer and the worker, the GPU aside.

    OMP_NUM_THREADS=1 .venv/bin/python benchmarks/bench_ipc_handles.py [--rounds 5] [--bucket-mb 1024] [--json]

Per refit: the model's 18,867 HF tensors (48 layers x (attention 4 + norms 4 + router 1 + 128 experts x
3) + embeddings, head, final norm; bf16) cut into buckets of `--bucket-mb` like the export, and per
bucket what crosses AsyncLLM's process boundary: the update info (bucket_update_info + `encode_ipc_args`
of each tensor's `reduce_tensor` tuple, or of the bucket buffer's one), vLLM's msgpack encode and
decode of `collective_rpc`'s kwargs, then the worker's `decode_update_info`. The `reduce_tensor`
tuples are built from the shapes (no GPU here): the same 15 fields with 64-byte handles. Not counted
for the packed form: its device copy into the staging buffer (about a millisecond per GiB bucket on
an H200) and the worker's clone of each tensor. Reported: seconds per refit (min / median / max over
interleaved rounds), message bytes, and the load it was measured at. Not measured (needs a GPU):
cudaIpcGetMemHandle / cudaIpcOpenMemHandle per distinct allocation (per tensor, one per segment of the
caching allocator a tensor sits in; packed, one per update), the ref-counter file and event handles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import torch

LAYERS, EXPERTS, HIDDEN, INTER, VOCAB, HEAD_DIM, Q_HEADS, KV_HEADS = 48, 128, 2048, 768, 151936, 128, 32, 4
UUID = "GPU-00000000-0000-0000-0000-000000000000"


def qwen3_30b_a3b_tensors() -> list[tuple[str, tuple[int, ...]]]:
    out = [("model.embed_tokens.weight", (VOCAB, HIDDEN))]
    q, kv = Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM
    for i in range(LAYERS):
        p = f"model.layers.{i}"
        out += [(f"{p}.self_attn.q_proj.weight", (q, HIDDEN)), (f"{p}.self_attn.k_proj.weight", (kv, HIDDEN)),
                (f"{p}.self_attn.v_proj.weight", (kv, HIDDEN)), (f"{p}.self_attn.o_proj.weight", (HIDDEN, q)),
                (f"{p}.self_attn.q_norm.weight", (HEAD_DIM,)), (f"{p}.self_attn.k_norm.weight", (HEAD_DIM,)),
                (f"{p}.input_layernorm.weight", (HIDDEN,)), (f"{p}.post_attention_layernorm.weight", (HIDDEN,)),
                (f"{p}.mlp.gate.weight", (EXPERTS, HIDDEN))]
        for e in range(EXPERTS):
            out += [(f"{p}.mlp.experts.{e}.gate_proj.weight", (INTER, HIDDEN)),
                    (f"{p}.mlp.experts.{e}.up_proj.weight", (INTER, HIDDEN)),
                    (f"{p}.mlp.experts.{e}.down_proj.weight", (HIDDEN, INTER))]
    return out + [("model.norm.weight", (HIDDEN,)), ("lm_head.weight", (VOCAB, HIDDEN))]


def buckets(tensors, bucket_bytes: int) -> list[list[tuple[str, tuple[int, ...]]]]:
    out, cur, size = [], [], 0
    for name, shape in tensors:
        n = 2 * int(torch.Size(shape).numel())
        if cur and size + n > bucket_bytes:
            out.append(cur)
            cur, size = [], 0
        cur.append((name, shape))
        size += n
    return out + [cur] if cur else out


def _stride(shape) -> tuple[int, ...]:
    s, out = 1, []
    for d in reversed(shape):
        out.append(s)
        s *= d
    return tuple(reversed(out))


def reduce_args(shape, k: int) -> tuple:
    """The tuple torch.multiprocessing.reductions.reduce_tensor returns for a CUDA tensor (15 fields)."""
    nbytes = 2 * int(torch.Size(shape).numel())
    return (torch.Tensor, torch.Size(shape), _stride(shape), 0, torch.storage.TypedStorage, torch.bfloat16, 0,
            k.to_bytes(8, "little") * 8, nbytes, 0, False, b"/torch_ipc_refcounter_123456", k, b"\0" * 64, True)


def per_tensor_refit(bs, enc, dec) -> tuple[float, int]:
    from megatron_sao.weights.buckets import bucket_update_info
    from megatron_sao.weights.vllm_worker.ipc_handles import decode_update_info, encode_ipc_args

    t0, size, k = time.perf_counter(), 0, 0
    for b in bs:
        fake = [(n, torch.empty(s, device="meta", dtype=torch.bfloat16)) for n, s in b]
        handles = []
        for _, shape in b:
            handles.append({UUID: encode_ipc_args(reduce_args(shape, k))})
            k += 1
        msg = enc.encode({"update_info": {**bucket_update_info(fake), "ipc_handles": handles}})
        size += sum(len(m) for m in msg)
        decode_update_info(dec.decode(msg)["update_info"])
    return time.perf_counter() - t0, size


def per_bucket_refit(bs, enc, dec) -> tuple[float, int]:
    """The same buckets as IPCTransport sends them now (packed): one handle per bucket's staging buffer
    (exported once per update), every tensor's byte size; the worker's decode_update_info."""
    from megatron_sao.weights.buckets import bucket_update_info
    from megatron_sao.weights.vllm_worker.ipc_handles import decode_update_info, encode_ipc_args

    t0, size = time.perf_counter(), 0
    handle = {UUID: encode_ipc_args(reduce_args((1 << 29,), 0))}
    for b in bs:
        fake = [(n, torch.empty(s, device="meta", dtype=torch.bfloat16)) for n, s in b]
        sizes = [2 * int(torch.Size(shape).numel()) for _, shape in b]
        msg = enc.encode({"update_info": {**bucket_update_info(fake), "tensor_sizes": sizes, "ipc_handles": handle}})
        size += sum(len(m) for m in msg)
        decode_update_info(dec.decode(msg)["update_info"])
    return time.perf_counter() - t0, size


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--bucket-mb", type=int, default=1024)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    enc, dec = MsgpackEncoder(), MsgpackDecoder()
    tensors = qwen3_30b_a3b_tensors()
    bs = buckets(tensors, args.bucket_mb << 20)
    times: dict[str, list[float]] = {"per_tensor": [], "per_bucket": []}
    sizes = {}
    for _ in range(args.rounds):  # interleaved: a busy moment hits both
        for name, fn in (("per_tensor", per_tensor_refit), ("per_bucket", per_bucket_refit)):
            s, n = fn(bs, enc, dec)
            times[name].append(s)
            sizes[name] = n
    out = {"tensors": len(tensors), "buckets": len(bs), "bucket_mb": args.bucket_mb,
           "model_gib": round(sum(2 * torch.Size(s).numel() for _, s in tensors) / 2**30, 1),
           "load": os.getloadavg(), "cores": os.cpu_count()}
    for name, ts in times.items():
        out[name] = {"s_per_refit": {"min": min(ts), "median": statistics.median(ts), "max": max(ts)},
                     "message_bytes": sizes[name]}
    if args.json:
        print(json.dumps(out))
        return
    print(f"{out['tensors']} tensors ({out['model_gib']} GiB bf16) in {out['buckets']} buckets of "
          f"{args.bucket_mb} MiB; load {out['load'][0]:.1f} on {out['cores']} cores")
    for name in times:
        t = out[name]["s_per_refit"]
        print(f"  {name:10s} {t['min']:.3f} / {t['median']:.3f} / {t['max']:.3f} s per refit (min / median / max), "
              f"{out[name]['message_bytes'] / 2**20:.1f} MiB of messages")


if __name__ == "__main__":
    main()
