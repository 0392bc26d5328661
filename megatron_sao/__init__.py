"""megatron-sao: single-rollout asynchronous RL (SAO) on Megatron-Core with vLLM rollouts."""
__version__ = "0.1.0"
