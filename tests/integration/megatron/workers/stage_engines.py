"""Run one `sao` stage (the real CLI) and record every MegatronEngine it builds.

Usage: python -m tests.integration.megatron.workers.stage_engines RECORD.jsonl STAGE CONFIG [overrides ...]

The engine's constructor is wrapped (after it ran) to append, per engine, what its built
TransformerConfig and parameters say: recompute settings, params dtype, the attention kernel, the
dtypes of the model parameters and of the optimizer's main parameters.
"""

from __future__ import annotations

import json
import sys

from megatron_sao.megatron import engine as E
from megatron_sao.megatron.optimizer import model_main_param_pairs, sub_optimizers

RECORD = sys.argv[1]
_init = E.MegatronEngine.__init__


def _recording_init(self, *args, **kwargs):
    _init(self, *args, **kwargs)
    c = self.config
    pairs = [pair for opt in sub_optimizers(self.optimizer) for pair in model_main_param_pairs(opt)]
    row = {"role": self.role, "recompute_granularity": c.recompute_granularity,
           "recompute_method": c.recompute_method, "recompute_num_layers": c.recompute_num_layers,
           "params_dtype": str(c.params_dtype), "bf16": c.bf16, "attention_backend": c.attention_backend.name,
           "model_param_dtypes": sorted({str(p.dtype) for p in self.module.parameters()}),
           "main_param_dtypes": sorted({str(main.dtype) for _, main in pairs})}
    with open(RECORD, "a") as f:
        f.write(json.dumps(row) + "\n")


E.MegatronEngine.__init__ = _recording_init

from megatron_sao.cli import main  # noqa: E402

sys.exit(main(sys.argv[2:]))
