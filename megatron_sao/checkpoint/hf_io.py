"""Read and write HF safetensors checkpoint directories.

Reading is lazy: `HFCheckpointReader` is a Mapping[name, Tensor] over model.safetensors or a
sharded model.safetensors.index.json; a tensor is read from disk when it is accessed, so a 30B
checkpoint can be converted one tensor at a time. Every floating-point tensor read is checked finite:
a file with garbage bytes at the right size (random bits hold a NaN or inf exponent once in 256 values)
is refused naming the file and the tensor, before the trainer builds anything on it or writes a
checkpoint of it (it used to surface steps later as a rollout log-prob mismatch).

Writing (`HFCheckpointWriter`) streams (name, tensor) pairs into shards of at most
`max_shard_bytes`, named like transformers does (model.safetensors for one shard, else
model-0000i-of-0000n.safetensors + model.safetensors.index.json), and copies the source
checkpoint's non-weight files (config.json, generation_config.json, tokenizer files, chat
template, ...) byte for byte. Use it inside `atomic_output_dir` for all-or-nothing output.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Iterable, Iterator

import torch
from safetensors.torch import save_file

from megatron_sao.files.safetensors_check import SafetensorsFileError, open_safetensors

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".h5", ".msgpack", ".gguf")
_WEIGHT_INDEXES = (INDEX_FILE, "pytorch_model.bin.index.json")


def is_weight_file(name: str) -> bool:
    return name.endswith(_WEIGHT_SUFFIXES) or name in _WEIGHT_INDEXES


class HFCheckpointReader(Mapping):
    """Lazy read-only mapping over the tensors of an HF safetensors checkpoint directory."""

    def __init__(self, hf_dir: str | os.PathLike) -> None:
        self.dir = Path(hf_dir)
        if not self.dir.is_dir():
            raise FileNotFoundError(f"HF checkpoint directory {self.dir} does not exist")
        index = self.dir / INDEX_FILE
        if index.is_file():
            with open(index) as f:
                weight_map = json.load(f).get("weight_map")
            if not isinstance(weight_map, dict):
                raise ValueError(f"{index} has no 'weight_map' object")
            self._file_of = dict(weight_map)
        elif (self.dir / SINGLE_FILE).is_file():
            with open_safetensors(self.dir / SINGLE_FILE) as f:
                self._file_of = {k: SINGLE_FILE for k in f.keys()}
        else:
            raise FileNotFoundError(f"{self.dir} has neither {SINGLE_FILE} nor {INDEX_FILE} "
                                    "(only safetensors checkpoints are supported)")
        for fname in set(self._file_of.values()):
            if not (self.dir / fname).is_file():
                raise FileNotFoundError(f"{self.dir}: shard {fname} listed in {INDEX_FILE} is missing")
        self._handles: dict[str, object] = {}

    def _handle(self, fname: str):
        if fname not in self._handles:
            self._handles[fname] = open_safetensors(self.dir / fname)
        return self._handles[fname]

    def __getitem__(self, name: str) -> torch.Tensor:
        try:
            fname = self._file_of[name]
        except KeyError:
            raise KeyError(f"tensor {name} not in HF checkpoint {self.dir}") from None
        tensor = self._handle(fname).get_tensor(name)
        if tensor.is_floating_point() and not bool(torch.isfinite(tensor).all()):
            bad = int((~torch.isfinite(tensor)).sum())
            raise SafetensorsFileError(f"{self.dir / fname}: tensor {name!r} holds {bad} non-finite value(s) (NaN or "
                                       f"inf) of {tensor.numel()}: the weights file is damaged")
        return tensor

    def __iter__(self) -> Iterator[str]:
        return iter(self._file_of)

    def __len__(self) -> int:
        return len(self._file_of)

    def __contains__(self, name: object) -> bool:
        return name in self._file_of

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape without reading the data."""
        return tuple(self._handle(self._file_of[name]).get_slice(name).get_shape())

    def extra_files(self) -> list[Path]:
        """Top-level non-weight files (config, generation config, tokenizer, templates, ...)."""
        return sorted(p for p in self.dir.iterdir() if p.is_file() and not is_weight_file(p.name))


def copy_extra_files(files: Iterable[Path], out_dir: Path) -> list[str]:
    """Copy files byte for byte (shutil.copyfile) into out_dir; returns their names."""
    names = []
    for src in files:
        shutil.copyfile(src, out_dir / src.name)
        names.append(src.name)
    return names


class HFCheckpointWriter:
    """Stream tensors into safetensors shards; `close()` writes the index (if >1 shard)."""

    def __init__(self, out_dir: str | os.PathLike, max_shard_bytes: int = 5 * 1024**3) -> None:
        if max_shard_bytes <= 0:
            raise ValueError(f"max_shard_bytes must be positive, got {max_shard_bytes}")
        self.dir = Path(out_dir)
        self.max_shard_bytes = max_shard_bytes
        self._pending: dict[str, torch.Tensor] = {}
        self._pending_bytes = 0
        self._shards: list[list[str]] = []  # tensor names per written shard
        self._total_bytes = 0
        self._closed = False

    def add(self, name: str, tensor: torch.Tensor) -> None:
        if self._closed:
            raise RuntimeError("HFCheckpointWriter is closed")
        if name in self._pending or any(name in s for s in self._shards):
            raise ValueError(f"tensor {name} written twice")
        nbytes = tensor.numel() * tensor.element_size()
        if self._pending and self._pending_bytes + nbytes > self.max_shard_bytes:
            self._flush()
        self._pending[name] = tensor.detach().contiguous().cpu()
        self._pending_bytes += nbytes
        self._total_bytes += nbytes

    def _flush(self) -> None:
        idx = len(self._shards)
        save_file(self._pending, str(self.dir / f".shard-{idx:05d}.safetensors"), metadata={"format": "pt"})
        self._shards.append(list(self._pending))
        self._pending, self._pending_bytes = {}, 0

    def close(self) -> list[str]:
        """Write the last shard, give shards their final names and write the index; returns file names."""
        if self._pending or not self._shards:
            self._flush()
        self._closed = True
        n = len(self._shards)
        if n == 1:
            os.replace(self.dir / ".shard-00000.safetensors", self.dir / SINGLE_FILE)
            return [SINGLE_FILE]
        weight_map, files = {}, []
        for i, names in enumerate(self._shards):
            fname = f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            os.replace(self.dir / f".shard-{i:05d}.safetensors", self.dir / fname)
            weight_map.update({k: fname for k in names})
            files.append(fname)
        with open(self.dir / INDEX_FILE, "w") as f:
            json.dump({"metadata": {"total_size": self._total_bytes}, "weight_map": weight_map}, f, indent=2)
        return files + [INDEX_FILE]
