"""Methods mixed into every vLLM worker (``worker_extension_cls``), called through ``collective_rpc``.

Why a worker extension: AsyncLLM always runs its EngineCore in a separate process, and vLLM only
pickles callables or tensors in ``collective_rpc`` with ``VLLM_ALLOW_INSECURE_SERIALIZATION=1``. A named
method taking plain ``bytes`` (a safetensors blob) needs neither; the CPU fixes it applies after a
reload are ``cpu_moe_repack`` (fused-MoE experts) and ``cpu_lm_head_repack`` (a tied LM head). This
module is imported inside the vLLM worker process; it must not import the rest of megatron_sao
(``vllm_worker/gloo_engine.py`` and ``transfer_group`` import only torch and vLLM).

Importing it registers the CPU weight-transfer backend ``"sao_gloo"`` (``vllm_worker/gloo_engine.py``): vLLM
imports the extension class before it builds the worker's weight-transfer engine.
"""

from __future__ import annotations

import torch

from megatron_sao.weights.vllm_worker import gloo_engine
from megatron_sao.weights.vllm_worker.cpu_lm_head_repack import repack_cpu_lm_heads
from megatron_sao.weights.vllm_worker.cpu_moe_repack import expert_modules, repack_cpu_moe
from megatron_sao.weights.vllm_worker.ipc_handles import decode_update_info

gloo_engine.register()


class SAOWorkerExtension:
    """Mixed into vLLM's Worker; ``self`` is the worker (``self.model_runner``, ``self.reload_weights``)."""

    def sao_reload_weights(self, blobs: list[bytes]) -> dict:
        """Load a complete checkpoint-named update (safetensors blobs, one per bucket) in place."""
        from safetensors.torch import load

        state: dict[str, torch.Tensor] = {}
        for blob in blobs:
            state.update(load(bytes(blob)))
        self.reload_weights(weights_iterator=list(state.items()))  # type: ignore[attr-defined]
        model = self.model_runner.model  # type: ignore[attr-defined]
        repacked = repack_cpu_moe(model, expert_modules(state))
        return {"tensors": len(state), "moe_layers_repacked": repacked, "lm_heads_repacked": repack_cpu_lm_heads(model)}

    def sao_reopen_weight_update(self) -> None:
        """Let the update in progress take a bucket again after a failed receive.

        vLLM's ``Worker.update_weights`` ends the worker's update session on any error of the engine's
        receive, so the bucket the trainer sends again over a re-formed group (another server died
        mid-bucket and broke the group for everyone: ``weights/server_group.py``) would be
        refused. The engine's layerwise reload and its record of the tensors it loaded are intact, so
        the same session goes on: only vLLM's flag is set back."""
        engine = getattr(self, "weight_transfer_engine", None)
        if not getattr(engine, "updating", False):
            raise RuntimeError("sao_reopen_weight_update: no sao_gloo weight update in progress")
        self._weight_update_active = True  # type: ignore[attr-defined]

    def sao_last_update(self) -> dict:
        """What the weight-transfer engine's last update loaded and repacked (``sao_gloo``); {} for
        engines that do not record it (vLLM's NCCL engine)."""
        engine = getattr(self, "weight_transfer_engine", None)
        received = getattr(engine, "received", None)
        if received is None or not hasattr(engine, "last_repacked"):
            return {}
        return {"tensors": len(received), "moe_layers_repacked": engine.last_repacked,
                "lm_heads_repacked": engine.last_heads_repacked}

    def sao_gpu_uuid(self) -> str:
        """The physical GPU this worker's model is on, as vLLM's ``ipc`` engine keys the handles it opens:
        the trainer checks it is its own before it shares any tensor (``IPCTransport.setup``)."""
        return str(torch.cuda.get_device_properties(self.device).uuid)  # type: ignore[attr-defined]

    def sao_ipc_update_weights(self, update_info: dict) -> None:
        """One bucket by CUDA IPC: the trainer's handle of its staging buffer in plain data (``ipc_handles``)
        back to the tuple vLLM's ``ipc`` engine opens, then vLLM's own ``update_weights`` (its session
        check, the packed receive, which clones each tensor out of the buffer, the layerwise load, a device
        synchronize). When this returns, the worker has read the buffer and the trainer may overwrite it
        with the next bucket (``weights/inprocess_transports.py::IPCTransport``)."""
        self.update_weights(decode_update_info(update_info))  # type: ignore[attr-defined]

    def sao_abort_weight_update(self) -> None:
        """Leave the update in progress, whatever a failed bucket left behind.

        vLLM's ``Worker.update_weights`` ends the update session on any receive error, while the
        engine's layerwise reload stays open with the model's layers on the meta device, so a plain
        ``finish_weight_update`` would refuse ("without a matching start") and leave a model that
        cannot run. Setting the flag back lets vLLM's finish run its ``finalize_layerwise_reload``:
        layers that received nothing get their previous tensors back and layers that received all of
        theirs hold the new ones, but a layer that received only some of its tensors (cut by the failed
        bucket) is materialized with ``torch.empty_strided`` and loaded with what arrived, so its other
        tensors hold uninitialised memory. The engine must not serve until a complete update."""
        self._weight_update_active = True  # type: ignore[attr-defined]
        self.finish_weight_update()  # type: ignore[attr-defined]
