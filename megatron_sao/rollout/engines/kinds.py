"""The rollout tier's vocabulary, defined once: engine backends and in-flight policies (torch-free, so
the config tree can type its fields with them without importing an engine)."""

from __future__ import annotations

from typing import Literal, get_args

Backend = Literal["hf", "vllm", "vllm_server"]
BACKENDS: tuple[str, ...] = get_args(Backend)

# What an in-flight request does across a weight update (``protocol.py``'s docstring): keep its KV
# cache and continue with the new weights, or end at once with the tokens sampled so far.
InflightPolicy = Literal["keep", "abort"]
INFLIGHT_POLICIES: tuple[str, ...] = get_args(InflightPolicy)
