"""Write an engine's weights as an HF model directory (the rollout engine's and users' format).

Collective: every rank takes part in the gather; rank 0 writes. The directory appears atomically
(temp dir + rename), with config and tokenizer files copied byte for byte from the source model.
"""

from __future__ import annotations

from pathlib import Path

from megatron_sao.checkpoint.atomic_dir import atomic_output_dir
from megatron_sao.checkpoint.hf_io import HFCheckpointReader, HFCheckpointWriter, copy_extra_files


def export_hf_model(engine, src_model_dir: str | Path, out_dir: str | Path,
                    bucket_bytes: int = 256 << 20) -> Path | None:
    buckets = engine.export_hf_weights(bucket_bytes)
    if engine.ctx.rank != 0:
        for _ in buckets:  # take part in the collectives; rank 0 receives the tensors
            pass
        return None
    with atomic_output_dir(out_dir, overwrite=True) as tmp:
        writer = HFCheckpointWriter(tmp)
        for bucket in buckets:
            for name, tensor in bucket:
                writer.add(name, tensor)
        writer.close()
        copy_extra_files(HFCheckpointReader(str(src_model_dir)).extra_files(), tmp)
    return Path(out_dir)
