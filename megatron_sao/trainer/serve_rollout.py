"""``sao serve-rollout CONFIG [overrides] --host H --port P``: ``rollout/engines/http_server.py`` on the run's model.

The glue between a run config and the rollout server lives here, on the trainer side, so that
``rollout/`` never imports ``trainer/``: the server serves the same model the trainer starts from
(the stage outputs in the run dir, or a built-in model materialized with the run's seed).
"""

from __future__ import annotations

import argparse
import asyncio
from pathlib import Path


def main(args: argparse.Namespace) -> int:
    from megatron_sao.config import load_config
    from megatron_sao.models.builtin import resolve_model_dir
    from megatron_sao.rollout.engines.http_server import serve_forever
    from megatron_sao.rollout.engines.protocol import EngineConfig
    from megatron_sao.trainer.train import wire_stages

    cfg = wire_stages(load_config(args.config, args.overrides))
    try:
        model_dir = resolve_model_dir(cfg.model.path, Path(cfg.run.dir), cfg.run.seed)
    except FileNotFoundError as e:
        raise SystemExit(f"serve-rollout: {e}") from None
    r = cfg.rollout
    engine_cfg = EngineConfig(backend="hf", model_path=str(model_dir), dtype=cfg.model.dtype,
                              max_model_len=cfg.model.max_seq_len, inflight_policy=r.inflight_policy,
                              seed=cfg.run.seed, max_batch_size=r.max_num_seqs or r.concurrency)
    asyncio.run(serve_forever(engine_cfg, args.host, args.port))
    return 0
