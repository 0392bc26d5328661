"""Build rollout engines from an ``EngineConfig``: the only module that imports every backend.

Imports are lazy so the ``hf`` backend never needs vLLM installed, and kept out of ``protocol.py``
so that the backends (which import the protocol) and the factory (which imports the backends) do
not form an import cycle.
"""

from __future__ import annotations

from megatron_sao.rollout.engines.protocol import EngineConfig, RolloutEngine


def make_engine(cfg: EngineConfig) -> RolloutEngine:
    """One engine: HF or in-process vLLM; for ``vllm_server`` the client of the first (only) URL.

    The in-process vLLM engine starts its own background loop; call ``await engine.close()`` when done.
    """
    cfg.validate()
    if cfg.backend == "vllm_server":
        if len(cfg.server_urls) != 1:
            raise ValueError(f"make_engine builds one engine but EngineConfig.server_urls names "
                             f"{len(cfg.server_urls)}; use make_engines (every server is used)")
        return make_engines(cfg)[0]
    if cfg.backend == "hf":
        from megatron_sao.rollout.engines.hf_engine import HFEngine

        return HFEngine.from_pretrained(cfg)
    from megatron_sao.rollout.engines.vllm_engine import VLLMEngine

    return VLLMEngine(cfg)


def make_engines(cfg: EngineConfig) -> list[RolloutEngine]:
    """Every engine the config describes: one client per server URL for ``vllm_server``, else one."""
    cfg.validate()
    if cfg.backend != "vllm_server":
        return [make_engine(cfg)]
    from megatron_sao.rollout.engines.vllm_server_client import VLLMServerClient

    return [VLLMServerClient(url, cfg, index=i) for i, url in enumerate(cfg.server_urls)]
