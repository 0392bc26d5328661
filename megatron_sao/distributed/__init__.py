"""Process-wide helpers of the torch.distributed world that any package may use (no Megatron in them).

``collective_guard`` (the CPU suite's check that collectives get device tensors) and ``rank0_gate``
(no rank waits inside a collective for a phase only rank 0 runs); ``ports`` (free TCP ports for
rendezvous and servers).
"""
