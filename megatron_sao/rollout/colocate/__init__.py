"""Colocated placement: a vLLM engine shard in every trainer rank, generation and training taking turns.

``layout`` (which ranks form which engine), ``vllm_shard`` (this rank's part of an engine),
``vllm_cpu`` (what the CPU build needs), ``hub`` + ``lockstep`` (how rank 0's episode driver reaches
every engine), ``cycle`` (the memory dance around a train step), ``probe`` (its seconds and bytes).
"""
