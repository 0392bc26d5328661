"""Offline HF <-> Megatron checkpoint conversion (`sao convert hf-to-megatron|megatron-to-hf`).

No torch.distributed: full tensors are built one at a time by the architecture's converter and
sliced per rank with `shard_tensor`. Output appears atomically (see atomic_dir): any error
(missing tensor, shape that does not fit the config, unsupported architecture) leaves no output
directory behind. Peak memory is about one pipeline stage's dense tensors plus one expert rank's
experts (everything written to one safetensors file is held until that file is written).
"""

from __future__ import annotations

import collections
import json
import logging
import os
from pathlib import Path
from typing import Iterable, Mapping

import torch
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from safetensors.torch import save_file

from megatron_sao.checkpoint.converters import get_converter
from megatron_sao.checkpoint.converters._common import RuleConverter
from megatron_sao.checkpoint.hf_io import HFCheckpointReader, HFCheckpointWriter, copy_extra_files
from megatron_sao.checkpoint.megatron_format import (
    HF_FILES_DIR,
    MegatronCheckpointReader,
    dense_file,
    expert_file,
    is_expert_param,
    owner_expert_rank,
    owner_stage,
    write_metadata,
)
from megatron_sao.checkpoint.param_layout import ROLES, full_param_shapes
from megatron_sao.checkpoint.sharding import RankLayout, shard_tensor
from megatron_sao.files.atomic_dir import atomic_output_dir, check_output_dir
from megatron_sao.models.hf_config import ModelSpec, model_spec_from_hf
from megatron_sao.models.parallel_sizes import ParallelSizes
from megatron_sao.models.value_head import VALUE_HEAD_INITS

logger = logging.getLogger(__name__)

_VALUE_HEAD_SEED = 20250711


def _progress(enabled: bool) -> Progress:
    return Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    disable=not enabled, transient=True)


def _check_hf_names(converter: RuleConverter, state: Mapping, spec: ModelSpec, role: str) -> None:
    """Fail before writing anything if an HF tensor is missing or unexpected."""
    needed = {n: name for name in full_param_shapes(spec, role) for n in converter.hf_names(name, spec)}
    missing = [n for n in needed if n not in state]
    if missing:
        raise ValueError(f"HF checkpoint is missing tensor(s) {missing[:5]}{' ...' if len(missing) > 5 else ''} "
                         f"(needed for Megatron {needed[missing[0]]})")
    optional_head = spec.tie_word_embeddings or role == "critic"
    unused = [n for n in state if n not in needed and not (n == "lm_head.weight" and optional_head)
              and not n.endswith("rotary_emb.inv_freq")]
    if unused:
        raise ValueError(f"HF checkpoint has tensor(s) the {spec.arch} {role} mapping does not use: {unused[:5]} "
                         "(wrong architecture in config.json?)")


def _fresh_value_head(spec: ModelSpec, init: str, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """HF-named value head for a critic made from an actor: weight N(0, 0.02) or zero, bias zero."""
    if init not in VALUE_HEAD_INITS:
        raise ValueError(f"value_head_init must be one of {VALUE_HEAD_INITS}, got {init!r}")
    weight = torch.zeros(1, spec.hidden_size, dtype=dtype)
    if init == "normal":
        gen = torch.Generator().manual_seed(_VALUE_HEAD_SEED)
        weight = (torch.randn(1, spec.hidden_size, generator=gen) * 0.02).to(dtype)
    return {"score.weight": weight, "score.bias": torch.zeros(1, dtype=dtype)}


def _files_of_stage(names: Iterable[str], spec: ModelSpec, sizes: ParallelSizes, stage: int):
    """Group one stage's tensors by output file: (dense names, {ep_rank: expert names})."""
    dense, experts = [], collections.defaultdict(list)
    for name in names:
        if owner_stage(name, spec, sizes.pp) != stage:
            continue
        if is_expert_param(name):
            experts[owner_expert_rank(name, spec, sizes.ep)].append(name)
        else:
            dense.append(name)
    return dense, experts


def convert_hf_to_megatron(hf_dir: str | os.PathLike, out_dir: str | os.PathLike, *, tp: int = 1, pp: int = 1,
                           ep: int = 1, etp: int | None = None, role: str = "actor", value_head_init: str = "zero",
                           overwrite: bool = False, progress: bool = True) -> Path:
    """HF safetensors dir -> megatron-sao sharded checkpoint for the given layout.

    `etp` None takes the trainer's default (`models.parallel_sizes.default_expert_tp`). Vocabulary
    tensors are stored padded to `padded_vocab_size(V, tp)` rows, exactly as the rank's model holds
    them; reading a full tensor back strips the padding.

    role="critic": the HF `score.weight` becomes the value head; an actor checkpoint (no
    score.weight) gets a fresh value head (`value_head_init`: "normal" N(0, 0.02) or "zero") and
    its lm_head is dropped.
    """
    if role not in ROLES:
        raise ValueError(f"role must be one of {ROLES}, got {role!r}")
    check_output_dir(out_dir, overwrite)
    reader = HFCheckpointReader(hf_dir)
    spec = model_spec_from_hf(hf_dir)
    # Sequence parallelism does not change any weight: assume it where the trainer needs it (MoE, tp > 1)
    # so that the trainer's layout rules (incl. the etp*ep >= tp refusal) apply to what is written.
    sizes = ParallelSizes(tp=tp, pp=pp, ep=ep, etp=etp, sequence_parallel=tp > 1)
    sizes.validate_for(spec)
    converter = get_converter(spec)
    state: Mapping = reader
    if role == "critic" and "score.weight" not in reader:
        head = _fresh_value_head(spec, value_head_init, reader["model.embed_tokens.weight"].dtype)
        logger.info("critic from an actor checkpoint: value head initialised '%s'", value_head_init)
        state = collections.ChainMap(head, reader)
    _check_hf_names(converter, state, spec, role)
    names = list(full_param_shapes(spec, role))
    etp_size = sizes.expert_tp
    written: list[str] = []
    with atomic_output_dir(out_dir, overwrite) as tmp, _progress(progress) as bar:
        task = bar.add_task("HF -> Megatron", total=len(names))
        for stage in range(sizes.pp):
            (tmp / f"pp_{stage:03d}").mkdir()
            dense, experts = _files_of_stage(names, spec, sizes, stage)
            files: dict[str, dict[str, torch.Tensor]] = collections.defaultdict(dict)
            for name in dense:
                full = converter.to_mcore(name, state, spec)
                for t in range(sizes.tp):
                    layout = RankLayout(tp=sizes.tp, tp_rank=t, pp=sizes.pp, pp_rank=stage)
                    files[dense_file(stage, t)][name] = shard_tensor(name, full, layout, spec).contiguous()
                bar.advance(task)
            for ep_rank, expert_names in sorted(experts.items()):
                for name in expert_names:
                    full = converter.to_mcore(name, state, spec)
                    for t in range(etp_size):
                        layout = RankLayout(tp=etp_size, tp_rank=t, pp=sizes.pp, pp_rank=stage, ep=sizes.ep,
                                            ep_rank=ep_rank, etp=etp_size, etp_rank=t)
                        files[expert_file(stage, ep_rank, t)][name] = shard_tensor(name, full, layout,
                                                                                   spec).contiguous()
                    bar.advance(task)
                # Write this expert rank's files now: bounds memory to one expert rank at a time.
                for fname in [expert_file(stage, ep_rank, t) for t in range(etp_size)]:
                    save_file(files.pop(fname), str(tmp / fname))
                    written.append(fname)
            for fname, tensors in files.items():
                save_file(tensors, str(tmp / fname))
                written.append(fname)
        (tmp / HF_FILES_DIR).mkdir()
        hf_files = copy_extra_files(reader.extra_files(), tmp / HF_FILES_DIR)
        write_metadata(tmp, spec=spec, role=role,
                       sizes={"tp": sizes.tp, "pp": sizes.pp, "ep": sizes.ep, "etp": etp_size},
                       files=written, hf_files=hf_files, source=os.fspath(hf_dir))
    logger.info("wrote %s (%s, tp=%d pp=%d ep=%d etp=%d, %d files)", out_dir, role, sizes.tp, sizes.pp, sizes.ep,
                etp_size, len(written))
    return Path(out_dir)


def _critic_hf_config(config_path: Path) -> None:
    """Turn a copied causal-LM config.json into a token-classification (num_labels=1) one, the HF
    layout of a critic (verl's AutoModelForTokenClassification critics). Left as is if it already
    is one, so HF critic -> Megatron -> HF reproduces config.json byte for byte."""
    with open(config_path) as f:
        cfg = json.load(f)
    archs = cfg.get("architectures") or []
    if archs and all(a.endswith("ForTokenClassification") for a in archs):
        return
    cfg["architectures"] = [a.replace("ForCausalLM", "ForTokenClassification") for a in archs]
    cfg["id2label"], cfg["label2id"] = {"0": "LABEL_0"}, {"LABEL_0": 0}
    with open(config_path, "w") as f:
        json.dump(cfg, f, indent=2)


def convert_megatron_to_hf(megatron_dir: str | os.PathLike, out_dir: str | os.PathLike, *, overwrite: bool = False,
                           max_shard_bytes: int = 5 * 1024**3, progress: bool = True) -> Path:
    """megatron-sao checkpoint (any layout) -> HF safetensors dir with the original non-weight files."""
    check_output_dir(out_dir, overwrite)
    reader = MegatronCheckpointReader(megatron_dir)
    spec, role = reader.spec, reader.role
    converter = get_converter(spec)
    names = list(full_param_shapes(spec, role))
    with atomic_output_dir(out_dir, overwrite) as tmp, _progress(progress) as bar:
        task = bar.add_task("Megatron -> HF", total=len(names))
        writer = HFCheckpointWriter(tmp, max_shard_bytes=max_shard_bytes)
        for name in names:
            for hf_name, tensor in converter.mcore_to_hf(name, reader.full_tensor(name), spec):
                writer.add(hf_name, tensor)
            bar.advance(task)
        writer.close()
        copy_extra_files(sorted(p for p in reader.hf_files_dir.iterdir() if p.is_file()), tmp)
        if role == "critic" and (tmp / "config.json").is_file():
            _critic_hf_config(tmp / "config.json")
    logger.info("wrote HF checkpoint %s (%s, %d Megatron tensors)", out_dir, role, len(names))
    return Path(out_dir)
