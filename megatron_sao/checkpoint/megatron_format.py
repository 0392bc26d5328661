"""megatron-sao's sharded Megatron checkpoint format (no torch.distributed needed to read/write).

Layout of a checkpoint directory:

    megatron_sao_checkpoint.json   format version, role, ModelSpec, parallel sizes, file list
    hf/                            the source HF checkpoint's non-weight files, byte for byte
                                   (config.json, generation_config.json, tokenizer files, ...)
    pp_PPP/tp_TT.safetensors       non-expert tensors of pipeline stage PPP, TP shard TT
    pp_PPP/ep_EEE_etp_TT.safetensors   expert tensors of stage PPP, expert rank EEE, expert-TP shard TT

Tensors are stored under their canonical *global* names (global layer and expert indices) and
each file holds exactly the shard that the corresponding rank's model holds. Dense and expert
tensors live in separate files because Megatron places them on two different rank grids
(tp x pp for attention, etp x ep x pp for experts; e.g. TP=2, EP=2 fits in two ranks only with
ETP=1), so a single mp_rank_TT_PPP_EEE file per rank would not describe both.

Why not megatron.core.dist_checkpointing: it needs an initialised process group and the model
objects to save/load, while conversion should be a plain offline tool. This format is still
layout-independent on load: `MegatronCheckpointReader.full_tensor` reassembles any tensor from
its shards, and `load_megatron_checkpoint_into_model` re-slices it for the loading rank's layout.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from megatron_sao.checkpoint.sharding import unshard_tensor
from megatron_sao.files.safetensors_check import open_safetensors
from megatron_sao.models.hf_config import ModelSpec

META_FILE = "megatron_sao_checkpoint.json"
HF_FILES_DIR = "hf"
FORMAT_VERSION = 1

_EXPERT_MARK = ".mlp.experts.local_experts."


def is_expert_param(global_name: str) -> bool:
    return _EXPERT_MARK in global_name


def dense_file(pp_rank: int, tp_rank: int) -> str:
    return f"pp_{pp_rank:03d}/tp_{tp_rank:02d}.safetensors"


def expert_file(pp_rank: int, ep_rank: int, etp_rank: int) -> str:
    return f"pp_{pp_rank:03d}/ep_{ep_rank:03d}_etp_{etp_rank:02d}.safetensors"


def owner_stage(global_name: str, spec: ModelSpec, pp: int) -> int:
    """Pipeline stage that holds a (canonical global) parameter."""
    if global_name.startswith("embedding."):
        return 0
    if global_name.startswith(("decoder.final_layernorm.", "output_layer.", "value_head.")):
        return pp - 1
    layer = int(global_name.split(".")[2])
    return layer // (spec.num_layers // pp)


def owner_expert_rank(global_name: str, spec: ModelSpec, ep: int) -> int:
    expert = int(global_name.split(_EXPERT_MARK)[1].split(".")[0])
    return expert // (spec.num_experts // ep)


def write_metadata(out_dir: Path, *, spec: ModelSpec, role: str, sizes: dict[str, int], files: list[str],
                   hf_files: list[str], source: str) -> None:
    meta: dict[str, Any] = {"format": "megatron_sao_sharded_safetensors", "format_version": FORMAT_VERSION,
                            "role": role, "spec": spec.to_dict(), "parallel": sizes, "files": sorted(files),
                            "hf_files": sorted(hf_files), "source": source}
    with open(out_dir / META_FILE, "w") as f:
        json.dump(meta, f, indent=2)


class MegatronCheckpointReader:
    """Reads a megatron-sao checkpoint; reassembles full tensors from their shards on demand."""

    def __init__(self, ckpt_dir: str | os.PathLike) -> None:
        self.dir = Path(ckpt_dir)
        meta_path = self.dir / META_FILE
        if not meta_path.is_file():
            raise FileNotFoundError(f"{self.dir} is not a megatron-sao checkpoint (no {META_FILE})")
        with open(meta_path) as f:
            self.meta = json.load(f)
        if self.meta.get("format_version") != FORMAT_VERSION:
            raise ValueError(f"{meta_path}: format_version {self.meta.get('format_version')} != {FORMAT_VERSION}")
        self.spec = ModelSpec.from_dict(self.meta["spec"])
        self.role: str = self.meta["role"]
        sizes = self.meta["parallel"]
        self.tp, self.pp, self.ep, self.etp = sizes["tp"], sizes["pp"], sizes["ep"], sizes["etp"]
        missing = [f for f in self.meta["files"] if not (self.dir / f).is_file()]
        if missing:
            raise FileNotFoundError(f"{self.dir}: shard file(s) listed in {META_FILE} are missing: {missing}")
        self._handles: dict[str, Any] = {}

    @property
    def layout_sizes(self) -> dict[str, int]:
        return dict(self.meta["parallel"])

    @property
    def hf_files_dir(self) -> Path:
        return self.dir / HF_FILES_DIR

    def _read(self, fname: str, name: str) -> torch.Tensor:
        if fname not in self._handles:
            self._handles[fname] = open_safetensors(self.dir / fname)
        handle = self._handles[fname]
        if name not in handle.keys():
            raise KeyError(f"tensor {name} missing from shard {self.dir / fname}")
        return handle.get_tensor(name)

    def shard_files(self, global_name: str) -> list[str]:
        """Files that hold the TP (or expert-TP) shards of `global_name`, in shard order."""
        stage = owner_stage(global_name, self.spec, self.pp)
        if is_expert_param(global_name):
            e = owner_expert_rank(global_name, self.spec, self.ep)
            return [expert_file(stage, e, t) for t in range(self.etp)]
        return [dense_file(stage, t) for t in range(self.tp)]

    def full_tensor(self, global_name: str) -> torch.Tensor:
        shards = [self._read(f, global_name) for f in self.shard_files(global_name)]
        return unshard_tensor(global_name, shards, self.spec)
