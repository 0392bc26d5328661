"""An engine's training state as a Megatron distributed checkpoint: saved at one layout, loaded at any.

One engine directory is what `megatron.core.dist_checkpointing.save` writes with its torch_dist backend
(torch.distributed.checkpoint underneath):

    common.pt         rank 0: the `sao` record (format, role, model spec, the layout it was saved at,
                      state_version, Adam's step, the LR scheduler) and other non-tensor values
    __R_I.distcp      every rank's tensor shards         .metadata  the global index of every shard
    metadata.json     backend and version (written last: a directory without it was never finished)

Tensors are stored under global names with their global shapes: the model's own sharded state dict
(`GPTModel.sharded_state_dict`: TP and EP shards with their offsets, PP stages by global layer number,
vocabulary padding allowed to differ) and the optimizer state in model space (`optimizer_state.py`).
Loading builds the same request from the live engine, whatever its TP / PP / EP / ETP / DP, and
dist_checkpointing reads each rank's slices; a different data-parallel size (and so distributed-optimizer
sharding, or none) is a different request, not a different file.

Every call here is collective over the engine's world. The RNG is not part of an engine's state: nothing in
a train step draws random numbers (dropout 0, `models/gpt.py`); the trainer keeps its own in rng.pt.
"""

from __future__ import annotations

import json
import os
from typing import Any

import torch

from megatron_sao.megatron.optimizer_state import adam_step, load_optimizer_state, sharded_optimizer_state

FORMAT = "megatron_sao.dist/1"


class UnreadableCheckpoint(RuntimeError):
    """dist_checkpointing could not read a checkpoint's contents (raised on every rank alike)."""

LEGACY_FORMAT = "megatron_sao.engine/1"  # one torch file per rank (state_io.py): same layout only


def layout_of(engine) -> dict[str, Any]:
    c = engine.ctx
    return {"tp": c.tp, "pp": c.pp, "ep": c.ep, "etp": c.etp, "dp": c.dp, "world_size": c.world_size,
            "sequence_parallel": c.sequence_parallel,
            "distributed_optimizer": engine.optim_config.use_distributed_optimizer}


def _record(engine) -> dict[str, Any]:
    return {"format": FORMAT, "role": engine.role, "spec": engine.spec.to_dict(), "layout": layout_of(engine),
            "state_version": engine.state_version, "adam_step": adam_step(engine.optimizer),
            "scheduler": engine.scheduler.state_dict()}


def _sharded_state(engine, *, loading: bool) -> dict[str, Any]:
    model = engine.module.sharded_state_dict()
    return {"model": model, "optimizer": sharded_optimizer_state(engine.optimizer, model, loading=loading)}


def save_strategy():
    """torch_dist, fully parallel over data parallelism: a shard every DP rank holds (the model; the optimizer
    state the distributed optimizer gathers into model space) is written by all of them, a part each, not by
    DP rank 0 alone (Megatron-LM's --ckpt-fully-parallel-save; AReaL and verl do the same)."""
    from megatron.core import parallel_state
    from megatron.core.dist_checkpointing.serialization import get_default_save_sharded_strategy
    from megatron.core.dist_checkpointing.strategies.fully_parallel import FullyParallelSaveStrategyWrapper

    return FullyParallelSaveStrategyWrapper(get_default_save_sharded_strategy("torch_dist"),
                                            parallel_state.get_data_parallel_group(with_context_parallel=True))


def save(engine, directory: str, *, asynchronous: bool = False):
    """Write the engine's state into `directory` (created if missing; empty). Synchronous: returns None
    once every rank's shards are on disk. Asynchronous: returns megatron's AsyncRequest, which writes
    from a snapshot when scheduled (`async_saves.py`) while training goes on."""
    from megatron.core import dist_checkpointing

    from megatron_sao.megatron import writer_results

    engine._require()
    writer_results.install_new_queue()
    if engine.ctx.rank == 0:
        os.makedirs(directory, exist_ok=True)
    torch.distributed.barrier()
    state = _sharded_state(engine, loading=False)
    state["sao"] = _record(engine)
    return dist_checkpointing.save(state, directory, sharded_strategy=save_strategy(),
                                   async_sharded_save=asynchronous)


def read_record(directory: str) -> dict[str, Any]:
    """What an engine directory holds and how it was written (no process group needed)."""
    legacy = os.path.join(directory, "meta.json")
    if os.path.isfile(legacy):
        with open(legacy) as f:
            return json.load(f)
    from megatron.core.dist_checkpointing import load_common_state_dict

    if not os.path.isfile(os.path.join(directory, "metadata.json")):
        raise FileNotFoundError(f"no engine checkpoint at {directory} (no metadata.json: never finished)")
    return load_common_state_dict(directory)["sao"]


def _refuse_other_model(engine, record: dict, directory: str) -> None:
    if record.get("role") != engine.role:
        raise ValueError(f"engine checkpoint {directory} holds a {record.get('role')}, this engine is the "
                         f"{engine.role}")
    saved, mine = record.get("spec") or {}, engine.spec.to_dict()
    diff = {k: (saved.get(k), v) for k, v in mine.items() if saved.get(k) != v}
    if diff:
        raise ValueError(f"engine checkpoint {directory} holds another model (saved, this engine): {diff}")


def load(engine, directory: str) -> dict[str, Any]:
    """Restore what `save` wrote, resharded to this engine's layout. Returns the checkpoint's record."""
    from megatron.core import dist_checkpointing

    from megatron_sao.megatron import state_io

    engine._require()
    directory = os.path.abspath(directory)
    record = read_record(directory)
    if record.get("format") == LEGACY_FORMAT:
        state_io.load_engine_state(engine, directory, record)
        return record
    if record.get("format") != FORMAT:
        raise ValueError(f"engine checkpoint {directory}: unknown format {record.get('format')!r}")
    _refuse_other_model(engine, record, directory)
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        loaded = dist_checkpointing.load(_sharded_state(engine, loading=True), directory)
    # A damaged index or shard: the trainer falls back to the previous checkpoint. torch.distributed.checkpoint
    # raises CheckpointException, a BaseException, on every rank when any rank failed.
    except (Exception, CheckpointException) as e:
        raise UnreadableCheckpoint(f"{directory} could not be loaded: {e!r:.500}") from e
    missing, unexpected = engine.module.load_state_dict(loaded["model"], strict=False)
    missing = [k for k in missing if not k.endswith("_extra_state")]
    if missing or unexpected:
        raise ValueError(f"engine checkpoint {directory}: missing {missing[:5]}, unexpected {unexpected[:5]}")
    load_optimizer_state(engine.optimizer, loaded["optimizer"], int(record["adam_step"]))
    engine.scheduler.load_state_dict(record["scheduler"])
    engine.state_version = int(record["state_version"])
    torch.distributed.barrier()
    return record
