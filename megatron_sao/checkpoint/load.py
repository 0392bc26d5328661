"""Initialise Megatron model chunks from an HF checkpoint or a megatron-sao checkpoint.

Both paths work the same way: for each parameter of this rank, compute its canonical global
name, fetch the *full* tensor (HF: through the converter, reading only the HF tensors it needs;
Megatron checkpoint: reassembled from the saved TP shards of whatever layout it was saved with)
and copy this rank's TP shard into the parameter. So a checkpoint saved at one TP/PP/EP layout
loads at any other. No collective communication is used; every rank reads the files it needs.
"""

from __future__ import annotations

import logging
from typing import Callable, Sequence

import torch

from megatron_sao.checkpoint.converters import get_converter
from megatron_sao.checkpoint.hf_io import HFCheckpointReader
from megatron_sao.checkpoint.sharding import RankLayout, local_to_global_name, shard_tensor
from megatron_sao.models.hf_config import ModelSpec
from megatron_sao.models.names import canonical_name, is_extra_state

logger = logging.getLogger(__name__)

TIED_HEAD_SOURCE = "embedding.word_embeddings.weight"


def _chunks(model_chunks) -> list[torch.nn.Module]:
    return list(model_chunks) if isinstance(model_chunks, (list, tuple)) else [model_chunks]


def source_name(global_name: str, spec: ModelSpec) -> str:
    """Full tensor that a parameter is loaded from: a tied actor's output layer (held by Megatron's
    last PP stage) is a copy of the embedding."""
    if global_name == "output_layer.weight" and spec.tie_word_embeddings:
        return TIED_HEAD_SOURCE
    return global_name


@torch.no_grad()
def load_full_tensors_into_model(model_chunks, get_full: Callable[[str], torch.Tensor], spec: ModelSpec,
                                 layout: RankLayout, *, vp_layer_offsets: Sequence[int] | None = None) -> int:
    """Copy this rank's shard of `get_full(global_name)` into every parameter; returns #tensors.

    Shapes are checked per tensor (ValueError names it). Virtual pipeline chunks are not supported
    yet: pass one chunk per pipeline stage.
    """
    chunks = _chunks(model_chunks)
    if len(chunks) != 1 or vp_layer_offsets is not None:
        raise NotImplementedError("loading into virtual-pipeline model chunks is not implemented")
    count = 0
    for local, param in chunks[0].state_dict(keep_vars=True).items():
        if is_extra_state(local) or param is None:
            continue
        global_name = local_to_global_name(local, layout, spec)
        shard = shard_tensor(global_name, get_full(source_name(global_name, spec)), layout, spec)
        if tuple(shard.shape) != tuple(param.shape):
            raise ValueError(f"tensor {global_name}: checkpoint shard shape {tuple(shard.shape)} does not fit "
                             f"model parameter {canonical_name(local)} shape {tuple(param.shape)}")
        param.copy_(shard.to(dtype=param.dtype))
        count += 1
    return count


def load_hf_into_model(model_chunks, hf_dir: str, spec: ModelSpec, layout: RankLayout, *,
                       role: str = "actor") -> int:
    """Load an HF safetensors checkpoint (on-disk names) into this rank's model chunks.

    A critic built from an actor checkpoint (no score.weight in the HF dir) keeps the value head
    it was built with (N(0, 0.02) or zero init) and ignores lm_head; everything else must exist.
    """
    converter = get_converter(spec)
    reader = HFCheckpointReader(hf_dir)
    fresh_value_head = role == "critic" and "score.weight" not in reader

    def get_full(name: str) -> torch.Tensor:
        return converter.to_mcore(name, reader, spec)

    chunks = _chunks(model_chunks)
    if fresh_value_head:
        logger.info("critic: %s has no score.weight; keeping the freshly initialised value head", hf_dir)
        kept = {canonical_name(n): p.detach().clone() for chunk in chunks for n, p in chunk.named_parameters()
                if canonical_name(n).startswith("value_head.")}

        def get_full(name: str, _inner=get_full) -> torch.Tensor:  # wraps the plain getter
            return kept[name] if name in kept else _inner(name)

    n = load_full_tensors_into_model(chunks, get_full, spec, layout)
    logger.info("loaded %d tensors from HF checkpoint %s (%s, layout %s)", n, hf_dir, role, layout)
    return n


def load_megatron_checkpoint_into_model(model_chunks, ckpt_dir: str, layout: RankLayout) -> int:
    """Load a megatron-sao sharded checkpoint (any saved layout) into this rank's model chunks."""
    from megatron_sao.checkpoint.megatron_format import MegatronCheckpointReader

    reader = MegatronCheckpointReader(ckpt_dir)
    n = load_full_tensors_into_model(model_chunks, reader.full_tensor, reader.spec, layout)
    logger.info("loaded %d tensors from Megatron checkpoint %s (saved at %s, loaded at %s)", n, ckpt_dir,
                reader.layout_sizes, layout)
    return n
