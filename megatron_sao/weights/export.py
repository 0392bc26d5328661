"""Full HF-named weights out of a TP/PP/EP-sharded Megatron model, streamed in size-bounded buckets.

This is the source of weight sync (trainer -> rollout engines) and of HF export. Tensors move one
at a time, so no rank ever holds more than one full tensor plus rank 0's current bucket:

  1. TP: all-gather the shards of a parameter over its tensor-parallel group (the expert-TP group
     for expert weights) and reassemble with `checkpoint.sharding.unshard_tensor`.
  2. EP: all-gather each local expert's full weight over the expert-parallel group; EP rank j's
     local expert i is global expert j * (E / EP) + i.
  3. PP: stage s (s > 0) sends its full tensors to global rank 0 by broadcast inside rank 0's
     pipeline group, after broadcasting the list of (global name, shape, dtype) it will send.
Rank 0 converts each full tensor to HF names (`converters.get_converter(spec).mcore_to_hf`) and
yields a bucket whenever the next tensor would overflow `bucket_bytes`. Every rank must iterate
the generator to the end (non-zero ranks yield nothing): the collectives pair up across ranks.

`every_rank=True` (colocated placement: each rank loads the buckets into its own vLLM shard, which
slices its tensor-parallel part itself) yields the same buckets on every rank. It needs pp=1: steps
1 and 2 already leave every full tensor on every rank of the stage, so no extra communication is
made; a pipeline-parallel model would need stage-to-stage broadcasts of every tensor.
Every collective runs under the process-group timeout set by `init_parallel`.
"""

from __future__ import annotations

import dataclasses
from typing import Iterator

import torch
import torch.distributed as dist

from megatron_sao.checkpoint.sharding import RankLayout, local_to_global_name, tp_partition, unshard_tensor

Bucket = list[tuple[str, torch.Tensor]]


def _tp_gather(global_name: str, param: torch.Tensor, spec, layout: RankLayout) -> torch.Tensor:
    from megatron.core import parallel_state as ps

    split = tp_partition(global_name, spec)
    size = layout.expert_tp if split.expert else layout.tp
    if split.dim is None or size == 1:
        return unshard_tensor(global_name, [param.detach()], spec)  # strips vocab padding at TP 1 too
    group = ps.get_expert_tensor_parallel_group() if split.expert else ps.get_tensor_model_parallel_group()
    shards = [torch.empty_like(param) for _ in range(size)]
    dist.all_gather(shards, param.detach().contiguous(), group=group)
    return unshard_tensor(global_name, shards, spec)


def _stage_tensors(module: torch.nn.Module, spec, layout: RankLayout) -> Iterator[tuple[str, torch.Tensor]]:
    """(global canonical name, full tensor) for every weight of this pipeline stage.

    Collective over this stage's TP and EP groups: all ranks of the stage iterate it in step.
    """
    from megatron.core import parallel_state as ps

    for local_name, param in module.named_parameters():
        global_name = local_to_global_name(local_name, layout, spec)
        full = _tp_gather(global_name, param, spec, layout)
        if ".mlp.experts.local_experts." in global_name and layout.ep > 1:
            parts = [torch.empty_like(full) for _ in range(layout.ep)]
            dist.all_gather(parts, full.contiguous(), group=ps.get_expert_model_parallel_group())
            for ep_rank, part in enumerate(parts):
                owner = dataclasses.replace(layout, ep_rank=ep_rank)
                yield local_to_global_name(local_name, owner, spec), part
        else:
            yield global_name, full


def _stage_metadata(module: torch.nn.Module, spec, layout: RankLayout) -> list[tuple[str, tuple, torch.dtype]]:
    """What `_stage_tensors` will produce, computed locally (no collectives)."""
    out = []
    for local_name, param in module.named_parameters():
        global_name = local_to_global_name(local_name, layout, spec)
        split = tp_partition(global_name, spec)
        size = layout.expert_tp if split.expert else layout.tp
        shape = list(param.shape)
        if split.dim is not None and size > 1:
            shape[split.dim] *= size
        if split.vocab:  # unshard_tensor strips the padding rows (models/vocab.py)
            shape[0] = spec.vocab_size
        owners = range(layout.ep) if ".mlp.experts.local_experts." in global_name and layout.ep > 1 else [None]
        for ep_rank in owners:
            lay = layout if ep_rank is None else dataclasses.replace(layout, ep_rank=ep_rank)
            out.append((local_to_global_name(local_name, lay, spec), tuple(shape), param.dtype))
    return out


class _Bucketer:
    def __init__(self, spec, bucket_bytes: int) -> None:
        from megatron_sao.checkpoint.converters import get_converter

        self.converter = get_converter(spec)
        self.spec = spec
        self.limit = bucket_bytes
        self.items: Bucket = []
        self.size = 0

    def add(self, global_name: str, full: torch.Tensor) -> Iterator[Bucket]:
        for hf_name, tensor in self.converter.mcore_to_hf(global_name, full, self.spec):
            nbytes = tensor.numel() * tensor.element_size()
            if self.items and self.size + nbytes > self.limit:
                yield self.flush()
            self.items.append((hf_name, tensor.detach().clone()))
            self.size += nbytes

    def flush(self) -> Bucket:
        out, self.items, self.size = self.items, [], 0
        return out


@torch.no_grad()
def export_hf_weights(module: torch.nn.Module, spec, ctx, *, bucket_bytes: int = 512 << 20,
                      every_rank: bool = False) -> Iterator[Bucket]:
    """Yield lists of (hf_name, full tensor) of at most `bucket_bytes` (one oversized tensor may
    fill a bucket alone) on global rank 0; other ranks run the matching collectives, yield nothing.
    With `every_rank` (pp=1 only) every rank yields the same buckets.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    layout = RankLayout.from_parallel_state()
    if every_rank:
        if ctx.pp != 1:
            raise ValueError(f"an every-rank weight export needs parallel.pp=1 (got pp={ctx.pp}): the colocated "
                             "engines load full tensors on every rank, which pipeline stages do not hold")
        bucketer = _Bucketer(spec, bucket_bytes)
        for name, full in _stage_tensors(module, spec, layout):
            yield from bucketer.add(name, full)
        if bucketer.items:
            yield bucketer.flush()
        return
    on_root_pipeline = ctx.tp_rank == 0 and ctx.dp_rank == 0  # the pipeline group holding rank 0
    bucketer = _Bucketer(spec, bucket_bytes) if ctx.rank == 0 else None
    for stage in range(ctx.pp):
        if ctx.pp_rank == stage:
            sending = stage > 0 and on_root_pipeline
            if sending:
                meta = [_stage_metadata(module, spec, layout)]
                dist.broadcast_object_list(meta, src=ctx.rank, group=ctx.pp_group, device=ctx.device)
            for name, full in _stage_tensors(module, spec, layout):
                if bucketer is not None:
                    yield from bucketer.add(name, full)
                elif sending:
                    dist.broadcast(full.contiguous(), src=ctx.rank, group=ctx.pp_group)
        elif ctx.rank == 0:
            src = dist.get_global_rank(ctx.pp_group, stage)
            meta = [None]
            dist.broadcast_object_list(meta, src=src, group=ctx.pp_group, device=ctx.device)
            for name, shape, dtype in meta[0]:
                buf = torch.empty(shape, dtype=dtype, device=ctx.device)
                dist.broadcast(buf, src=src, group=ctx.pp_group)
                yield from bucketer.add(name, buf)
    if bucketer is not None and bucketer.items:
        yield bucketer.flush()
    dist.barrier()  # no rank leaves while rank 0 may still be receiving
