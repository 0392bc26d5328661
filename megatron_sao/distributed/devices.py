"""Which device a collective's tensors must be on, by the group's backend."""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_sao.distributed import collective_guard


def collective_device(group=None) -> torch.device:
    """The device a tensor must be on for a collective over `group` (the default group if None).

    NCCL groups: this rank's GPU; gloo groups (megatron-core's *_GLOO ones, the CPU build): the
    host, or the collective guard's pretend accelerator when it checks a CPU run.
    """
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    if collective_guard.installed() and collective_guard.nccl_group(group):
        return collective_guard.PRETEND_DEVICE
    return torch.device("cpu")
