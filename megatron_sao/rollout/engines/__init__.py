"""Rollout engines: the protocol every backend speaks (``protocol``) and the backends behind it.

``factory`` builds them from an ``EngineConfig``: ``hf_engine`` (transformers on one thread; CPU demo,
tests), ``vllm_engine`` (in-process AsyncLLM), ``vllm_server_client`` (a separately launched ``vllm
serve`` or ``http_server``, over HTTP). ``http_server`` serves any engine on vLLM's routes.
"""
