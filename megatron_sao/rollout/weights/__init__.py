"""How new weights reach the rollout engines.

Vocabulary: a *weight sync* (``sync.WeightSync``) is one update of every engine to a new policy
version, streamed bucket by bucket; a *transport* (``vllm_transport``) is how one in-process vLLM
engine takes the bytes; the *transfer group* (``rollout/vllm_worker/transfer_group.py``) is the
process group between the trainer's rank 0 and an engine's workers.
"""
